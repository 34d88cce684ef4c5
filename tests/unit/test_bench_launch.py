"""Cluster launch command lines (golden) and the pure poll/progress parsers."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from vcfslm import contract as C
from vcfslm.bench import launch as L
from vcfslm.bench.cluster import ClusterOptions, plan_launches
from vcfslm.guest_layout import layout_paths
from vcfslm.inventory_load import parse_inventory
from vcfslm.matrix import Matrix
from vcfslm.node_selection import NodeTarget, targets_of
from vcfslm.runspec import ProbeSpec, RunSpec

ROOT = Path(__file__).resolve().parents[2]


def spec_of(inv, nodes, run_id: str, **changes) -> RunSpec:
    return RunSpec.of_inventory(inv, [n.name for n in nodes], run_id, **changes)


def targets(inv):
    """Every node of the inventory as the launch plan takes it (the CLI's slice)."""
    return targets_of(inv, [n.name for n in inv.nodes])


@pytest.fixture
def inv():
    return parse_inventory((ROOT / "inventories" / "vx650v4-4node.yaml").read_text(), "brief.yaml")


def test_torchrun_lines_per_node_golden(inv):
    launches = plan_launches(targets(inv), spec_of(inv, inv.nodes, "r1"), ClusterOptions())
    assert [la.global_ranks for la in launches] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    argv = list(launches[2].torchrun_argv)
    assert argv == [
        "/opt/vcfslm/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "4", "--node-rank", "2",
        "--master-addr", "172.16.25.21", "--master-port", "29500", "--rdzv-conf", "timeout=621",
        "--max-restarts", "0",
        "--log-dir", "/opt/vcfslm/runs/r1/logs/slm-03/ranks", "--redirects", "3", "--tee", "3",
        "--no-python", "/opt/vcfslm/launch/rank.sh", "--",
        "--spec", "/opt/vcfslm/runs/r1/spec-slm-03.json", "--node", "slm-03"]
    job = launches[2].spec
    assert job.model == "microsoft/Phi-3-mini-128k-instruct"
    assert job.matrix.to_json() == ('{"batch_sizes": [1, 4, 8, 16], "input_tokens": [128, 512, 1024], '
                                    '"output_tokens": 128, "repeats": 3, "warmup": 1}')
    assert (job.out, job.run.run_id, job.nodes, job.run.threads, job.run.compile_mode, job.timeout_s) == (
        "/opt/vcfslm/runs/r1", "r1", 4, 24, "compile", 1800)
    # the launch line writes the node's spec where its ranks read it
    assert shlex.quote(job.to_json()) in launches[2].launch_command
    # every node rendezvous on node 0's bench IP, never the management network
    assert all("172.16.25.21" in la.torchrun_argv for la in launches)
    assert not any("192.168.10.21" in la.torchrun_argv for la in launches)


def test_the_plan_takes_targets_not_an_inventory():
    """Where a node is and what its guest holds come in its NodeTarget; what runs (model,
    ranks, threads) is the spec's, even where the inventory since says otherwise."""
    from vcfslm import topology

    slots = tuple(topology.rank_slots(8, 2, 2, 4))
    paths = layout_paths("/srv/w/", "/srv/w/venv", "/srv/w/vllm")
    nodes = (NodeTarget("a", "10.0.0.1", 2222, "10.1.0.1", 29600, paths, slots),
             NodeTarget("b", "10.0.0.2", 22, "10.1.0.2", 29600, paths, slots))
    spec = RunSpec(run_id="r", mode="cluster", model="./models/phi3", matrix=Matrix((1,), (16,), 4),
                   ranks=2, threads=4, nodes=("b",))
    [la] = plan_launches(nodes, spec, ClusterOptions())
    argv = list(la.torchrun_argv)
    assert (la.name, la.address, la.bench_ip, la.run_dir) == ("b", "10.0.0.2", "10.1.0.2", "/srv/w/runs/r")
    assert argv[:3] == ["/srv/w/venv/bin/python", "-m", "torch.distributed.run"]
    assert argv[argv.index("--master-addr") + 1:argv.index("--master-port") + 2] == ["10.1.0.2", "--master-port",
                                                                                    "29600"]
    assert la.placement == L.RankPlacement(4, slots) and la.global_ranks == (0, 1)
    assert la.spec.model == "/srv/w/models/phi3"
    with pytest.raises(ValueError, match="no target for node.s. c of run r"):
        plan_launches(nodes, spec.replaced(nodes=("a", "c")), ClusterOptions())


def test_options_reach_the_worker(inv):
    spec = spec_of(inv, inv.nodes[:1], "r2", scenarios="b=1",
                   matrix=Matrix.of_inventory(inv.bench, output_tokens=16, repeats=1))
    [la] = plan_launches(targets(inv), spec, ClusterOptions(resume=True))
    argv = list(la.torchrun_argv)
    matrix = la.spec.matrix
    assert matrix.repeats == 1 and matrix.output_tokens == 16
    assert la.spec.resume and la.spec.run.scenarios == "b=1"
    assert argv[argv.index("--nnodes") + 1] == "1"


def test_shell_snippets_parse(inv):
    la = plan_launches(targets(inv), spec_of(inv, inv.nodes, "r1"), ClusterOptions())[0]
    for cmd in (la.launch_command, L.poll_command(la, 10), L.stop_command(la), L.lock_command(la, "r1"),
                L.unlock_command(la)):
        subprocess.run(["bash", "-n", "-c", cmd], check=True)
    assert "setsid nohup bash -c" in la.launch_command
    assert "export VCFSLM_PID_DIR=/opt/vcfslm/runs/r1/pids" in shlex.split(la.launch_command)[-1] or \
        "VCFSLM_PID_DIR" in la.launch_command


def test_detached_run_records_pid_and_exit(tmp_path):
    """The launch snippet really detaches, records its pid, and writes the exit code."""
    run = tmp_path / "run"
    la = L.NodeLaunch(0, "n1", "127.0.0.1", "127.0.0.1", str(run), "", (0,))
    cmd = L.detached(["bash", "-c", "echo hello; exit 3"], run_dir=str(run), pid_file=la.pid_file,
                     exit_file=la.exit_file, log_file=la.log_file)
    pid = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout.strip()
    assert pid.isdigit()
    for _ in range(100):
        out = subprocess.run(["bash", "-c", L.poll_command(la, 0)], capture_output=True, text=True).stdout
        if out.startswith("EXIT"):
            break
        subprocess.run(["sleep", "0.05"])
    assert L.parse_poll(out) == ("exited", 3, "hello\n")


def test_stop_kills_group_and_pid_files(tmp_path):
    run = tmp_path / "run"
    la = L.NodeLaunch(0, "n1", "127.0.0.1", "127.0.0.1", str(run), "", (0,))
    # a "worker" in its own session, as torchrun starts them, recorded in the pid file
    script = f"setsid sleep 300 & echo $! > {run}/pids/rank-0.pid; sleep 300"
    cmd = L.detached(["bash", "-c", script], run_dir=str(run), pid_file=la.pid_file,
                     exit_file=la.exit_file, log_file=la.log_file)
    subprocess.run(["bash", "-c", cmd], check=True, capture_output=True)
    for _ in range(100):
        if (run / "pids" / "rank-0.pid").exists():
            break
        subprocess.run(["sleep", "0.05"])
    pids = [int((run / "node-n1.pid").read_text()), int((run / "pids" / "rank-0.pid").read_text())]
    subprocess.run(["bash", "-c", L.stop_command(la, grace_s=2)], check=True)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_lock_is_exclusive_and_stale_lock_taken_over(tmp_path):
    la = L.NodeLaunch(0, "n1", "127.0.0.1", "127.0.0.1", str(tmp_path / "runs" / "a"), "", (0,))
    sh = lambda c: subprocess.run(["bash", "-c", c], capture_output=True, text=True).stdout.strip()  # noqa: E731
    assert sh(L.lock_command(la, "a")) == "LOCKED"
    Path(la.lock_dir, "pid").write_text(str(subprocess.Popen(["sleep", "30"]).pid))
    assert sh(L.lock_command(la, "b")) == "HELD a"
    Path(la.lock_dir, "pid").write_text("999999")  # dead pid: stale
    assert sh(L.lock_command(la, "c")) == "LOCKED"
    sh(L.unlock_command(la))
    assert not Path(la.lock_dir).exists()


@pytest.mark.parametrize(("line", "expected"), [
    ("[default3]:hello", (3, "hello")),
    ("[12]:x", (12, "x")),
    ("plain", (None, "plain")),
])
def test_split_rank_line(line, expected):
    assert L.split_rank_line(line) == expected


def test_parse_poll():
    assert L.parse_poll("RUNNING\nabc\n") == ("running", None, "abc\n")
    assert L.parse_poll("EXIT 0\n") == ("exited", 0, "")
    assert L.parse_poll("GONE\n") == ("gone", None, "")


def test_rendezvous_timeout_grows_with_the_cluster():
    one, sixteen, big = (C.rendezvous_timeout_s(1, 2), C.rendezvous_timeout_s(16, 1),
                         C.rendezvous_timeout_s(64, 4))
    # never below torch's own static-rendezvous default, and growing with nodes and ranks
    assert C.RDZV_BASE_S <= one < sixteen < big
    assert C.rendezvous_timeout_s(64, 1) < big
    assert (one, sixteen, big) == (606, 681, 1052)
    assert all(isinstance(v, int) for v in (one, sixteen, big))
    # the workers' group waits at least as long, and never less than a collective may take
    assert C.process_group_timeout_s(1, 2) == C.COLLECTIVE_TIMEOUT_S
    assert C.process_group_timeout_s(512, 4) == C.rendezvous_timeout_s(512, 4) > C.COLLECTIVE_TIMEOUT_S


def test_rendezvous_timeout_reaches_torchrun_and_the_workers(inv, monkeypatch):
    """The installed torchrun reads --rdzv-conf timeout= into its static rendezvous."""
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launches = plan_launches(targets(inv), spec_of(inv, inv.nodes, "r1", probe=ProbeSpec.of_flags(0)), ClusterOptions())
    argv = list(launches[1].torchrun_argv)
    assert launches[1].spec.timeout_s == C.process_group_timeout_s(4, 4)
    assert not launches[1].spec.run.probe.enabled
    args = get_args_parser().parse_args(argv[3:])
    config, _, _ = config_from_args(args)
    assert config.rdzv_backend == "static"
    assert int(config.rdzv_configs["timeout"]) == C.rendezvous_timeout_s(4, 4)
    assert config.rdzv_configs["rank"] == 1


def test_launch_records_the_pid_in_the_lock_in_the_same_round_trip(tmp_path):
    run = tmp_path / "runs" / "r"
    la = L.NodeLaunch(0, "n1", "127.0.0.1", "127.0.0.1", str(run), "", (0,))
    subprocess.run(["bash", "-c", L.lock_command(la, "r")], check=True, capture_output=True)
    cmd = L.detached(["true"], run_dir=str(run), pid_file=la.pid_file, exit_file=la.exit_file,
                     log_file=la.log_file, pid_copy=f"{la.lock_dir}/pid")
    pid = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout.strip()
    assert pid.isdigit() and Path(la.lock_dir, "pid").read_text().strip() == pid


def test_torchrun_console_is_unbuffered(inv):
    """torchrun's console goes to a file the operator tails: block buffering would hold
    the ranks' progress back until the run ends."""
    la = plan_launches(targets(inv), spec_of(inv, inv.nodes, "r1"), ClusterOptions())[0]
    assert "export PYTHONUNBUFFERED=1;" in la.launch_command


def test_each_launch_is_built_once_with_its_files_placement_and_rendezvous(inv):
    launches = plan_launches(targets(inv), spec_of(inv, inv.nodes, "r1"), ClusterOptions())
    for la in launches:
        files = L.NodeFiles(la.run_dir, la.name)
        # the launch line names the files the launch itself polls, stops and unlocks by
        for path in (files.pid_file, files.exit_file, files.log_file, f"{files.lock_dir}/pid"):
            assert shlex.quote(path) in la.launch_command
        assert (la.pid_file, la.exit_file, la.log_file, la.lock_dir) == \
            (files.pid_file, files.exit_file, files.log_file, files.lock_dir)
        assert la.placement == L.RankPlacement(24, tuple(inv.rank_slots()))
        assert la.rdzv_timeout_s == C.rendezvous_timeout_s(4, 4) == 621
        assert la.spec.run.threads == la.placement.threads


def test_the_worker_reads_the_matrix_the_launcher_wrote(inv, tmp_path):
    from vcfslm.bench.worker import parse_args

    spec = spec_of(inv, inv.nodes[:1], "r1", matrix=Matrix.of_inventory(inv.bench, output_tokens=32, repeats=2))
    [la] = plan_launches(targets(inv), spec, ClusterOptions())
    argv = list(la.torchrun_argv)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(la.spec.to_json())
    worker_argv = argv[argv.index("--no-python") + 2:]
    assert worker_argv[:3] == ["--", "--spec", la.files.spec_file]
    worker_argv[2] = str(spec_file)
    parsed = parse_args(worker_argv)
    assert parsed.spec.matrix == Matrix((1, 4, 8, 16), (128, 512, 1024), 32, warmup=1, repeats=2)
    assert parsed.spec == la.spec and parsed.node == la.name


# ------------------------------------------------------------------ rank.sh's placement


def rendered(threads: int, slots) -> str:
    from vcfslm.guest.templates import render_template

    return render_template("rank.sh.j2", {"python": "/v/bin/python", "threads_per_rank": threads,
                                          "inductor_cache_dir": "/c", "use_numactl": True, "rank_slots": slots,
                                          "env_file": ""})


def test_a_rendered_rank_script_reads_back_as_its_placement(inv):
    from vcfslm.bench.local import plan_ranks
    from vcfslm.guest.templates import render_template

    slots = tuple(inv.rank_slots())
    assert L.parse_rank_script(rendered(24, slots)) == L.RankPlacement(24, slots)
    # the local run's context (dicts with a cpu string) renders the same arms
    ranks = plan_ranks({0: (0, 1), 1: (2, 3)}, ranks=2, threads=1)
    text = render_template("rank.sh.j2", {"python": "/p", "threads_per_rank": 1, "inductor_cache_dir": "/c",
                                          "use_numactl": False, "ranks": ranks, "env_file": ""})
    assert [(s.local_rank, s.numa_node, s.cpus, s.bind) for s in L.parse_rank_script(text).slots] == \
        [(0, 0, (0,), "cpus"), (1, 1, (2,), "cpus")]
    assert L.parse_rank_script("#!/bin/sh\n") == L.RankPlacement(None, ())


def test_placement_mismatches_name_the_rank_and_both_values(inv):
    from vcfslm.topology import RankSlot

    want = L.RankPlacement(24, tuple(inv.rank_slots()))
    assert L.placement_mismatches(want, want, (4, 5, 6, 7), "/l/rank.sh") == []
    swapped = (RankSlot(0, 1, tuple(range(24, 48)), "node"), RankSlot(1, 0, tuple(range(24)), "node"))
    got = L.placement_mismatches(L.RankPlacement(None, swapped), want, (4, 5, 6, 7), "/l/rank.sh")
    fix = "(re-render it: vcfslm provision --stage guests)"
    assert got == [
        f"/l/rank.sh runs no threads per rank (OMP_NUM_THREADS), the launch 24 (bench.threads_per_rank) {fix}",
        f"/l/rank.sh puts local rank 0 (rank 4) on NUMA node 1, the launch on NUMA node 0 {fix}",
        f"/l/rank.sh puts local rank 0 (rank 4) on CPUs 24-47, the launch on CPUs 0-23 {fix}",
        f"/l/rank.sh puts local rank 1 (rank 5) on NUMA node 0, the launch on NUMA node 1 {fix}",
        f"/l/rank.sh puts local rank 1 (rank 5) on CPUs 0-23, the launch on CPUs 24-47 {fix}",
        f"/l/rank.sh has no placement for local rank 2 (rank 6); the launch starts 4 rank(s) per node {fix}",
        f"/l/rank.sh has no placement for local rank 3 (rank 7); the launch starts 4 rank(s) per node {fix}"]
