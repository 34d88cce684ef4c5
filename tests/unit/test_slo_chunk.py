"""The serving chunk from the SLO (pure): the prompt tokens a step takes beside running
decodes are the most whose step, by the rank's measured decode time and probed linears,
stays within the tightest TPOT limit less a margin; none set, the kernel curve's chunk."""

from __future__ import annotations

import itertools

import pytest

from vcfslm.engine.step_cost import (
    MAX_CHUNK_TOKENS,
    MIN_SLO_CHUNK_TOKENS,
    SLO_MARGIN,
    StepCost,
    chunk_rule,
    linears_s,
    slo_chunk_tokens,
    slo_chunks,
    tightest_tpot_ms,
)

W = 7_640_000_000      # Phi-3-mini's step weights, bf16
# The 2-core EPYC's probe: decode linears flat to 4 rows, then compute-bound; 0.45 TFLOP/s.
ROWS, GBS = (1, 2, 4, 8, 16, 32, 64), (41.2, 41.9, 40.6, 30.9, 21.6, 12.2, 6.57)
DECODE = {1: 0.26, 4: 0.27, 16: 0.42}


def cost(decode=None, curve=True, gemm=0.45):
    return StepCost(dict(decode or DECODE), W, gemm, 36.0, ROWS if curve else None, GBS if curve else None)


def test_linears_follow_the_probed_curve_then_the_gemm_rate():
    assert linears_s(1, W, 0.45, 36.0, ROWS, GBS) == pytest.approx(W / 41.2e9)
    assert linears_s(16, W, 0.45, 36.0, ROWS, GBS) == pytest.approx(W / 21.6e9)
    mid = linears_s(12, W, 0.45, 36.0, ROWS, GBS)
    assert W / 30.9e9 < mid < W / 21.6e9                       # interpolated in time
    # past 64 rows: at least the GEMM rate per row (W FLOPs per row), never cheaper than the curve's end
    past = linears_s(128, W, 0.45, 36.0, ROWS, GBS) - linears_s(64, W, 0.45, 36.0, ROWS, GBS)
    assert past >= 64 * W / 0.45e12 - 1e-9
    # no curve: the read floor, or the rows' FLOPs when they take longer
    assert linears_s(1, W, 0.45, 36.0) == pytest.approx(W / 36e9)
    assert linears_s(100, W, 0.45, 36.0) == pytest.approx(100 * W / 0.45e12)
    times = [linears_s(r, W, 0.45, 36.0, ROWS, GBS) for r in range(1, 200)]
    assert times == sorted(times)                               # more rows never cost less


def test_headroom_gives_more_tokens_a_tight_limit_fewer():
    c = cost()
    loose, mid, tight = (slo_chunk_tokens(c, 1, limit) for limit in (1500, 580, 340))
    assert loose > mid > tight >= MIN_SLO_CHUNK_TOKENS
    # fewer decodes leave more room under the same limit
    by_lanes = slo_chunks(c, 580)
    assert set(by_lanes) == {1, 4, 16} and by_lanes[1] >= by_lanes[4] > by_lanes[16]
    # a faster GEMM fits more prompt tokens into the same headroom
    assert slo_chunk_tokens(cost(curve=False, gemm=2.0), 1, 580) > slo_chunk_tokens(cost(curve=False), 1, 580)
    assert all(v % 8 == 0 for v in by_lanes.values())


def test_a_limit_the_decodes_alone_exceed_still_makes_progress():
    c = cost()
    assert c.step_s(16, 0) > 0.9 * 0.400
    assert slo_chunk_tokens(c, 16, 400) == MIN_SLO_CHUNK_TOKENS
    assert slo_chunk_tokens(c, 1, 100_000) == MAX_CHUNK_TOKENS        # clamped
    assert slo_chunk_tokens(c, 1, 100_000, most=64) == 64                # ... to the batched budget


@pytest.mark.parametrize("limit,decode_1,curve", list(itertools.product(
    (300, 450, 580, 775, 960, 2000), (0.1, 0.26, 0.4), (True, False))))
def test_the_step_estimate_never_exceeds_the_limit(limit, decode_1, curve):
    c = cost({1: decode_1, 4: decode_1 * 1.05, 16: decode_1 * 1.6}, curve=curve)
    target = limit / 1000 * (1 - SLO_MARGIN)
    for lanes, tokens in slo_chunks(c, limit).items():
        if c.step_s(lanes, MIN_SLO_CHUNK_TOKENS) <= target:
            assert c.step_s(lanes, tokens) <= target                       # within the limit, margin kept
            assert tokens == MAX_CHUNK_TOKENS or c.step_s(lanes, tokens + 8) > target   # and the most that is
        else:
            assert tokens == MIN_SLO_CHUNK_TOKENS                          # no room: progress only


def test_no_slo_falls_back_to_the_kernel_rule():
    assert tightest_tpot_ms({}) is None and tightest_tpot_ms(None) is None
    assert tightest_tpot_ms({"A": {"tpot_ms": None, "ttft_s": 2}}) is None
    assert tightest_tpot_ms({"A": {"tpot_ms": 900, "ttft_s": 2}, "B": {"tpot_ms": 580, "ttft_s": 33}}) == 580
    assert chunk_rule(None) == "kernel"
    assert chunk_rule(580.0) == "slo:tpot<=580ms"
    assert chunk_rule(580.0, flag_tokens=32) == "flag"                # a fixed chunk wins
