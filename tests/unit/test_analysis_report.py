"""report.py: content and order, escaping, metadata and topology rows, refusing clashing inputs."""

from __future__ import annotations

import os
import stat

import pytest
from test_analysis_support import BRIEF_SHAPED, brief_shaped_csv, make_run, make_serve_run

from vcfslm import steadiness
from vcfslm.analysis.report import ReportOptions, build, load_inputs, write_report
from vcfslm.analysis.report_render import flatten, topology_rows
from vcfslm.errors import CsvError
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
    order = ['<table id="summary"', 'id="validity"', "<h2>Key figures</h2>", 'id="fig-3-tpot-slo"',
             'id="fig-4-ttft-slo"', "<h2>Reasoning per SLO</h2>", "<h2>Tables</h2>", "<h2>More figures</h2>",
             'id="fig-1-throughput"', 'id="fig-5-roofline"', "<h2>Run r</h2>"]
    assert [html.index(m) for m in order] == sorted(html.index(m) for m in order)
    assert html.count("data:image/png;base64,") == 4 and 'id="fig-2' not in html
    assert html.count("<details>") == 2 and "<summary>SLO-A (TPOT ≤ 130 ms, TTFT ≤ 3 s): 16 [16–&lt;32] streams/VM " \
        "at 128 input tokens</summary>" in html
    assert "http://" not in html and "https://" not in html
    assert result.skipped_figures == [
        "fig-2-matched-tpot: needs single-VM and cluster data at the same batch per rank",
        "fig-6-model: no performance model (cannot calibrate on this run: it lacks the bandwidth probe "
        "(the run was made with --no-probe?))"]
    assert reporter.last("report").startswith("written to")
    mode = stat.S_IMODE(os.stat(tmp_path / "out" / "report.html").st_mode)
    assert mode & stat.S_IRGRP, "the report should be as readable as its PNGs"


def test_markdown_holds_crossover_sizing_and_validity(tmp_path):
    def late(r):
        if r.local_rank == 3:
            r.start_skew_s = 2.0
        return r
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, tweak=late)
    write_report([run_dir], tmp_path / "out", ReportOptions(peaks=(256, 1000)))
    md = (tmp_path / "out" / "report.md").read_text()
    lines = md.splitlines()
    assert lines[4:9] == ["## Answer", "",
                          "### Single-VM threshold and nodes per SLO and input length (p90 of streams)", "",
                          "| model | SLO | input tokens | threshold (streams/VM) | first failing (streams/VM) | binding "
                          "| nodes for 256 streams | nodes for 1000 streams | note |"]
    thin = "few samples: p90 judged on fewer than 50 streams at 4 (4), 16 (16), 32 (32) streams/VM"
    assert f"| synthetic:tiny | SLO-B | 128 | ≥ 64 | > 64 | – | ≤ 4 | ≤ 16 | {thin} |" in lines
    assert f"| synthetic:tiny | SLO-A | 128 | 16 [16–<32] | 32 | TPOT | 16 [9–16] | 63 [32–63] | {thin} |" in lines
    assert lines.index("## Answer") < lines.index("## Validity warnings") < lines.index("## Key figures") \
        < lines.index("## Reasoning per SLO") < lines.index("## Tables") < lines.index("## More figures")
    # The reasoning: one entry per SLO, one line per context under it.
    assert sum(line.startswith("- **SLO-") for line in lines) == 2
    assert ("  - 128 input tokens: every tested load meets it (at 64 streams/VM: TPOT 178.6 ms ≤ 200, TTFT 2.00 s "
            "≤ 5), so the threshold is ≥ 64 and the node counts are upper bounds. Nodes: 256 streams → "
            "ceil(256 / 64) = 4 at most; 1000 streams → ceil(1000 / 64) = 16 at most. Few samples: p90 judged on "
            "fewer than 50 streams at 4 (4), 16 (16), 32 (32) streams/VM.") in lines
    assert md.count("Per-rank latency does not change with scale-out") == 1
    assert "start skew up to 2.000 s in 1 window(s)" in md
    key = md.split("## Key figures")[1].split("## Reasoning")[0]
    assert "(fig-3-tpot-slo.png)" in key and "(fig-4-ttft-slo.png)" in key and "(fig-1-throughput.png)" not in key
    assert "(fig-1-throughput.png)" in md.split("## More figures")[1]


