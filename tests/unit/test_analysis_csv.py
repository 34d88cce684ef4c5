"""CSV import of external measurements: good tables, every error with file:line:column, round trip."""

from __future__ import annotations

import pytest
from test_analysis_support import brief_shaped_csv, make_run

from vcfslm.analysis.cells import SINGLE, aggregate, load_runs
from vcfslm.analysis.csv_import import import_csv, parse_csv
from vcfslm.analysis.tables import cells_csv
from vcfslm.errors import CsvError

HEADER = "scope,vms,ranks_per_vm,batch_per_rank,input_tokens,output_tokens,ttft_s,tpot_ms,rank_tps"


def test_a_good_table_with_comments_bom_and_optional_columns(tmp_path):
    path = tmp_path / "published.csv"
    path.write_text("\ufeff# hand-made, for the tests\n" + HEADER + ",tpot_p90_ms,roofline_tpot_ms,roofline_ttft_s\n"
                    "single,1,4,1,128,256,0.3,116,8.4,120,100,0.24\n"
                    "\n"
                    "cluster,4,4,16,128,256,2.0,159,96.7,,,\n", encoding="utf-8")
    cells = import_csv(path).cells
    single, cluster = cells
    assert single.scope == SINGLE and single.streams_per_vm == 4 and single.tpot_ms.p90 == 120.0
    assert single.roofline_tpot_ms == 100.0 and single.origin == "csv" and single.source == "published.csv:3"
    assert single.roofline_ttft_s == 0.24 and single.ttft_efficiency == pytest.approx(0.8)
    assert cluster.roofline_ttft_s is None and cluster.ttft_efficiency is None
    assert (cluster.streams_per_vm, cluster.streams_cluster) == (64, 256)
    assert cluster.tpot_ms.get("p90") is None and cluster.rank_tps == 96.7


def test_every_problem_at_once_with_line_column_and_name():
    text = (HEADER + "\n"
            "singel,1,4,1,128,256,0.3,116,8.4\n"          # line 2: scope
            "single,1,4,1,128,256,fast,116,8.4\n"          # line 3: ttft_s not a number
            "single,1,4,-2,128,256,0.3,116,8.4\n"          # line 4: negative batch
            "single,1,4,1,128\n"                           # line 5: too few fields
            "single,2,4,4,128,256,0.3,116,8.4\n"           # line 6: single with 2 VMs
            "single,1,4,8,128,256,0.3,,8.4\n"              # line 7: tpot missing
            "single,1,4,1,128,256,0.3,116,8.4\n"           # line 8: ok
            "single,1,4,1,128,256,0.3,116,8.4\n")          # line 9: duplicate of 8
    with pytest.raises(CsvError) as err:
        parse_csv(text, "m.csv")
    got = [str(p) for p in err.value.problems]
    assert got[0].startswith("m.csv:2:1: scope: 'singel' is not a scope")
    assert got[1].startswith("m.csv:3:7: ttft_s: 'fast' is not a number")
    assert got[2].startswith("m.csv:4:4: batch_per_rank: must be positive")
    assert got[3].startswith("m.csv:5: expected 9 fields")
    assert got[4].startswith("m.csv:6:2: vms: scope single means one VM")
    assert got[5].startswith("m.csv:7:8: tpot_ms: value missing")
    assert got[6].startswith("m.csv:9: duplicate of line 8")
    assert len(got) == 7


def test_percentile_order_is_checked():
    with pytest.raises(CsvError, match=r"x.csv:2:11: tpot_p99_ms: 150 is below tpot_p90_ms 160"):
        parse_csv(HEADER + ",tpot_p90_ms,tpot_p99_ms\nsingle,1,4,1,128,256,0.3,116,8.4,160,150\n", "x.csv")


@pytest.mark.parametrize("text, message", [
    ("", "x.csv:1: empty CSV"),
    ("# only a comment\n", "x.csv:1: empty CSV"),
    (HEADER + "\n", "x.csv:1: no data rows"),
    ("scope,vms,tpot,ranks_per_vm\n", "x.csv:1:3: tpot: unknown column"),
    (HEADER.replace(",rank_tps", "") + "\n", "missing required column(s): rank_tps"),
    (HEADER + ",vms\n", "x.csv:1:10: vms: column given twice"),
])
def test_header_problems(text, message):
    with pytest.raises(CsvError) as err:
        parse_csv(text, "x.csv")
    assert message in str(err.value)


def test_streams_per_vm_column_must_agree():
    with pytest.raises(CsvError, match="does not equal batch_per_rank x ranks_per_vm = 16"):
        parse_csv(HEADER + ",streams_per_vm\nsingle,1,4,4,128,256,0.3,116,8.4,12\n", "x.csv")


def test_unreadable_file(tmp_path):
    with pytest.raises(CsvError, match="cannot read CSV"):
        import_csv(tmp_path / "nope.csv")


def test_tables_csv_reads_back(tmp_path):
    run = make_run(tmp_path / "r", "r", ["vm1"], {(1, 128): (0.1, 100.0, 10.0), (4, 512): (0.7, 130.0, 30.0)},
                   repeats=2, roofline=90.0, roofline_ttft=0.05)
    # the matrix also asks for (1, 512) and (4, 128): empty cells, which tables.csv leaves out
    original = [c for c in aggregate(load_runs([run])).cells if c.has_data]
    assert len(original) == 2
    again = parse_csv(cells_csv(original), "tables.csv").cells
    assert [c.key for c in again] == [c.key for c in original]
    for a, b in zip(original, again, strict=True):
        assert (b.ttft_s, b.tpot_ms, b.rank_tps, b.roofline_tpot_ms, b.roofline_ttft_s) == \
            (a.ttft_s, a.tpot_ms, a.rank_tps, a.roofline_tpot_ms, a.roofline_ttft_s)
        assert b.ttft_efficiency == pytest.approx(a.ttft_efficiency)


def test_brief_shaped_table_parses():
    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    assert sorted({c.streams_per_vm for c in cells}) == [4, 16, 32, 64]
