"""analysis/serve.py: serving points, the serving threshold per SLO, the static crossover
beside it and the sizing law from it, on synthetic serving runs with known latencies."""

from __future__ import annotations

import math

import pytest
from test_analysis_support import BRIEF_SHAPED, make_run, make_serve_run

from vcfslm.analysis.cells import aggregate, load_runs
from vcfslm.analysis.serve import analyse
from vcfslm.analysis.serve_points import serve_points
from vcfslm.analysis.serve_sizing import size
from vcfslm.analysis.slo_spec import DEFAULT_SLOS
from vcfslm.errors import UsageError
from vcfslm.serving import decisions as serving
from vcfslm.serving import judging

SLO_A, SLO_B = DEFAULT_SLOS            # A: TPOT <= 130 ms, TTFT <= 3 s; B: TPOT <= 200 ms, TTFT <= 5 s
# (load per rank, input tokens) -> (TTFT s, TPOT ms, mean busy slots per rank): with 4 ranks per VM
# SLO-A passes 4 req/s/VM and fails 8 on TPOT; SLO-B passes 8 and fails 16 on both.
RAMP = {(1.0, 128): (0.5, 100.0, 2.0), (2.0, 128): (2.0, 150.0, 5.0), (4.0, 128): (6.0, 250.0, 12.0)}
SHORT = {(streams // 4, 128): v for (inp, streams), v in BRIEF_SHAPED.items() if inp == 128}


def analysed(tmp_path, *run_dirs, slos=DEFAULT_SLOS, peaks=(256,), headroom=0.0):
    runs = load_runs(run_dirs)
    return analyse(runs, slos, aggregate(runs).cells, peaks, headroom)


def answer(result, slo):
    (t,) = [t for t in result.primaries if t.slo == slo]
    return t


def test_threshold_from_known_latencies_per_slo(tmp_path):
    got = analysed(tmp_path, make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP))
    a, b = answer(got, SLO_A), answer(got, SLO_B)
    assert (a.status, a.passing, a.failing, a.binding) == ("threshold", 1.0, 2.0, "TPOT")
    assert (b.status, b.passing, b.failing, b.binding) == ("threshold", 2.0, 4.0, "TPOT and TTFT")
    # per VM: load x 4 ranks; streams: mean busy slots x 4 ranks (Little's law, measured)
    assert (a.load_per_vm, a.failing_per_vm, a.streams_per_vm) == (4.0, 8.0, 8.0)
    assert (b.threshold_text, b.first_failing_text, b.streams_text) == ("8", "16", "20.0")
    assert b.verdicts == {1.0: True, 2.0: True, 4.0: False}
    assert ("meets it up to 4 req/s/VM (8.0 concurrent streams/VM measured; attainment 100 % ≥ 90 % "
            "(40 requests; p90 TPOT 100.0 ms, p90 TTFT 0.50 s)); 8 req/s/VM fails on TPOT (attainment 0 % < 90 %"
            in a.summary())
    # 40 requests per load are fewer than a 90 % attainment needs to be trusted: said, not hidden.
    assert a.few_samples == ("90 % attainment judged on fewer than 50 requests at 4 (40), 8 (40), 16 (40) req/s/VM",)
    p = got.points[0]
    assert (p.ttft_p50_s, p.ttft_p90_s, p.tpot_p50_ms, p.tpot_p90_ms) == (0.5, 0.5, 100.0, 100.0)
    assert (p.requests, p.unfinished, p.windows, p.valid) == (40, 0, 4, True)


def test_the_threshold_is_the_one_serving_judges(tmp_path):
    run = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    records = load_runs([run])[0].serve_records
    pooled = serving.load_results(records)
    for slo in DEFAULT_SLOS:
        want = judging.threshold({load: serving.meets(r, slo.tpot_ms, slo.ttft_s) for load, r in pooled.items()})
        t = answer(analysed(tmp_path, run), slo)
        assert (t.passing, t.failing) == want


def test_below_and_above_the_range_tried(tmp_path):
    fast = {(1.0, 128): (0.2, 90.0, 1.0), (2.0, 128): (0.3, 95.0, 3.0)}
    slow = {(1.0, 128): (9.0, 400.0, 15.0), (2.0, 128): (12.0, 500.0, 16.0)}
    above = answer(analysed(tmp_path, make_serve_run(tmp_path / "f", "f", ["vm1"], fast)), SLO_A)
    assert (above.status, above.threshold_text, above.first_failing_text, above.streams_text) == \
        ("above", "≥ 8", "> 8", "≥ 12.0")
    assert "every load tried meets it, so the threshold is ≥ 8 req/s/VM (the largest tried" in above.summary()
    s = size(above, 256)
    assert s.nodes_by_streams == 22 and s.nodes_text() == "≤ 22" and "upper bounds" in s.reasoning
    below = answer(analysed(tmp_path, make_serve_run(tmp_path / "w", "w", ["vm1"], slow)), SLO_B)
    assert (below.status, below.threshold_text, below.streams_text, below.binding) == \
        ("below", "< 4", "–", "TPOT and TTFT")
    assert "below the smallest load tried" in below.summary() and "Measure lower loads" in below.summary()
    s = size(below, 256)
    assert s.nodes is None and s.nodes_text() == "below range" and "measure lower loads" in s.reasoning


def test_unfinished_requests_fail_the_load(tmp_path):
    def unfinished(r):
        if r.load == 2.0:               # 2 of every 10 requests never finish: the p90 reaches them
            r.unfinished, r.offered = 2, r.offered + 2
        return r

    fast = {(1.0, 128): (0.2, 90.0, 1.0), (2.0, 128): (0.3, 95.0, 3.0)}
    t = answer(analysed(tmp_path, make_serve_run(tmp_path / "u", "u", ["vm1"], fast, tweak=unfinished)), SLO_B)
    assert (t.status, t.passing, t.failing) == ("threshold", 1.0, 2.0)
    assert t.binding == "TPOT and TTFT (unfinished requests)"
    p = t.point(2.0)
    assert math.isinf(p.ttft_p90_s) and math.isinf(p.tpot_p90_ms) and p.ttft_p50_s == 0.3
    assert (p.requests, p.unfinished) == (48, 8)
    assert "attainment 83.33 % < 90 % (48 requests; p90 TPOT ∞ (unfinished requests), p90 TTFT ∞" in t.summary()
    assert p.to_dict()["ttft_p90_s"] is None and p.to_dict()["tails_infinite"] == ["ttft", "tpot"]

    def one_in_twenty(r):           # 1 in 20 unfinished: the p90 stays among the finished ones
        if r.load == 2.0 and r.local_rank == 0:
            r.unfinished = 2
        return r

    ok = answer(analysed(tmp_path, make_serve_run(tmp_path / "v", "v", ["vm1"], fast, tweak=one_in_twenty,
                                                  requests=10)), SLO_B)
    assert ok.status == "above"


def test_goodput_by_hand(tmp_path):
    # Per rank and window (10 s span): 6 requests meet SLO-A and SLO-B, 2 meet only B (TPOT 150 ms),
    # 2 meet neither (TPOT 300 ms), 1 more unfinished. Four ranks.
    def mixed(r):
        r.tpot_ms = [100.0] * 6 + [150.0] * 2 + [300.0] * 2
        r.unfinished, r.offered = 1, 11
        return r

    got = analysed(tmp_path, make_serve_run(tmp_path / "g", "g", ["vm1"], {(1.0, 128): (0.5, 100.0, 2.5)},
                                            tweak=mixed))
    (p,) = got.points
    # requests/s per rank = good / 10 s; per VM x 4 ranks
    assert p.goodput_per_vm == pytest.approx({"A": 6 / 10 * 4, "B": 8 / 10 * 4})
    assert p.completed_per_vm == pytest.approx(10 / 10 * 4)
    assert (p.requests, p.unfinished, p.streams_per_vm) == (44, 4, 10.0)
    assert p.tpot_p90_ms == 300.0        # 4 unfinished of 44: the p90 (position 38.7) stays among the finished


def test_invalid_windows_are_left_out_and_runs_without_a_valid_one_flagged(tmp_path):
    def broken(r):
        if r.load == 2.0 and r.local_rank == 1:       # one bad rank: its awful latencies do not count
            r.valid, r.invalid_reasons, r.tpot_ms = False, ["recompiled"], [900.0] * len(r.tpot_ms)
        if r.load == 4.0:
            r.valid, r.invalid_reasons = False, ["start skew"]
        return r

    run = make_serve_run(tmp_path / "i", "i", ["vm1"], RAMP, tweak=broken)
    got = analysed(tmp_path, run)
    b = answer(got, SLO_B)
    assert b.verdicts == {1.0: True, 2.0: True, 4.0: None}
    assert b.status == "above" and "No valid data at 16 req/s/VM: those loads are not judged." in b.summary()
    two, four = b.point(2.0), b.point(4.0)
    assert two.tpot_p90_ms == 150.0 and two.invalid_windows == 1 and not two.valid
    assert four.result is None and four.flags[-1] == "no valid window: no numbers"
    assert any("at 2 req/s per rank: 1 invalid window(s) left out (recompiled)" in w for w in got.warnings)

    assert not any("recompiles inside" in w for w in got.warnings)   # said once, by the invalid-window flag

    dead = make_serve_run(tmp_path / "d", "d", ["vm1"], RAMP, tweak=lambda r: broken(r) if r.load == 4.0 else r)
    points, warnings = serve_points(load_runs([dead]), DEFAULT_SLOS)
    assert "run d has no valid serving window: no serving numbers" not in warnings

    every = make_serve_run(tmp_path / "e", "e", ["vm1"], {(1.0, 128): (0.5, 100.0, 2.0)},
                           tweak=_invalid)
    _, warnings = serve_points(load_runs([every]), DEFAULT_SLOS)
    assert "run e has no valid serving window: no serving numbers" in warnings


def _invalid(r):
    r.valid, r.invalid_reasons = False, ["numerics gate: top-1 agreement 0.5 < 0.99"]
    return r


def test_missing_loads_and_incomplete_windows_are_flagged(tmp_path):
    def drop(r):
        if r.load == 4.0:
            return None
        return None if (r.load == 2.0 and r.local_rank == 3) else r

    _, warnings = serve_points(load_runs([make_serve_run(tmp_path / "m", "m", ["vm1"], RAMP, tweak=drop)]),
                               DEFAULT_SLOS)
    assert any(w.endswith("at 2 req/s per rank: incomplete: 3 of 4 windows recorded") for w in warnings)
    assert any(w.endswith("no windows recorded at 4 req/s per rank (load missing)") for w in warnings)


def test_the_ratio_to_the_static_crossover_of_a_static_run_given_alongside(tmp_path):
    static = make_run(tmp_path / "st", "st", ["vm1"], SHORT)       # p90: SLO-A 16 streams/VM, SLO-B >= 64
    got = analysed(tmp_path, static, make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP))
    by_slo = {c.threshold.slo.name: c for c in got.comparisons}
    a, b = by_slo["A"], by_slo["B"]
    assert (a.static.status, a.static.threshold, a.static.percentile) == ("crossover", 16, "p90")
    assert a.ratio == pytest.approx(8 / 16) and a.ratio_text == "0.50" and a.note == ""
    assert (b.static_text, b.ratio_text) == ("≥ 64", "≤ 0.31")     # the static side is a lower bound
    assert b.to_dict()["ratio"] == pytest.approx(20 / 64)
    alone = analysed(tmp_path, tmp_path / "s")
    assert all(c.static is None and c.ratio is None and c.note == "no static-batch data among the inputs"
               for c in alone.comparisons)


