"""Tables: per-scope results, the matched-load comparison and its spread verdict, crossover and sizing."""

from __future__ import annotations

import csv
import io
from dataclasses import replace

import pytest
from test_analysis_support import brief_shaped_csv

from vcfslm.analysis.cells import CLUSTER, SINGLE, Cell, CellKey, Quantiles
from vcfslm.analysis.csv_import import parse_csv
from vcfslm.analysis.slo import LoadPoint, crossover, crossovers, size
from vcfslm.analysis.slo_spec import DEFAULT_SLOS, parse_slo
from vcfslm.analysis.tables import (
    Table,
    compare,
    comparison_summary,
    comparison_table,
    crossover_table,
    results_table,
    sizing_table,
)


def cell(scope, tpot, tpot_repeats=(), tps=10.0, tps_repeats=(), ttft=0.5, vms=None, batch=4, inp=128):
    vms = vms or (1 if scope == SINGLE else 4)
    return Cell(CellKey(scope, vms, 4, batch, inp, 256), Quantiles(ttft, ttft, ttft), Quantiles(tpot, tpot, tpot),
                tps, rank_tps_repeats=tuple(tps_repeats), ttft_repeats=(ttft,) * len(tpot_repeats),
                tpot_repeats=tuple(tpot_repeats))


def by_metric(comparisons):
    return {c.metric: c for c in comparisons}


def test_results_table_rows_and_tails():
    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    t = results_table(cells, SINGLE)
    assert t.title == "single VM (1 VM × 4 ranks per VM), 256 output tokens"
    assert "TTFT p90 (s)" not in t.columns and len(t.rows) == 12
    row = dict(zip(t.columns, t.rows[3], strict=True))     # 128 tokens, batch 16
    assert (row["input tokens"], row["batch/rank"], row["streams/VM"], row["streams cluster-wide"]) == \
        ("128", "16", "64", "64")
    assert (row["TPOT p50 (ms)"], row["per-user speed (t/s)"], row["rank throughput p50 (t/s)"]) == \
        ("178.6", "5.6", "86.4")
    tails = results_table(cells, SINGLE, tails=True)
    assert {"TTFT p90 (s)", "TTFT p99 (s)", "TPOT p90 (ms)", "TPOT p99 (ms)"} <= set(tails.columns)


def test_cluster_rows_count_streams_cluster_wide():
    cells = parse_csv(brief_shaped_csv("cluster", 4), "b.csv").cells
    t = results_table(cells, CLUSTER)
    row = dict(zip(t.columns, t.rows[3], strict=True))
    assert (row["streams/VM"], row["streams cluster-wide"]) == ("64", "256")
    assert t.title.startswith("cluster (4 VMs × 4 ranks per VM)")


def test_markdown_and_csv_escape():
    t = Table("T", ["a|b", "c"], [["1|2", "x"]], ["note"])
    md = t.markdown()
    assert "| a\\|b | c |" in md and "| 1\\|2 | x |" in md and "- note" in md
    assert list(csv.reader(io.StringIO(t.csv()))) == [["a|b", "c"], ["1|2", "x"]]


def test_comparison_equal_or_better():
    got = by_metric(compare([cell(SINGLE, 160, tps=90), cell(CLUSTER, 159, tps=96.7)]))
    assert got["TPOT (ms)"].cluster_not_worse and got["TPOT (ms)"].diff_pct == pytest.approx(-0.625)
    assert got["rank throughput (t/s)"].verdict == "cluster equal or better"
    assert "Distribution shows no per-rank cost" in comparison_summary(list(got.values()))


