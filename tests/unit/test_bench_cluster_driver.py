"""ClusterBench over scripted transports: success, a failed node, a dropped connection,
a timeout, a held lock — every failure stops every node and keeps what finished."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vcfslm import __version__
from vcfslm.bench import launch as L
from vcfslm.bench.cluster import ClusterBench, ClusterOptions
from vcfslm.errors import BenchError
from vcfslm.guest.fake import FakeTransport
from vcfslm.inventory_load import parse_inventory
from vcfslm.node_selection import targets_of
from vcfslm.results import WindowRecord, load_run
from vcfslm.runspec import RunSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inv():
    return parse_inventory((ROOT / "inventories" / "vx650v4-4node.yaml").read_text(), "brief.yaml")


def record(rank: int, node: str, batch: int = 1, window: int = 0) -> str:
    return WindowRecord(run_id="r", node=node, node_rank=rank // 4, rank=rank, local_rank=rank % 4,
                        world_size=8, ranks_per_node=4, nodes=2, batch_per_rank=batch, input_tokens=128,
                        output_tokens=128, window=window, start_skew_s=0.001, wall_s=2.0,
                        generated_tokens=128 * batch, rank_tps=64.0 * batch, ttft_s=[0.1] * batch,
                        tpot_ms=[15.0] * batch, e2e_s=[2.0] * batch).to_json() + "\n"


def scripted(name: str, polls: list[str], *, lock: str = "LOCKED", ranks=range(4)) -> FakeTransport:
    """A node whose preflight passes, whose launch prints a pid, and whose polls follow `polls`."""
    t = FakeTransport(name)
    t.add(re.compile(r"test -x .*rank\.sh.*"), f"VERSION {__version__}\n")
    t.add(re.compile(r"mkdir -p \S+/\.\. && if mkdir .*\.lock-.*"), lock + "\n")
    t.add(re.compile(r"mkdir -p .*/pids .*setsid nohup.*"), "4242\n")
    t.add(re.compile(r"if \[ -f .*node-.*\.exit.*"), list(polls))
    t.add(re.compile(r"t=''; .*kill -TERM.*"), "")
    t.add(re.compile(r"rm -rf .*\.lock-.*"), "")
    t.add(re.compile(r"ls .*/ranks 2>/dev/null"), "\n".join(f"rank-{r}.jsonl" for r in ranks) + "\n")
    return t


def spec_of(inv, nodes, run_id: str = "r", **changes) -> RunSpec:
    """The cluster run of the inventory's settings on `nodes`."""
    return RunSpec.of_inventory(inv, [n.name for n in nodes], run_id, **changes)


def targets(inv):
    """Every node of the inventory as the bench drives it (the CLI's slice)."""
    return targets_of(inv, [n.name for n in inv.nodes])


def bench_for(inv, transports: dict, tmp_path: Path, **changes) -> ClusterBench:
    def connect(node):
        return transports[node.name]
    return ClusterBench(targets(inv), connect, spec_of(inv, inv.nodes[:len(transports)], **changes),
                        ClusterOptions(runs_root=tmp_path, poll_s=0.0))


def with_records(t: FakeTransport, run_dir: str, ranks, node: str) -> None:
    for r in ranks:
        t.files[f"{run_dir}/ranks/rank-{r}.jsonl"] = record(r, node).encode()


def stops(t: FakeTransport) -> int:
    return sum("kill -TERM" in c for c in t.calls)


def test_success_collects_every_rank(inv, tmp_path):
    a = scripted("slm-01", ["RUNNING\n[default0]:VCFSLM-PROGRESS {\"scenario\": 1, \"scenarios\": 1}\n",
                            "EXIT 0\n"])
    b = scripted("slm-02", ["EXIT 0\n"], ranks=range(4, 8))
    bench = bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path)
    with_records(a, bench.launches[0].run_dir, range(4), "slm-01")
    with_records(b, bench.launches[1].run_dir, range(4, 8), "slm-02")
    meta, records = bench.run()
    assert meta.complete and {r.rank for r in records} == set(range(8))
    assert load_run(tmp_path / "r")[0].complete
    assert stops(a) == stops(b) == 0
    assert (tmp_path / "r" / "logs" / "slm-01" / "rank-0.log").read_text().startswith("VCFSLM-PROGRESS")
    assert all(c.closed for c in (a, b))


