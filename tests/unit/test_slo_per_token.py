"""A TTFT limit that grows with the prompt (`ttft<=2s+1ms/tok`): parsed, described, kept in
meta.json's form, and judged per request wherever a serving load is judged (attainment, the
sweep's verdict, goodput, the bootstrap) and per context for static cells."""

from __future__ import annotations

import dataclasses

import pytest
from test_analysis_support import serve_record

from vcfslm.analysis.slo import LoadPoint, judge
from vcfslm.analysis.slo_spec import Slo, parse_slo, slos_from_meta
from vcfslm.errors import SloSpecError
from vcfslm.matrix import serve_limits
from vcfslm.serving import decisions as serving
from vcfslm.serving import judging


def test_the_per_token_allowance_parses_describes_and_round_trips():
    slo = parse_slo("R:tpot<=200ms,ttft<=2s+1ms/tok")
    assert (slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms) == (200.0, 2.0, 1.0)
    assert slo.describe() == "SLO-R (TPOT ≤ 200 ms, TTFT ≤ 2 s + 1 ms/prompt token)"
    assert slo.ttft_limit(1000) == pytest.approx(3.0) and slo.ttft_limit(0) == 2.0
    assert parse_slo("R:ttft<=0.5s + 0.002s/token").ttft_per_token_ms == 2.0
    assert slos_from_meta({"R": slo.limits()}) == [slo]
    assert serve_limits({"R": slo.limits()})["R"]["ttft_per_token_ms"] == 1.0
    assert "ttft_per_token_ms" not in parse_slo("B:tpot<=200ms,ttft<=5s").to_dict()
    for bad, words in (("R:tpot<=200ms+1ms/tok", "only ttft may grow per prompt token"),
                       ("R:ttft<=2s+0ms/tok", "must be positive")):
        with pytest.raises(SloSpecError, match=words):
            parse_slo(bad)
    with pytest.raises(SloSpecError, match="ttft_per_token_ms: must be a positive number"):
        slos_from_meta({"R": {"tpot_ms": 100, "ttft_s": 2, "ttft_per_token_ms": -1}})


def test_each_request_is_judged_against_its_own_prompts_limit():
    # TTFTs of 1.5 s: within 1 s + 1 ms/token for prompts of 500 tokens or more only.
    ttft, tpot = [1.5, 1.5, 1.5, 1.5], [50.0] * 4
    inputs = [100, 400, 500, 3000]
    a = judging.attainment(ttft, tpot, 1, 100.0, 1.0, input_tokens=inputs, ttft_per_token_ms=1.0)
    assert (a.requests, a.good, a.ttft_good) == (5, 2, 2)
    assert judging.attainment(ttft, tpot, 0, 100.0, 1.0).good == 0
    with pytest.raises(ValueError, match="needs each request's prompt length"):
        judging.attainment(ttft, tpot, 0, 100.0, 1.0, input_tokens=[1], ttft_per_token_ms=1.0)
    per_token = {"tpot_ms": 100.0, "ttft_s": 1.0, "ttft_per_token_ms": 1.0}
    assert serving.goodput(ttft, tpot, 2.0, {"R": per_token}, inputs) == {"R": 1.0}


def test_a_serving_load_passes_under_the_per_token_limit_where_the_fixed_one_fails():
    record = serve_record(ttft=[1.5] * 10, tpot=50.0)
    record = dataclasses.replace(record, request_input_tokens=[2000] * 9 + [100])
    (result,) = serving.load_results([record]).values()
    assert result.input_tokens == (2000,) * 9 + (100,)
    fixed = {"tpot_ms": 100.0, "ttft_s": 1.0}
    grown = {**fixed, "ttft_per_token_ms": 1.0}
    assert serving.meets_limit(result, fixed, 0.9) is False
    assert serving.meets_limit(result, grown, 0.9) is True
    windows = serving.bootstrap_windows({1.0: result}, {"fixed": fixed, "grown": grown})
    (window,) = windows[1.0][0]
    assert window.good == {"fixed": 0, "grown": 9}
    # Records written before per-request lengths were kept read as the nominal context.
    old = dataclasses.replace(record, request_input_tokens=[])
    (old_result,) = serving.load_results([old]).values()
    assert old_result.input_tokens == (record.input_tokens,) * 10


def test_a_static_cell_is_judged_at_its_contexts_limit():
    slo = Slo("R", tpot_ms=200.0, ttft_s=1.0, ttft_per_token_ms=1.0)
    point = LoadPoint(streams_per_vm=4, tpot_ms=100.0, ttft_s=2.5)
    assert judge(point, slo, input_tokens=2048).meets
    assert judge(point, slo, input_tokens=128).failing == ("TTFT",)
