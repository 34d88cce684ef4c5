"""Cluster benchmark launch: per-node torchrun command lines (pure) and their driver.

Each node runs one torchrun, detached on the guest (setsid + nohup), so a dropped SSH
connection never kills a run by accident and a stop is always explicit:

    <run>/node-<name>.pid     the detached session's pid (== its process group)
    <run>/node-<name>.exit    torchrun's exit code, written when it ends
    <run>/logs/<name>/torchrun.log   torchrun's console (ranks teed, "[defaultN]:" prefixed)
    <run>/pids/rank-<rank>.pid       each worker's pid (torchrun starts workers in their
                                     own sessions, so the group alone would miss them)

The operator polls these over SSH (one short command per node per tick), streams the
new log lines, and on any failure stops every node: the process group and the pid
files, nothing broader. This module imports no SSH library: it drives a Transport.

The rendezvous budget (how long the ranks may take to meet) is the run contract's
(`contract.rendezvous_timeout_s`); the plan computes it once and every node's launch
carries it. Before anything starts, the preflight reads back the rank wrapper the guest
stage rendered (rank.sh) and checks that its threads and NUMA placement are the launch's
(`parse_rank_script`, `placement_mismatches`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..runspec import WorkerSpec
from ..steadiness import BUSY
from ..topology import RankSlot, parse_cpu_list

RANK_LINE = re.compile(r"^\[(?:[a-z]+)?(\d+)\]:(.*)$")


@dataclass(frozen=True)
class NodeFiles:
    """Where one node's run leaves its traces on the guest: a function of the run folder
    and the node's name alone, so the launch line can name them before the launch exists."""

    run_dir: str
    name: str

    @property
    def pid_file(self) -> str:
        return f"{self.run_dir}/node-{self.name}.pid"

    @property
    def exit_file(self) -> str:
        return f"{self.run_dir}/node-{self.name}.exit"

    @property
    def log_file(self) -> str:
        return f"{self.run_dir}/logs/{self.name}/torchrun.log"

    @property
    def lock_dir(self) -> str:
        return f"{self.run_dir}/../.lock-{self.name}"

    @property
    def spec_file(self) -> str:
        """The node's worker spec (vcfslm.runspec.WorkerSpec), which its ranks read."""
        return f"{self.run_dir}/spec-{self.name}.json"


@dataclass(frozen=True)
class RankPlacement:
    """Threads per rank and where each local rank runs: what a launch starts, and what a
    rendered rank.sh applies (templates/rank.sh.j2). The two are written at different
    times (rank.sh when the guest stage ran, the launch now), so the preflight compares them."""

    threads: int | None               # None: a rank.sh that sets no OMP_NUM_THREADS
    slots: tuple[RankSlot, ...]


@dataclass(frozen=True)
class NodeLaunch:
    """Everything needed to start, poll, stop and collect one node of a run."""

    index: int
    name: str
    address: str                      # management IP (SSH)
    bench_ip: str
    run_dir: str                      # remote run directory (shared layout on every node)
    launch_command: str
    global_ranks: tuple[int, ...]
    torchrun_argv: tuple[str, ...] = field(default=(), compare=False)
    placement: RankPlacement | None = field(default=None, compare=False)
    rdzv_timeout_s: int | None = field(default=None, compare=False)
    spec: WorkerSpec | None = field(default=None, compare=False)   # what the node's ranks read

    @property
    def files(self) -> NodeFiles:
        return NodeFiles(self.run_dir, self.name)

    @property
    def pid_file(self) -> str:
        return self.files.pid_file

    @property
    def exit_file(self) -> str:
        return self.files.exit_file

    @property
    def log_file(self) -> str:
        return self.files.log_file

    @property
    def lock_dir(self) -> str:
        return self.files.lock_dir


