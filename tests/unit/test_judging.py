"""vcfslm.serving.judging: the rule that says whether a load meets an SLO, its sample rule, the
threshold over loads, the sizing law and the bootstrap intervals on thresholds and node counts."""

from __future__ import annotations

import math
import random

import pytest

from vcfslm.analysis.cells import SINGLE, Cell, CellKey, Quantiles
from vcfslm.analysis.slo import crossovers, size
from vcfslm.analysis.slo_spec import Slo
from vcfslm.results import percentile
from vcfslm.serving import decisions as serving
from vcfslm.serving import judging
from vcfslm.serving.decisions import LoadResult
from vcfslm.serving.judging import Interval, Replicate, Rule


def test_min_samples_follow_the_tail_share():
    # p90 needs ~50 values (5 above it), p99 ~500; the median ~10.
    assert [judging.min_samples(q) for q in (0.5, 0.9, 0.95, 0.99)] == [10, 50, 100, 500]
    assert judging.few_samples({"4": 60, "8": 49}, 0.9, "requests") == "judged on fewer than 50 requests at 8 (49)"
    assert judging.few_samples({"4": 50}, 0.9, "requests") is None
    with pytest.raises(ValueError):
        judging.min_samples(1.0)


def test_rule_defaults_and_an_slo_with_its_own_percentile():
    rule = Rule()
    assert (rule.percentile, rule.attainment, rule.confidence) == ("p90", 0.9, 0.95)
    assert rule.percentile_for("p99") == "p99" and rule.attainment_for("p99") == pytest.approx(0.99)
    assert rule.static_text() == "p90 of streams" and rule.serving_text() == "90 % of requests meet every limit"
    for bad in ({"percentile": "p95"}, {"attainment": 1.0}, {"attainment": 0.0}, {"confidence": 1.2}):
        with pytest.raises(ValueError):
            Rule(**bad)


def test_attainment_counts_exactly_and_unfinished_requests_met_nothing():
    a = judging.attainment([1.0] * 9 + [9.0], [100.0] * 10, 0, 200.0, 3.0)
    assert (a.requests, a.good, a.share) == (10, 9, 0.9)
    assert judging.attains(a, 0.9) is True          # 9 of 10 is 90 %, not a float hair below
    assert judging.attains(judging.attainment([1.0] * 9, [100.0] * 9, 1, 200.0, 3.0), 0.9) is True
    assert judging.attains(judging.attainment([1.0] * 9, [100.0] * 9, 2, 200.0, 3.0), 0.9) is False
    assert judging.attains(judging.attainment([], [], 0, 200.0, 3.0), 0.9) is None
    # A limit of None constrains nothing; a value at the limit meets it.
    assert judging.attainment([5.0], [200.0], 0, 200.0, None).good == 1


def test_binding_names_the_limit_that_keeps_the_share_down():
    ttft_only = judging.attainment([9.0] * 3 + [1.0] * 7, [100.0] * 10, 0, 200.0, 3.0)
    assert ttft_only.binding(0.9) == "TTFT"
    both = judging.attainment([9.0] * 2 + [1.0] * 8, [100.0] * 8 + [300.0] * 2, 0, 200.0, 3.0)
    assert both.binding(0.9) == "TPOT and TTFT"
    together = judging.attainment([9.0] + [1.0] * 9, [100.0] * 9 + [300.0], 0, 200.0, 3.0)
    assert together.binding(0.85) == "TPOT and TTFT together"


def test_threshold_and_sizing_law():
    assert judging.threshold({1.0: True, 2.0: True, 4.0: False, 8.0: True}) == (2.0, 4.0)
    assert judging.threshold({1.0: None, 2.0: False}) == (None, 2.0)
    assert judging.nodes_required(256, 64) == 4 and judging.nodes_required(256, 64, 0.1) == 5
    assert judging.nodes_required(100, 0.3) == 334               # exact: no float rounding up to 335
    with pytest.raises(ValueError):
        judging.nodes_required(10, 0)


