"""report.py: content and order, escaping, metadata and topology rows, refusing clashing inputs."""

from __future__ import annotations

import os
import stat

import pytest
from test_analysis_support import BRIEF_SHAPED, brief_shaped_csv, make_run

from vcfslm.analysis.report import build, flatten, load_inputs, topology_rows, write_report
from vcfslm.errors import InventoryError
from vcfslm.progress import RecordingReporter
from vcfslm.results import read_meta, write_meta

SHORT = {(streams // 4, 128): v for (inp, streams), v in BRIEF_SHAPED.items() if inp == 128}


def test_html_is_self_contained_escaped_and_answer_first(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, roofline=100.0,
                       guests={"vm1": {"numa": {"nodes": 4, "ok": False}, "note": "<b>odd</b>"}})
    meta = read_meta(run_dir)
    meta.label = "lab <script>alert(1)</script>"
    write_meta(run_dir, meta)
    reporter = RecordingReporter()
    result = write_report([run_dir], tmp_path / "out", reporter=reporter)
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<script>alert(1)</script>" not in html and "lab &lt;script&gt;" in html
    assert "&lt;b&gt;odd&lt;/b&gt;" in html and '<td class="fail">FAIL</td>' in html
    assert html.index("<h2>Crossover</h2>") < html.index("<h2>Tables</h2>") < html.index("<h2>Figures</h2>") \
        < html.index("<h2>Run r</h2>")
    assert html.count("data:image/png;base64,") == 4 and "fig-2" not in html.split("<h2>Figures</h2>")[1][:200]
    assert "http://" not in html and "https://" not in html
    assert result.skipped_figures == ["fig-2-matched-tpot: needs single-VM and cluster data at the same batch per rank"]
    assert reporter.last("report").startswith("written to")
    mode = stat.S_IMODE(os.stat(tmp_path / "out" / "report.html").st_mode)
    assert mode & stat.S_IRGRP, "the report should be as readable as its PNGs"


def test_markdown_holds_crossover_sizing_and_validity(tmp_path):
    def late(r):
        if r.local_rank == 3:
            r.start_skew_s = 2.0
        return r
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, tweak=late)
    write_report([run_dir], tmp_path / "out", peaks=(256, 1000))
    md = (tmp_path / "out" / "report.md").read_text()
    assert "every tested load meets it, so the threshold is ≥ 64 streams/VM" in md
    assert "Nodes = ceil(1000 / 64) = ceil(15.62) = 16." in md
    assert "start skew up to 2.000 s in 1 window(s)" in md
    assert "![" in md and "(fig-1-throughput.png)" in md


def test_tails_shown_only_with_repeats_or_a_stricter_percentile(tmp_path):
    one = load_inputs([make_run(tmp_path / "a", "a", ["vm1"], SHORT)])
    assert "TPOT p90 (ms)" not in build(*one).tables[0].columns
    assert "TPOT p90 (ms)" in build(*one, percentile="p90").tables[0].columns
    two = load_inputs([make_run(tmp_path / "b", "b", ["vm1"], SHORT, repeats=2)])
    assert "TPOT p99 (ms)" in build(*two).tables[0].columns


def test_the_same_cell_from_a_run_and_a_csv_is_refused(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], {(1, 128): (0.3, 116.0, 8.4)}, out=256)
    path = tmp_path / "t.csv"
    path.write_text(brief_shaped_csv())
    with pytest.raises(InventoryError, match="t.csv:2 same cell as in r"):
        load_inputs([run_dir], [path])


def test_flatten_and_topology_rows(tmp_path):
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "ok": True}) == [("a.b", "1"), ("a.c", "[1, 2]"), ("ok", "pass")]
    run_dir = make_run(tmp_path / "r", "r", ["vm1", "vm2"], SHORT, guests={"vm1": {"numa_nodes": 4}, "vm2": "?"})
    assert topology_rows(read_meta(run_dir)) == [("vm1", "numa_nodes", "4"), ("vm2", "facts", "?")]
