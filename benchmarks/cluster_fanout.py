"""Fan-out of the cluster bench: the same small matrix on 1 lab node and on N lab nodes.

Real sshd guests on loopback (127.0.0.150 and up), the project's wheel installed by the
guest stage, one torchrun per guest over SSH (static rendezvous on node 0's bench IP),
1 rank per node, synthetic:tiny. It checks that every rank of every run has a record
for every scenario x repeat, and prints the wall times, the N/1 ratio, the barrier
skew (the workers' `start_skew_s`) and where the time went.

All guests are this machine: N ranks share its CPUs, so the ratio measures the
orchestration *and* N times the model work on the same cores. It is > 1 by design.

    .venv/bin/python benchmarks/cluster_fanout.py [--nodes 16] [--compile eager|compile]

A small invocation (2 nodes, one scenario; about a minute here):

    .venv/bin/python benchmarks/cluster_fanout.py --nodes 2 --scenarios 1x16

Each run is planned as `vcfslm bench` plans one: a RunSpec of the inventory's bench
settings with the flags over them, and one NodeTarget per node (node_selection.targets_of).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vcfslm.bench import launch as L  # noqa: E402
from vcfslm.bench.cluster import ClusterBench, ClusterOptions  # noqa: E402
from vcfslm.cli.cluster import inspect_guest, inventory_sha256  # noqa: E402
from vcfslm.cli.guest_stage import bench_connector, ssh_connector  # noqa: E402
from vcfslm.contract import parse_progress, rendezvous_timeout_s  # noqa: E402
from vcfslm.guest.provision import GuestRun, provision_guests  # noqa: E402
from vcfslm.guest.wheel import ProjectWheel  # noqa: E402
from vcfslm.inventory_load import load_inventory  # noqa: E402
from vcfslm.lab import generate, guests  # noqa: E402
from vcfslm.lab.lab import seed_guest_venv  # noqa: E402
from vcfslm.matrix import Matrix  # noqa: E402
from vcfslm.node_selection import targets_of  # noqa: E402
from vcfslm.runspec import ProbeSpec, RunSpec  # noqa: E402

FIRST_INDEX = 139  # 127.0.0.150.. : away from the lab's, the tests' and ssh_fanout's guests
PHASES = ("preflight", "start", "watch", "collect")


class TimedBench(ClusterBench):
    """A ClusterBench that notes how long each phase took and when each worker event arrived."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.phase_s: dict[str, float] = {}
        self.events: list[tuple[float, dict]] = []
        self.t0 = time.monotonic()
        for name in PHASES:
            setattr(self, name, self._timed(name, getattr(self, name)))

    def _timed(self, name, fn):
        def wrapper(*a, **kw):
            started = time.monotonic()
            try:
                return fn(*a, **kw)
            finally:
                self.phase_s[name] = time.monotonic() - started
        return wrapper

    def _consume(self, la, text: str) -> None:
        now = time.monotonic() - self.t0
        for line in text.splitlines():
            event = parse_progress(L.split_rank_line(line)[1])
            if event is not None:
                self.events.append((now, event))
        super()._consume(la, text)