def test_interval_ends_and_their_text():
    # The low end: the replicates' thresholds; the high end: their first failing loads, exclusive.
    reps = [Replicate(4.0, False, 8.0)] * 10 + [Replicate(8.0, False, 16.0)] * 85 + [Replicate(16.0, True)] * 5
    iv = judging.interval(reps)
    assert (iv.low, iv.high, iv.high_bound, iv.high_open, iv.replicates) == (4.0, 16.0, True, False, 100)
    assert iv.text() == "[4–≥ 16]"
    assert judging.interval([Replicate(None, False, 4.0)] * 3 + [Replicate(8.0, False, 16.0)] * 97).text() \
        == "[none–<16]"
    agreed = judging.interval([Replicate(8.0, False, 16.0)] * 50)
    assert agreed.text() == "[8–<16]"
    assert agreed.to_dict() == {"low": 8.0, "high": 16.0, "low_is_lower_bound": False, "high_is_lower_bound": False,
                                "high_is_exclusive": True, "replicates": 50, "confidence": 0.95}
    assert judging.interval([Replicate(8.0, False)] * 50).text() == "[8–8]"    # no failing load known
    assert judging.interval([Replicate(8.0, True)] * 50).text() == ""          # nothing beyond "≥ 8"
    assert judging.interval([Replicate(None, False, 4.0)] * 50).text() == ""   # nothing beyond "none"
    assert judging.interval([None, None]) is None
    assert judging.replicate_of({4.0: True, 8.0: True, 16.0: False}) == Replicate(8.0, False, 16.0)
    # Nodes from the interval's ends: 256 / 4 = 64 at most; the threshold is below 16, so more than 256 / 16.
    nodes = judging.nodes_interval([Replicate(4.0, False, 8.0)] * 3 + [Replicate(8.0, False, 16.0)] * 97, 256)
    assert (nodes.low, nodes.high, nodes.high_open, nodes.text()) == (17, 64, False, "[17–64]")
    assert judging.nodes_of(Interval(4.0, 10.0, high_open=True), 100).text() == "[11–25]"      # 100 / 10 = 10 -> 11
    assert judging.nodes_of(Interval(4.0, 16.0, high_open=True), 256, 0.2).text() == "[21–80]"  # 256 / 12.8 = 20
    bound = judging.nodes_interval([Replicate(16.0, True)] * 10, 256)
    assert bound.text(mark="≤ ") == ""
    assert Interval(2, 4, False, True).text(mark="≤ ") == "[2–≤ 4]"


def test_a_bracketed_threshold_reaches_toward_the_first_failing_load():
    # 4 streams/VM passes, 16 fails, every replicate agrees: the threshold is somewhere in [4, 16).
    cells = _cells(random.Random(1), [4, 16], lambda load: 100.0 + load * 2.0, window_sd=0.01, stream_sd=0.0)
    (c,) = crossovers(cells, [Slo("T", tpot_ms=120.0)], "p90", Rule(replicates=200))
    assert (c.threshold, c.first_failing, c.interval_text) == (4, 16, "[4–<16]")
    s = size(c, 256)
    # ceil(256 / 4) = 64 at most; below 16 streams/VM needs more than 256 / 16 = 16 nodes: 17 at least.
    assert s.answer_text() == "4 [4–<16] streams/VM → 64 [17–64] nodes"
    d = s.to_dict()
    assert (d["threshold_interval"]["high"], d["threshold_interval"]["high_is_exclusive"]) == (16.0, True)
    assert (d["nodes_interval"]["low"], d["nodes_interval"]["high"]) == (17, 64)
    assert "95% interval: threshold [4–<16] streams/VM, nodes [17–64] (200 bootstrap replicates)." in s.reasoning


# ------------------------------------------------------------------ coverage


def _cells(rng: random.Random, loads, tpot_of, ranks=4, windows=3, batch=4, window_sd=0.08, stream_sd=0.02):
    """Static cells whose streams' TPOT is tpot_of(load) x a window factor x a stream factor: the
    streams of one window share most of their time, as static batches do."""
    out = []
    for load in loads:
        strata = []
        for _ in range(ranks):
            ws = []
            for _ in range(windows):
                f = math.exp(rng.gauss(0, window_sd))
                ws.append(((0.1,) * batch, tuple(tpot_of(load) * f * math.exp(rng.gauss(0, stream_sd))
                                                 for _ in range(batch))))
            strata.append(tuple(ws))
        tpot = [v for s in strata for w in s for v in w[1]]
        ttft = [v for s in strata for w in s for v in w[0]]
        out.append(Cell(CellKey(SINGLE, 1, 1, load, 128, 64), Quantiles(*(percentile(ttft, q) for q in (50, 90, 99))),
                        Quantiles(*(percentile(tpot, q) for q in (50, 90, 99))), 1.0, strata=tuple(strata)))
    return out


