"""The answer: per-scope cells, tables, SLO crossover, the sizing law and the report.

Pure modules (no plotting): `cells` (records -> cells), `csv_import` (external tables
-> cells), `slo` (crossover and sizing), `tables` (markdown / CSV), `report` (files).
`figures` is the only module that imports matplotlib; `report` loads it lazily.
"""
