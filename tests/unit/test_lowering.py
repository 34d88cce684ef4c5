"""vcfslm/lowering.py: the sweep below its grid, on real serving records with known times:
halving, whole users, the budget, too few requests, requests that ran alone, and a pass
that hands the bracket back to bisection."""

from __future__ import annotations

from test_analysis_support import serve_record

from vcfslm.results.records import REQUEST_LISTS
from vcfslm.serving import decisions as serving
from vcfslm.serving import lowering
from vcfslm.serving.decisions import RefineRule

LIMIT = {"tpot_ms": 200.0, "ttft_s": 3.0}
RULE = RefineRule(budget_s=600.0, steps=3)


def window(load, tpot, *, gap=1.0, n=20, ttft=0.5, out=2, rank=0, w=0, kind="rate", unfinished=0):
    """One rank's window of `n` requests arriving `gap` s apart, each lasting ttft + tpot x (out - 1)."""
    r = serve_record(local_rank=rank, ranks=2, kind=kind, load=load, out=out, window=w, ttft=[ttft] * n,
                     tpot=tpot if isinstance(tpot, list) else [tpot] * n, span=gap * n, unfinished=unfinished)
    r.arrival_s = [5.0 + i * gap for i in range(n)]
    return r


def results(*records):
    return serving.load_results(records)


# Requests 0.25 s apart that each last 0.5 + 0.3 = 0.8 s: every one overlaps its neighbours.
def crowded(load, tpot=300.0, **kw):
    return window(load, tpot, gap=0.25, **kw)


# Requests 1 s apart that each last 0.8 s (TPOT 300 ms, 2 tokens): every one ran alone.
def sparse(load, tpot=300.0, **kw):
    return window(load, tpot, gap=1.0, **kw)


def test_fewest_requests_a_verdict_needs():
    assert (lowering.fewest(0.9), lowering.fewest(0.95), lowering.fewest(0.99), lowering.fewest(0.5)) == (10, 20, 100, 2)


def test_halving_rounds_as_the_sweep_rounds_and_users_stop_at_one():
    assert lowering.halved(2.0, "rate") == 1.0
    assert lowering.halved(0.35, "rate") == 0.175
    assert lowering.halved(2.0002, "rate") == 1.0          # three significant digits, as next_load rounds
    assert lowering.halved(5.0, "users") == 2.0
    assert lowering.halved(3.0, "users") == 1.0
    assert lowering.halved(2.0, "users") == 1.0
    assert lowering.halved(1.0, "users") is None


def test_requests_that_ran_alone_are_those_none_other_overlapped():
    r = window(1.0, 300.0, n=4)
    # 0: [5, 5.8]  1: [6, 6.8] overlaps 2: [6.5, 7.3]  3: [8, 8.8]
    r.arrival_s = [5.0, 6.0, 6.5, 8.0]
    assert lowering.alone_indices(r) == [0, 3]
    # One that starts as another's last token comes does not overlap it.
    r.arrival_s = [5.0, 5.8, 6.6, 7.4]
    assert lowering.alone_indices(r) == [0, 1, 2, 3]
    # A long request overlaps every one that arrives while it runs, not only the next.
    r.arrival_s, r.e2e_s = [5.0, 6.0, 7.0, 9.0], [3.5, 0.1, 0.1, 0.1]
    assert lowering.alone_indices(r) == [3]
    # An unfinished request's times are unknown: its window gives none.
    assert lowering.alone_indices(window(1.0, 300.0, n=4, unfinished=1)) == []
    assert lowering.alone_indices(crowded(1.0)) == []


def test_a_failing_smallest_load_is_halved():
    got = lowering.lower_load(results(crowded(2.0), crowded(4.0)), LIMIT, 0.9, RULE, slo="A")
    assert (got.kind, got.load, got.failing, got.binding) == (lowering.LOWER, 1.0, 2.0, "TPOT")
    assert got.reason == "2 fails on TPOT; 1 next" and not got.stopped


def test_no_lowering_once_a_load_passes_and_bisection_takes_the_bracket():
    # 1 passes after 2 failed: lowering is done, and next_load bisects between them.
    got = results(crowded(1.0, 150.0), crowded(2.0), crowded(4.0))
    low = lowering.lower_load(got, LIMIT, 0.9, RULE, steps_taken=1)
    assert low.kind == lowering.BRACKET and not low.stopped and low.load is None
    verdicts = {load: serving.meets_limit(res, LIMIT, 0.9) for load, res in got.items()}
    assert serving.next_load(verdicts, "rate", 1, RULE.steps) == 1.5
    # Nothing failed: nothing to lower either.
    assert lowering.lower_load(results(crowded(1.0, 150.0)), LIMIT, 0.9, RULE).kind == lowering.BRACKET


def test_users_stop_at_one():
    low = lowering.lower_load(results(crowded(1.0, kind="users")), LIMIT, 0.9,
                              RefineRule(load_kind="users", steps=3))
    assert (low.kind, low.load) == (lowering.FLOOR, None)
    assert low.reason == "1 fails on TPOT; 1 user is the fewest" and low.stopped
    halved = lowering.lower_load(results(crowded(3.0, kind="users", n=40)), LIMIT, 0.9, RefineRule(load_kind="users"))
    assert (halved.kind, halved.load) == (lowering.LOWER, 1.0)


