"""The opening answer: summary rows with their bounds, the table's columns, plain text, reasoning per SLO."""

from __future__ import annotations

from test_analysis_support import brief_shaped_csv

from vcfslm.analysis.cells import CLUSTER
from vcfslm.analysis.csv_import import parse_csv
from vcfslm.analysis.slo import LoadPoint, Origin, crossover, crossovers, size
from vcfslm.analysis.slo_spec import DEFAULT_SLOS, parse_slo
from vcfslm.analysis.summary import (
    SummaryRow,
    reasoning_intro,
    slo_reasons,
    summary_rows,
    summary_table,
)
from vcfslm.analysis.tables import Table

A, B = DEFAULT_SLOS


def sized(xs, peaks=(256,), headroom=0.0):
    return [size(c, p, headroom) for c in xs for p in peaks]


def test_rows_mark_bounds_and_the_unachievable():
    xs = [crossover([LoadPoint(4, 116, 0.3, 1), LoadPoint(16, 125, 0.6, 4), LoadPoint(32, 140, 1.0, 8)], A, 128),
          crossover([LoadPoint(4, 116, 0.3, 1), LoadPoint(64, 178.6, 2.0, 16)], B, 128),
          crossover([LoadPoint(4, 117, 0.4, 1)], parse_slo("fast:tpot<=100"), 128),
          crossover([LoadPoint(4, 120, 1.0, 1), LoadPoint(16, 150, 6.0, 4)], B, 1024)]
    assert summary_rows(xs, sized(xs, (256, 1000))) == [
        SummaryRow("SLO-A", 128, None, "16", "32", "TPOT", ("16", "63")),
        SummaryRow("SLO-B", 128, None, "≥ 64", "> 64", "–", ("≤ 4", "≤ 16")),
        SummaryRow("SLO-fast", 128, None, "none", "4", "TPOT", ("not achievable", "not achievable")),
        SummaryRow("SLO-B", 1024, None, "4", "16", "TTFT", ("64", "250")),
    ]


def test_rows_note_non_monotonic_data_and_a_cluster_reading():
    wobbly = crossover([LoadPoint(4, 120, 1, 1), LoadPoint(16, 140, 1, 4), LoadPoint(32, 125, 1, 8)], A, 512)
    from_cluster = crossover([LoadPoint(4, 120, 1, 1)], B, 128, origin=Origin(scope=CLUSTER))
    rows = summary_rows([wobbly, from_cluster], sized([wobbly, from_cluster]))
    assert [r.note for r in rows] == ["not monotonic: passes again at 32",
                                      "read from cluster cells (no single-VM data)"]
    t = summary_table([wobbly, from_cluster], sized([wobbly, from_cluster]))
    assert t.columns[-1] == "note"


def test_brief_shaped_answer_table():
    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    xs = crossovers(cells, DEFAULT_SLOS, "p50")
    t = summary_table(xs, sized(xs, (256,)))
    assert t.title == "Single-VM threshold and nodes per SLO and input length (p50 of streams)"
    assert t.columns == ["model", "SLO", "input tokens", "threshold (streams/VM)", "first failing (streams/VM)",
                         "binding", "nodes for 256 streams"]
    assert {r[0] for r in t.rows} == {"–"}                  # a CSV without a model column names none
    got = {(r[1], r[2]): (r[3], r[6]) for r in t.rows}
    # The brief: SLO-B 256 short-context streams -> 4 nodes, SLO-A -> 16.
    assert got[("SLO-B", "128")] == ("≥ 64", "≤ 4") and got[("SLO-A", "128")] == ("16", "16")
    assert (got[("SLO-B", "512")], got[("SLO-B", "1024")]) == (("32", "8"), ("16", "16"))


def test_headroom_and_several_output_lengths_show_in_the_table():
    xs = [crossover([LoadPoint(4, 116, 0.3, 1), LoadPoint(16, 140, 0.6, 4)], A, 128, 64),
          crossover([LoadPoint(4, 116, 0.3, 1), LoadPoint(16, 140, 0.6, 4)], A, 128, 256)]
    t = summary_table(xs, sized(xs, (100,), 0.1), headroom=0.1)
    assert t.title.endswith("(p90 of streams, headroom 10%)") and "output tokens" in t.columns
    assert [r[-1] for r in t.rows] == ["28", "28"]          # ceil(100 / (4 x 0.9))
    assert "× (1 − headroom)" in t.notes[0]


def test_text_lines_are_aligned_whole_and_unwrapped():
    t = Table("T", ["a", "long column"], [["≥ 64", "x"], ["1", "not achievable at all"]], ["a note"])
    assert t.text() == ["T",
                        "a     long column",
                        "----  ---------------------",
                        "≥ 64  x",
                        "1     not achievable at all",
                        "  a note"]
    assert Table("E", ["a"], []).text() == ["E", "a", "-", "(no rows)"]


def test_reasoning_is_said_once_per_slo_with_a_line_per_context():
    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    xs = crossovers(cells, DEFAULT_SLOS, "p50")
    reasons = slo_reasons(xs, sized(xs, (256,)))
    assert [r.slo for r in reasons] == [A, B] and [len(r.contexts) for r in reasons] == [3, 3]
    a = reasons[0]
    assert a.headline == ("SLO-A (TPOT ≤ 130 ms, TTFT ≤ 3 s): 16 streams/VM at 128 input tokens; "
                          "4 streams/VM at 512 input tokens; 4 streams/VM at 1024 input tokens")
    assert a.rule == "A load meets SLO-A when its p50 TPOT ≤ 130 ms and p50 TTFT ≤ 3 s."
    assert a.contexts[0] == ("128 input tokens: meets it up to 16 streams/VM (TPOT 125.0 ms ≤ 130, TTFT 0.60 s "
                             "≤ 3); 32 fails on TPOT (TPOT 140.0 ms > 130, TTFT 1.00 s ≤ 3). Nodes: 256 streams "
                             "→ ceil(256 / 16) = 16.")
    # Nothing said per context that belongs to the SLO or to the method.
    assert not any("SLO-A" in line or "scale-out" in line for r in reasons for line in r.contexts)
    assert "scale-out" in reasoning_intro() and "× (1 − 0.1)" in reasoning_intro(0.1)


def test_reasoning_for_the_unachievable_names_the_floor():
    x = crossover([LoadPoint(4, 117, 0.4, 1), LoadPoint(16, 130, 0.5, 4)], parse_slo("fast:tpot<=100"), 128)
    (r,) = slo_reasons([x], sized([x]))
    assert r.headline == "SLO-fast (TPOT ≤ 100 ms): not achievable at 128 input tokens"
    assert r.contexts == ("128 input tokens: not achievable. Even the single-stream floor, 4 streams/VM, has "
                          "TPOT 117.0 ms > 100, TTFT 0.40 s; TPOT binds. More nodes add capacity, not per-user "
                          "speed.",)
