"""`vcfslm report` and `vcfslm size` through click: files, answers, exit codes, clear errors."""

from __future__ import annotations

import json

from click.testing import CliRunner
from test_analysis_support import BRIEF_SHAPED, brief_shaped_csv, make_run

from vcfslm.cli import main
from vcfslm.cli.report import COMMANDS, report, size

# batch per rank -> (TTFT s, TPOT ms, rank t/s) at 128 input tokens: SLO-A threshold 16, SLO-B >= 64
SHORT = {(streams // 4, 128): v for (inp, streams), v in BRIEF_SHAPED.items() if inp == 128}


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
    assert lines[:5] == [
        "Single-VM threshold and nodes per SLO and input length (p50)",
        "SLO    input tokens  threshold (streams/VM)  first failing (streams/VM)  binding  nodes for 256 streams",
        "-----  ------------  ----------------------  --------------------------  -------  ---------------------",
        "SLO-A  128           16                      32                          TPOT     16",
        "SLO-B  128           ≥ 64                    > 64                        –        ≤ 4"]
    assert "SLOs: SLO-A (TPOT ≤ 130 ms, TTFT ≤ 3 s); SLO-B (TPOT ≤ 200 ms, TTFT ≤ 5 s). Percentile judged: p50." \
        in lines
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
    assert "SLO-gold  128           4                       16                          TPOT     64" \
        in r.output.splitlines()
    r = run("report", run_dir, "--slo", "tight:tpot<=110ms", "--percentile", "p99", "--peak-streams", 256,
            "--peak-streams", 1000)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "Single-VM threshold and nodes per SLO and input length (p99)"
    assert lines[3] == ("SLO-tight  128           none                    4                           TPOT     "
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
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hand-report" / "report.html").exists()


def test_size_reproduces_the_briefs_worked_example(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(brief_shaped_csv())
    r = run("size", "--peak-streams", 256, "--slo", "B", "--input-tokens", 128, "--results", path)
    assert r.exit_code == 0, r.output
    assert "nodes: 4" in r.output and "ceil(256 / 64)" in r.output
    r = run("size", "--peak-streams", 256, "--slo", "A", "--input-tokens", 128, "--results", path,
            "--output", "json")
    data = json.loads(r.output)
    (answer,) = data["sizings"]
    assert answer["nodes"] == 16 and answer["threshold_streams_per_vm"] == 16 and answer["binding"] == "TPOT"


def test_size_without_slo_gives_every_slo_and_context(tmp_path):
    path = tmp_path / "hand.csv"
    path.write_text(brief_shaped_csv())
    r = run("size", "--peak-streams", 256, "--results", path, "--output", "json", "--headroom", "0.1")
    data = json.loads(r.output)
    got = {(s["slo"]["name"], s["input_tokens"]): s["nodes"] for s in data["sizings"]}
    assert got == {("A", 128): 18, ("A", 512): 72, ("A", 1024): 72,
                   ("B", 128): 5, ("B", 512): 9, ("B", 1024): 18}
    r = run("size", "--peak-streams", 256, "--results", path, "--headroom", "0.1")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "Single-VM threshold and nodes per SLO and input length (p50, headroom 10%)" in lines
    assert "SLO-B  128           ≥ 64                    > 64                        –              ≤ 5" in lines


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
    r = run("size", "--peak-streams", 10, "--percentile", "p90", "--results", path)
    assert r.exit_code == 2 and "p90 values are unknown" in r.output
