"""`vcfslm bench --nodes N`: drive one detached torchrun per guest over SSH.

The operator never carries model data: it preflights the guests, starts every node's
torchrun at once (static rendezvous on node 0's bench IP), polls their logs, stops
all of them on the first failure, timeout or interrupt, and fetches the records into
`runs/<run-id>/`. Command lines come from `launch.py`; SSH from a `Transport`.

What runs is the RunSpec's; where (each node's addresses, ports, guest layout and rank
slots) is one `node_selection.NodeTarget` per node, which the CLI slices from the inventory.

Every phase fans out over the nodes at once (`fan_out`, one worker pool for the run, as
wide as the guest fan-out allows). Each node keeps one transport for the whole run,
reconnected only when it drops, and one poll is one command on it.
"""

from __future__ import annotations

import math
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..contract import parse_progress, process_group_timeout_s, rendezvous_timeout_s
from ..errors import BenchError, CommandFailed, TransportError, VcfslmError
from ..guest_layout import guest_model
from ..node_selection import GUEST_PARALLEL_CAP, NodeTarget, parallelism
from ..progress import NullReporter, Reporter
from ..results import (
    SERVE_RESULTS,
    RunMeta,
    merge_records,
    rank_summaries,
    read_meta,
    read_rank_facts,
    read_records,
    read_serve_records,
    write_meta,
    write_records,
)
from ..run_meta import build_run_meta
from ..runspec import RunSpec, WorkerSpec
from . import launch as L
from .tracker import BenchTracker


@dataclass
class ClusterOptions:
    """How the operator drives the run; what the run measures is its RunSpec.

    inventory_sha256: the hash of the file the run was planned from (meta.json's), or None."""

    runs_root: Path = Path("runs")
    resume: bool = False
    poll_s: float = 1.0
    inventory_sha256: str | None = None


def run_targets(targets: Sequence[NodeTarget], spec: RunSpec) -> list[NodeTarget]:
    """The targets of the nodes the spec names, in the order given; ValueError when the
    spec names a node no target is for."""
    missing = [n for n in spec.nodes if n not in {t.name for t in targets}]
    if missing:
        raise ValueError(f"no target for node(s) {', '.join(missing)} of run {spec.run_id}")
    return [t for t in targets if t.name in set(spec.nodes)]


def plan_launches(targets: Sequence[NodeTarget], spec: RunSpec, opts: ClusterOptions) -> list[L.NodeLaunch]:
    """One NodeLaunch per node of the run (pure: the --dry-run output is exactly this).

    The targets give where things are (guest layout, addresses, port, rank slots); what
    runs is the spec's."""
    nodes = run_targets(targets, spec)
    run_dir = f"{nodes[0].paths.runs_dir}/{spec.run_id}"
    ranks = spec.ranks
    master = nodes[0].bench_ip
    rdzv_timeout = rendezvous_timeout_s(len(nodes), ranks)
    pg_timeout = process_group_timeout_s(len(nodes), ranks)
    out = []
    for i, node in enumerate(nodes):
        paths = node.paths
        # What rank.sh must apply for this launch (the preflight compares the rendered one).
        placement = L.RankPlacement(spec.threads, node.slots)
        server = spec.server.on_node(paths.launch_dir, node.bench_ip) \
            if spec.serve is not None and spec.server is not None and not spec.server.in_process else None
        worker = WorkerSpec(run=spec, out=run_dir, model=guest_model(spec.model, paths.models_dir),
                            nodes=len(nodes), resume=opts.resume, timeout_s=pg_timeout, server=server)
        files = L.NodeFiles(run_dir, node.name)
        argv = L.torchrun_argv([paths.python, "-m", "torch.distributed.run"],
                               L.Rendezvous(len(nodes), ranks, i, master, nodes[0].rdzv_port, rdzv_timeout),
                               rank_script=paths.rank_script, log_dir=f"{run_dir}/logs/{node.name}/ranks",
                               args=L.worker_args(files.spec_file, node.name))
        # PYTHONUNBUFFERED: torchrun tees the ranks into a file; block-buffered, the operator
        # would see progress only every few KiB (or when the run ends).
        env = {"VCFSLM_PID_DIR": f"{run_dir}/pids", "VCFSLM_RUN_DIR": run_dir, "PYTHONUNBUFFERED": "1"}
        cmd = L.detached(argv, run_dir=run_dir, pid_file=files.pid_file, exit_file=files.exit_file,
                         log_file=files.log_file, env=env, pid_copy=f"{files.lock_dir}/pid",
                         files={files.spec_file: worker.to_json()})
        out.append(L.NodeLaunch(i, node.name, node.address, node.bench_ip, run_dir, cmd,
                                tuple(range(i * ranks, (i + 1) * ranks)), tuple(argv), placement,
                                rdzv_timeout, worker))
    return out