def test_one_failed_node_stops_all_and_keeps_records(inv, tmp_path):
    a = scripted("slm-01", ["RUNNING\n"] * 3)
    b = scripted("slm-02", ["RUNNING\n", "EXIT 1\n[default2]:Traceback: rank died\n"], ranks=range(4, 8))
    bench = bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path)
    with_records(a, bench.launches[0].run_dir, range(2), "slm-01")  # what finished before
    with pytest.raises(BenchError) as info:
        bench.run()
    text = str(info.value)
    assert "node slm-02 failed: torchrun exit 1" in text and "rank died" in text
    assert "vcfslm bench --resume r" in text
    assert stops(a) == 1 and stops(b) == 1
    meta, records = load_run(tmp_path / "r")
    assert not meta.complete and "slm-02" in meta.failure
    assert {r.rank for r in records} == {0, 1}


def test_timeout_stops_everything(inv, tmp_path):
    a = scripted("slm-01", ["RUNNING\n"])
    bench = bench_for(inv, {"slm-01": a}, tmp_path, timeout_s=0.0001)
    with pytest.raises(BenchError, match="timeout after"):
        bench.run()
    assert stops(a) == 1


def test_vanished_torchrun_is_a_failure(inv, tmp_path):
    a = scripted("slm-01", ["GONE\n"])
    with pytest.raises(BenchError, match="vanished"):
        bench_for(inv, {"slm-01": a}, tmp_path).run()
    assert stops(a) == 1


def test_held_lock_fails_preflight_and_starts_nothing(inv, tmp_path):
    a = scripted("slm-01", ["EXIT 0\n"])
    b = scripted("slm-02", ["EXIT 0\n"], lock="HELD other-run")
    with pytest.raises(BenchError, match="another bench holds the lock \\(other-run\\)"):
        bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path).run()
    assert not any("setsid" in c for c in a.calls + b.calls)
    assert any("rm -rf" in c and ".lock-slm-01" in c for c in a.calls)  # the lock it took is released


def test_preflight_reports_version_mismatch_and_missing_scripts(inv, tmp_path):
    a = scripted("slm-01", ["EXIT 0\n"])
    a.script = {k: v for k, v in a.script.items() if not (isinstance(k, re.Pattern) and "rank" in k.pattern)}
    a.add(re.compile(r"test -x .*rank\.sh.*"), "MISSING the rank script /opt/vcfslm/launch/rank.sh\nVERSION 0.0.1\n")
    with pytest.raises(BenchError) as info:
        bench_for(inv, {"slm-01": a}, tmp_path).run()
    assert "missing the rank script" in str(info.value)
    assert "guest runs vcfslm 0.0.1" in str(info.value)


def test_lost_ssh_while_running_reconnects(inv, tmp_path):
    """A dropped connection is not a failure by itself: the detached run goes on."""
    a = scripted("slm-01", ["RUNNING\n", "EXIT 0\n"])
    first = {"n": 0}
    fresh = scripted("slm-01", ["EXIT 0\n"])
    original_run = a.run

    def flaky(cmd, *args, **kw):
        if cmd.startswith("if [ -f") and first["n"] == 0:
            first["n"] += 1
            from vcfslm.errors import TransportError
            raise TransportError("connection reset")
        return original_run(cmd, *args, **kw)

    a.run = flaky
    conns = iter([a, fresh])
    bench = ClusterBench(targets(inv), lambda node: next(conns), spec_of(inv, inv.nodes[:1], "r"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0))
    with_records(fresh, bench.launches[0].run_dir, range(4), "slm-01")
    meta, _ = bench.run()
    assert meta.complete


