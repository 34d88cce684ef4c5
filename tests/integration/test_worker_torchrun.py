"""The rank worker under a real torchrun (2 ranks, gloo, the tiny model): barrier-aligned
windows, resume after a killed rank, and `vcfslm bench --local` end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vcfslm import results
from vcfslm.bench.launch import NodeFiles, worker_args
from vcfslm.matrix import Matrix
from vcfslm.runspec import ProbeSpec, RunSpec, WorkerSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("torch")
pytest.importorskip("transformers")

PREFIX = "VCFSLM-PROGRESS "


def torchrun(out: Path, *, resume: bool = False, scenarios_b=("1", "2"), env_extra=None,
             probe: bool = True) -> subprocess.Popen:
    """Two worker ranks on this machine, one thread each, the eager decode step (fast to start);
    probe=False: no rank probes (a test that reads no probe figure saves both ranks' GEMM probe).
    The ranks read their node's worker spec, written where a launch writes it."""
    matrix = Matrix(tuple(int(b) for b in scenarios_b), (8,), 5, warmup=1, repeats=2)
    run = RunSpec(run_id="t", mode="local", model="synthetic:tiny", matrix=matrix, compile_mode="eager",
                  ranks=2, threads=1, nodes=("local",),
                  probe=ProbeSpec(mib=32) if probe else ProbeSpec(enabled=False))
    spec_file = Path(NodeFiles(str(out), "local").spec_file)
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(WorkerSpec(run=run, out=str(out), model=run.model, nodes=1, resume=resume).to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "vcfslm.bench.worker", "--", *worker_args(str(spec_file), "local")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def events(lines):
    return [json.loads(line[line.index(PREFIX) + len(PREFIX):]) for line in lines if PREFIX in line]


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, list[str]]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return proc.returncode, out.splitlines()


def test_windows_start_together_and_a_failed_numerics_gate_invalidates_that_rank_only(tmp_path):
    # Rank 1 reaches every barrier 0.4 s late (only a working barrier keeps the skew small),
    # and its numerics gate fails: its windows are measured, aligned and marked invalid.
    rc, lines = finish(torchrun(tmp_path, env_extra={"VCFSLM_FAULT_DELAY": "1:0.4",
                                                     "VCFSLM_FAULT_NUMERICS": "1:0.5"}))
    assert rc == 0, "\n".join(lines[-30:])
    recs = results.read_records(tmp_path / "results.jsonl")
    assert {(r.rank, r.batch_per_rank, r.window) for r in recs} == {
        (rank, b, w) for rank in (0, 1) for b in (1, 2) for w in (0, 1)}
    assert all(r.world_size == 2 for r in recs)
    assert max(r.start_skew_s for r in recs) < 0.2, [r.start_skew_s for r in recs]
    assert min(r.start_skew_s for r in recs) == 0.0  # the earliest rank defines the origin
    assert all(len(r.ttft_s) == r.batch_per_rank and r.roofline_tpot_ms > 0 for r in recs)
    assert all(r.valid for r in recs if r.rank == 0)
    bad = [r for r in recs if r.rank == 1]
    assert bad and all(not r.valid and r.invalid_reasons[0].startswith("numerics gate: ") for r in bad)
    facts = {f["rank"]: f for f in json.loads((tmp_path / "ranks.json").read_text())}
    assert sorted(facts) == [0, 1] and facts[0]["probe"]["read_gbs"] > 0
    assert facts[0]["numerics"]["passed"] and not facts[1]["numerics"]["passed"]
    assert facts[0]["pack"]["linears"] == 9
    gated = {(e["rank"], e["passed"]) for e in events(lines) if e["phase"] == "gated"}
    assert gated == {(0, True), (1, False)}
    phases = {(e["rank"], e["phase"]) for e in events(lines)}
    assert {(0, "warmup"), (1, "measure"), (0, "done"), (1, "finished")} <= phases
    # the TTFT floor comes from the GEMM probe, the steady footprint from each window's end
    assert all(r.roofline_ttft_s and r.roofline_ttft_s > 0 and r.rss_bytes > 0 for r in recs)
    # each rank appended its own records as windows ended
    assert len(results.read_records(tmp_path / "ranks" / "rank-1.jsonl")) == 4


def test_a_failed_gate_of_one_shape_invalidates_that_shapes_windows_only(tmp_path):
    # rank 0's step at 2 tokens (the batch-2 decode graph) is wrong; its batch-1 graph is not
    rc, lines = finish(torchrun(tmp_path, env_extra={"VCFSLM_FAULT_NUMERICS": "0:0.5:2"}, probe=False))
    assert rc == 0, "\n".join(lines[-30:])
    recs = results.read_records(tmp_path / "results.jsonl")
    bad = {(r.rank, r.batch_per_rank) for r in recs if not r.valid}
    assert bad == {(0, 2)}
    assert all(r.invalid_reasons[0].startswith("numerics gate: static 2x8: ") for r in recs if not r.valid)
    facts = {f["rank"]: f["numerics"] for f in json.loads((tmp_path / "ranks.json").read_text())}
    assert facts[1]["passed"] and not facts[0]["passed"] and facts[0]["failed"] == ["static 2x8"]
    gated = sorted((e["rank"], e["graph"], e["passed"]) for e in events(lines) if e["phase"] == "gated")
    assert gated == [(0, "static 1x8", True), (0, "static 2x8", False), (1, "static 1x8", True),
                     (1, "static 2x8", True)]


def test_resume_after_a_killed_rank(tmp_path):
    proc = torchrun(tmp_path, probe=False)
    seen, done_first, pids = [], set(), {}
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        for e in events([line]):
            if e["phase"] == "start":
                pids[e["rank"]] = e["pid"]
            if e["phase"] == "done" and e["scenario"] == 1:
                done_first.add(e["rank"])
        if done_first == {0, 1}:
            os.kill(pids[1], signal.SIGKILL)  # rank 1 dies in scenario 2
            break
    rc, rest = finish(proc)
    assert rc != 0, "torchrun should fail when a rank is killed"
    assert not (tmp_path / "results.jsonl").exists()
    partial = results.read_records(tmp_path / "ranks" / "rank-1.jsonl")
    assert {r.batch_per_rank for r in partial} == {1}

    rc, lines = finish(torchrun(tmp_path, resume=True, probe=False))
    assert rc == 0, "\n".join(lines[-30:])
    ev = events(lines)
    assert {(e["rank"], e["scenario"]) for e in ev if e["phase"] == "skip"} == {(0, 1), (1, 1)}
    recs = results.read_records(tmp_path / "results.jsonl")
    keys = [(r.rank, r.batch_per_rank, r.window) for r in recs]
    assert sorted(keys) == sorted({(rank, b, w) for rank in (0, 1) for b in (1, 2) for w in (0, 1)})


def test_bench_local_end_to_end(tmp_path):
    from click.testing import CliRunner

    from vcfslm.cli import main

    started = time.monotonic()
    result = CliRunner().invoke(main, [
        "bench", "--local", "--model", "synthetic:tiny", "--ranks", "2", "--batch-sizes", "1,2",
        "--input-tokens", "8", "--output-tokens", "5", "--warmup", "1", "--repeats", "2",
        "--compile", "default", "--probe-mib", "32", "--runs-dir", str(tmp_path), "--run-id", "e2e"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "e2e"
    meta, recs = results.load_run(run)
    assert meta.complete and meta.mode == "local" and meta.ranks_per_node == 2
    assert {r.rank for r in recs} == {0, 1} and len(recs) == 8
    assert all(r.placement["compile_mode"] == "compile" and r.placement["measurement_mode"] for r in recs)
    assert all(r.placement["problems"] == [] for r in recs)
    assert (run / "results.csv").exists() and (run / "launch" / "rank.sh").exists()
    assert (run / "logs" / "local" / "torchrun.log").exists()
    assert meta.probe["local"]["0"]["read_gbs"] > 0
    assert set(meta.ranks) == {"0", "1"} and all(f["numerics"]["passed"] for f in meta.ranks.values())
    if len(os.sched_getaffinity(0)) >= 2:
        affinities = {r.rank: r.placement["cpu_affinity"] for r in recs}
        assert affinities[0] != affinities[1]  # each rank pinned to its own CPU
    assert "TPOT" in result.output and "next: vcfslm report" in result.output
    assert time.monotonic() - started < 300


def _vcfslm_bench(runs: Path, run_id: str, *extra: str, verbose: bool = False) -> subprocess.CompletedProcess:
    """`vcfslm bench --local` with stdout and stderr pipes (as under `| cat` or in CI), 40 columns."""
    return subprocess.run(
        [sys.executable, "-m", "vcfslm.cli", *(["-v"] if verbose else []), "bench", "--local",
         "--model", "synthetic:tiny", "--batch-sizes", "1,2", "--input-tokens", "8", "--output-tokens", "5",
         "--warmup", "1", "--repeats", "2", "--compile", "eager", "--no-probe", "--runs-dir", str(runs),
         "--run-id", run_id, *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "40"})


def test_bench_local_output_is_whole_lines_in_a_pipe(tmp_path):
    runs = tmp_path.joinpath(*["a-long-folder-name-for-the-runs"] * 5)
    done = _vcfslm_bench(runs, "pipe")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert "…" not in done.stdout and f"run dir: {runs / 'pipe'}" in out
    # the report's results table for this run, one markdown row per cell
    header = next(line for line in out if line.startswith("| input tokens | batch/rank |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in out if line.startswith("|") and line != header and "---" not in line]
    cells = [dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True)) for row in rows]
    assert [(c["input tokens"], c["batch/rank"], c["streams/VM"]) for c in cells] == [("8", "1", "1"), ("8", "2", "2")]
    for c in cells:
        # every figure whole (validity is the engine's business, not the output's)
        assert c["windows"] in ("0/2", "1/2", "2/2")
        assert all(float(c[k]) >= 0 for k in ("TTFT p50 (s)", "TPOT p50 (ms)", "rank throughput p50 (t/s)"))
    err = done.stderr.splitlines()
    assert [line.split(",")[0] for line in err if line.startswith("bench: ")] == [
        "bench: scenario 1/2 (batch 1", "bench: scenario 2/2 (batch 2", "bench: finished"]
    assert any(line.startswith("bench: finished, 6/6 windows, 100%, done in ") for line in err)
    assert not any(line.startswith("rank 0:") for line in err)  # per-rank lines need -v


def test_bench_local_verbose_shows_each_rank_and_json_is_machine_checked(tmp_path):
    loud = _vcfslm_bench(tmp_path, "loud", verbose=True)
    assert loud.returncode == 0, loud.stderr
    ranks = [line for line in loud.stderr.splitlines() if line.startswith("rank 0: scenario 2/2 b=2 in=8: measure 1")]
    assert len(ranks) == 1 and " TPOT " in ranks[0] and " tok/s" in ranks[0]  # one record, one line
    done = _vcfslm_bench(tmp_path, "json", "--output", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["complete"] and [(s["batch_per_rank"], s["input_tokens"]) for s in data["scenarios"]] == \
        [(1, 8), (2, 8)]


def test_bench_local_serving_sweep_bisects_between_a_passing_and_a_failing_rate(tmp_path):
    """One rank serves 5 requests/s (meets every SLO) and 5000/s (meets none: the queue grows
    past the window's cutoff), then the sweep measures a load between them for each SLO.

    The SLOs are generous: the brief's (TTFT 3 s) can fail 5 requests/s of a 2 s window when
    the suite's other processes starve this rank for a few seconds, and a sweep stops where
    every SLO fails. Requests left unfinished at the cutoff miss any limit, so 5000/s fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "vcfslm.cli", "bench", "--local", "--model", "synthetic:tiny", "--threads", "1",
         "--slo", "A:tpot<=2000ms,ttft<=30s", "--slo", "B:tpot<=4000ms,ttft<=60s",
         "--serve", "--rates", "5,5000", "--sweep", "--sweep-steps", "1", "--sweep-budget", "8", "--slots", "2",
         "--input-tokens", "8",
         "--output-tokens", "5", "--duration", "2", "--warmup-s", "0.25", "--cooldown-s", "0.25", "--repeats", "1",
         "--compile", "eager", "--no-probe", "--runs-dir", str(tmp_path), "--run-id", "sweep", "-o", "json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "40"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = results.read_run(tmp_path / "sweep")
    assert run.meta.complete and not run.records and run.meta.matrix["serve"]["sweep"] is True
    loads = sorted({r.load for r in run.serve_records})
    assert loads[0] == 5.0 and loads[-1] == 5000.0 and any(5.0 < v < 5000.0 for v in loads), loads
    served = json.loads(proc.stdout)["serving"]
    rows = {row["load_per_rank"]: row for row in served["points"]}
    assert rows[5000.0]["unfinished"] > 0 and rows[5.0]["unfinished"] == 0
    # every SLO: 5/s passes, 5000/s fails, so each threshold lies between them
    answers = {t["slo"]["name"]: t for t in served["answer"]}
    assert set(answers) == {"A", "B"}, served["answer"]
    for t in answers.values():
        assert t["status"] == "threshold", t
        assert 5.0 <= t["threshold_load_per_rank"] < t["first_failing_load_per_rank"] <= 5000.0, t
    overloaded = next(r for r in run.serve_records if r.load == 5000.0)
    assert overloaded.max_queue > 100 and overloaded.mean_active > 1.5   # both slots busy throughout
    # Once bisected, the sweep refines: its interval reaches up to the first failing load, so
    # while the gap is wide it tries new loads inside it (each an extra window the budget counts,
    # kept short here). It says for each SLO what stopped it (precision, or the budget), and the
    # run keeps it.
    stops = run.meta.ranks["0"]["sweep"]
    assert [(s["slo"], s["input_tokens"]) for s in stops] == [("A", 8), ("B", 8)], stops
    assert all("within 25% of the threshold" in s["reason"] or "budget of 8 s spent" in s["reason"]
               for s in stops), stops
    assert len(loads) > 3 and any(r.window >= 1 and r.load not in (5.0, 5000.0) for r in run.serve_records)