def sockets_of(pid: int) -> int:
    """Open sockets of a process (0 when it is gone)."""
    try:
        return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def agent_pid(run_id: str) -> int | None:
    """Node 0's torchrun agent (it hosts the rendezvous store) of this run."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"torch.distributed.run" in cmd and b"--node-rank" in cmd and \
                    cmd[cmd.index(b"--node-rank") + 1] == b"0" and run_id.encode() in b" ".join(cmd):
                return int(proc.name)
    return None


class Sampler(threading.Thread):
    """Peak sockets while a run goes: the operator's fds, each rank's, node 0's agent's.

    Lab guests are this machine, so their processes can be looked at directly."""

    def __init__(self, run_dir: Path, run_id: str):
        super().__init__(daemon=True)
        self.run_dir, self.run_id = run_dir, run_id
        self.stop = threading.Event()
        self.operator_fds = self.rank_sockets = self.store_sockets = 0

    def run(self) -> None:
        agent = None
        while not self.stop.wait(0.5):
            self.operator_fds = max(self.operator_fds, len(os.listdir("/proc/self/fd")))
            for f in (self.run_dir / "pids").glob("rank-*.pid"):
                try:
                    self.rank_sockets = max(self.rank_sockets, sockets_of(int(f.read_text())))
                except (OSError, ValueError):
                    pass
            agent = agent or agent_pid(self.run_id)
            if agent:
                self.store_sockets = max(self.store_sockets, sockets_of(agent))


def write_inventory(started, workdir: Path, path: Path, port: int) -> Path:
    doc = generate.guests_inventory(started, str(workdir), bench_port=port, ranks_per_node=1)
    doc["bench"]["threads_per_rank"] = 1
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def first_seen(events, phase: str) -> list[float]:
    """Per rank, when its first event of `phase` reached the operator (s since the run began)."""
    seen: dict[int, float] = {}
    for t, e in events:
        if e.get("phase") == phase and e.get("rank") is not None:
            seen.setdefault(e["rank"], t)
    return sorted(seen.values())


def run_spec(inv, nodes: int, run_id: str, args) -> RunSpec:
    """The run on the inventory's first `nodes` nodes: its bench settings, the flags over them."""
    return RunSpec.of_inventory(inv, [n.name for n in inv.nodes[:nodes]], run_id, compile_mode=args.compile,
                                probe=ProbeSpec.of_flags(args.probe_mib), scenarios=args.scenarios,
                                command=("benchmarks/cluster_fanout.py", *sys.argv[1:]))


def one_run(inv, nodes: int, run_id: str, runs: Path, args) -> dict:
    spec = run_spec(inv, nodes, run_id, args)
    targets = targets_of(inv, spec.nodes, spec.ranks, spec.threads)
    opts = ClusterOptions(runs_root=runs, poll_s=args.poll, inventory_sha256=inventory_sha256(inv.source))
    open_node = bench_connector(inv, None, runs / run_id / "logs" / "ssh")
    bench = TimedBench(targets, lambda target: open_node(inv.node(target.name)), spec, opts,
                       inspect_guest=lambda target, transport: inspect_guest(inv, transport))
    sampler = Sampler(Path(inv.guest.workdir) / "runs" / run_id, run_id)
    sampler.start()
    started, cpu = time.perf_counter(), time.process_time()
    try:
        meta, records = bench.run()
    finally:
        sampler.stop.set()
        sampler.join()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    scenarios = len(spec.matrix.scenarios(spec.scenarios))
    expected = nodes * spec.ranks * scenarios * spec.matrix.repeats
    per_rank: dict[int, int] = {}
    for r in records:
        per_rank[r.rank] = per_rank.get(r.rank, 0) + 1
    missing = [rank for rank in range(nodes * spec.ranks)
               if per_rank.get(rank, 0) != scenarios * spec.matrix.repeats]
    if not meta.complete or len(records) != expected or missing:
        raise SystemExit(f"{run_id}: incomplete: {len(records)}/{expected} records, ranks short: {missing}")
    skews = [r.start_skew_s * 1000 for r in records]
    ev = bench.events
    return {
        "nodes": nodes, "wall": wall, "operator_cpu": cpu, "operator_fds": sampler.operator_fds,
        "rank_sockets": sampler.rank_sockets, "store_sockets": sampler.store_sockets, "records": len(records), "expected": expected,
        "ranks": len(per_rank), "phases": dict(bench.phase_s), "connects": bench.connects,
        "skew_p50": statistics.median(skews), "skew_max": max(skews),
        "window_s": statistics.mean(r.wall_s for r in records),
        "last_start": max(first_seen(ev, "start"), default=float("nan")),
        "last_loaded": max(first_seen(ev, "loaded"), default=float("nan")),
        "first_window": min(first_seen(ev, "warmup"), default=float("nan")),
        "finished": max(first_seen(ev, "finished"), default=float("nan")),
    }