def test_numerics_gate_failures_lead_the_validity_warnings(tmp_path):
    def gate(r):
        if r.node == "vm3" and r.local_rank == 2:
            r.valid, r.invalid_reasons = False, ["numerics gate: max |logit diff| 0.9 > 0.25 (bf16 tolerance)"]
        return r
    run_dir = make_run(tmp_path / "c", "c", ["vm1", "vm2", "vm3", "vm4"], SHORT, tweak=gate)
    result = write_report([run_dir], tmp_path / "out")
    named = ("run c: numerics gate failed on node vm3, rank 10 (local rank 2): max |logit diff| 0.9 > 0.25 "
             "(bf16 tolerance); its 4 window(s) are left out of every number")
    assert result.warnings[0] == named
    md = (tmp_path / "out" / "report.md").read_text()
    warnings = md.split("## Validity warnings")[1].split("## Key figures")[0]
    assert warnings.lstrip().startswith("- " + named)
    html = (tmp_path / "out" / "report.html").read_text()
    box = html.split('id="validity"')[1].split("</div>")[0]
    assert "Validity warnings (" in box and "numerics gate failed on node vm3, rank 10" in box
    assert html.index('id="validity"') < html.index("<h2>Key figures</h2>")


def test_tails_shown_only_with_repeats_or_a_stricter_percentile(tmp_path):
    one = load_inputs([make_run(tmp_path / "a", "a", ["vm1"], SHORT)])
    assert "TPOT p90 (ms)" not in build(*one, ReportOptions(percentile="p50")).tables[0].columns
    assert "TPOT p90 (ms)" in build(*one).tables[0].columns          # p90 is what the answer judges
    two = load_inputs([make_run(tmp_path / "b", "b", ["vm1"], SHORT, repeats=2)])
    assert "TPOT p99 (ms)" in build(*two).tables[0].columns


def test_the_same_cell_from_a_run_and_a_csv_is_refused(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], {(1, 128): (0.3, 116.0, 8.4)}, out=256)
    path = tmp_path / "t.csv"
    path.write_text(brief_shaped_csv())
    with pytest.raises(CsvError, match="t.csv:2: same cell as in r"):
        load_inputs([run_dir], [path])


def test_flatten_and_topology_rows(tmp_path):
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "ok": True}) == [("a.b", "1"), ("a.c", "[1, 2]"), ("ok", "pass")]
    run_dir = make_run(tmp_path / "r", "r", ["vm1", "vm2"], SHORT, guests={"vm1": {"numa_nodes": 4}, "vm2": "?"})
    assert topology_rows(read_meta(run_dir)) == [("vm1", "numa_nodes", "4"), ("vm2", "facts", "?")]


RAMP = {(1.0, 128): (0.5, 100.0, 2.0), (2.0, 128): (2.0, 150.0, 5.0), (4.0, 128): (6.0, 250.0, 12.0)}


