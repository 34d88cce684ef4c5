"""The serving domain: what a load is and when its requests arrive (arrivals), what the
requests look like (workloads, window_plan), whether a load meets an SLO (judging), the
serving spec and its sweep (decisions, lowering), and the HTTP servers a run may drive
(servers). serve/, bench/, analysis/ and deploy/ import it; it imports only vcfslm.errors."""