def _coverage(loads, slope, truth, seeds=300):
    """Over `seeds` seeded draws of static cells at `loads` whose TPOT rises by `slope` per stream and
    whose limit lies between the true p90 at `truth` and at truth + 1: the share of intervals
    [low, <high) holding `truth`, the share of point estimates equal to it, and the share of the
    replicates' thresholds alone (their central 95 %, no failing load) holding it."""
    def tpot_of(load):
        return 100.0 * (1 + slope * load)

    # The true p90 of a load's streams: its TPOT x the p90 of the lognormal factors.
    p90 = 1.2815516 * math.sqrt(0.08 ** 2 + 0.02 ** 2)

    def true_p90(load):
        return tpot_of(load) * math.exp(p90)

    slo = Slo("T", tpot_ms=(true_p90(truth) + true_p90(truth + 1)) / 2)
    covered = exact = by_thresholds = 0
    for seed in range(seeds):
        (c,) = crossovers(_cells(random.Random(seed), loads, tpot_of), [slo], "p90", Rule(replicates=300, seed=seed))
        iv = c.interval
        low = 0 if iv.low is None else iv.low
        assert iv.high_open or iv.high_bound
        covered += low <= truth and (iv.high_bound or truth < iv.high)
        exact += c.threshold == truth
        thresholds = sorted(-1 if r.threshold is None else r.threshold for r in c.replicates if r is not None)
        by_thresholds += low <= truth <= thresholds[math.ceil(0.975 * len(thresholds)) - 1]
    return covered / seeds, exact / seeds, by_thresholds / seeds


def test_the_95_percent_interval_covers_a_known_threshold_in_90_to_99_percent_of_seeds():
    # Every load tested (streams/VM, one rank per VM): loads up to 8 meet the limit, 9 and above do not.
    covered, exact, _ = _coverage(list(range(1, 17)), 0.05, 8)
    assert 0.90 <= covered <= 0.99, covered
    # The point estimate alone finds the truth far less often than its interval covers it.
    assert exact < covered - 0.2
    # A grid with gaps: the truth (6) lies between the tested loads 4 and 8, so no tested load is it.
    # The interval reaches up to the first failing load and still covers it as often as it claims;
    # the replicates' thresholds alone (tested loads only) fall well short of 95 %.
    covered, exact, by_thresholds = _coverage([1, 2, 4, 8, 16], 0.04, 6)
    assert 0.90 <= covered <= 0.99, covered
    assert exact == 0 and by_thresholds < 0.9, by_thresholds


def test_a_sizing_carries_the_interval_its_threshold_implies():
    loads = [4, 8, 16, 32]
    cells = _cells(random.Random(1), loads, lambda load: 100.0 + load * 2.0, window_sd=0.01, stream_sd=0.0)
    (c,) = crossovers(cells, [Slo("T", tpot_ms=145.0)], "p90", Rule(replicates=200))
    assert (c.threshold, c.first_failing, c.interval.text()) == (16, 32, "[16–<32]")
    s = size(c, 256)
    assert (s.nodes, s.interval_text) == (16, "[9–16]")
    assert s.answer_text() == "16 [16–<32] streams/VM → 16 [9–16] nodes"
    assert s.to_dict()["nodes_interval"]["low"] == 9
    # A CSV's cells hold no windows: no interval, and the answer says nothing it cannot back.
    bare = [Cell(x.key, x.ttft_s, x.tpot_ms, 1.0) for x in cells]
    (b,) = crossovers(bare, [Slo("T", tpot_ms=145.0)], "p90")
    assert b.interval is None and size(b, 256).answer_text() == "16 streams/VM → 16 nodes"


# ------------------------------------------------------------------ serving


class _Window:
    def __init__(self, rank, window, load, good, bad, unfinished=0, active=2.0, wall=10.0):
        self.rank, self.window, self.load, self.run_id = rank, window, load, "r"
        self.ttft_s = [1.0] * good + [9.0] * bad
        self.tpot_ms = [100.0] * (good + bad)
        self.unfinished, self.mean_active, self.valid, self.wall_s = unfinished, active, True, wall
        self.span_s, self.invalid_reasons = 10.0, []


def _results(by_load):
    """{load: [(rank, good, bad), ...]} as pooled LoadResults of one window per entry."""
    return serving.load_results(_Window(rank, i, load, good, bad) for load, ws in by_load.items()
                                for i, (rank, good, bad) in enumerate(ws))


LIMIT = {"tpot_ms": 200.0, "ttft_s": 3.0}


