"""The calibrated performance model: hand-computed cases, fits on cells made from known
efficiencies, the prediction interval, and the extrapolation flags."""

from __future__ import annotations

import random

import pytest

from vcfslm.analysis import perfmodel as P
from vcfslm.roofline import ModelDims

# A small shape whose numbers are easy to follow by hand: 1 layer, hidden 4, 2 heads of 2,
# intermediate 8, vocab 10; 1e9 weight bytes per step, 1e6 KV bytes per token.
TOY = ModelDims(num_hidden_layers=1, hidden_size=4, num_attention_heads=2, num_key_value_heads=2, head_dim=2,
                intermediate_size=8, vocab_size=10, step_weight_bytes=10**9, kv_bytes_per_token=10**6)
# Per layer and token: qkv 4*(2+4)*2 = 48, o 2*2*4 = 16, gate+up 4*16 = 64, down 32 -> 160.
PER_LAYER = 160

# The model's shape of the brief (Phi-3-mini), 2 layers: a realistic mix of terms.
PHI3_2L = ModelDims(num_hidden_layers=2, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
                    head_dim=96, intermediate_size=8192, vocab_size=32064, step_weight_bytes=650_016_768,
                    kv_bytes_per_token=24_576)
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)
# A knee like the probe measures on an AVX512-BF16 EPYC, 1 thread: flat to 4 rows, then falling.
CURVE_GBS = (20.0, 20.0, 20.0, 14.8, 10.4, 6.0, 3.2)
RATES = P.RankRates(20.0, 0.22, CURVE_ROWS, CURVE_GBS)

TRUE = {"eta_w": 0.8, "eta_kv": 0.1, "overhead": 0.002, "eta_p": 0.9, "eta_pa": 0.05, "overhead_p": 0.01}


def synthetic(batches, inputs, rates=RATES, dims=PHI3_2L, repeats=3, noise=0.0, seed=0, truth=TRUE,
              source="synthetic", out=16) -> list[P.Observation]:
    """Observations made from the model itself with known efficiencies (and optional noise)."""
    rng = random.Random(seed)
    obs = []
    for b in batches:
        for i in inputs:
            s = P.Scenario(b, i, out)
            x = P.terms(dims, rates, s)
            step = x.linears_s / truth["eta_w"] + x.kv_s / truth["eta_kv"] + truth["overhead"]
            ttft = (x.prefill_s / truth["eta_p"] + x.prefill_attention_s / truth["eta_pa"]
                    + x.weights_s / truth["eta_w"] + truth["overhead_p"])
            for _ in range(repeats):
                obs.append(P.Observation(s, step * 1000 * (1 + rng.gauss(0, noise)),
                                         ttft * (1 + rng.gauss(0, noise)), rates, dims, source))
    return obs


def eff(model: P.PerfModel) -> dict[str, float | None]:
    return {e.name: e.value for e in model.efficiencies()}


def test_terms_by_hand():
    rates = P.RankRates(read_gbs=10.0, gemm_tflops=1.0)   # no curve: the roofline knee
    s = P.Scenario(batch=2, input_tokens=10, output_tokens=4)
    x = P.terms(TOY, rates, s)
    assert x.weights_s == pytest.approx(0.1)                          # 1e9 B / 10 GB/s
    assert x.kv_s == pytest.approx(2 * 12 * 1e6 / 10e9)               # 2 streams x (10 + 4/2) tokens
    linear_flops = 2 * 2 * (PER_LAYER + 4 * 10)                        # 2 rows through 160 + lm_head 40
    assert x.linears_s == pytest.approx(max(0.1, linear_flops / 1e12))  # bandwidth-bound: 0.1
    assert x.prefill_s == pytest.approx((2 * 2 * 10 * PER_LAYER + 2 * 2 * 4 * 10) / 1e12)
    assert x.prefill_attention_s == pytest.approx(4 * 2 * 10 * 5.5 * 4 / 1e12)
    assert x.knee == pytest.approx(1.0)


def test_compute_bound_roofline_knee_without_a_curve():
    rates = P.RankRates(read_gbs=1000.0, gemm_tflops=1e-9)  # absurdly slow compute: FLOPs bind
    x = P.terms(TOY, rates, P.Scenario(8, 10, 4))
    assert x.linears_s == pytest.approx(2 * 8 * (PER_LAYER + 40) / 1e3)
    assert x.knee > 1


