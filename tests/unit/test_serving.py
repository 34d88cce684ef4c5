"""Serving mode's pure decisions: arrivals, lengths, tails, verdicts, goodput, the sweep."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from vcfslm.serving import decisions as serving
from vcfslm.serving import judging
from vcfslm.serving.decisions import LoadResult, ServeSpec


def _gaps(times):
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_rate_and_dispersion_for_a_known_seed(burstiness):
    rate, duration = 20.0, 2000.0
    times = serving.arrival_times(rate, duration, random.Random(1234), burstiness)
    gaps = _gaps(times)
    # ~40,000 arrivals: the rate within 2 %, the gaps' coefficient of variation within 3 %
    # of 1/sqrt(shape) (1 for Poisson, 2 for shape 0.25, 0.5 for shape 4).
    assert len(times) / duration == pytest.approx(rate, rel=0.02)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)
    assert all(0 <= t < duration for t in times) and times == sorted(times)


def test_poisson_counts_per_second_have_variance_equal_to_mean():
    times = serving.arrival_times(5.0, 4000.0, random.Random(7))
    counts = [0] * 4000
    for t in times:
        counts[int(t)] += 1
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.08)


def test_the_same_seed_draws_the_same_window_and_ranks_differ():
    spec = ServeSpec(loads=(2.0,), lengths="uniform", duration_s=30)
    a = serving.open_loop_plan(spec, 2.0, 512, random.Random(serving.window_seed(0, 0, 2.0, 512, 0)))
    b = serving.open_loop_plan(spec, 2.0, 512, random.Random(serving.window_seed(0, 0, 2.0, 512, 0)))
    c = serving.open_loop_plan(spec, 2.0, 512, random.Random(serving.window_seed(0, 1, 2.0, 512, 0)))
    assert a == b and a != c
    assert all(256 <= p.input_tokens <= 512 and 64 <= p.output_tokens <= 128 for p in a)
    assert len({p.input_tokens for p in a}) > 5


def test_fixed_lengths_are_the_nominal_ones():
    spec = ServeSpec(loads=(3.0,), duration_s=20)
    plan = serving.open_loop_plan(spec, 3.0, 128, random.Random(0))
    assert {(p.input_tokens, p.output_tokens) for p in plan} == {(128, 128)}


def test_think_time_mean():
    rng = random.Random(3)
    assert statistics.fmean(serving.think_time(2.0, rng) for _ in range(20000)) == pytest.approx(2.0, rel=0.03)
    assert serving.think_time(0.0, rng) == 0.0


def test_spec_problems_name_the_setting():
    with pytest.raises(ValueError, match="leave nothing"):
        ServeSpec(duration_s=10, warmup_s=5, cooldown_s=5)
    with pytest.raises(ValueError, match="users must be whole"):
        ServeSpec(load_kind="users", loads=(1.5,))
    with pytest.raises(ValueError, match="arrival must be one of"):
        ServeSpec(arrival="uniform")
    with pytest.raises(ValueError, match="output tokens must be at least 2"):
        ServeSpec(output_tokens=1)


def test_spec_round_trips_through_its_record():
    spec = ServeSpec(load_kind="users", loads=(1, 2, 4), input_tokens=(128, 512), sweep=True)
    assert ServeSpec.of_record(spec.to_dict()) == spec
    assert spec.arrival_kind == "closed" and spec.max_context == 640
    assert ServeSpec(duration_s=60, warmup_s=5, cooldown_s=5).span_s == 50


def test_in_span():
    spec = ServeSpec(duration_s=60, warmup_s=5, cooldown_s=10)
    assert [serving.in_span(t, spec) for t in (4.9, 5.0, 50.0, 50.1)] == [False, True, True, False]


def test_tail_counts_unfinished_requests_as_infinite():
    values = [float(i) for i in range(1, 11)]            # 1..10
    assert serving.tail(values, 0) == pytest.approx(9.1)
    assert math.isinf(serving.tail(values, 2))           # 12 requests: p90 reaches an unfinished one
    assert serving.tail(values * 10, 1) < math.inf       # 1 in 101 does not reach p90
    assert math.isnan(serving.tail([], 0))


def _result(load, ttft, tpot, unfinished=0):
    return LoadResult(load, tuple(ttft), tuple(tpot), unfinished, span_s=10.0)


def test_a_load_where_each_tail_passes_but_only_80_percent_meet_both_fails_at_90_percent_attainment():
    # 100 requests: 10 miss TTFT (but meet TPOT), another 10 miss TPOT (but meet TTFT).
    ttft = [0.5] * 80 + [4.0] * 10 + [0.5] * 10
    tpot = [100.0] * 80 + [100.0] * 10 + [300.0] * 10
    r = _result(1.0, ttft, tpot)
    limit_tpot, limit_ttft = 200.0, 3.0
    # The old rule: the p90 of each indicator on its own is within its limit.
    old_rule = serving.tail(ttft, 0, 90) <= limit_ttft and serving.tail(tpot, 0, 90) <= limit_tpot
    assert old_rule is True
    a = r.attainment(limit_tpot, limit_ttft)
    assert (a.requests, a.good, a.tpot_good, a.ttft_good) == (100, 80, 90, 90)
    assert a.binding(0.9) == "TPOT and TTFT together"
    assert serving.meets(r, limit_tpot, limit_ttft, 0.9) is False
    assert serving.meets(r, limit_tpot, limit_ttft, 0.8) is True          # exactly 80 %: met
    # A request still unfinished at the cutoff met no limit.
    assert serving.meets(_result(1.0, [0.5] * 9, [100.0] * 9, unfinished=1), 200.0, 3.0, 0.9) is True
    assert serving.meets(_result(1.0, [0.5] * 9, [100.0] * 9, unfinished=2), 200.0, 3.0, 0.9) is False


def test_share_for_an_slo_with_its_own_percentile():
    assert serving.share_for({"tpot_ms": 100.0}, 0.9) == 0.9
    assert serving.share_for({"tpot_ms": 100.0, "percentile": "p99"}, 0.9) == pytest.approx(0.99)


def test_meets_judges_both_tails_inclusively():
    r = _result(1.0, [1.0] * 10, [100.0] * 10)
    assert serving.meets(r, tpot_ms=100.0, ttft_s=1.0) is True
    assert serving.meets(r, tpot_ms=99.0, ttft_s=None) is False
    assert serving.meets(r, tpot_ms=None, ttft_s=0.5) is False
    assert serving.meets(_result(1.0, [], []), 100.0, 1.0) is None
    assert serving.meets(_result(1.0, [0.1], [10.0], unfinished=5), 100.0, 1.0) is False


def test_goodput_per_slo():
    limits = {"A": {"tpot_ms": 130.0, "ttft_s": 3.0}, "B": {"tpot_ms": 50.0, "ttft_s": 1.0}}
    out = serving.goodput([0.5, 2.0, 4.0], [40.0, 100.0, 40.0], span_s=2.0, limits=limits)
    assert out == {"A": 1.0, "B": 0.5}
    assert serving.goodput([], [], 0.0, limits) == {"A": 0.0, "B": 0.0}


def test_load_results_pool_ranks_and_repeats():
    class R:
        def __init__(self, rank, load, ttft, unfinished=0, valid=True):
            self.rank, self.load, self.ttft_s, self.tpot_ms = rank, load, ttft, [10.0] * len(ttft)
            self.unfinished, self.span_s, self.mean_active, self.window = unfinished, 5.0, 2.0, 0
            self.valid, self.invalid_reasons = valid, ([] if valid else ["1 compilation(s)"])

    pooled = serving.load_results([R(0, 1.0, [0.1, 0.2]), R(1, 1.0, [0.3], 1, valid=False), R(0, 2.0, [1.0])])
    assert list(pooled) == [1.0, 2.0]
    one = pooled[1.0]
    # the invalid window is not pooled, only named
    assert (one.requests, one.unfinished, one.span_s, one.ranks) == (2, 0, 5.0, 1)
    assert one.invalid == ("rank 1 window 0: 1 compilation(s)",)
    only_invalid = serving.load_results([R(1, 3.0, [0.3], valid=False)])[3.0]
    assert only_invalid.requests == 0 and serving.meets(only_invalid, 100.0, 1.0) is None


def test_threshold_is_the_last_pass_before_the_first_failure():
    assert judging.threshold({1.0: True, 2.0: True, 4.0: False, 8.0: True}) == (2.0, 4.0)
    assert judging.threshold({1.0: False}) == (None, 1.0)
    assert judging.threshold({1.0: True, 2.0: None}) == (1.0, None)


def test_next_load_bisects_rates_and_users():
    assert serving.next_load({1.0: True, 4.0: False}, "rate", 0, 3) == 2.5
    assert serving.next_load({1.0: True, 2.5: True, 4.0: False}, "rate", 1, 3) == 3.25
    assert serving.next_load({1.0: True, 4.0: False}, "rate", 3, 3) is None     # steps used up
    assert serving.next_load({1.0: True, 1.02: False}, "rate", 0, 3) is None    # within tolerance
    assert serving.next_load({1.0: True, 2.0: True}, "rate", 0, 3) is None      # no failure to bisect
    assert serving.next_load({4.0: True, 16.0: False}, "users", 0, 5) == 10.0
    assert serving.next_load({4.0: True, 5.0: False}, "users", 0, 5) is None


def test_sweep_converges_on_a_known_threshold():
    truth = 3.3
    verdicts = {load: load <= truth for load in (1.0, 2.0, 4.0, 8.0)}
    for step in range(10):
        nxt = serving.next_load(verdicts, "rate", step, 10)
        if nxt is None:
            break
        verdicts[nxt] = nxt <= truth
    passing, failing = judging.threshold(verdicts)
    assert passing <= truth < failing and (failing - passing) / failing <= serving.SWEEP_TOLERANCE
