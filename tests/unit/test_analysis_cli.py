"""`vcfslm report` and `vcfslm size` through click: files, answers, exit codes, clear errors."""

from __future__ import annotations

import json

from click.testing import CliRunner
from test_analysis_support import BRIEF_SHAPED, brief_shaped_csv, make_run, make_serve_run

from vcfslm.cli import main
from vcfslm.cli.report import COMMANDS, report, size

# batch per rank -> (TTFT s, TPOT ms, rank t/s) at 128 input tokens: SLO-A threshold 16, SLO-B >= 64
SHORT = {(streams // 4, 128): v for (inp, streams), v in BRIEF_SHAPED.items() if inp == 128}
# serving: (req/s per rank, input) -> (TTFT s, TPOT ms, busy slots per rank); 4 ranks per VM:
# SLO-A passes 4 req/s/VM (8 streams/VM), SLO-B passes 8 req/s/VM (20 streams/VM)
RAMP = {(1.0, 128): (0.5, 100.0, 2.0), (2.0, 128): (2.0, 150.0, 5.0), (4.0, 128): (6.0, 250.0, 12.0)}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_module_exports_both_commands():
    assert COMMANDS == [report, size]


def test_report_writes_every_file_and_prints_the_answer(tmp_path):
    single = make_run(tmp_path / "single", "single", ["vm1"], SHORT, repeats=2)
    cluster = make_run(tmp_path / "cluster", "cluster", ["vm1", "vm2", "vm3", "vm4"], SHORT, repeats=2)
    out = tmp_path / "out"
    r = run("report", single, cluster, "--out", out)
    assert r.exit_code == 0, r.output
    for name in ("report.html", "report.md", "tables.csv", "crossover.csv", "fig-1-throughput.png",
                 "fig-2-matched-tpot.png", "fig-3-tpot-slo.png", "fig-4-ttft-slo.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "fig-5-roofline.png").exists()
    lines = r.output.splitlines()
    # The answer opens stdout, as whole aligned lines (nothing wrapped or cut off a terminal).
    # Every stream of these runs has its cell's values, so every replicate agrees: at least 16 and
    # below the first failing load, 32: [16–<32], and 256 streams need 9 to 16 nodes. Two
    # windows of a few streams are fewer than a p90 needs, and the table says so.
    thin = "few samples: p90 judged on fewer than 50 streams at 4 (8), 16 (32) streams/VM"
    assert [line.rstrip() for line in lines[:5]] == [
        "Single-VM threshold and nodes per SLO and input length (p90 of streams)",
        "model           SLO    input tokens  threshold (streams/VM)  first failing (streams/VM)  binding  "
        "nodes for 256 streams  note",
        "--------------  -----  ------------  ----------------------  --------------------------  -------  "
        "---------------------  " + "-" * len(thin),
        "synthetic:tiny  SLO-A  128           16 [16–<32]             32                          TPOT     "
        f"16 [9–16]              {thin}",
        "synthetic:tiny  SLO-B  128           ≥ 64                    > 64                        –        "
        f"≤ 4                    {thin}"]
    assert ("SLOs: SLO-A (TPOT ≤ 130 ms, TTFT ≤ 3 s); SLO-B (TPOT ≤ 200 ms, TTFT ≤ 5 s). Judged by: static "
            "batches at p90 of streams; 95% intervals by bootstrap. Note: run single records no static rule "
            "(written before runs did): its cells are judged at p90 of streams. Note: run cluster records no "
            "static rule (written before runs did): its cells are judged at p90 of streams.") in lines
    assert lines.index(f"report written to {out}") > 4
    md = (out / "report.md").read_text()
    assert "### Matched per-rank load: single VM vs cluster" in md and "Distribution shows no per-rank cost" in md
    assert "## Run cluster" in md and "| vm4 | numa_ok | pass |" in md
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 4 and "<img" in html and 'src="fig-' not in html


def test_report_default_out_is_the_run_and_slo_flags(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, slos={"gold": {"tpot_ms": 120, "ttft_s": 1}})
    r = run("report", run_dir)
    assert r.exit_code == 0, r.output
    assert (run_dir / "report.html").exists()
    assert any(line.startswith("synthetic:tiny  SLO-gold  128           4 [4–<16]               16                          "
                               "TPOT     64 [17–64]") for line in r.output.splitlines())
    r = run("report", run_dir, "--slo", "tight:tpot<=110ms", "--percentile", "p99", "--peak-streams", 256,
            "--peak-streams", 1000)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "Single-VM threshold and nodes per SLO and input length (p99 of streams)"
    assert lines[3].startswith("synthetic:tiny  SLO-tight  128           none                    4                           TPOT     "
                               "not achievable         not achievable")


def test_report_warns_about_validity(tmp_path):
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT, complete=False)
    r = run("report", run_dir)
    assert r.exit_code == 0 and "run r is not complete" in r.output


def test_report_bad_inputs_exit_2_without_traceback(tmp_path):
    r = run("report", tmp_path / "missing")
    assert r.exit_code == 2 and "does not exist: not a run folder" in r.output and "Traceback" not in r.output
    r = run("report")
    assert r.exit_code == 2 and "nothing to analyse" in r.output
    run_dir = make_run(tmp_path / "r", "r", ["vm1"], SHORT)
    r = run("report", run_dir, "--slo", "x:tpot<150")
    assert r.exit_code == 2 and "needs '<='" in r.output


def test_report_from_csv_only(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(brief_shaped_csv())
    r = run("report", "--csv", path)
    assert r.exit_code == 2 and "p90 values are unknown" in r.output and "try --percentile p50" in r.output
    r = run("report", "--csv", path, "--percentile", "p50")       # the brief's medians, by name
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hand-report" / "report.html").exists()


def test_size_reproduces_the_briefs_worked_example(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(brief_shaped_csv())
    r = run("size", "--peak-streams", 256, "--slo", "B", "--input-tokens", 128, "--results", path,
            "--percentile", "p50")
    assert r.exit_code == 0, r.output
    assert "nodes: 4" in r.output and "ceil(256 / 64)" in r.output
    assert "answer: SLO-B, 128-token inputs, p50 of streams: ≥ 64 streams/VM → ≤ 4 nodes" in r.output.splitlines()
    r = run("size", "--peak-streams", 256, "--slo", "A", "--input-tokens", 128, "--results", path,
            "--output", "json", "--percentile", "p50")
    data = json.loads(r.output)
    (answer,) = data["sizings"]
    assert answer["nodes"] == 16 and answer["threshold_streams_per_vm"] == 16 and answer["binding"] == "TPOT"


def test_size_without_slo_gives_every_slo_and_context(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(brief_shaped_csv())
    r = run("size", "--peak-streams", 256, "--results", path, "--output", "json", "--headroom", "0.1",
            "--percentile", "p50")
    data = json.loads(r.output)
    got = {(s["slo"]["name"], s["input_tokens"]): s["nodes"] for s in data["sizings"]}
    assert got == {("A", 128): 18, ("A", 512): 72, ("A", 1024): 72,
                   ("B", 128): 5, ("B", 512): 9, ("B", 1024): 18}
    r = run("size", "--peak-streams", 256, "--results", path, "--headroom", "0.1", "--percentile", "p50")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "Single-VM threshold and nodes per SLO and input length (p50 of streams, headroom 10%)" in lines
    assert "–      SLO-B  128           ≥ 64                    > 64                        –              ≤ 5" \
        in lines


def test_size_uses_the_latest_run_or_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("size", "--peak-streams", 10)
    assert r.exit_code == 2 and "no run dirs under runs/" in r.output and "--results" in r.output
    make_run(tmp_path / "runs" / "old", "old", ["vm1"], SHORT, created="2025-01-01T00:00:00")
    newer = {k: (ttft, tpot + 50, tps) for k, (ttft, tpot, tps) in SHORT.items()}
    make_run(tmp_path / "runs" / "new", "new", ["vm1"], newer, created="2025-02-01T00:00:00")
    r = run("size", "--peak-streams", 64, "--slo", "B", "--output", "json")
    data = json.loads(r.output)
    assert data["results"] == ["runs/new"] and data["sizings"][0]["threshold_streams_per_vm"] == 32


def test_size_unknown_context_and_missing_percentile(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(brief_shaped_csv())
    r = run("size", "--peak-streams", 10, "--input-tokens", 4096, "--results", path)
    assert r.exit_code == 2 and "tested contexts: 128 in / 256 out, 512 in / 256 out" in r.output
    r = run("size", "--peak-streams", 10, "--results", path)          # p90 by default
    assert r.exit_code == 2 and "p90 values are unknown" in r.output


def test_report_of_a_serving_only_run_has_the_section_and_figures(tmp_path):
    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    r = run("report", serve)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "Serving threshold per SLO and context (continuous batching, 90 % attainment)"
    assert lines[3].split()[:12] == ["SLO-A", "128", "req/s", "4", "[4–<8]", "8", "TPOT", "8.0", "[8.0–<20.0]", "–",
                                     "–", "32"]
    assert lines[3].endswith("few samples: 90 % attainment judged on fewer than 50 requests at 4 (40), 8 (40), "
                             "16 (40) req/s/VM; no static-batch data among the inputs")
    assert ("SLOs: SLO-A (TPOT ≤ 130 ms, TTFT ≤ 3 s); SLO-B (TPOT ≤ 200 ms, TTFT ≤ 5 s). Judged by: serving by "
            "attainment, 90 % of requests meet every limit; 95% intervals by bootstrap.") in lines
    for name in ("fig-7-serve-latency.png", "fig-8-serve-goodput.png", "serving.json", "report.md", "report.html"):
        assert (serve / name).stat().st_size > 0, name
    assert not (serve / "fig-1-throughput.png").exists()
    assert "figure skipped: fig-9-serve-vs-static: no serving threshold with a static crossover of the same " \
        "SLO and context, judged at the same share, among the inputs" in lines
    assert "has no records" not in r.output
    md = (serve / "report.md").read_text()
    assert "## Serving" in md and "## Reasoning per SLO" not in md and "## Tables" not in md
    data = json.loads((serve / "serving.json").read_text())
    assert [t["threshold_load_per_vm"] for t in data["answer"]] == [4.0, 8.0]


def test_size_from_the_serving_threshold(tmp_path):
    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    r = run("size", "--peak-streams", 256, "--slo", "B", "--results", serve)       # serving-only: serving
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == f"sizing from {serve} (serving threshold, 90 % of requests meet every limit)"
    assert lines[-1] == "nodes: 13"
    assert lines[-2] == ("answer: SLO-B, 128-token inputs, 90 % attainment: 8 [8–<16] req/s/VM, 20.0 [20.0–<48.0] "
                         "streams/VM → 13 [6–13] nodes, binding TPOT and TTFT")
    assert "Nodes = ceil(256 / 20) = ceil(12.80) = 13." in r.output
    r = run("size", "--peak-streams", 256, "--peak-rps", 40, "--slo", "B", "--results", serve, "-o", "json")
    data = json.loads(r.output)
    (answer,) = data["sizings"]
    assert data["threshold"] == "serving" and data["attainment"] == 0.9 and data["peak_rps"] == 40
    assert (answer["nodes_by_streams"], answer["nodes_by_rate"], answer["nodes"]) == (13, 5, 5)
    assert answer["threshold_streams_per_vm"] == 20.0 and answer["threshold_load_per_vm"] == 8.0
    assert answer["static"]["static_streams_per_vm"] is None


def test_size_defaults_to_static_when_static_cells_are_among_the_inputs(tmp_path):
    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    static = make_run(tmp_path / "st", "st", ["vm1"], SHORT)
    r = run("size", "--peak-streams", 256, "--slo", "A", "--results", serve, "--results", static, "-o", "json")
    data = json.loads(r.output)
    assert data["threshold"] == "static" and data["sizings"][0]["nodes"] == 16
    r = run("size", "--peak-streams", 256, "--slo", "A", "--results", serve, "--results", static,
            "--threshold", "serving", "-o", "json")
    data = json.loads(r.output)
    (answer,) = data["sizings"]
    assert data["threshold"] == "serving" and answer["nodes"] == 32
    assert answer["static"]["static_streams_per_vm"] == 16 and answer["static"]["ratio"] == 0.5
    r = run("size", "--peak-streams", 256, "--slo", "A", "--results", serve, "--results", static,
            "--threshold", "serving")
    assert ("  static crossover (static p90 of streams, serving 90 % attainment): 16 streams/VM; serving / static = "
            "0.50") in r.output.splitlines()
    # Judged at shares that differ, the two do not compare: no ratio, and the note says why.
    r = run("size", "--peak-streams", 256, "--slo", "A", "--results", serve, "--results", static,
            "--threshold", "serving", "--percentile", "p50", "-o", "json")
    (answer,) = json.loads(r.output)["sizings"]
    assert answer["static"]["ratio"] is None and answer["static"]["comparable"] is False
    assert answer["static"]["note"] == "no ratio: static p50 of streams, serving 90 % attainment do not compare"


def test_size_peak_rps_usage_errors(tmp_path):
    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    static = make_run(tmp_path / "st", "st", ["vm1"], SHORT)
    users = make_serve_run(tmp_path / "u", "u", ["vm1"], RAMP, kind="users")
    r = run("size", "--peak-rps", 40, "--threshold", "static", "--results", serve)
    assert r.exit_code == 2 and "--peak-rps sizes from the serving threshold of a rate load" in r.output
    r = run("size", "--peak-rps", 40, "--results", static)                      # default static
    assert r.exit_code == 2 and "--peak-rps" in r.output and "--threshold serving" in r.output
    r = run("size", "--peak-rps", 40, "--results", users)
    assert r.exit_code == 2 and "--peak-rps" in r.output and "needs the serving threshold of a rate load" \
        in r.output and "Traceback" not in r.output
    r = run("size", "--results", serve)
    assert r.exit_code == 2 and "Missing option '--peak-streams'" in r.output
    r = run("size", "--peak-streams", 10, "--threshold", "serving", "--results", static)
    assert r.exit_code == 2 and "no serving measurements among the inputs" in r.output
    r = run("size", "--peak-streams", 10, "--threshold", "serving", "--input-tokens", 512, "--results", serve)
    assert r.exit_code == 2 and "tested serving contexts: 128 in / 64 out" in r.output
    r = run("size", "--peak-streams", 10, "--threshold", "static", "--results", serve)
    assert r.exit_code == 2 and "(the inputs hold serving measurements: --threshold serving)" in r.output


def test_a_serving_run_swept_before_attainment_is_judged_by_it_and_says_so(tmp_path):
    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP)
    meta = json.loads((serve / "meta.json").read_text())
    del meta["matrix"]["serve"]["attainment"]
    (serve / "meta.json").write_text(json.dumps(meta))
    r = run("size", "--peak-streams", 256, "--slo", "B", "--results", serve)
    assert r.exit_code == 0, r.output
    assert ("note: run s was swept by p90 TTFT and p90 TPOT, each on its own, before attainment; its loads are "
            "judged here by 90 % of requests meet every limit") in r.output.splitlines()


def test_attainment_flag_rejudges_a_serving_run(tmp_path):
    def one_in_ten_late(r):            # at 2 req/s per rank, one request in ten misses TTFT
        if r.load == 2.0:
            r.ttft_s = [9.0 if i % 10 == 0 else v for i, v in enumerate(r.ttft_s)]
        return r

    serve = make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP, tweak=one_in_ten_late)
    at = {}
    for share in ("0.9", "0.95"):
        r = run("size", "--peak-streams", 256, "--slo", "B", "--results", serve, "--attainment", share, "-o", "json")
        (answer,) = json.loads(r.output)["sizings"]
        at[share] = (answer["attainment"], answer["threshold_load_per_vm"], answer["binding"])
    assert at == {"0.9": (0.9, 8.0, "TPOT and TTFT"), "0.95": (0.95, 4.0, "TTFT")}


def test_presets_are_named_with_their_source_in_help_and_judged_at_their_percentile(tmp_path):
    r = run("size", "--help")
    text = " ".join(r.output.split()).replace("- ", "-")          # help wraps at hyphens too
    assert "mlperf-server (MLPerf Inference (datacenter) Llama-3.1-8B Server scenario: TTFT 2 s, TPOT 100 ms " \
           "at p99)" in text
    assert "mlperf-interactive (MLPerf Inference (datacenter) Llama-3.1-8B Interactive scenario" in text
    static = make_run(tmp_path / "st", "st", ["vm1"], SHORT, repeats=2)
    r = run("size", "--peak-streams", 256, "--slo", "mlperf-server", "--results", static, "-o", "json")
    assert r.exit_code == 0, r.output
    (answer,) = json.loads(r.output)["sizings"]
    assert answer["percentile"] == "p99" and answer["slo"] == {"name": "mlperf-server", "tpot_ms": 100.0,
                                                               "ttft_s": 2.0, "percentile": "p99"}
    assert answer["status"] == "none"                   # the brief's 116 ms floor is above 100 ms
    r = run("size", "--peak-streams", 256, "--slo", "nope", "--results", static)
    assert r.exit_code == 2 and "known: A, B, mlperf-server, mlperf-interactive" in r.output


def test_report_and_size_of_two_models_answer_per_model(tmp_path):
    slower = {k: (ttft, tpot * 1.3, tps / 1.3) for k, (ttft, tpot, tps) in SHORT.items()}
    phi = make_run(tmp_path / "phi3", "phi3", ["vm1"], SHORT, model="synthetic:phi-3-mini")
    qwen = make_run(tmp_path / "qwen7b", "qwen7b", ["vm1"], slower, model="synthetic:qwen2.5-7b")
    r = run("report", phi, qwen, "--out", tmp_path / "out", "--slo", "B")
    assert r.exit_code == 0, r.output
    lines = [line.rstrip() for line in r.output.splitlines()]
    assert lines[1].startswith("model                 SLO    input tokens  threshold (streams/VM)")
    assert lines[3].startswith("synthetic:phi-3-mini  SLO-B  128           ≥ 64                    > 64")
    assert lines[4].startswith("synthetic:qwen2.5-7b  SLO-B  128           32 [32–<64]             64")
    assert (tmp_path / "out" / "fig-10-models.png").stat().st_size > 0
    out = run("size", "--peak-streams", 256, "--results", phi, "--results", qwen, "--slo", "B", "-o", "json")
    assert out.exit_code == 0, out.output
    got = [(s["model"], s["threshold_streams_per_vm"], s["nodes"]) for s in json.loads(out.stdout)["sizings"]]
    assert got == [("synthetic:phi-3-mini", 64, 4), ("synthetic:qwen2.5-7b", 32, 8)]
    text = run("size", "--peak-streams", 256, "--results", phi, "--results", qwen, "--slo", "B")
    assert text.exit_code == 0, text.output
    assert ("answer: synthetic:qwen2.5-7b, SLO-B, 128-token inputs, p90 of streams: 32 [32–<64] streams/VM → "
            "8 [5–8] nodes, binding TPOT") in text.stdout.splitlines()