def test_serving_bootstrap_is_seeded_and_reads_streams_per_replicate():
    results = _results({1.0: [(0, 20, 0), (1, 20, 0)], 2.0: [(0, 18, 2), (1, 17, 3)], 4.0: [(0, 5, 15), (1, 6, 14)]})
    windows = serving.bootstrap_windows(results, {"B": LIMIT})
    assert [len(s) for s in windows[2.0]] == [1, 1] and windows[2.0][0][0].good == {"B": 18}
    one = judging.serving_replicates(windows, {"B": 0.9}, 200, seed=3)
    two = judging.serving_replicates(windows, {"B": 0.9}, 200, seed=3)
    assert [r for r, _ in one["B"]] == [r for r, _ in two["B"]]
    reps = [r for r, _ in one["B"]]
    # 87.5 % attainment at load 2 sits just below 90 %: the replicates disagree between 1 and 2.
    assert {r.threshold for r in reps} == {1.0, 2.0}
    assert all(active[1.0] == 2.0 for _, active in one["B"])


RULE = serving.RefineRule(precision=0.25, budget_s=600.0)


def test_refine_adds_windows_where_the_replicates_disagree_then_stops_and_says_why():
    # 4 passes, 4.5 fails at 87.5 % (just below 90 %), 8 fails: the gap 4–4.5 is narrow, but some
    # replicates pass 4.5 and fail only at 8, so the interval reaches to 8: more windows at 4 and 4.5.
    results = _results({4.0: [(0, 20, 0), (1, 20, 0)], 4.5: [(0, 18, 2), (1, 17, 3)], 8.0: [(0, 5, 15), (1, 6, 14)]})
    step = serving.refine(results, LIMIT, 0.9, RULE, spent_s=0.0)
    assert (step.loads, step.new_load, step.done) == ((4.0, 4.5), None, False)
    assert step.reason == "interval [4–<8] is 100% of the threshold"
    spent = serving.refine(results, LIMIT, 0.9, RULE, spent_s=600.0)
    assert spent.done and spent.reason.startswith("budget of 600 s spent")
    sure = _results({4.0: [(0, 50, 0), (1, 50, 0)], 4.5: [(0, 5, 45), (1, 5, 45)], 8.0: [(0, 5, 45), (1, 5, 45)]})
    done = serving.refine(sure, LIMIT, 0.9, RULE)
    assert done.done and done.reason == "interval [4–<4.5] is within 25% of the threshold"
    every = serving.refine(_results({1.0: [(0, 10, 0)]}), LIMIT, 0.9, RULE)
    assert every.done and every.reason == "no bracket: every load passes"


def test_refine_measures_a_new_load_inside_a_wide_gap_until_it_is_narrow():
    # The truth: up to 3.4 requests/s per rank meets the SLO. Tested: 1 passes and 4 fails, every
    # replicate agrees, so more windows cannot narrow [1–<4]; a load inside the gap can.
    def measured(load):
        return [(0, 50, 0), (1, 50, 0)] if load <= 3.4 else [(0, 5, 45), (1, 5, 45)]

    loads, proposed = [1.0, 4.0], []
    while not (step := serving.refine(_results({v: measured(v) for v in loads}), LIMIT, 0.9, RULE)).done:
        assert step.loads == () and step.new_load not in loads
        proposed.append(step.new_load)
        loads.append(step.new_load)
    # Bisected as next_load does (rounded to three digits): 2.5, then 3.25; then 3.25–4 is within 25 %.
    assert proposed == [2.5, 3.25]
    assert step.reason == "interval [3.25–<4] is within 25% of the threshold"
    first = serving.refine(_results({1.0: measured(1.0), 4.0: measured(4.0)}), LIMIT, 0.9, RULE)
    assert first.reason == "interval [1–<4] is 300% of the threshold, the gap 1–4 alone 300%"
    # Users are whole: between 1 and 2 there is nothing to try, and agreeing replicates need no more windows.
    users = serving.RefineRule(precision=0.25, budget_s=600.0, load_kind="users")
    adjacent = serving.refine(_results({1.0: measured(1.0), 2.0: measured(4.0)}), LIMIT, 0.9, users)
    assert adjacent.done and adjacent.reason.endswith("and no load to try between 1 and 2")
    assert serving.refine(_results({1.0: measured(1.0), 4.0: measured(4.0)}), LIMIT, 0.9, users).new_load == 2.0
    # The budget still bounds it.
    assert serving.refine(_results({1.0: measured(1.0), 4.0: measured(4.0)}), LIMIT, 0.9, RULE, 600.0).done


def test_load_result_attainment_matches_the_per_window_counts():
    results = _results({2.0: [(0, 18, 2), (1, 17, 3)]})
    res: LoadResult = results[2.0]
    assert res.attainment(200.0, 3.0).good == 35 and res.requests == 40
    assert serving.meets(res, 200.0, 3.0, 0.9) is False and serving.meets(res, 200.0, 3.0, 0.85) is True