def test_a_serving_run_beside_a_static_one_adds_a_serving_section_and_keeps_the_static_ones(tmp_path):
    static = make_run(tmp_path / "st", "st", ["vm1"], SHORT)
    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    write_report([static], tmp_path / "alone")
    result = write_report([static, serve], tmp_path / "both")
    alone = (tmp_path / "alone" / "report.md").read_text().splitlines()
    md = (tmp_path / "both" / "report.md").read_text()
    lines = md.splitlines()
    # The static answer table is the same; the serving one follows it inside the answer.
    table = alone[alone.index("## Answer"):alone.index("## Validity warnings")]
    assert lines[lines.index("## Answer"):lines.index("## Answer") + len(table) - 1] == table[:-1]
    assert lines.index("### Serving threshold per SLO and context (continuous batching, 90 % attainment)") \
        < lines.index("## Validity warnings") < lines.index("## Key figures") < lines.index("## Reasoning per SLO") \
        < lines.index("## Serving") < lines.index("## Tables") < lines.index("## More figures")
    thin = "few samples: 90 % attainment judged on fewer than 50 requests at 4 (40), 8 (40), 16 (40) req/s/VM"
    assert f"| SLO-A | 128 | req/s | 4 [4–<8] | 8 | TPOT | 8.0 [8.0–<20.0] | 16 | 0.50 | 32 [13–32] | {thin} |" in lines
    assert (f"| SLO-B | 128 | req/s | 8 [8–<16] | 16 | TPOT and TTFT | 20.0 [20.0–<48.0] | ≥ 64 | ≤ 0.31 | 13 [6–13] "
            f"| {thin} |") in lines
    serving = md.split("\n## Serving\n")[1].split("\n## Tables\n")[0]
    for name in ("fig-7-serve-latency.png", "fig-8-serve-goodput.png", "fig-9-serve-vs-static.png"):
        assert f"({name})" in serving and f"({name})" not in md.split("## More figures")[1]
    assert ("- SLO-A, 128-token inputs: serving carries 8.0 concurrent streams/VM at its threshold, static "
            "batches 16 at their crossover (static p90 of streams, serving 90 % attainment): ratio 0.50.") in lines
    assert any(line.startswith("- SLO-B (TPOT ≤ 200 ms, TTFT ≤ 5 s), serving requests/s") and line.endswith(
        "Nodes: 256 streams → ceil(256 / 20) = 13 [6–13]. By rate: nodes = ceil(peak requests/s / 8) "
        "(vcfslm size --threshold serving --peak-rps X).") for line in lines)
    assert "### Serving, single VM (1 VM x 4 ranks, 16 slots, poisson) input 128 / output 64" in lines
    assert "| 2 | 8 | 40 | 0 | 2.00 | 2.00 | 150.0 | 150.0 | 20.0 | 4.00 | 0.00 | 4.00 | 0.0 % | 100.0 % | 4/4 |" \
        in lines
    assert result.report.serving is not None and result.skipped_figures == [
        "fig-2-matched-tpot: needs single-VM and cluster data at the same batch per rank",
        "fig-5-roofline: no roofline data (no bandwidth or compute probe in this run)",
        "fig-6-model: no performance model (cannot calibrate on this run: it lacks the bandwidth probe "
        "(the run was made with --no-probe?))"]
    html = (tmp_path / "both" / "report.html").read_text()
    order = ['<table id="summary"', '<table id="serving-answer"', 'id="validity"', "<h2>Key figures</h2>",
             '<h2 id="serving">Serving</h2>', 'id="fig-7-serve-latency"', 'id="fig-9-serve-vs-static"',
             "<h2>Tables</h2>"]
    assert [html.index(m) for m in order] == sorted(html.index(m) for m in order)
    assert html.count("data:image/png;base64,") == 6


def test_no_serve_records_no_serving_section(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT)
    report = build(*load_inputs([run_dir]))
    assert report.serving is None and report.serving_tables == []
    write_report([run_dir], tmp_path / "out")
    assert "Serving" not in (tmp_path / "out" / "report.md").read_text()
    assert not (tmp_path / "out" / "serving.json").exists()


def test_serving_only_html_answers_with_the_serving_table(tmp_path):
    def bad(r):
        if r.load == 4.0 and r.local_rank == 0:
            r.valid, r.invalid_reasons = False, ["recompiled"]
        return r

    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP, tweak=bad)
    result = write_report([serve], tmp_path / "out")
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.index("<h3>Serving threshold per SLO and context (continuous batching, 90 % attainment)</h3>") \
        < html.index('<table id="summary"') < html.index('id="validity"')
    assert "<h2>Key figures</h2>" not in html and "Reasoning per SLO" not in html
    assert html.count("data:image/png;base64,") == 2
    assert result.warnings == ["serving single VM (1 VM x 4 ranks, 16 slots, poisson) input 128 / output 64 "
                               "at 4 req/s per rank: 1 invalid window(s) left out (recompiled)"]


# A second model, 1.3x slower per token at every load: no SLO-A threshold, SLO-B at 32 streams/VM.
SLOWER = {k: (ttft, tpot * 1.3, tps / 1.3) for k, (ttft, tpot, tps) in SHORT.items()}