def test_curve_interpolation_and_beyond():
    r = P.RankRates(20.0, 0.2, (1, 4, 16), (20.0, 10.0, 5.0))
    per = lambda gbs: 1 / (gbs * 1e9)  # noqa: E731
    assert r.seconds_per_weight_byte(1) == pytest.approx(per(20))
    assert r.seconds_per_weight_byte(2) == pytest.approx(per(20) + (per(10) - per(20)) / 3)
    assert r.seconds_per_weight_byte(16) == pytest.approx(per(5))
    assert r.seconds_per_weight_byte(32) == pytest.approx(per(5) * 2)     # compute-bound beyond
    # a dip in the measured curve (noise) never makes more rows cheaper
    dip = P.RankRates(20.0, 0.2, (1, 2, 4), (20.0, 25.0, 10.0))
    assert dip.seconds_per_weight_byte(2) == pytest.approx(per(20))
    assert P.RankRates(20.0, 0.2).seconds_per_weight_byte(4) is None


@pytest.mark.parametrize("kwargs, message", [
    ({"read_gbs": 0, "gemm_tflops": 1}, "read_gbs"),
    ({"read_gbs": 1, "gemm_tflops": float("nan")}, "gemm_tflops"),
    ({"read_gbs": 1, "gemm_tflops": 1, "decode_rows": (1, 2), "decode_gbs": (1.0,)}, "pair up"),
    ({"read_gbs": 1, "gemm_tflops": 1, "decode_rows": (4, 2), "decode_gbs": (1.0, 1.0)}, "increasing"),
])
def test_rates_refuse_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        P.RankRates(**kwargs)


def test_prediction_by_hand_from_known_coefficients():
    obs = synthetic([1, 4, 8, 16], [128, 512], repeats=1)
    model = P.fit_model(obs)
    s = P.Scenario(8, 512, 16)
    x = P.terms(PHI3_2L, RATES, s)
    p = P.predict(model, PHI3_2L, RATES, s)
    step = x.linears_s / 0.8 + x.kv_s / 0.1 + 0.002
    assert p.tpot_ms == pytest.approx(step * 1000, rel=1e-6)
    ttft = x.prefill_s / 0.9 + x.prefill_attention_s / 0.05 + x.weights_s / 0.8 + 0.01
    assert p.ttft_s == pytest.approx(ttft, rel=1e-6)
    assert p.rank_tps == pytest.approx(8 * 16 / (ttft + 15 * step), rel=1e-6)
    assert p.flags == ()


def test_fit_recovers_known_efficiencies_exactly():
    model = P.fit_model(synthetic([1, 4, 8, 16], [128, 512, 1024]))
    got = eff(model)
    assert got["eta_w"] == pytest.approx(0.8, rel=1e-6)
    assert got["eta_kv"] == pytest.approx(0.1, rel=1e-6)
    assert got["decode overhead"] == pytest.approx(2.0, rel=1e-4)       # ms
    assert got["eta_p"] == pytest.approx(0.9, rel=1e-6)
    assert got["eta_pa"] == pytest.approx(0.05, rel=1e-5)
    assert got["prefill overhead"] == pytest.approx(10.0, rel=1e-4)
    assert model.decode.s_rel == pytest.approx(0.0, abs=1e-9)


def test_fit_with_noise_has_errors_that_cover_the_truth():
    model = P.fit_model(synthetic([1, 4, 8, 16], [128, 512, 1024], repeats=3, noise=0.03, seed=7))
    for e in model.efficiencies():
        truth = {"eta_w": 0.8, "eta_kv": 0.1, "decode overhead": 2.0, "eta_p": 0.9, "eta_pa": 0.05,
                 "prefill overhead": 10.0}[e.name]
        assert e.stderr is not None and e.stderr > 0
        assert abs(e.value - truth) <= 4 * e.stderr + 1e-9, e.text()
    # the 95 % interval of a new observation holds about 95 % of fresh noisy draws
    fresh = synthetic([1, 4, 8, 16], [128, 512, 1024], repeats=10, noise=0.03, seed=99)
    inside = 0
    for o in fresh:
        p = P.predict(model, o.dims, o.rates, o.scenario)
        inside += p.tpot_interval[0] <= o.tpot_ms <= p.tpot_interval[1]
    assert 0.85 <= inside / len(fresh) <= 1.0


