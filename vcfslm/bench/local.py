"""`vcfslm bench --local`: run the rank workers on this machine under torchrun.

The same rank wrapper as on the guests (templates/rank.sh.j2) pins each rank with
numactl; torchrun runs standalone (one node, a free rendezvous port):

    python -m torch.distributed.run --standalone --nproc-per-node R --no-python \\
        RUN_DIR/launch/rank.sh -- <worker arguments>

The "--" keeps torchrun's parser away from the worker's `--node` (which it would
reject as an ambiguous abbreviation of its own `--node-rank`); the worker drops it.

Pure helpers (rank placement on this machine's NUMA nodes, the commands) are separate
from `run_local`, which does the side effects: run dir, meta.json, the subprocess, the
progress lines, the final meta. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import results, topology
from ..contract import parse_progress
from ..errors import BenchError, Problem, RunFolderError, UsageError
from ..guest_layout import host_inductor_cache
from ..matrix import Matrix, serve_complete
from ..progress import NullReporter, Reporter
from ..run_meta import build_run_meta
from ..runspec import RunSpec, WorkerSpec
from ..serving.decisions import ServeSpec
from ..serving.servers import ServerSpec
from .launch import NodeFiles, report_event, worker_args
from .tracker import BenchTracker

NODE_NAME = "local"


@dataclass
class LocalRun:
    """The outcome of a local run: its folder, metadata and records."""

    run_dir: Path
    meta: results.RunMeta
    records: list[results.WindowRecord] = field(default_factory=list)
    serve_records: list[results.ServeRecord] = field(default_factory=list)


# ------------------------------------------------------------------ pure helpers


def plan_ranks(node_cpus: dict[int, Sequence[int]], ranks: int, threads: int) -> list[dict[str, Any]]:
    """Place `ranks` ranks of `threads` threads on this machine's NUMA nodes.

    The block placement and CPU-set arithmetic is topology.rank_slots' (the same as on
    the guests); its CPU indices are mapped onto the real CPU ids of each node, so
    machines whose nodes are not numbered contiguously work too. Nodes are taken at
    the size of the smallest. Raises UsageError when ranks cannot be placed.
    Returns the rank.sh.j2 `ranks` context: {local_rank, numa_node, cpus, bind}.
    """
    nodes = sorted(node_cpus)
    if not nodes:
        raise UsageError("no CPUs found on this machine")
    size = min(len(node_cpus[n]) for n in nodes)
    problems = topology.placement_problems(size * len(nodes), len(nodes), ranks, threads)
    if problems:
        raise UsageError([Problem("", None, None, "--ranks/--threads",
                                      f"{p} (this machine: {len(nodes)} NUMA node(s) of {size} CPUs)")
                              for p in problems])
    out = []
    for slot in topology.rank_slots(size * len(nodes), len(nodes), ranks, threads):
        node = nodes[slot.numa_node]
        real = sorted(node_cpus[node])[:size]
        cpus = [real[i - slot.numa_node * size] for i in slot.cpus]
        out.append({"local_rank": slot.local_rank, "numa_node": node,
                    "cpus": topology.format_cpu_list(cpus), "bind": slot.bind})
    return out


def default_threads(node_cpus: dict[int, Sequence[int]], ranks: int) -> int:
    """Threads per rank when not given: this machine's CPUs shared evenly, within one node."""
    size = min(len(c) for c in node_cpus.values())
    total = size * len(node_cpus)
    return max(1, min(size, total // max(ranks, 1)))


def worker_spec(spec: RunSpec, run_dir: Path, resume: bool = False) -> WorkerSpec:
    """What this machine's ranks read (the worker's --spec file): the run's spec, the run
    folder, the model as given."""
    return WorkerSpec(run=spec, out=str(run_dir), model=spec.model, resume=resume,
                      server=spec.server if spec.serve is not None and spec.server is not None
                      and not spec.server.in_process else None)


def torchrun_command(python: str, ranks: int, wrapper: Path, worker_args: list[str]) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "--no-python", str(wrapper), "--", *worker_args]


def run_complete(records: list[results.WindowRecord], matrix: Matrix, world_size: int,
                 scenarios: str | None = None) -> bool:
    """Every rank has `repeats` windows of every scenario (of those `scenarios` selects)."""
    wanted = matrix.scenarios(scenarios)
    have: dict[tuple[int, tuple[int, int, int]], set[int]] = {}
    for r in records:
        have.setdefault((r.rank, r.scenario), set()).add(r.window)
    return all(len(have.get((rank, s), ())) >= matrix.repeats
               for rank in range(world_size) for s in wanted)


def machine_node_cpus() -> dict[int, tuple[int, ...]]:
    """This machine's NUMA nodes and their CPUs, restricted to the CPUs we may use."""
    from .placement import node_cpu_lists

    allowed = set(os.sched_getaffinity(0))
    out = {}
    for node, cpus in node_cpu_lists().items():
        usable = tuple(c for c in cpus if c in allowed)
        if usable:
            out[node] = usable
    return out or {0: tuple(sorted(allowed))}


# ------------------------------------------------------------------ the driver


@dataclass(frozen=True)
class LocalLaunch:
    """How a local run is started on this machine (what it measures is its RunSpec).

    resume: continue the run in place (its finished scenarios are skipped). python: the
    ranks' interpreter (default: this one). server_python: the interpreter of an HTTP
    server's own venv (serving with --server)."""

    runs_dir: str | Path = "runs"
    resume: bool = False
    python: str | None = None
    inductor_cache_dir: str | None = None
    server_python: str | None = None


def run_local(spec: RunSpec, launch: LocalLaunch = LocalLaunch(), *,
              render_template: Callable[[str, dict[str, Any]], str],
              reporter: Reporter | None = None) -> LocalRun:
    """Run `spec` with its ranks on this machine; returns the run (records gathered).

    A serving spec (`spec.serve`) runs continuous batching under its load; its matrix then
    only sizes the numerics gate (matrix.serve_matrix). render_template(name, context):
    the guests' templates (the rank wrapper rank.sh.j2, an HTTP server's launch scripts,
    one per NUMA node the ranks use, rendered into the run folder), handed in by the caller
    so that the bench stage never imports the guest stage.
    Raises BenchError when torchrun or a rank fails (meta.json records the failure).
    """
    reporter = reporter or NullReporter()
    python = launch.python or sys.executable
    node_cpus = machine_node_cpus()
    threads = spec.threads or default_threads(node_cpus, spec.ranks)
    slots = plan_ranks(node_cpus, spec.ranks, threads)
    spec = spec.replaced(threads=threads)
    run_id, resume = spec.run_id, launch.resume
    run_dir = Path(launch.runs_dir) / run_id
    if resume and not (run_dir / "meta.json").exists():
        raise RunFolderError([Problem(str(run_dir / "meta.json"), None, None, "",
                                      f"cannot resume {run_id}: no such file")])
    if not resume and run_dir.exists():
        raise UsageError(f"run folder {run_dir} already exists (choose another --run-id or --resume)")
    (run_dir / "launch").mkdir(parents=True, exist_ok=True)
    log_dir = run_dir / "logs" / NODE_NAME
    log_dir.mkdir(parents=True, exist_ok=True)

    cache_dir = str(host_inductor_cache(launch.inductor_cache_dir, os.environ))
    use_numactl = spec.numactl and shutil.which("numactl") is not None
    context = {"python": python, "threads_per_rank": threads, "inductor_cache_dir": cache_dir,
               "use_numactl": use_numactl, "ranks": slots, "env_file": ""}
    wrapper = run_dir / "launch" / "rank.sh"
    results.atomic_write_text(wrapper, render_template("rank.sh.j2", context))
    wrapper.chmod(0o755)

    serve, matrix = spec.serve, spec.matrix
    if serve is not None and spec.server is not None and not spec.server.in_process:
        spec = spec.replaced(server=render_server_scripts(run_dir / "launch", spec.server, slots, serve, spec.model,
                                                          use_numactl, launch.server_python, render_template))
    meta = _initial_meta(run_dir, spec, resume, node_cpus, slots, use_numactl)
    results.write_meta(run_dir, meta)

    spec_file = Path(NodeFiles(str(run_dir.resolve()), NODE_NAME).spec_file)
    results.atomic_write_text(spec_file, worker_spec(spec, run_dir.resolve(), resume).to_json() + "\n")
    cmd = torchrun_command(python, spec.ranks, wrapper.resolve(), worker_args(str(spec_file), NODE_NAME))
    reporter.log(f"run {run_id}: {spec.ranks} rank(s) x {threads} thread(s), "
                 f"{'numactl' if use_numactl else 'no numactl'}; folder {run_dir}")
    tracker = BenchTracker(matrix.warmup + matrix.repeats, started=time.monotonic())
    rc, tail, failures = _run_streaming(cmd, log_dir / "torchrun.log", reporter, spec.timeout_s, tracker)

    records = results.read_records(run_dir / "results.jsonl") if (run_dir / "results.jsonl").exists() else []
    served = run_dir / results.SERVE_RESULTS
    serve_records = results.read_serve_records(served) if serve and served.exists() else []
    _finish_meta(meta, run_dir, records, matrix, spec.ranks, spec.scenarios)
    if serve:
        meta.complete = serve_complete(serve_records, serve, spec.ranks)
    if rc != 0:
        detail = "; ".join(failures) or "\n".join(f"  | {line}" for line in tail)
        meta.failure = f"torchrun exited {rc}: {detail}"[:4000]
        meta.complete = False
        results.write_meta(run_dir, meta)
        raise BenchError(f"local run {run_id} failed (torchrun exit {rc}); logs in {log_dir}\n{detail}")
    if records:
        results.records_to_csv(run_dir / "results.csv", records)
    results.write_meta(run_dir, meta)
    return LocalRun(run_dir, meta, records, serve_records)


def _initial_meta(run_dir: Path, spec: RunSpec, resume: bool, node_cpus, slots, use_numactl: bool) -> results.RunMeta:
    # A resume keeps the run's creation time and facts; its matrix may extend the run's.
    previous = results.read_meta(run_dir) if resume else None
    guests = None if previous else {
        NODE_NAME: {"numa_nodes": {str(k): topology.format_cpu_list(v) for k, v in node_cpus.items()},
                    "ranks": slots, "numactl": use_numactl}}
    if not spec.command:
        spec = spec.replaced(command=sys.argv)
    return build_run_meta(spec, previous=previous, guests=guests)


def render_server_scripts(launch_dir: Path, server: ServerSpec, slots: list[dict[str, Any]], serve: ServeSpec,
                          model: str, use_numactl: bool, server_python: str | None,
                          render_template: Callable[[str, dict[str, Any]], str] | None) -> ServerSpec:
    """One launch script per NUMA node the ranks use (the guests' template), and the server's
    entry file beside them; the spec, pointed at that folder."""
    backend = server.backend
    if backend is None or render_template is None:
        raise UsageError(f"--server {server.name}: no launch template to render")
    if not (Path(model) / "config.json").exists():
        raise UsageError([Problem("", None, None, "--model",
                                  f"--server {server.name} serves a model folder (with config.json); "
                                  f"got {model!r} (write one with `vcfslm model write`)")])
    if not server_python or not Path(server_python).exists():
        raise UsageError([Problem("", None, None, "--server-python",
                                  f"no interpreter with {server.name} at {server_python or '(none)'}: "
                                  f"`make {server.name}` installs it in .venv-{server.name}, or pass "
                                  f"--server-python")])
    from ..serving.servers import kv_bytes_per_token, kv_cache_gib, split_cpus

    nodes = [slot["numa_node"] for slot in slots]
    if len(set(nodes)) != len(nodes):
        raise UsageError([Problem("", None, None, "--ranks",
                                  f"--server {server.name} runs one server per NUMA node; {len(nodes)} ranks on "
                                  f"{len(set(nodes))} node(s) would share one (use --ranks {len(set(nodes))})")])
    config = json.loads((Path(model) / "config.json").read_text())
    kv = server.kv_cache_gib or kv_cache_gib(kv_bytes_per_token(config), serve.slots, serve.max_context)
    if backend.entry:
        results.atomic_write_text(launch_dir / backend.entry, render_template(backend.entry, {}))
    for slot in slots:
        node = slot["numa_node"]
        cpus = topology.parse_cpu_list(slot["cpus"])
        try:
            server_cpus, _ = split_cpus(cpus, server.reserved_cores)
        except ValueError as exc:
            raise UsageError([Problem("", None, None, "bench.serve.vllm.reserved_cores", str(exc))]) from None
        path = launch_dir / backend.script_name(node)
        results.atomic_write_text(path, render_template(backend.template, {
            "python": str(Path(server_python).absolute()), "entry": str((launch_dir / (backend.entry or "")).resolve()),
            "numa_node": node, "server_cpus": topology.format_cpu_list(server_cpus), "kv_cache_gib": kv,
            "use_numactl": use_numactl, "env_file": ""}))
        path.chmod(0o755)
    return server.with_launch_dir(str(launch_dir.resolve()))


def _finish_meta(meta: results.RunMeta, run_dir: Path, records, matrix: Matrix, ranks: int,
                 scenarios: str | None) -> None:
    facts_path = run_dir / "ranks.json"
    if facts_path.exists():
        facts = json.loads(facts_path.read_text(encoding="utf-8"))
        if facts:
            meta.versions = facts[0].get("placement", {}).get("versions", {})
            meta.probe = {NODE_NAME: {str(f["rank"]): f.get("probe") for f in facts}}
            meta.guests.setdefault(NODE_NAME, {})["placement"] = {
                str(f["rank"]): f.get("placement") for f in facts}
            meta.guests[NODE_NAME]["model"] = facts[0].get("model")
            meta.ranks = results.rank_summaries(facts)
    meta.complete = bool(records) and run_complete(records, matrix, ranks, scenarios)


def _run_streaming(cmd: list[str], log_path: Path, reporter: Reporter, timeout: float | None,
                   tracker: BenchTracker | None = None) -> tuple[int, list[str], list[str]]:
    """Run `cmd`, tee its output to `log_path`, report progress; (rc, last lines, failures).

    The run's position (tracker) goes to the reporter as Progress, each rank's as detail.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    tail: deque[str] = deque(maxlen=30)
    failures: list[str] = []
    with open(log_path, "a", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, env=env, start_new_session=True)
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            _stop(proc)

        timer = threading.Timer(timeout, expire) if timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                event = parse_progress(line)
                if event is not None:
                    report_event(reporter, tracker, f"rank {event.get('rank', '?')}", event)
                    if event.get("phase") == "failed":
                        failures.append(f"rank {event.get('rank')}: {event.get('error')}")
            rc = proc.wait()
        except KeyboardInterrupt:
            _stop(proc)
            raise
        finally:
            if timer:
                timer.cancel()
    if timed_out.is_set():
        failures.append(f"timed out after {timeout:.0f} s")
        rc = rc or 124
    return rc, list(tail), failures


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks (its own process group, started by us)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
