"""The serving sweep's refinement as the rank worker drives it (bench/serve_worker.py's _refine):
a new load inside a wide gap, windows where the replicates disagree, the budget, on fake windows."""

from __future__ import annotations

from vcfslm.bench.serve_worker import _refine, extra_seconds
from vcfslm.serving import ServeSpec

LIMIT = {"tpot_ms": 200.0, "ttft_s": 3.0}


class _Window:
    """A serving record as the sweep reads it: one rank's window at one load."""

    def __init__(self, rank, window, load, good, bad, wall=10.0):
        self.rank, self.window, self.load, self.run_id = rank, window, float(load), "r"
        self.ttft_s = [1.0] * good + [9.0] * bad
        self.tpot_ms = [100.0] * (good + bad)
        self.unfinished, self.mean_active, self.valid, self.wall_s = 0, 2.0, True, wall
        self.span_s, self.invalid_reasons = 10.0, []


class Sweep:
    """Two ranks whose loads up to `truth` requests/s meet the SLO with every request, and above it none."""

    def __init__(self, truth, loads, repeats=1):
        self.truth, self.records, self.measured = truth, [], []
        for load in loads:
            for window in range(repeats):
                self.measure(load, window)

    def measure(self, load, window):
        self.measured.append((load, window))
        good = 50 if load <= self.truth else 5
        self.records += [_Window(rank, window, load, good, 50 - good) for rank in (0, 1)]


def test_the_sweep_measures_new_loads_inside_the_gap_then_stops_once_it_is_narrow():
    sweep = Sweep(3.4, [1.0, 4.0])
    spec = ServeSpec(loads=(1.0, 4.0), sweep=True, repeats=1)
    why = _refine(spec, "B", LIMIT, lambda: sweep.records, sweep.measure)
    # Each new load is one window numbered after the repeats, so the budget counts it.
    assert sweep.measured[2:] == [(2.5, 1), (3.25, 1)]
    assert extra_seconds(sweep.records, spec.repeats) == 20.0
    assert why == "interval [3.25–<4] is within 25% of the threshold"


def test_the_budget_bounds_the_new_loads():
    sweep = Sweep(3.4, [1.0, 4.0])
    spec = ServeSpec(loads=(1.0, 4.0), sweep=True, repeats=1, sweep_budget_s=10.0)
    why = _refine(spec, "B", LIMIT, lambda: sweep.records, sweep.measure)
    assert sweep.measured[2:] == [(2.5, 1)]
    assert why.startswith("budget of 10 s spent (10 s of extra windows); interval [2.5–<4] is 60% of the threshold")