def test_fit_on_small_batches_predicts_the_large_ones_through_the_probed_knee():
    fit = synthetic([1, 4], [128, 512], noise=0.02, seed=3)
    held = synthetic([8, 16], [128, 512], repeats=1)
    check = P.validate(P.fit_model(fit), held)
    assert check.median_abs("tpot") < 0.05 and check.median_abs("ttft") < 0.05
    assert all("batch" in c.flags[0] for c in check.cells)    # beyond the largest fitted batch: said


def test_fit_on_one_thread_predicts_two_threads_with_their_own_rates():
    two = P.RankRates(34.0, 0.43, CURVE_ROWS, tuple(g * 1.7 for g in CURVE_GBS))
    fit = synthetic([1, 4, 8, 16], [128, 512], noise=0.02, seed=5, source="1t")
    held = synthetic([1, 4, 8, 16], [128, 512], rates=two, repeats=1, source="2t")
    check = P.validate(P.fit_model(fit), held)
    assert check.median_abs("tpot") < 0.05 and check.median_abs("ttft") < 0.05


def test_a_term_the_cells_never_exercise_is_dropped_and_flagged_where_it_matters():
    # One scenario only: every term moves together, so only the required ones are fitted;
    # a long context, where the KV and attention terms would matter, then says so.
    model = P.fit_model(synthetic([1], [16]))
    got = eff(model)
    assert got["eta_kv"] is None and got["eta_pa"] is None
    assert got["decode overhead"] == 0.0 and got["prefill overhead"] == 0.0
    far = P.predict(model, PHI3_2L, RATES, P.Scenario(4, 16384, 16))
    assert "TPOT: the KV cache term was not identified by the fitted cells" in far.flags
    assert "TTFT: the prefill attention term was not identified by the fitted cells" in far.flags
    assert "input 16384 beyond the longest fitted (16)" in far.flags


def test_extrapolation_flags():
    model = P.fit_model(synthetic([1, 2], [128, 512]))
    other = ModelDims(**{**PHI3_2L.__dict__, "num_hidden_layers": 32})
    p = P.predict(model, other, RATES, P.Scenario(32, 128, 16))
    assert "batch 32 beyond the largest fitted (2)" in p.flags
    assert "another model shape than the fitted one" in p.flags
    assert any(f.startswith("compute-side decode") for f in p.flags)
    inside = P.predict(model, PHI3_2L, RATES, P.Scenario(2, 512, 16))
    assert inside.flags == ()


def test_fit_refuses_too_little_and_says_when_it_fits_badly():
    with pytest.raises(ValueError, match="at least 2"):
        P.fit_model(synthetic([1], [128], repeats=1))
    # TPOT falling with batch is nothing a bandwidth/compute model makes: a large residual says so
    shrinking = [P.Observation(P.Scenario(b, 128, 16), 100.0 / b, 1.0 * b, RATES, PHI3_2L) for b in (1, 2, 4, 8)]
    assert P.fit_model(shrinking).decode.s_rel > 0.3


def test_t_quantiles():
    assert P.t95(1) == pytest.approx(12.706)
    assert P.t95(10) == pytest.approx(2.228)
    assert P.t95(1000) == pytest.approx(1.96)


def test_statement_names_every_fitted_value():
    model = P.fit_model(synthetic([1, 4, 8, 16], [128, 512]))
    text = "\n".join(model.statement())
    assert text.startswith("decode step = linears(batch) / eta_w")
    assert "eta_w = 0.800" in text and "eta_kv = 0.100" in text and "eta_p = 0.900" in text
    assert "batch ≤ 16, input ≤ 512" in text


def test_without_a_curve_the_linears_stream_at_linear_gbs_and_the_kv_at_read_gbs():
    s = P.Scenario(batch=2, input_tokens=10, output_tokens=4)
    plain = P.terms(TOY, P.RankRates(read_gbs=10.0, gemm_tflops=1.0), s)
    faster = P.terms(TOY, P.RankRates(read_gbs=10.0, gemm_tflops=1.0, linear_gbs=20.0), s)
    assert faster.linears_s == pytest.approx(plain.linears_s / 2)    # 1e9 B at 20 GB/s
    assert faster.kv_s == plain.kv_s and faster.weights_s == plain.weights_s
    with pytest.raises(ValueError, match="triad_gbs"):
        P.RankRates(10.0, 1.0, triad_gbs=0.0)