def test_progress_events_reach_the_reporter(inv, tmp_path):
    from vcfslm.progress import RecordingReporter

    event = {"rank": 0, "phase": "measure", "scenario": 2, "scenarios": 4, "window": 1}
    a = scripted("slm-01", [f"RUNNING\n[default0]:VCFSLM-PROGRESS {json.dumps(event)}\n", "EXIT 0\n"])
    rep = RecordingReporter()
    bench = ClusterBench(targets(inv), lambda n: a, spec_of(inv, inv.nodes[:1], "r"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0), reporter=rep)
    with_records(a, bench.launches[0].run_dir, range(4), "slm-01")
    bench.run()
    # per-rank lines are detail (shown with -v); the run's position is one Progress
    assert any(subject == "slm-01/rank 0" and "scenario 2/4" in s and "measure 1" in s
               for subject, s in rep.details)
    assert not any(subject.startswith("slm-01/rank") for subject, _ in rep.updates)
    [p] = [p for p in rep.progresses if p.subject == "bench"]
    assert (p.label, p.done, p.unit) == ("scenario 2/4 (batch None, input None)", 1, "windows")


def test_stop_command_targets_only_this_runs_pids(inv):
    la = L.NodeLaunch(0, "slm-01", "x", "y", "/opt/vcfslm/runs/r", "", (0, 1))
    cmd = L.stop_command(la)
    assert "/opt/vcfslm/runs/r/node-slm-01.pid" in cmd
    assert "/opt/vcfslm/runs/r/pids/rank-0.pid" in cmd and "/opt/vcfslm/runs/r/pids/rank-1.pid" in cmd
    assert "pkill" not in cmd and "killall" not in cmd


# ------------------------------------------------------------------ fan-out and connections


def test_fan_out_keeps_node_order_whatever_finishes_first():
    import time
    from concurrent.futures import ThreadPoolExecutor

    from vcfslm.bench.cluster import fan_out

    def slow_first(i):
        time.sleep(0.05 * (3 - i))  # item 0 finishes last
        if i == 1:
            raise ValueError("node 1 broke")
        return i * 10

    with ThreadPoolExecutor(4) as pool:
        out = fan_out(slow_first, [0, 1, 2, 3], pool)
    assert out[0] == 0 and out[2] == 20 and out[3] == 30
    assert isinstance(out[1], ValueError)  # one node's failure does not hide the others' results


def test_fan_out_fail_fast_starts_nothing_after_a_failure():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from vcfslm.bench.cluster import NotRun, fan_out

    ran = []
    lock = threading.Lock()

    def task(i):
        with lock:
            ran.append(i)
        if i == 1:
            raise RuntimeError("cannot launch")
        return i

    with ThreadPoolExecutor(1) as pool:  # one at a time: items after the failure are queued
        out = fan_out(task, [0, 1, 2, 3], pool, fail_fast=True)
    assert out[0] == 0 and isinstance(out[1], RuntimeError)
    assert all(isinstance(r, NotRun) for r in out[2:])
    assert ran == [0, 1]


def many_nodes(inv, n: int):
    base = inv.nodes[0]
    return [base.model_copy(update={"name": f"n{i:03d}"}) for i in range(n)]


def test_pool_covers_every_node_up_to_the_guest_cap(inv, tmp_path):
    from vcfslm.node_selection import GUEST_PARALLEL_CAP

    opts = ClusterOptions(runs_root=tmp_path)
    for n, workers in ((20, 20), (70, GUEST_PARALLEL_CAP)):
        wide = inv.model_copy(update={"nodes": many_nodes(inv, n)})
        assert ClusterBench(targets(wide), lambda n: None, spec_of(wide, wide.nodes), opts).workers == workers


def test_launch_failure_on_one_node_stops_every_node(inv, tmp_path):
    a = scripted("slm-01", ["RUNNING\n"])
    b = scripted("slm-02", ["RUNNING\n"], ranks=range(4, 8))
    b.add(re.compile(r"mkdir -p .*/pids .*setsid nohup.*"), (1, "", "no space left on device"))
    bench = bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path)
    with pytest.raises(BenchError, match="could not start torchrun on slm-02"):
        bench.run()
    assert stops(a) == 1 and stops(b) == 1
    assert not any(c.startswith("if [ -f") for c in a.calls + b.calls)  # never polled


class CountingConnector:
    """Hands out one scripted transport per connect and counts the connects per node."""

    def __init__(self, make):
        self.make, self.count, self.made = make, {}, {}

    def __call__(self, node):
        self.count[node.name] = self.count.get(node.name, 0) + 1
        t = self.make(node.name)
        self.made.setdefault(node.name, []).append(t)
        return t