def test_comparison_worse_within_and_beyond_spread():
    within = by_metric(compare([cell(SINGLE, 100, (98, 102)), cell(CLUSTER, 101, (100, 103))]))["TPOT (ms)"]
    assert within.diff_pct == pytest.approx(1.0) and within.within_spread is True
    assert within.verdict == "cluster worse, within run-to-run spread"
    beyond = by_metric(compare([cell(SINGLE, 100, (99, 101)), cell(CLUSTER, 110, (109, 111))]))["TPOT (ms)"]
    assert beyond.within_spread is False and beyond.verdict == "cluster worse, beyond run-to-run spread"
    unknown = by_metric(compare([cell(SINGLE, 100, (100,)), cell(CLUSTER, 110, (110,))]))["TPOT (ms)"]
    assert unknown.within_spread is None and "spread unknown" in unknown.verdict
    text = comparison_summary([within, beyond])
    assert "1 lie beyond it" in text and "TPOT (ms) +10.0%" in text


def test_comparison_needs_a_matched_load():
    assert compare([cell(SINGLE, 100, batch=1), cell(CLUSTER, 100, batch=4)]) == []
    assert "No matched loads" in comparison_summary([])
    assert comparison_table([]).rows == []


def test_crossover_and_sizing_tables_say_edge_cases():
    a, b = DEFAULT_SLOS
    xs = [crossover([LoadPoint(4, 116, 0.3, 1), LoadPoint(64, 178.6, 2.0, 16)], b, 128),
          crossover([LoadPoint(4, 117, 0.4, 1)], parse_slo("fast:tpot<=100"), 128),
          crossover([LoadPoint(4, 120, 1, 1), LoadPoint(16, 140, 1, 4), LoadPoint(32, 125, 1, 8)], a, 512)]
    t = crossover_table(xs)
    col = {name: i for i, name in enumerate(t.columns)}
    assert [r[col["threshold (streams/VM)"]] for r in t.rows] == ["≥ 64", "none", "4"]
    assert "not achievable in this configuration" in t.rows[1][col["note"]]
    assert "non-monotonic: passes again at 32" in t.rows[2][col["note"]]
    s = sizing_table([size(x, 256) for x in xs])
    assert [r[s.columns.index("nodes")] for r in s.rows] == ["≤ 4", "not achievable", "64"]
    assert [r[-1] for r in s.rows] == ["–", "–", "–"]       # no windows behind these points: no interval


def test_brief_shaped_crossover_table():
    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    t = crossover_table(crossovers(cells, DEFAULT_SLOS, "p50"))
    rows = {(r[0][:5], r[1]): r[3] for r in t.rows}
    assert rows[("SLO-B", "128")] == "≥ 64" and rows[("SLO-A", "128")] == "16"
    assert (rows[("SLO-B", "512")], rows[("SLO-B", "1024")]) == ("32", "16")


def test_efficiency_columns_sit_side_by_side_and_only_with_a_floor():
    header = "scope,vms,ranks_per_vm,batch_per_rank,input_tokens,output_tokens,ttft_s,tpot_ms,rank_tps"
    both = parse_csv(header + ",roofline_tpot_ms,roofline_ttft_s\nsingle,1,4,1,128,256,0.5,125,8,100,0.4\n",
                     "x.csv").cells
    t = results_table(both, SINGLE)
    i = t.columns.index("TPOT efficiency")
    assert t.columns[i + 1] == "TTFT efficiency" and t.rows[0][i:i + 2] == ["80%", "80%"]
    assert any(n.startswith("TTFT efficiency = prefill floor") for n in t.notes)
    old = parse_csv(header + ",roofline_tpot_ms\nsingle,1,4,1,128,256,0.5,125,8,100\n", "x.csv").cells
    assert "TPOT efficiency" in results_table(old, SINGLE).columns
    assert "TTFT efficiency" not in results_table(old, SINGLE).columns
    bare = parse_csv(brief_shaped_csv(), "b.csv").cells
    assert not {"TPOT efficiency", "TTFT efficiency"} & set(results_table(bare, SINGLE).columns)


def test_flags_column_only_when_a_cell_is_flagged():
    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    assert "flags" not in results_table(cells, SINGLE).columns
    flagged = [replace(cells[0], flags=("recompiles inside 1 window(s)",))] + cells[1:]
    t = results_table(flagged, SINGLE)
    assert t.columns[-1] == "flags" and t.rows[0][-1] == "recompiles inside 1 window(s)" and t.rows[1][-1] == ""