def worker_args(spec_file: str, node: str) -> list[str]:
    """Arguments of `python -m vcfslm.bench.worker` (after the rank wrapper): the node's
    worker spec (vcfslm.runspec.WorkerSpec, one JSON file in the run folder) and the node's
    name; the rest each rank reads from torchrun's environment."""
    return ["--spec", spec_file, "--node", node]


@dataclass(frozen=True)
class Rendezvous:
    """Where and how one node's torchrun meets the others: a static rendezvous on node 0's
    bench IP. timeout_s: how long node 0's agent waits for every node (and the others for
    node 0's store); None: torchrun's default (900 s)."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout_s: int | None = None


def torchrun_argv(torchrun: Sequence[str], rdzv: Rendezvous, *, rank_script: str, log_dir: str,
                  args: Sequence[str]) -> list[str]:
    """torchrun with a static rendezvous on node 0's bench IP and the rank wrapper.

    torchrun: how to start it, e.g. [venv python, "-m", "torch.distributed.run"] (the module
    works wherever torch imports; the console script may live elsewhere). The static backend
    reads only `timeout` from --rdzv-conf (join_timeout and read_timeout belong to the
    c10d/etcd backends).
    """
    conf = ["--rdzv-conf", f"timeout={int(rdzv.timeout_s)}"] if rdzv.timeout_s is not None else []
    return [*torchrun, "--nnodes", str(rdzv.nnodes), "--nproc-per-node", str(rdzv.nproc_per_node),
            "--node-rank", str(rdzv.node_rank), "--master-addr", rdzv.master_addr,
            "--master-port", str(rdzv.master_port), *conf, "--max-restarts", "0",
            "--log-dir", log_dir, "--redirects", "3", "--tee", "3",
            # "--" keeps torchrun's parser off the worker's options (--node vs --node-rank).
            "--no-python", rank_script, "--", *args]


def detached(argv: Sequence[str], *, run_dir: str, pid_file: str, exit_file: str, log_file: str,
             env: dict[str, str] | None = None, pid_copy: str | None = None,
             files: dict[str, str] | None = None) -> str:
    """Shell that starts argv in its own session, records its pid and, later, its exit code.

    pid_copy: a second file that gets the pid in the same round trip (the bench lock's, so a
    later run can tell a live holder from a stale lock). files: path -> text, written before
    argv starts (the node's worker spec), in the same round trip.
    """
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted((env or {}).items()))
    inner = f"{exports}{shlex.join(argv)}; echo $? > {shlex.quote(exit_file)}.tmp && " \
            f"mv {shlex.quote(exit_file)}.tmp {shlex.quote(exit_file)}"
    log_parent = log_file.rsplit("/", 1)[0]
    # Separate statements: a `&&` chain ending in `&` would background the mkdir too.
    writes = "".join(f"printf '%s\\n' {shlex.quote(text)} > {shlex.quote(path)} || exit 1; "
                     for path, text in sorted((files or {}).items()))
    return (f"mkdir -p {shlex.quote(run_dir)}/pids {shlex.quote(log_parent)} || exit 1; "
            f"{writes}rm -f {shlex.quote(exit_file)}; "
            f"setsid nohup bash -c {shlex.quote(inner)} > {shlex.quote(log_file)} 2>&1 < /dev/null & "
            f"echo $! > {shlex.quote(pid_file)}; "
            + (f"cp {shlex.quote(pid_file)} {shlex.quote(pid_copy)} 2>/dev/null; " if pid_copy else "")
            + f"cat {shlex.quote(pid_file)}")


# ------------------------------------------------------------------ the rank wrapper's placement

_OMP_THREADS = re.compile(r"^\s*export OMP_NUM_THREADS=(\d+)\s*$", re.M)
# One `case` arm per local rank, as templates/rank.sh.j2 renders it.
_RANK_ARM = re.compile(r"^\s*(\d+)\) NUMA_NODE=(\d+); CPUS='([^']*)'; BIND='(\w+)' ;;\s*$", re.M)


def parse_rank_script(text: str) -> RankPlacement:
    """The threads per rank (OMP_NUM_THREADS) and per-rank placement a rendered rank.sh applies."""
    threads = _OMP_THREADS.search(text)
    slots = tuple(RankSlot(int(m.group(1)), int(m.group(2)), parse_cpu_list(m.group(3)), m.group(4))
                  for m in _RANK_ARM.finditer(text))
    return RankPlacement(int(threads.group(1)) if threads else None, slots)


def placement_mismatches(rendered: RankPlacement, launch: RankPlacement, global_ranks: Sequence[int],
                         script: str) -> list[str]:
    """Where the rank wrapper at `script` would place ranks other than the launch does, one
    message per difference naming the rank and both values (empty: they agree). A rank.sh
    rendered for another inventory would pin the workers to the wrong threads or node."""
    fix = "(re-render it: vcfslm provision --stage guests)"
    out = []
    if rendered.threads != launch.threads:
        seen = "no" if rendered.threads is None else str(rendered.threads)
        out.append(f"{script} runs {seen} threads per rank (OMP_NUM_THREADS), the launch "
                   f"{launch.threads} (bench.threads_per_rank) {fix}")
    have = {slot.local_rank: slot for slot in rendered.slots}
    for want in launch.slots:
        who = f"local rank {want.local_rank} (rank {global_ranks[want.local_rank]})"
        got = have.get(want.local_rank)
        if got is None:
            out.append(f"{script} has no placement for {who}; the launch starts {len(launch.slots)} "
                       f"rank(s) per node {fix}")
            continue
        for label, seen, wanted in (("NUMA node", got.numa_node, want.numa_node),
                                    ("CPUs", got.cpu_list, want.cpu_list),
                                    ("binding", got.bind, want.bind)):
            if seen != wanted:
                out.append(f"{script} puts {who} on {label} {seen}, the launch on {label} {wanted} {fix}")
    return out


# ------------------------------------------------------------------ driving a node


def poll_command(launch: NodeLaunch, offset: int) -> str:
    """One round trip: exit code (or 'running'/'gone') then the log from byte `offset`."""
    pid, ex, log = (shlex.quote(p) for p in (launch.pid_file, launch.exit_file, launch.log_file))
    return (f"if [ -f {ex} ]; then echo EXIT $(cat {ex}); "
            f"elif [ -f {pid} ] && kill -0 $(cat {pid}) 2>/dev/null; then echo RUNNING; "
            f"else echo GONE; fi; tail -c +{offset + 1} {log} 2>/dev/null || true")


def stop_command(launch: NodeLaunch, grace_s: int = 10) -> str:
    """TERM the node's process group and every recorded worker pid, then KILL what is left."""
    pid = shlex.quote(launch.pid_file)
    ranks = " ".join(f"{launch.run_dir}/pids/rank-{r}.pid" for r in launch.global_ranks)
    targets = (f"t=''; [ -f {pid} ] && t=\"-$(cat {pid})\"; "
               f"for f in {ranks}; do [ -f \"$f\" ] && t=\"$t $(cat \"$f\")\"; done; ")
    return (f"{targets}"
            f"if [ -n \"$t\" ]; then kill -TERM -- $t 2>/dev/null; "
            f"for i in $(seq {grace_s * 5}); do alive=''; for p in $t; do "
            f"kill -0 -- $p 2>/dev/null && alive=1; done; [ -z \"$alive\" ] && break; sleep 0.2; done; "
            f"kill -KILL -- $t 2>/dev/null; fi; true")


def lock_command(launch: NodeLaunch, run_id: str) -> str:
    """Take this node's bench lock (mkdir is atomic); a stale lock of a dead pid is taken over."""
    lock = shlex.quote(launch.lock_dir)
    return (f"mkdir -p {shlex.quote(launch.run_dir)}/.. && "
            f"if mkdir {lock} 2>/dev/null; then echo {shlex.quote(run_id)} > {lock}/run; echo LOCKED; "
            f"else held=$(cat {lock}/run 2>/dev/null); pidf={lock}/pid; "
            f"if [ -f \"$pidf\" ] && kill -0 $(cat \"$pidf\") 2>/dev/null; then echo HELD $held; "
            f"else echo {shlex.quote(run_id)} > {lock}/run; rm -f \"$pidf\"; echo LOCKED; fi; fi")


def unlock_command(launch: NodeLaunch) -> str:
    return f"rm -rf {shlex.quote(launch.lock_dir)}"


def parse_poll(stdout: str) -> tuple[str, int | None, str]:
    """(state, exit code, new log text) from poll_command's output."""
    head, _, rest = stdout.partition("\n")
    head = head.strip()
    if head.startswith("EXIT"):
        try:
            return "exited", int(head.split()[1]), rest
        except (IndexError, ValueError):
            return "exited", -1, rest
    return ("running" if head == "RUNNING" else "gone"), None, rest


def split_rank_line(line: str) -> tuple[int | None, str]:
    """torchrun's teed '[default3]:text' -> (3, 'text'); other lines -> (None, line)."""
    m = RANK_LINE.match(line)
    return (int(m.group(1)), m.group(2)) if m else (None, line)


def report_event(reporter, tracker, subject: str, event: dict, now: float | None = None) -> None:
    """One worker event to the reporter: the rank's line as detail (a failure as a status
    everyone sees), the run's position as Progress when `tracker` moves."""
    import time

    from ..progress import emit_detail, emit_progress

    if event.get("phase") == "failed":
        reporter.update(subject, progress_status(event))
    else:
        emit_detail(reporter, subject, progress_status(event))
    if tracker is not None:
        p = tracker.feed(event, time.monotonic() if now is None else now)
        if p is not None:
            emit_progress(reporter, p)


def progress_status(event: dict) -> str:
    """One human line for a progress event (what the reporter shows per rank)."""
    phase = event.get("phase", "?")
    if "load" in event and phase in ("warmup", "serve", "skip"):
        unit = "req/s" if event.get("load_kind") == "rate" else "users"
        head = f"serve {event.get('load')} {unit} in={event.get('input_tokens')}: {phase}"
        if phase != "skip":
            head += (f" {event.get('window')}  {event.get('completed')}/{event.get('offered')} done  "
                     f"TTFT p90 {event.get('ttft_s_p90')} s  TPOT p90 {event.get('tpot_ms_p90')} ms  "
                     f"busy {event.get('mean_active')}")
            if not event.get("valid", True):
                head += "  (invalid)"
        return head
    if phase in ("warmup", "measure", "skip", "done"):
        head = (f"scenario {event.get('scenario')}/{event.get('scenarios')} "
                f"b={event.get('batch')} in={event.get('input_tokens')}: {phase}")
        if phase in ("warmup", "measure"):
            head += (f" {event.get('window')}  TPOT {event.get('tpot_ms_p50')} ms  "
                     f"TTFT {event.get('ttft_s_p50')} s  {event.get('rank_tps')} tok/s")
            if not event.get("valid", True):
                head += "  (invalid)"
        return head
    if phase == "swept":
        return f"sweep {event.get('slo')} in={event.get('input_tokens')}: stopped: {event.get('reason')}"
    if phase == "probed":
        head = f"bandwidth read {event.get('read_gbs')} GB/s, triad {event.get('triad_gbs')} GB/s"
        if event.get("steadiness") == BUSY:
            head += "  (probed on a busy machine: see the report's validity warnings)"
        return head
    if phase == "loaded":
        return f"model loaded in {event.get('load_s')} s"
    if phase == "chunked":
        return (f"prompt pieces of at most {event.get('chunk_tokens')} tokens per step (from {event.get('from')}), "
                f"{event.get('batched_tokens')} under a backlog")
    if phase == "failed":
        return f"failed: {event.get('error')}"
    return phase