def test_runs_of_two_models_give_one_answer_row_per_model_never_folded(tmp_path):
    phi = make_run(tmp_path / "phi3", "phi3", ["vm1"], SHORT, model="synthetic:phi-3-mini")
    llama = make_run(tmp_path / "llama", "llama", ["vm1"], SLOWER, model="synthetic:llama-3.2-3b")
    report = build(*load_inputs([phi, llama]))
    # Same scope, VMs, ranks, batches and contexts: only the model tells the cells apart.
    assert len(report.analysis.cells) == 2 * len(SHORT)
    assert report.analysis.models() == ["synthetic:phi-3-mini", "synthetic:llama-3.2-3b"]
    t = report.summary
    assert t.columns[:3] == ["model", "SLO", "input tokens"]
    col = {name: i for i, name in enumerate(t.columns)}
    got = [(r[0], r[1], r[col["threshold (streams/VM)"]], r[col["nodes for 256 streams"]]) for r in t.rows]
    assert got == [("synthetic:phi-3-mini", "SLO-A", "16 [16–<32]", "16 [9–16]"),
                   ("synthetic:llama-3.2-3b", "SLO-A", "none", "not achievable"),
                   ("synthetic:phi-3-mini", "SLO-B", "≥ 64", "≤ 4"),
                   ("synthetic:llama-3.2-3b", "SLO-B", "32 [32–<64]", "8 [5–8]")]
    # Each sentence names its model once the answer holds several.
    assert [x.model for x in report.crossovers] == ["synthetic:phi-3-mini", "synthetic:llama-3.2-3b"] * 2
    assert report.sizings[3].reasoning.startswith("synthetic:llama-3.2-3b, SLO-B (TPOT ≤ 200 ms, TTFT ≤ 5 s)")
    assert report.sizings[3].to_dict()["model"] == "synthetic:llama-3.2-3b"
    assert [r.headline for r in report.reasons][1] == (
        "SLO-B (TPOT ≤ 200 ms, TTFT ≤ 5 s): ≥ 64 streams/VM at synthetic:phi-3-mini, 128 input tokens; "
        "32 [32–<64] streams/VM at synthetic:llama-3.2-3b, 128 input tokens")
    # The detail table tells the two models' rows apart too.
    assert report.tables[0].columns[0] == "model" and len(report.tables[0].rows) == 2 * len(SHORT)


def test_a_report_of_two_models_draws_streams_per_model_among_the_key_figures(tmp_path):
    phi = make_run(tmp_path / "phi3", "phi3", ["vm1"], SHORT, model="synthetic:phi-3-mini")
    llama = make_run(tmp_path / "llama", "llama", ["vm1"], SLOWER, model="synthetic:llama-3.2-3b")
    write_report([phi, llama], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    lines = md.splitlines()
    assert "| model | SLO | input tokens | threshold (streams/VM) | first failing (streams/VM) | binding " \
           "| nodes for 256 streams | note |" in lines
    assert any(line.startswith("| synthetic:llama-3.2-3b | SLO-B | 128 | 32 [32–<64] | 64 | TPOT | 8 [5–8] |")
               for line in lines)
    key = md.split("## Key figures")[1].split("## Reasoning")[0]
    assert key.index("(fig-10-models.png)") < key.index("(fig-3-tpot-slo.png)")
    assert (tmp_path / "out" / "fig-10-models.png").stat().st_size > 0
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.index('id="fig-10-models"') < html.index('id="fig-3-tpot-slo"')


def test_a_csv_naming_no_model_still_clashes_with_a_run_of_any_model_but_not_a_csv_of_another(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], {(1, 128): (0.3, 116.0, 8.4)}, out=256,
                       model="synthetic:qwen2.5-7b")
    other = tmp_path / "other.csv"
    header, *rows = brief_shaped_csv().splitlines()
    other.write_text("\n".join([header + ",model"] + [row + ",synthetic:phi-3-mini" for row in rows]) + "\n")
    analysis, _ = load_inputs([run_dir], [other])
    assert analysis.models() == ["synthetic:qwen2.5-7b", "synthetic:phi-3-mini"]
    same = tmp_path / "same.csv"
    same.write_text("\n".join([header + ",model"] + [row + ",synthetic:qwen2.5-7b" for row in rows]) + "\n")
    with pytest.raises(CsvError, match="same.csv:2: same cell as in r"):
        load_inputs([run_dir], [same])


def test_serving_runs_of_two_models_stand_side_by_side_each_beside_its_own_static_crossover(tmp_path):
    runs = [make_run(tmp_path / "phi-st", "phi-st", ["vm1"], SHORT, model="synthetic:phi-3-mini"),
            make_serve_run(tmp_path / "phi-s", "phi-s", ["vm1"], RAMP, model="synthetic:phi-3-mini"),
            make_run(tmp_path / "qwen-st", "qwen-st", ["vm1"], SLOWER, model="synthetic:qwen2.5-7b"),
            make_serve_run(tmp_path / "qwen-s", "qwen-s", ["vm1"], RAMP, model="synthetic:qwen2.5-7b")]
    report = build(*load_inputs(runs))
    t = report.serving_answer
    col = {name: i for i, name in enumerate(t.columns)}
    assert t.columns[0] == "model"
    got = sorted((r[0], r[col["SLO"]], r[col["static crossover (streams/VM)"]]) for r in t.rows)
    assert got == [("synthetic:phi-3-mini", "SLO-A", "16"), ("synthetic:phi-3-mini", "SLO-B", "≥ 64"),
                   ("synthetic:qwen2.5-7b", "SLO-A", "none"), ("synthetic:qwen2.5-7b", "SLO-B", "32")]
    assert {c.to_dict()["model"] for c in report.serving.comparisons} == {"synthetic:phi-3-mini",
                                                                         "synthetic:qwen2.5-7b"}
    assert all(s.reasoning.startswith(s.threshold.key.model + ", SLO-") for s in report.serving.sizings)
    titles = [x.title for x in report.serving_tables]
    assert "Serving, synthetic:qwen2.5-7b, single VM (1 VM x 4 ranks, 16 slots, poisson) input 128 / output 64" \
        in titles


