"""`vcfslm bench --nodes N` on the lab: real sshd guests, real torchrun, synthetic:tiny.

Lab guests share this machine, so the remote run folders are visible here too: the
dead-rank test reads a rank's pid file and kills that worker like a crash would. The
complete 1-node (compiled) and 4-node runs are the README walkthrough's own
(tests/integration/test_e2e_readme.py), checked there with the same assert_complete.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_checks import assert_complete, run_processes

from vcfslm.contract import process_group_timeout_s, rendezvous_timeout_s
from vcfslm.results import load_run, read_run

pytestmark = pytest.mark.integration

VCFSLM = [sys.executable, "-m", "vcfslm.cli"]
# No check here reads a rank probe (four ranks' probes on two cores were a third of a run
# before its first window): the benches run without them.


def bench(lab, *args, timeout=600):
    env = {**os.environ, **lab.env, "VCFSLM_STATE": str(lab.dir / "state.json")}
    return subprocess.run([*VCFSLM, "bench", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_dry_run_prints_each_nodes_command(provisioned_lab, tmp_path):
    proc = bench(provisioned_lab, "--nodes", "4", "--dry-run", "--output", "json", "--runs-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    plans = json.loads(proc.stdout)
    inv = provisioned_lab.load_inventory()
    assert [p["node"] for p in plans] == [n.name for n in inv.nodes]
    master = str(inv.nodes[0].bench_ip)
    for i, p in enumerate(plans):
        argv = p["torchrun"]
        assert argv[argv.index("--node-rank") + 1] == str(i)
        assert argv[argv.index("--master-addr") + 1] == master
        # the rendezvous budget of a 4-node run, for torchrun and for the workers' group
        assert argv[argv.index("--rdzv-conf") + 1] == f"timeout={rendezvous_timeout_s(4, inv.bench.ranks_per_node)}"
        # the workers' group timeout is in the node's worker spec, which the launch line writes
        assert p["spec"]["timeout_s"] == process_group_timeout_s(4, inv.bench.ranks_per_node)
        assert argv[-4:] == ["--spec", f"{p['run_dir']}/spec-{p['node']}.json", "--node", p["node"]]
        assert p["spec"]["out"] == p["run_dir"] and p["spec"]["nodes"] == 4
    assert not list(tmp_path.iterdir())  # nothing launched, nothing written


def test_dead_rank_stops_everything_and_resume_completes(provisioned_lab, tmp_path):
    inv = provisioned_lab.load_inventory()
    remote = Path(inv.guest.workdir) / "runs" / "t-dead"
    env = {**os.environ, **provisioned_lab.env, "VCFSLM_STATE": str(provisioned_lab.dir / "state.json")}
    proc = subprocess.Popen([*VCFSLM, "bench", "--nodes", "2", "--run-id", "t-dead", "--runs-dir", str(tmp_path),
                             "--repeats", "2", "--timeout", "300", "--compile", "eager", "--no-probe"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = remote / "ranks" / "rank-0.jsonl"
        deadline = time.monotonic() + 240
        # wait until the first scenario is finished on rank 0 (2 windows), then kill rank 3
        while time.monotonic() < deadline and proc.poll() is None:
            if first.exists() and len(first.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        victim = int((remote / "pids" / "rank-3.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "incomplete" in err and "--resume t-dead" in err
    assert "slm-02" in err  # the node whose rank died is named
    time.sleep(0.5)
    assert not run_processes("t-dead")
    meta, kept = load_run(tmp_path / "t-dead")
    assert not meta.complete and meta.failure
    assert kept, "finished windows must be kept"
    again = bench(provisioned_lab, "--resume", "t-dead", "--runs-dir", str(tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert_complete(tmp_path / "t-dead", 2, inv.bench.ranks_per_node,
                    len(inv.bench.batch_sizes) * len(inv.bench.input_tokens), 2)
    assert not run_processes("t-dead")


SERVE = ["--serve", "--rates", "4,8", "--slots", "2", "--duration", "2", "--warmup-s", "0.25",
         "--cooldown-s", "0.25", "--repeats", "1", "--compile", "eager", "--no-probe"]


def test_serving_run_survives_a_dead_rank_and_resume_completes(provisioned_lab, tmp_path):
    """2 nodes x 2 ranks serve two loads per context; rank 3 dies after the first window,
    everything stops cleanly, the finished windows stay, --resume measures the rest."""
    inv = provisioned_lab.load_inventory()
    remote = Path(inv.guest.workdir) / "runs" / "t-serve"
    env = {**os.environ, **provisioned_lab.env, "VCFSLM_STATE": str(provisioned_lab.dir / "state.json")}
    proc = subprocess.Popen([*VCFSLM, "bench", "--nodes", "2", "--run-id", "t-serve", "--runs-dir", str(tmp_path),
                             "--timeout", "300", *SERVE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        first = remote / "ranks" / "serve-0.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if first.exists() and len(first.read_text().splitlines()) >= 1:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        os.kill(int((remote / "pids" / "rank-3.pid").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "incomplete" in err and "--resume t-serve" in err
    time.sleep(0.5)
    assert not run_processes("t-serve")
    run = read_run(tmp_path / "t-serve", require_records=False)
    assert not run.meta.complete and run.meta.failure
    kept = {(r.rank, r.scenario) for r in run.serve_records}
    assert kept, "finished serving windows must be kept"

    again = bench(provisioned_lab, "--resume", "t-serve", "--runs-dir", str(tmp_path), "--output", "json",
                  "--no-probe")
    assert again.returncode == 0, again.stdout + again.stderr
    run = read_run(tmp_path / "t-serve")
    assert run.meta.complete and run.meta.matrix["serve"]["loads"] == [4.0, 8.0]
    got = {(r.rank, r.input_tokens, r.load) for r in run.serve_records}
    assert got == {(rank, i, load) for rank in range(4) for i in inv.bench.input_tokens for load in (4.0, 8.0)}
    assert kept <= {(r.rank, r.scenario) for r in run.serve_records}   # resumed, not re-measured
    for r in run.serve_records:
        assert r.slots == 2 and r.arrival == "poisson" and r.offered == r.completed + r.unfinished
        assert len(r.ttft_s) == len(r.tpot_ms) == r.completed and all(t > 0 for t in r.ttft_s)
        assert r.ranks_per_node == 2 and r.nodes == 2 and r.node in ("slm-01", "slm-02")
    assert len({r.seed for r in run.serve_records}) == len(run.serve_records)  # independent arrivals per rank
    points = json.loads(again.stdout)["serving"]["points"]
    assert {(p["input_tokens"], p["load_per_rank"]) for p in points if p["scope"] == "cluster"} == {
        (i, load) for i in inv.bench.input_tokens for load in (4.0, 8.0)}
    assert not run_processes("t-serve")