def test_sizing_law_from_the_serving_threshold_by_streams_and_by_rate(tmp_path):
    got = analysed(tmp_path, make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP), peaks=(256, 1000))
    b = answer(got, SLO_B)
    assert [(s.peak_streams, s.nodes_by_streams) for s in got.sizings if s.threshold is b] == [(256, 13), (1000, 50)]
    s = size(b, 256, 40.0, headroom=0.2)
    # 256 / (20 x 0.8) = 16 exactly; 40 / (8 x 0.8) = 6.25 -> 7
    assert (s.nodes_by_streams, s.nodes_by_rate, s.nodes) == (16, 7, 7)
    assert "Nodes = ceil(256 / 16) = ceil(16.00) = 16 (headroom 20%)" in s.reasoning
    assert "By rate: nodes = ceil(40 / 6.4) = ceil(6.25) = 7" in s.reasoning
    d = s.to_dict()
    assert d["threshold_kind"] == "serving" and d["threshold_streams_per_vm"] == 20.0
    assert d["threshold_load_per_vm"] == 8.0 and d["load_unit"] == "req/s per VM"
    # Every replicate passes 8 req/s/VM and fails 16: the threshold is somewhere in [8, 16), and the
    # streams there in [20, 48) (the busy slots at both loads, by Little's law). Nodes follow from the
    # ends: by rate ceil(40 / 8) = 5 at most and floor(40 / 16) + 1 = 3 at least; by streams
    # ceil(256 / 20) = 13 and floor(256 / 48) + 1 = 6.
    plain = size(b, 256, 40.0)
    assert plain.answer_text("rate") == "8 [8–<16] req/s/VM, 20.0 [20.0–<48.0] streams/VM → 5 [3–5] nodes"
    assert plain.answer_text("streams") == "8 [8–<16] req/s/VM, 20.0 [20.0–<48.0] streams/VM → 13 [6–13] nodes"
    assert ("95% interval: threshold [8–<16] req/s/VM, nodes by streams [6–13], by rate [3–5] (400 bootstrap "
            "replicates).") in plain.reasoning
    d = plain.to_dict()
    assert d["threshold_interval_per_vm"] == {"low": 8.0, "high": 16.0, "low_is_lower_bound": False,
                                              "high_is_lower_bound": False, "high_is_exclusive": True,
                                              "replicates": 400, "confidence": 0.95}
    assert (d["nodes_by_rate_interval"]["low"], d["nodes_by_rate_interval"]["high"]) == (3, 5)
    assert d["nodes_by_streams_interval"]["high_is_exclusive"] is False
    # With 20 % headroom the ends are derated too: 256 / (48 x 0.8) = 6.7 -> 7; 40 / (16 x 0.8) = 3.1 -> 4.
    assert s.answer_text("rate") == "8 [8–<16] req/s/VM, 20.0 [20.0–<48.0] streams/VM → 7 [4–7] nodes"
    assert s.interval_text("streams") == "[7–16]"
    with pytest.raises(UsageError, match="peak streams must be a positive"):
        size(b, 0)


