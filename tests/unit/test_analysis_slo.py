"""SLO parsing, the crossover (edge cases, ties, non-monotonic data) and the sizing law."""

from __future__ import annotations

import pytest
from test_analysis_support import BRIEF_SHAPED, brief_shaped_csv

from vcfslm.analysis.csv_import import parse_csv
from vcfslm.analysis.slo import LoadPoint, crossover, crossovers, nodes_required, size
from vcfslm.analysis.slo_spec import DEFAULT_SLOS, Slo, parse_slo, resolve_slos, slos_from_meta
from vcfslm.errors import SloSpecError, UsageError

A, B = DEFAULT_SLOS


def points(*rows):
    """(streams per VM, TPOT ms, TTFT s) rows -> load points (batch 1 at the lowest load)."""
    return [LoadPoint(s, tpot, ttft, batch_per_rank=s // 4) for s, tpot, ttft in rows]


# ------------------------------------------------------------------ parsing


def test_defaults_are_the_briefs():
    assert (A.name, A.tpot_ms, A.ttft_s) == ("A", 130.0, 3.0)
    assert (B.name, B.tpot_ms, B.ttft_s) == ("B", 200.0, 5.0)


@pytest.mark.parametrize("text, tpot, ttft", [
    ("strict:tpot<=150ms,ttft<=2s", 150.0, 2.0),
    ("x:tpot<=0.15s", 150.0, None),
    ("x:ttft<=500ms", None, 0.5),
    ("x: tpot ≤ 150 , ttft <= 2", 150.0, 2.0),
    ("x:TTFT<=1.5s,TPOT<=99.5ms", 99.5, 1.5),
])
def test_parse_slo(text, tpot, ttft):
    slo = parse_slo(text)
    assert (slo.tpot_ms, slo.ttft_s) == (tpot, ttft)


def test_parse_slo_reports_every_problem_at_once():
    with pytest.raises(SloSpecError) as err:
        parse_slo("bad name!:tpot<150,foo<=3,ttft<=2h,tpot<=1,tpot<=2")
    text = str(err.value)
    assert "name" in text and "needs '<='" in text and "unknown indicator 'foo'" in text
    assert "unknown unit 'h'" in text and "tpot given twice" in text
    assert len(err.value.problems) == 5
    assert all(p.file == "--slo" for p in err.value.problems)


@pytest.mark.parametrize("text", ["tpot<=150", "x:", "x:tpot", "x:tpot<=0ms", "x:,"])
def test_parse_slo_rejects(text):
    with pytest.raises(SloSpecError):
        parse_slo(text)


def test_resolve_slos_by_name_and_spec():
    known = list(DEFAULT_SLOS)
    assert resolve_slos([], known) == known
    assert resolve_slos(["B"], known) == [B]
    assert resolve_slos(["slo-b", "SLO-A"], known) == [B, A]
    mine = resolve_slos(["mine:tpot<=150ms"], known)[0]
    assert mine == Slo("mine", 150.0, None)
    with pytest.raises(SloSpecError, match="unknown SLO .*known: A, B"):
        resolve_slos(["C"], known)


def test_slos_from_inventory_meta():
    assert slos_from_meta({}) == list(DEFAULT_SLOS)
    assert slos_from_meta({"gold": {"tpot_ms": 110, "ttft_s": 1}}) == [Slo("gold", 110.0, 1.0)]
    assert slos_from_meta({"s": "tpot<=150ms"}) == [Slo("s", 150.0, None)]
    assert slos_from_meta([{"name": "n", "tpot_ms": 90}]) == [Slo("n", 90.0, None)]
    with pytest.raises(SloSpecError, match="neither tpot_ms nor ttft_s"):
        slos_from_meta({"x": {"latency": 1}})
    with pytest.raises(SloSpecError) as err:
        slos_from_meta({"gold": {"tpot_ms": "fast"}})
    assert str(err.value) == "meta.json slos: slos.gold: limits must be numbers: {'tpot_ms': 'fast'}"


# ---------------------------------------------------------------- crossover


def test_crossover_plain_with_tpot_binding():
    c = crossover(points((4, 116, 0.3), (16, 125, 0.6), (32, 140, 1.0), (64, 178, 2.0)), A, 128)
    assert (c.status, c.threshold, c.first_failing, c.binding) == ("crossover", 16, 32, "TPOT")
    assert "meets the SLO up to 16 streams/VM" in c.summary()
    assert "first failing load is 32 streams/VM" in c.summary() and "TPOT binds" in c.summary()


def test_crossover_binding_ttft_and_both():
    ttft = crossover(points((4, 100, 1.0), (16, 120, 3.5)), A, 1024)
    assert (ttft.threshold, ttft.binding) == (4, "TTFT")
    both = crossover(points((4, 100, 1.0), (16, 131, 3.01)), A, 1024)
    assert both.binding == "TPOT and TTFT"


def test_ties_at_the_threshold_meet_the_slo():
    c = crossover(points((4, 120, 1.0), (16, 130.0, 3.0), (32, 130.0001, 3.0)), A, 128)
    assert (c.threshold, c.first_failing, c.binding) == (16, 32, "TPOT")
    exact = parse_slo("x:tpot<=0.15s,ttft<=1500ms")
    assert crossover(points((4, 150.0, 1.5)), exact, 128).status == "all"


def test_nothing_meets_names_the_single_stream_floor():
    c = crossover(points((4, 117, 0.4), (16, 130, 0.8)), parse_slo("fast:tpot<=100ms"), 128)
    assert (c.status, c.threshold, c.first_failing, c.binding) == ("none", None, 4, "TPOT")
    text = c.summary()
    assert "not achievable in this configuration" in text
    assert "single-stream floor" in text and "TPOT 117.0 ms > 100" in text
    assert c.threshold_text == "none"      # the wording of the answer table, every table alike


def test_floor_without_batch_one_is_not_called_single_stream():
    c = crossover([LoadPoint(16, 150, 1.0, batch_per_rank=4)], parse_slo("f:tpot<=100"), 128)
    assert "lowest tested load" in c.summary() and "single-stream" not in c.summary()


def test_everything_meets_says_at_least_max_tested():
    c = crossover(points((4, 116, 0.3), (64, 178.6, 2.0)), B, 128)
    assert (c.status, c.threshold, c.first_failing, c.binding) == ("all", 64, None, None)
    assert c.threshold_text == "≥ 64"
    assert "≥ 64 streams/VM (the max tested)" in c.summary()


def test_non_monotonic_is_said_plainly_and_stays_conservative():
    c = crossover(points((4, 120, 1), (16, 140, 1), (32, 125, 1), (64, 150, 1)), A, 128)
    assert (c.threshold, c.first_failing, c.non_monotonic) == (4, 16, (32,))
    assert "not monotonic" in c.summary() and "32 streams/VM meet(s) the SLO again after 16 failed" in c.summary()


def test_points_are_sorted_by_load():
    c = crossover(points((64, 250, 1), (4, 100, 1), (16, 120, 1)), A, 128)
    assert [v.point.streams_per_vm for v in c.verdicts] == [4, 16, 64]
    assert c.threshold == 16


def test_tpot_only_slo_ignores_ttft():
    c = crossover(points((4, 100, 99.0), (16, 120, 99.0)), parse_slo("t:tpot<=130ms"), 128)
    assert c.status == "all"


# ------------------------------------------------------------------- sizing


def test_sizing_law_exact_arithmetic():
    assert nodes_required(256, 64) == 4
    assert nodes_required(257, 64) == 5
    assert nodes_required(256, 16) == 16
    # 2 x (1 - 0.3) is 1.4000000000000001 in floats; 21 / 1.4 must still be exactly 15.
    assert nodes_required(21, 2, 0.3) == 15
    assert nodes_required(256, 64, 0.1) == 5           # 256 / 57.6 = 4.44


@pytest.mark.parametrize("peak, headroom", [(0, 0.0), (-5, 0.0), (10, 1.0), (10, -0.1)])
def test_sizing_rejects_bad_inputs(peak, headroom):
    c = crossover(points((4, 100, 1)), A, 128)
    with pytest.raises(UsageError):
        size(c, peak, headroom)


def test_briefs_worked_example_from_a_hand_built_table():
    """SLO-B, 256 short-context sessions, threshold 64 streams/VM -> 4 nodes; SLO-A threshold 16 -> 16."""
    cells = parse_csv(brief_shaped_csv(), "hand-built.csv").cells
    # The brief reads its tables at the median: its p50, by name (the CSV has no tails).
    answers = {(c.slo.name, c.input_tokens): c for c in crossovers(cells, DEFAULT_SLOS, "p50")}
    b_short, a_short = answers[("B", 128)], answers[("A", 128)]
    assert b_short.threshold == 64 and a_short.threshold == 16
    sized_b, sized_a = size(b_short, 256), size(a_short, 256)
    assert sized_b.nodes == 4 and sized_a.nodes == 16
    assert "ceil(256 / 64) = ceil(4.00) = 4" in sized_b.reasoning
    assert "ceil(256 / 16) = ceil(16.00) = 16" in sized_a.reasoning
    # The brief's other SLO-B thresholds: 32 streams at 512 tokens, 16 at 1024, every one TPOT-bound.
    assert [answers[("B", n)].threshold for n in (512, 1024)] == [32, 16]
    assert {answers[("B", n)].binding for n in (512, 1024)} == {"TPOT"}
    assert len(BRIEF_SHAPED) == 12


def test_sizing_when_not_achievable_and_with_headroom():
    none = size(crossover(points((4, 117, 0.4)), parse_slo("f:tpot<=100"), 128), 256)
    assert none.nodes is None and "not achievable" in none.reasoning
    assert (none.nodes_text, none.answer_text()) == ("not achievable", "not achievable streams/VM → not achievable nodes")
    c = crossover(points((4, 116, 0.3), (64, 178.6, 2.0)), B, 128)
    s = size(c, 256, 0.1)
    assert s.nodes == 5 and s.effective_threshold == pytest.approx(57.6)
    assert "64 × (1 − 0.1) = 57.6" in s.reasoning and "upper bound" in s.reasoning
    d = s.to_dict()
    assert d["nodes"] == 5 and d["threshold_is_lower_bound"] is True and d["slo"]["name"] == "B"


def test_percentile_selects_the_tail():
    rows = ["scope,vms,ranks_per_vm,batch_per_rank,input_tokens,output_tokens,ttft_s,tpot_ms,rank_tps,"
            "ttft_p90_s,tpot_p90_ms"]
    for (inp, streams), (ttft, tpot, tps) in sorted(BRIEF_SHAPED.items()):
        rows.append(f"single,1,4,{streams // 4},{inp},256,{ttft},{tpot},{tps},{ttft},{tpot + 30}")
    cells = parse_csv("\n".join(rows) + "\n", "tails.csv").cells
    p50 = {c.input_tokens: c for c in crossovers(cells, [B], "p50")}
    p90 = {c.input_tokens: c for c in crossovers(cells, [B], "p90")}
    assert p50[128].threshold == 64 and p90[128].threshold == 32      # 178.6 + 30 > 200
    with pytest.raises(UsageError, match="p99 values are unknown"):
        crossovers(cells, [B], "p99")


def test_a_load_without_valid_data_is_named_not_judged():
    from vcfslm.analysis.cells import SINGLE, Cell, CellKey, Quantiles

    def cell(batch, tpot):
        return Cell(CellKey(SINGLE, 1, 4, batch, 128, 256), Quantiles(0.5), Quantiles(tpot), 10.0)

    (c,) = crossovers([cell(1, 100), cell(4, 120), cell(8, float("nan")), cell(16, 150)], [A], "p50")
    assert [v.point.streams_per_vm for v in c.verdicts] == [4, 16, 64]
    assert (c.threshold, c.first_failing) == (16, 64)
    assert "No valid data at 32 streams/VM: those loads are not judged." in c.summary()