def test_polling_reuses_one_connection_per_node(inv, tmp_path):
    polls = ["RUNNING\n"] * 6 + ["EXIT 0\n"]
    names = [n.name for n in inv.nodes]
    ranks = {name: range(4 * i, 4 * i + 4) for i, name in enumerate(names)}

    def make(name):
        t = scripted(name, list(polls), ranks=ranks[name])
        with_records(t, "/opt/vcfslm/runs/r", ranks[name], name)
        return t

    connect = CountingConnector(make)
    bench = ClusterBench(targets(inv), connect, spec_of(inv, inv.nodes, "r"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0))
    meta, records = bench.run()
    assert meta.complete and len({r.rank for r in records}) == 16
    # one connection per node for preflight, 7 poll ticks, fetch and unlock
    assert connect.count == {name: 1 for name in names} and bench.connects == 4
    for name in names:
        [t] = connect.made[name]
        calls = [c for c in t.calls if c.startswith("if [ -f")]
        assert len(calls) == 7  # one command per node per tick: state and new log together
        assert t.closed


def test_a_dropped_connection_is_reopened_once_and_kept(inv, tmp_path):
    from vcfslm.errors import TransportError

    def make(name):
        t = scripted(name, ["RUNNING\n"] * 3 + ["EXIT 0\n"])
        with_records(t, "/opt/vcfslm/runs/r", range(4), name)
        return t

    connect = CountingConnector(make)
    bench = ClusterBench(targets(inv), connect, spec_of(inv, inv.nodes[:1], "r"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0))
    bench.preflight()
    bench.start()
    [first] = connect.made["slm-01"]
    first.run = lambda *a, **k: (_ for _ in ()).throw(TransportError("connection reset"))
    assert bench.watch() is None
    bench.collect()
    bench._close()
    assert connect.count == {"slm-01": 2}  # the drop, then one fresh connection for the rest
    [_, second] = connect.made["slm-01"]
    assert sum(c.startswith("if [ -f") for c in second.calls) == 4


def test_a_node_that_has_exited_is_not_polled_again(inv, tmp_path):
    a = scripted("slm-01", ["EXIT 0\n"])
    b = scripted("slm-02", ["RUNNING\n"] * 4 + ["EXIT 0\n"], ranks=range(4, 8))
    bench = bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path)
    with_records(a, bench.launches[0].run_dir, range(4), "slm-01")
    with_records(b, bench.launches[1].run_dir, range(4, 8), "slm-02")
    assert bench.run()[0].complete
    polls = lambda t: sum(c.startswith("if [ -f") for c in t.calls)  # noqa: E731
    assert (polls(a), polls(b)) == (1, 5)


# ------------------------------------------------------------------ what the preflight reads


def rendered_rank_script(threads: int, slots) -> str:
    """rank.sh as the guest stage renders it (the shipped template)."""
    from vcfslm.guest.templates import render_template

    return render_template("rank.sh.j2", {"python": "/opt/vcfslm/venv/bin/python", "threads_per_rank": threads,
                                          "inductor_cache_dir": "/opt/vcfslm/cache/inductor", "use_numactl": True,
                                          "rank_slots": slots, "env_file": "/opt/vcfslm/launch/env.sh"})


def with_rank_script(t: FakeTransport, text: str) -> FakeTransport:
    """The preflight probe answers with the version, then the rendered rank.sh after its mark."""
    from vcfslm.bench.cluster import RANK_SCRIPT_MARK

    t.add(re.compile(r"test -x .*rank\.sh.*"), f"VERSION {__version__}\n{RANK_SCRIPT_MARK}\n{text}")
    return t


def test_a_rank_script_placed_as_the_launch_passes(inv, tmp_path):
    script = rendered_rank_script(inv.bench.threads_per_rank, inv.rank_slots())
    a = with_rank_script(scripted("slm-01", ["EXIT 0\n"]), script)
    b = with_rank_script(scripted("slm-02", ["EXIT 0\n"], ranks=range(4, 8)), script)
    bench = bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path)
    with_records(a, bench.launches[0].run_dir, range(4), "slm-01")
    with_records(b, bench.launches[1].run_dir, range(4, 8), "slm-02")
    assert bench.run()[0].complete
    # the rank script travels in the probe's round trip: no command of its own
    assert not any(c.startswith("cat ") for c in a.calls + b.calls)


