"""A numerics gate that failed on one graph of a rank: the cells of that graph's scenario
leave that rank's windows out; every other cell keeps them; the warning names the graph."""

from __future__ import annotations

from test_analysis_support import make_run

from vcfslm.analysis.cells import SINGLE, aggregate, load_runs
from vcfslm.verdicts import numerics_gate_failed

TABLE = {(1, 128): (0.1, 100.0, 10.0), (4, 128): (0.4, 120.0, 33.0)}
REASON = numerics_gate_failed("against eager: top-1 agreement 0.50 < 0.75", graph="static 4x128")


def test_a_failed_graph_voids_its_own_scenario_only(tmp_path):
    def gate(r):
        if r.local_rank == 1 and r.batch_per_rank == 4:
            r.valid, r.invalid_reasons = False, [REASON]
        return r

    a = aggregate(load_runs([make_run(tmp_path / "s", "s", ["vm1"], TABLE, tweak=gate)]))
    cells = {c.batch_per_rank: c for c in a.scope_cells(SINGLE)}
    assert cells[1].invalid_windows == 0 and cells[1].ranks_measured == 4
    assert cells[4].invalid_windows == 1 and cells[4].ranks_measured == 3
    assert a.warnings == [
        "run s: numerics gate failed on node vm1, rank 1 (local rank 1): static 4x128: against eager: top-1 "
        "agreement 0.50 < 0.75; its 1 window(s) are left out of every number"]