class NotRun(BenchError):
    """A node's task was never started: another node had already failed."""


def fan_out(fn: Callable[[Any], Any], items: Sequence, pool: Executor, *,
            fail_fast: bool = False) -> list[Any]:
    """fn over every item at once in `pool`; each item's value or exception, in item order.

    fail_fast: after the first exception, tasks not yet started do not run and come back
    as NotRun (running ones finish): a node that cannot launch stops the others launching.
    """
    failed = threading.Event()

    def task(item):
        if fail_fast and failed.is_set():
            raise NotRun("not started: another node failed first")
        try:
            return fn(item)
        except BaseException:
            failed.set()
            raise

    futures = [pool.submit(task, item) for item in items]
    out: list[Any] = []
    for fut in futures:
        try:
            out.append(fut.result())
        except Exception as exc:  # noqa: BLE001 - reported per node
            out.append(exc)
    return out


@dataclass
class NodeState:
    launch: L.NodeLaunch
    offset: int = 0
    state: str = "pending"
    exit_code: int | None = None
    tail: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class GuestReport:
    """One guest as the bench preflight sees it, gathered in one fetch per node: what the
    in-guest verification found wrong (it stops the run) and the facts it read (meta.json's
    `guests`)."""

    problems: list[str]
    facts: dict[str, Any]


# The bench preflight's probe prints the rendered rank wrapper after this line.
RANK_SCRIPT_MARK = "VCFSLM-RANK-SCRIPT"