def test_a_rank_script_rendered_for_other_threads_fails_before_anything_starts(inv, tmp_path):
    from vcfslm import topology

    good = rendered_rank_script(inv.bench.threads_per_rank, inv.rank_slots())
    stale = rendered_rank_script(12, topology.rank_slots(inv.vm.vcpus, inv.vm.vnuma_nodes, 4, 12))
    a = with_rank_script(scripted("slm-01", ["EXIT 0\n"]), good)
    b = with_rank_script(scripted("slm-02", ["EXIT 0\n"], ranks=range(4, 8)), stale)
    with pytest.raises(BenchError) as info:
        bench_for(inv, {"slm-01": a, "slm-02": b}, tmp_path).run()
    text = str(info.value)
    assert "slm-02: /opt/vcfslm/launch/rank.sh runs 12 threads per rank (OMP_NUM_THREADS), the launch 24" in text
    assert ("slm-02: /opt/vcfslm/launch/rank.sh puts local rank 1 (rank 5) on CPUs 24-35, the launch on "
            "CPUs 24-47") in text
    assert "slm-02: /opt/vcfslm/launch/rank.sh puts local rank 3 (rank 7) on binding cpus, the launch on " \
           "binding node" in text
    assert "slm-01" not in text.split("\n", 1)[1]  # the node whose script agrees has no problem
    assert not any("setsid" in c for c in a.calls + b.calls)
    assert any("rm -rf" in c and ".lock-slm-01" in c for c in a.calls)  # the lock it took is released


def test_the_guest_is_inspected_once_per_node_for_the_gate_and_the_record(inv, tmp_path):
    from vcfslm.bench.cluster import GuestReport

    seen = []

    def inspect(target, t):
        assert target.name == t.host    # the node's own target, with the transport to it
        seen.append(t.host)
        problems = ["expected 4 vNUMA nodes of 24 CPUs, seen 1 node of 2 CPUs"] if t.host == "slm-02" else []
        return GuestReport(problems, {"numa_nodes": [{"id": 0}], "host": t.host})

    a = scripted("slm-01", ["EXIT 0\n"])
    with_records(a, "/opt/vcfslm/runs/r", range(4), "slm-01")
    bench = ClusterBench(targets(inv), lambda n: a, spec_of(inv, inv.nodes[:1], "r"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0),
                         inspect_guest=inspect)
    meta, _ = bench.run()
    assert seen == ["slm-01"]
    assert meta.guests == {"slm-01": {"numa_nodes": [{"id": 0}], "host": "slm-01"}}

    seen.clear()
    a, b = scripted("slm-01", ["EXIT 0\n"]), scripted("slm-02", ["EXIT 0\n"], ranks=range(4, 8))
    nodes = {"slm-01": a, "slm-02": b}
    bench = ClusterBench(targets(inv), lambda n: nodes[n.name], spec_of(inv, inv.nodes[:2], "r2"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0), inspect_guest=inspect)
    with pytest.raises(BenchError, match="slm-02: expected 4 vNUMA nodes of 24 CPUs, seen 1 node of 2 CPUs"):
        bench.run()
    assert sorted(seen) == ["slm-01", "slm-02"]
    assert not any("setsid" in c for c in a.calls + b.calls)


def test_the_bench_records_the_facts_the_cli_hands_it(inv, tmp_path):
    """The inventory's hash and vCenter's view come from the CLI; the bench reads no inventory."""
    asked = []

    def vcenter(names):
        asked.append(names)
        return {"vms": {n: {"cpus": 96} for n in names}}

    a = scripted("slm-01", ["EXIT 0\n"])
    with_records(a, "/opt/vcfslm/runs/r", range(4), "slm-01")
    bench = ClusterBench(targets(inv), lambda n: a, spec_of(inv, inv.nodes[:1], "r"),
                         ClusterOptions(runs_root=tmp_path, poll_s=0.0, inventory_sha256="c0ffee"),
                         vcenter_facts=vcenter)
    meta, _ = bench.run()
    assert asked == [["slm-01"]]
    assert (meta.inventory_sha256, meta.vcenter) == ("c0ffee", {"vms": {"slm-01": {"cpus": 96}}})