def start_guests(count: int, base: Path):
    client = guests.ensure_client_keys(base / "ssh")
    started = []
    try:
        for i in range(count):
            started.append(guests.start_guest(FIRST_INDEX + i, base / "guests", client))
    except BaseException:
        for g in started:
            guests.stop_guest(g)
        raise
    guests.write_known_hosts(client.known_hosts, started)
    return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--compile", choices=("eager", "compile"), default="eager",
                        help="decode step (eager: 16 ranks compiling on 2 cores would measure the compiler)")
    parser.add_argument("--probe-mib", type=int, default=64,
                        help="bandwidth probe buffer per rank (the worker's 1 GiB x 16 ranks would not fit)")
    parser.add_argument("--poll", type=float, default=1.0, help="operator poll interval (s)")
    parser.add_argument("--scenarios", help="BATCHxINPUT patterns (default: the lab's whole matrix)")
    parser.add_argument("--keep", help="keep the lab and run folders under this folder")
    args = parser.parse_args()
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="vcfslm-cluster-fanout-")
    base = Path(args.keep or tmp.name)
    base.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    started = start_guests(args.nodes, base)
    try:
        work = base / "work"
        work.mkdir(exist_ok=True)
        seed_guest_venv(work / "venv")
        port = guests.free_port("0.0.0.0")
        inv = load_inventory(write_inventory(started, work, base / "inventory.yaml", port))
        wheel = ProjectWheel()
        wheel.get()
        prepared = provision_guests(inv, ssh_connector(inv, None),
                                    options=GuestRun(wheel=wheel, run_dir=base / "logs"))
        if not prepared.ok:
            raise SystemExit("guest stage failed:\n"
                             + "\n".join(f"{h.host}: {h.error}" for h in prepared.failed_hosts))
        setup = time.perf_counter() - began
        stamp = time.strftime("%H%M%S")
        one = one_run(inv, 1, f"fanout-1n-{stamp}", base / "runs", args)
        many = one_run(inv, args.nodes, f"fanout-{args.nodes}n-{stamp}", base / "runs", args)
    finally:
        for g in started:
            guests.stop_guest(g)
        if tmp is not None:
            tmp.cleanup()
    shape = generate.machine_shape()
    scenarios = len(Matrix.of_inventory(inv.bench).scenarios(args.scenarios))
    print(f"cluster bench fan-out: 1 vs {args.nodes} lab nodes x 1 rank, synthetic:tiny, "
          f"{args.compile}, {scenarios} scenarios x ({inv.bench.warmup} warmup + {inv.bench.repeats} "
          f"measured) windows, this machine: {shape.cpus} CPUs, {shape.memory_gib} GiB "
          f"(lab setup {setup:.0f} s, not counted)")
    print(f"rendezvous timeout: {rendezvous_timeout_s(1, 1)} s at 1 node, "
          f"{rendezvous_timeout_s(args.nodes, 1)} s at {args.nodes} nodes")
    head = f"{'':<28}{'1 node':>12}{f'{args.nodes} nodes':>12}"
    print(head)
    rows = [("wall (s)", "wall", "{:.1f}"), ("records (got/expected)", None, None),
            ("SSH connections opened", "connects", "{:d}"),
            ("operator CPU (s)", "operator_cpu", "{:.1f}"),
            ("operator open fds (peak)", "operator_fds", "{:d}"),
            ("sockets per rank (peak)", "rank_sockets", "{:d}"),
            ("node 0 agent sockets (peak)", "store_sockets", "{:d}")]
    rows += [(f"  {p} (s)", p, "{:.1f}") for p in PHASES]
    rows += [("  last rank started (s)", "last_start", "{:.1f}"),  # torchrun + rendezvous + import
             ("  last rank loaded (s)", "last_loaded", "{:.1f}"),
             ("  first window (s)", "first_window", "{:.1f}"),
             ("  last rank finished (s)", "finished", "{:.1f}"),
             ("mean window wall (s)", "window_s", "{:.3f}"),
             ("barrier skew p50 (ms)", "skew_p50", "{:.2f}"),
             ("barrier skew max (ms)", "skew_max", "{:.2f}")]
    for label, key, fmt in rows:
        if key is None:
            a, b = f"{one['records']}/{one['expected']}", f"{many['records']}/{many['expected']}"
        else:
            get = (lambda r, k=key: r["phases"].get(k, float("nan"))) if key in PHASES else \
                (lambda r, k=key: r[k])
            a, b = fmt.format(get(one)), fmt.format(get(many))
        print(f"{label:<28}{a:>12}{b:>12}")
    print(f"ratio {args.nodes}/1 wall: {many['wall'] / one['wall']:.2f}  "
          f"(every rank's records present in both runs)")


if __name__ == "__main__":
    main()