def test_users_loads_size_by_streams_only(tmp_path):
    users = {(1.0, 128): (0.5, 100.0, 1.0), (2.0, 128): (1.0, 120.0, 2.0), (4.0, 128): (4.0, 190.0, 4.0)}
    got = analysed(tmp_path, make_serve_run(tmp_path / "u", "u", ["vm1"], users, kind="users"))
    a = answer(got, SLO_A)
    assert (a.key.load_kind, a.key.arrival, a.threshold_text, a.streams_per_vm) == ("users", "closed", "8", 8.0)
    assert "meets it up to 8 users/VM" in a.summary()
    assert size(a, 64).nodes_by_streams == 8
    with pytest.raises(UsageError, match="--peak-rps needs a serving threshold of a rate load"):
        size(a, None, 10.0)


def test_cluster_series_answer_when_there_is_no_single_vm_one(tmp_path):
    got = analysed(tmp_path, make_serve_run(tmp_path / "c", "c", ["vm1", "vm2"], RAMP))
    b = answer(got, SLO_B)
    assert (b.key.scope, b.key.vms, b.threshold_text) == ("cluster", 2, "8")
    assert "No single-VM serving data: read from cluster series" in b.summary()
    single = make_serve_run(tmp_path / "s", "s", ["vm1"], {k: (t, p + 60, m) for k, (t, p, m) in RAMP.items()})
    both = analysed(tmp_path, tmp_path / "c", single)
    b = answer(both, SLO_B)
    assert b.key.scope == "single" and b.threshold_text == "4"     # TPOT 160 -> 210 at 8 req/s/VM
    assert len(both.thresholds) == 4                                # two series x two SLOs