def test_the_steps_and_the_seconds_bound_it():
    crowd = results(crowded(2.0), crowded(4.0))
    steps = lowering.lower_load(crowd, LIMIT, 0.9, RULE, steps_taken=3)
    assert (steps.kind, steps.load) == (lowering.BUDGET, 1.0)
    assert steps.reason == "2 fails on TPOT; no sweep step left (of 3)"
    spent = lowering.lower_load(crowd, LIMIT, 0.9, RULE, steps_taken=1, spent_s=612.0)
    assert spent.reason == "2 fails on TPOT; budget of 600 s spent (612 s of extra windows)"
    none = lowering.lower_load(crowd, LIMIT, 0.9, RefineRule(budget_s=0.0))
    assert none.kind == lowering.BUDGET and none.stopped
    assert lowering.lower_load(crowd, LIMIT, 0.9, RULE, steps_taken=2, spent_s=599.0).kind == lowering.LOWER


def test_too_few_requests_at_the_lower_load_stop_it():
    # At 2 req/s rank 0's window held two requests (overlapping), rank 1's none: one per window,
    # so 1 req/s would leave about half a request per window.
    empty = crowded(2.0, n=2, rank=1)
    for name in REQUEST_LISTS:
        setattr(empty, name, [])
    few = lowering.lower_load(results(crowded(2.0, n=2), empty), LIMIT, 0.9, RULE)
    assert (few.kind, few.load, few.expected) == (lowering.FEW, 1.0, 0.5)
    assert few.reason == ("2 fails on TPOT; 1 would leave about 0.5 requests per window, too few to judge: "
                          "longer windows would measure lower")
    # Two per window halve to one: still judged (flagged as few samples, as the grid's loads are).
    enough = lowering.lower_load(results(crowded(2.0, n=2), crowded(2.0, n=2, rank=1)), LIMIT, 0.9, RULE)
    assert (enough.kind, enough.load) == (lowering.LOWER, 1.0)


def test_a_lone_request_that_misses_stops_it_and_names_the_limit():
    low = lowering.lower_load(results(sparse(1.0), crowded(2.0)), LIMIT, 0.9, RULE, slo="A")
    assert (low.kind, low.binding, low.alone.requests, low.alone.good) == (lowering.ALONE, "TPOT", 20, 0)
    assert low.reason == ("a single request misses TPOT: no load meets SLO-A (20 of the 20 requests that ran "
                          "alone missed it)")
    assert low.stopped and low.load is None
    # The TTFT limit binds when that is what a request alone misses.
    slow_start = lowering.lower_load(results(sparse(1.0, 100.0, ttft=0.6)), {"tpot_ms": 200.0, "ttft_s": 0.5},
                                     0.9, RULE, slo="SLO-B")
    assert slow_start.reason.startswith("a single request misses TTFT: no load meets SLO-B")
    # Requests that ran alone and met it say nothing against it: halve on. Here the window's
    # first ten came 1 s apart (alone, TPOT 150 ms), its last ten 0.25 s apart (TPOT 300 ms).
    mixed = window(1.0, [150.0] * 10 + [300.0] * 10)
    mixed.arrival_s = [5.0 + i for i in range(10)] + [20.0 + 0.25 * i for i in range(10)]
    ok_alone = lowering.lower_load(results(mixed), LIMIT, 0.9, RULE)
    assert (ok_alone.kind, ok_alone.load, ok_alone.alone.requests, ok_alone.alone.good) == (lowering.LOWER, 0.5, 10, 10)


def test_few_lone_requests_fail_it_only_when_no_more_could_rescue_it():
    # One lone request missed: nine more good ones would make 90 %, so it does not decide.
    one = lowering.alone(results(sparse(1.0, [300.0], n=1)), LIMIT, 0.9)
    assert (one.requests, one.good, one.fails, one.binding) == (1, 0, False, "")
    two = lowering.alone(results(sparse(1.0, [300.0, 300.0], n=2)), LIMIT, 0.9)
    assert (two.requests, two.fails, two.binding) == (2, True, "TPOT")
    # Enough lone requests: judged as a load is (9 of 10 meet 90 %).
    nine = lowering.alone(results(sparse(1.0, [300.0] + [150.0] * 9, n=10)), LIMIT, 0.9)
    assert (nine.requests, nine.good, nine.fails) == (10, 9, False)
    eight = lowering.alone(results(sparse(1.0, [300.0] * 2 + [150.0] * 8, n=10)), LIMIT, 0.9)
    assert (eight.requests, eight.good, eight.fails, eight.binding) == (10, 8, True, "TPOT")


def test_a_lower_load_without_a_valid_window_is_not_tried_again():
    broken = crowded(1.0)
    broken.valid, broken.invalid_reasons = False, ["recompiled"]
    low = lowering.lower_load(results(broken, crowded(2.0)), LIMIT, 0.9, RULE)
    assert (low.kind, low.load) == (lowering.FLOOR, 1.0)
    assert (low.reason, low.failing) == ("2 fails on TPOT; 1 has no valid window", 2.0)