class ClusterBench:
    """One cluster run: preflight, launch, watch, stop, collect.

    targets: the run's nodes (node_selection.NodeTarget; at least the spec's). connect(target)
    opens a Transport to one. inspect_guest(target, transport) reads a guest's facts once
    for the preflight and meta.json; vcenter_facts(names) what vCenter reports of the VMs."""

    def __init__(self, targets: Sequence[NodeTarget], connect: Callable[[NodeTarget], Any], spec: RunSpec,
                 opts: ClusterOptions, reporter: Reporter | None = None,
                 inspect_guest: Callable[[NodeTarget, Any], GuestReport] | None = None,
                 vcenter_facts: Callable[[list[str]], dict] | None = None):
        self.connect, self.spec, self.opts = connect, spec, opts
        self.nodes = run_targets(targets, spec)
        self.reporter = reporter or NullReporter()
        self.inspect_guest = inspect_guest
        self.vcenter_facts = vcenter_facts
        self.facts: dict[str, Any] = {}
        self.launches = plan_launches(self.nodes, spec, opts)
        self.states = {la.name: NodeState(la) for la in self.launches}
        self.local_dir = Path(opts.runs_root) / spec.run_id
        self._transports: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.connects = 0  # connections opened (one per node, plus one per reconnect)
        self._vcenter: dict[str, Any] = {}
        self.tracker = BenchTracker(spec.matrix.warmup + spec.matrix.repeats, started=time.monotonic())

    # -- connections -----------------------------------------------------------------

    def _t(self, name: str):
        """This node's transport for the run: opened on first use, kept until it drops."""
        with self._lock:
            t = self._transports.get(name)
        if t is None:
            t = self.connect(next(n for n in self.nodes if n.name == name))
            with self._lock:
                self._transports[name] = t
                self.connects += 1
        return t

    def _retrying(self, name: str, fn: Callable[[Any], Any]) -> Any:
        """fn(transport); on a dropped connection, once more on a fresh one (idempotent fn only)."""
        try:
            return fn(self._t(name))
        except CommandFailed:
            raise
        except (TransportError, OSError, EOFError):
            self._drop(name)
            return fn(self._t(name))

    def _drop(self, name: str) -> None:
        with self._lock:
            t = self._transports.pop(name, None)
        if t is not None:
            try:
                t.close()
            except Exception:  # noqa: BLE001 - closing a dead connection may fail any way
                pass

    @property
    def workers(self) -> int:
        """Nodes driven at once: every node up to the guest fan-out cap."""
        return parallelism(None, len(self.launches), GUEST_PARALLEL_CAP)

    @property
    def rendezvous_timeout_s(self) -> int | None:
        """The plan's rendezvous budget (every node's launch carries the same one)."""
        return self.launches[0].rdzv_timeout_s if self.launches else None

    def _each(self, fn: Callable[[L.NodeLaunch], Any], *, fail_fast: bool = False) -> dict[str, Any]:
        """Run fn on every node at once; value or the exception per node, in node order."""
        if self._pool is None:
            # One pool for the run: a poll tick reuses its threads instead of starting N.
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="bench-node")
        results = fan_out(fn, self.launches, self._pool, fail_fast=fail_fast)
        return {la.name: res for la, res in zip(self.launches, results, strict=True)}

    # -- phases ------------------------------------------------------------------------

    def preflight(self) -> None:
        """Scripts, venv, version, rank.sh's placement against the launch's, the in-guest
        checks (NUMA, bench network), the bench lock."""
        targets = {n.name: n for n in self.nodes}

        def check(la: L.NodeLaunch) -> list[str]:
            t = self._t(la.name)
            paths = targets[la.name].paths
            problems = []
            probe = (f"test -x {shlex.quote(paths.rank_script)} || echo MISSING the rank script "
                     f"{paths.rank_script} '(run: vcfslm provision --stage guests)'; "
                     f"{shlex.quote(paths.python)} -c 'import torch.distributed.run, vcfslm; "
                     f"print(\"VERSION\", vcfslm.__version__)' 2>/dev/null "
                     f"|| echo MISSING torch or vcfslm in {paths.venv} '(run: vcfslm provision --stage guests)'")
            server = self.spec.server if self.spec.serve is not None else None
            if server is not None and server.backend is not None:
                # The server's own venv and its scripts, as the guest stage leaves them.
                script = f"{paths.launch_dir}/{server.backend.script_name(0)}"
                probe += (f"; test -x {shlex.quote(script)} && test -x {shlex.quote(paths.vllm_python)} || echo "
                          f"MISSING {server.name}: {script} or {paths.vllm_python} '(run: vcfslm guests -p "
                          f"{server.name}, or set bench.serve.server: {server.name} and vcfslm provision)'")
            # The rank wrapper itself, in the same round trip, for its placement.
            probe += f"; echo {RANK_SCRIPT_MARK}; cat {shlex.quote(paths.rank_script)} 2>/dev/null"
            out, marked, rank_script = t.run(probe, timeout=60, check=False).stdout.partition(
                RANK_SCRIPT_MARK + "\n")
            for line in out.splitlines():
                if line.startswith("MISSING"):
                    problems.append("missing " + line[len("MISSING "):])
                elif line.startswith("VERSION") and line.split()[1] != __version__:
                    problems.append(f"guest runs vcfslm {line.split()[1]}, the operator {__version__} "
                                    "(run: vcfslm provision --stage guests)")
            if marked and rank_script and la.placement is not None:
                problems += L.placement_mismatches(L.parse_rank_script(rank_script), la.placement,
                                                   la.global_ranks, paths.rank_script)
            if self.inspect_guest is not None:
                report = self.inspect_guest(targets[la.name], t)
                problems += report.problems
                self.facts[la.name] = report.facts
            if not problems:
                got = t.run(L.lock_command(la, self.spec.run_id), timeout=30, check=False).stdout.strip()
                if not got.startswith("LOCKED"):
                    problems.append(f"another bench holds the lock ({got.split(' ', 1)[-1]}); "
                                    f"if it is dead remove {la.lock_dir}")
            return problems

        results = self._each(check)
        problems = []
        for name, res in results.items():
            if isinstance(res, Exception):
                problems.append(f"{name}: {res}")
            else:
                problems += [f"{name}: {p}" for p in res]
        if problems:
            self._each(self._unlock)
            raise BenchError("bench preflight failed:\n" + "\n".join(f"  - {p}" for p in problems))

    def _unlock(self, la: L.NodeLaunch) -> None:
        try:
            self._retrying(la.name, lambda t: t.run(L.unlock_command(la), timeout=30, check=False))
        except (TransportError, OSError, EOFError):
            pass

    def start(self) -> None:
        """Start every node's torchrun, all at once (one round trip each: the launch line also
        records the pid in the node's lock); the first node that cannot start stops the rest."""
        def go(la: L.NodeLaunch) -> None:
            # Not retried: a launch that dropped mid-way may have started torchrun already.
            pid = self._t(la.name).run(la.launch_command, timeout=60).stdout.strip()
            self.states[la.name].state = "running"
            self.reporter.update(la.name, f"torchrun started (pid {pid})")

        results = self._each(go, fail_fast=True)
        failed = {n: e for n, e in results.items() if isinstance(e, Exception) and not isinstance(e, NotRun)}
        if failed:
            raise BenchError("could not start torchrun on " + ", ".join(f"{n} ({e})" for n, e in failed.items()))

    def _poll(self, la: L.NodeLaunch) -> None:
        """One round trip: the node's state and its new log lines (none once it has exited:
        the exit file is written after torchrun's last line, so that poll read them all)."""
        st = self.states[la.name]
        if st.state == "exited":
            return
        try:
            res = self._t(la.name).run(L.poll_command(la, st.offset), timeout=60, check=False)
        except (TransportError, OSError, EOFError) as exc:
            self._drop(la.name)  # reconnect next tick; the detached run goes on meanwhile
            st.error = f"SSH: {exc}"
            return
        st.error = None
        state, code, text = L.parse_poll(res.stdout)
        st.offset += len(text.encode())
        self._consume(la, text)
        st.state, st.exit_code = state, code

    def _consume(self, la: L.NodeLaunch, text: str) -> None:
        st = self.states[la.name]
        node_log = self.local_dir / "logs" / la.name / "torchrun.log"
        node_log.parent.mkdir(parents=True, exist_ok=True)
        with node_log.open("a", encoding="utf-8") as fh:
            fh.write(text)
        for line in text.splitlines():
            st.tail = (st.tail + [line])[-40:]
            local_rank, body = L.split_rank_line(line)
            if local_rank is not None:
                with (node_log.parent / f"rank-{la.global_ranks[0] + local_rank}.log").open("a") as fh:
                    fh.write(body + "\n")
            event = parse_progress(body)
            if event is not None:
                L.report_event(self.reporter, self.tracker, f"{la.name}/rank {event.get('rank', '?')}", event)

    def watch(self) -> str | None:
        """Poll until every node exits; the first failure (or timeout) as text, else None."""
        timeout = self.spec.timeout_s or math.inf    # the CLI gives every run one
        deadline = time.monotonic() + timeout
        lost_since: dict[str, float] = {}
        while True:
            self._each(self._poll)
            for name, st in self.states.items():
                if st.state == "exited" and st.exit_code != 0:
                    return f"node {name} failed: torchrun exit {st.exit_code}"
                if st.state == "gone":
                    return f"node {name}: torchrun vanished without an exit code"
                if st.error:
                    first = lost_since.setdefault(name, time.monotonic())
                    if time.monotonic() - first > 60:
                        return f"node {name}: {st.error} (for over 60 s)"
                else:
                    lost_since.pop(name, None)
            if all(st.state == "exited" and st.exit_code == 0 for st in self.states.values()):
                return None
            if time.monotonic() > deadline:
                return f"timeout after {timeout:g} s"
            time.sleep(self.opts.poll_s)

    def stop_all(self) -> None:
        """Stop every node's torchrun and workers (group + pid files), then release locks."""
        def stop(la: L.NodeLaunch) -> None:
            self._retrying(la.name, lambda t: t.run(f"{L.stop_command(la)}; {L.unlock_command(la)}",
                                                    timeout=90, check=False))
        for name, res in self._each(stop).items():
            if isinstance(res, Exception):
                self.reporter.log(f"{name}: could not stop cleanly: {res}")

    def collect(self) -> list:
        """Fetch every node's rank files into the local run dir and merge them there.

        Node 0's own merged file is not fetched: it exists only when every rank reached the
        end, while the rank files also hold what a failed or stopped run finished. Merging
        them here (results.merge_records, as rank 0 does) gives the same file either way.
        """
        ranks_dir = self.local_dir / "ranks"
        ranks_dir.mkdir(parents=True, exist_ok=True)

        def fetch_on(la: L.NodeLaunch, t) -> None:
            listing = t.run(f"ls {shlex.quote(la.run_dir)}/ranks 2>/dev/null", timeout=60, check=False).stdout
            for rank in la.global_ranks:
                # records (static, serving), then facts
                for name in (f"rank-{rank}.jsonl", f"serve-{rank}.jsonl", f"rank-{rank}.json"):
                    if name in listing.split():
                        t.get(f"{la.run_dir}/ranks/{name}", str(ranks_dir / name))

        def fetch(la: L.NodeLaunch) -> None:
            self._retrying(la.name, lambda t: fetch_on(la, t))
        for name, res in self._each(fetch).items():
            if isinstance(res, Exception):
                self.reporter.log(f"{name}: could not fetch records: {res}")
        records = merge_records(read_records(p) for p in sorted(ranks_dir.glob("rank-*.jsonl")))
        write_records(self.local_dir / "results.jsonl", records)
        served = merge_records(read_serve_records(p) for p in sorted(ranks_dir.glob("serve-*.jsonl")))
        if served or self.spec.serve is not None:
            write_records(self.local_dir / SERVE_RESULTS, served)
        return records

    # -- the whole run -------------------------------------------------------------------

    def meta(self, complete: bool, failure: str | None) -> RunMeta:
        previous = None
        if self.opts.resume and (self.local_dir / "meta.json").exists():
            previous = read_meta(self.local_dir)
        return build_run_meta(
            self.spec, complete=complete, failure=failure, previous=previous,
            inventory_sha256=self.opts.inventory_sha256, versions={"vcfslm": __version__},
            vcenter=self._vcenter, guests=self.facts,
            ranks=rank_summaries(read_rank_facts(self.local_dir / "ranks")))

    def run(self) -> tuple[RunMeta, list]:
        """Preflight, launch, watch, collect; BenchError (after a clean stop) on any failure."""
        self.local_dir.mkdir(parents=True, exist_ok=True)
        if self.vcenter_facts is not None:
            self._vcenter = self.vcenter_facts([n.name for n in self.nodes])
        write_meta(self.local_dir, self.meta(False, None))
        try:
            self.preflight()
        except VcfslmError:
            self._close()
            raise
        failure: str | None = None
        try:
            self.start()
            failure = self.watch()
        except KeyboardInterrupt:
            failure = "interrupted"
        except VcfslmError as exc:
            failure = str(exc)
        finally:
            if failure is not None:
                self.stop_all()
        try:
            records = self.collect()
            if failure is None:
                self._each(self._unlock)
            meta = self.meta(failure is None, failure)
            write_meta(self.local_dir, meta)
        finally:
            self._close()
        if failure is not None:
            raise BenchError(self._failure_text(failure))
        return meta, records

    def _failure_text(self, failure: str) -> str:
        lines = [f"run {self.spec.run_id} incomplete: {failure}",
                 f"finished windows kept in {self.local_dir}; continue with: vcfslm bench --resume {self.spec.run_id}"]
        for name, st in self.states.items():
            if st.state != "exited" or st.exit_code != 0:
                lines.append(f"last lines of {name} ({st.state}{'' if st.exit_code is None else f', exit {st.exit_code}'}):")
                lines += [f"  | {line}" for line in st.tail[-12:]]
        return "\n".join(lines)

    def _close(self) -> None:
        for name in list(self._transports):
            self._drop(name)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["ClusterBench", "ClusterOptions", "GuestReport", "NotRun", "fan_out", "plan_launches", "run_targets"]