# ---------------------------------------------------------------- a rank probed on a busy machine


def _rank(node: str, local_rank: int, share: float | None) -> dict:
    """A rank's kept facts in meta.json; share None: a probe older than its steadiness check."""
    probe = {"read_gbs": 30.0, "triad_gbs": 25.0, "threads": 24}
    if share is not None:
        others = steadiness.OthersCpu(cpus=24, wall_s=30.0, own_s=700.0, others_s=share * 720, share=share,
                                      steal_share=0.0)
        probe["steadiness"] = steadiness.judge({"read": steadiness.Spread(5, 0.025, 0.0252),
                                                "triad": steadiness.Spread(5, 0.03, 0.0301)}, others).to_dict()
    return {"node": node, "local_rank": local_rank, "probe": probe, "gemm": {"tflops": 1.0}}


def test_a_rank_probed_on_a_busy_machine_is_a_validity_warning_and_a_metadata_row(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, ranks=2)
    meta = read_meta(run_dir)
    meta.ranks = {"0": _rank("vm1", 0, 0.0), "1": _rank("vm1", 1, 0.4)}
    write_meta(run_dir, meta)
    result = write_report([run_dir], tmp_path / "out")
    warning = ("run r: the probe on node vm1, rank 1 was taken on a busy machine (other processes took 40% of the "
               "24 CPUs the probe ran on (limit 10%)): its figures are likely low, which skews the roofline "
               "floors, efficiencies and performance model drawn from them; rerun on a quiet machine")
    assert warning in result.warnings and sum("busy machine" in w for w in result.warnings) == 1
    md = (tmp_path / "out" / "report.md").read_text().splitlines()
    assert f"- {warning}" in md[md.index("## Validity warnings"):md.index("## Key figures")]
    assert "| probe steadiness, node vm1 rank 0 | steady: spreads read 0.8%, triad 0.3%; others took 0.0% of "\
           "24 CPUs |" in md
    assert "| probe steadiness, node vm1 rank 1 | busy: other processes took 40% of the 24 CPUs the probe ran on "\
           "(limit 10%) |" in md
    html = (tmp_path / "out" / "report.html").read_text()
    box = html.split('id="validity"')[1].split("</div>")[0]
    assert "the probe on node vm1, rank 1 was taken on a busy machine" in box


@pytest.mark.parametrize("ranks", [
    {"0": _rank("vm1", 0, None), "1": _rank("vm1", 1, None)},     # probes older than the check
    {},                                                            # a run older than kept rank facts
])
def test_a_run_older_than_the_probe_check_still_reports_and_claims_nothing(tmp_path, ranks):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, ranks=2)
    meta = read_meta(run_dir)
    meta.ranks = ranks
    write_meta(run_dir, meta)
    result = write_report([run_dir], tmp_path / "out")
    assert not any("busy machine" in w for w in result.warnings)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "probe steadiness" not in md and "## Answer" in md


def test_the_report_names_the_linear_kernels_and_their_memory(tmp_path):
    """The metadata says which plan the ranks' linears ran on, and that an fp32 plan held the
    weights at twice the bf16 memory; ranks that ran different plans are named."""
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, ranks=2)
    meta = read_meta(run_dir)
    fp32 = "onednn-fp32 (weights held in fp32, 2x the bf16 memory)"
    meta.ranks = {"0": {"node": "vm1", "pack": {"label": fp32}}, "1": {"node": "vm1", "pack": {"label": fp32}}}
    write_meta(run_dir, meta)
    write_report([run_dir], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text().splitlines()
    assert f"| linear kernels | {fp32} |" in md
    meta.ranks["1"]["pack"]["label"] = "dense-bf16"
    write_meta(run_dir, meta)
    write_report([run_dir], tmp_path / "out2")
    md = (tmp_path / "out2" / "report.md").read_text().splitlines()
    assert f"| linear kernels, ranks 0 | {fp32} |" in md and "| linear kernels, ranks 1 | dense-bf16 |" in md
