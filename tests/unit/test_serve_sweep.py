"""The serving sweep as the rank worker drives it (bench/windows.py): refinement (_refine: a
new load inside a wide gap, windows where the replicates disagree, the budget, on fake windows),
and sweep_input below a grid that fails, over a synthetic latency model."""

from __future__ import annotations

import math

from test_analysis_support import serve_record

from vcfslm.bench.windows import _refine, extra_seconds, sweep_input
from vcfslm.serving.decisions import ServeSpec

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


# ------------------------------------------------------------------ below the grid


class Latency:
    """A rank whose requests arrive evenly at `rate` per second over the span and each take
    TTFT 0.1 s plus TPOT x 4 tokens; the requests in flight together, c = ceil(rate x the lone
    request's time), slow each token by `per_stream` ms per other stream. Real ServeRecords."""

    def __init__(self, spec, lone_tpot_ms, per_stream_ms):
        self.spec, self.lone, self.per = spec, lone_tpot_ms, per_stream_ms
        self.records, self.measured = [], []

    def measure(self, load, input_tokens, extra=None):
        windows = [extra] if extra is not None else range(self.spec.repeats)
        for w in windows:
            self.measured.append(load if extra is None else (load, w))
            n = round(load * self.spec.span_s)
            alone_s = 0.1 + self.lone * 4 / 1000
            streams = max(1, math.ceil(load * alone_s - 1e-9))
            r = serve_record(ranks=1, load=load, inp=input_tokens, out=5, window=w, ttft=[0.1] * n,
                             tpot=[self.lone + self.per * (streams - 1)] * n, span=self.spec.span_s)
            self.records.append(r)


def swept(spec, model, limits={"A": LIMIT}):                  # noqa: B006 (read only)
    stops = []
    sweep_input(spec, limits, 128, model.measure, lambda: model.records, lambda name, why: stops.append((name, why)))
    return stops


GRID = ServeSpec(loads=(4.0, 8.0), sweep=True, duration_s=100.0, warmup_s=5.0, cooldown_s=5.0)


def test_a_failing_grid_is_halved_until_a_load_passes_then_bisected_and_refined():
    # Lone requests take 0.5 s (TPOT 100 ms): up to 2 req/s they never overlap and meet TPOT 200 ms;
    # two at once make 250 ms. The grid's 4 and 8 req/s both fail.
    model = Latency(GRID, 100.0, 150.0)
    stops = swept(GRID, model)
    # The grid stops at 4 (every SLO fails), halving finds 2, bisection takes the other two steps
    # (3, then 2.5), and refinement stops once the bracket is within 25 %.
    assert model.measured == [4.0, 2.0, 3.0, 2.5]
    assert stops == [("A", "interval [2–<2.5] is within 25% of the threshold")]


def test_a_lone_request_that_misses_stops_the_sweep_and_says_which_limit():
    # TPOT 250 ms even for a request alone (1.1 s each): no load can meet 200 ms.
    model = Latency(GRID, 250.0, 50.0)
    stops = swept(GRID, model)
    # 2 and 1 req/s overlap; at 0.5 every request ran alone and missed TPOT.
    assert model.measured == [4.0, 2.0, 1.0, 0.5]
    assert stops == [("A", "a single request misses TPOT: no load meets SLO-A (45 of the 45 requests that ran "
                           "alone missed it)")]


def test_the_budget_stops_the_halving_and_says_so():
    spec = ServeSpec(loads=(4.0, 8.0), sweep=True, duration_s=100.0, sweep_budget_s=150.0)
    model = Latency(spec, 250.0, 50.0)
    stops = swept(spec, model)
    # Each window below the grid takes 102 s of wall time: after 2 and 1, 204 s of 150 are spent.
    assert model.measured == [4.0, 2.0, 1.0]
    assert stops == [("A", "1 fails on TPOT; budget of 150 s spent (204 s of extra windows)")]
    steps = ServeSpec(loads=(4.0, 8.0), sweep=True, duration_s=100.0, sweep_steps=1)
    assert swept(steps, Latency(steps, 250.0, 50.0)) == [("A", "2 fails on TPOT; no sweep step left (of 1)")]


def test_windows_too_short_for_a_lower_load_stop_it():
    spec = ServeSpec(loads=(4.0, 8.0), sweep=True, duration_s=3.0, warmup_s=0.5, cooldown_s=0.5)   # a 2 s span
    model = Latency(spec, 250.0, 50.0)
    stops = swept(spec, model)
    # 8, 4, 2 and 1 request per window; the lone request at 0.5 req/s misses, but one alone
    # cannot say no load meets 90 %, and 0.25 would leave half a request per window.
    assert model.measured == [4.0, 2.0, 1.0, 0.5]
    assert stops == [("A", "0.5 fails on TPOT; 0.25 would leave about 0.5 requests per window, too few to judge: "
                           "longer windows would measure lower")]


def test_without_sweep_only_the_grid_is_measured():
    spec = ServeSpec(loads=(4.0, 8.0), duration_s=100.0)
    model = Latency(spec, 100.0, 150.0)
    assert swept(spec, model) == [] and model.measured == [4.0, 8.0]