def test_to_dict_is_json_ready(tmp_path):
    import json

    got = analysed(tmp_path, make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP))
    data = json.loads(json.dumps(got.to_dict(), allow_nan=False))
    assert data["attainment"] == 0.9 and len(data["points"]) == 3
    assert data["answer"][1]["rule"] == "90 % attainment" and data["answer"][1]["threshold_interval_per_vm"]
    assert data["answer"][1]["threshold_streams_per_vm"] == 20.0
    assert [v["meets"] for v in data["answer"][1]["verdicts"]] == [True, True, False]


def test_recompiles_are_flagged_once_invalid_or_counted(tmp_path):
    def recompiled(r):
        if r.load == 1.0 and r.local_rank == 0:       # the worker's verdict: invalid, the reason says it
            r.recompiles, r.valid, r.invalid_reasons = 2, False, ["2 compilation(s) inside the window"]
        if r.load == 2.0 and r.local_rank == 0:       # counted valid, yet it recompiled
            r.recompiles = 1
        return r

    got = analysed(tmp_path, make_serve_run(tmp_path / "r", "r", ["vm1"], RAMP, tweak=recompiled))
    one, two = (next(p for p in got.points if p.load == load) for load in (1.0, 2.0))
    assert one.flags == ("1 invalid window(s) left out (2 compilation(s) inside the window)",)
    assert two.flags == ("recompiles inside 1 window(s) counted as valid",)
