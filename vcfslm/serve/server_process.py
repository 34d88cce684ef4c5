"""One HTTP server's process on this VM: started from its node's launch script, waited for,
watched, measured and stopped, exactly the one that was started.

The rank that drives a server starts it, so their lives are tied: the server runs in a
session of its own (a Ctrl-C to the bench reaches it only through the rank), receives
SIGTERM when its rank dies however it dies (PR_SET_PDEATHSIG: torchrun's SIGKILL of a
hung rank included), and is stopped by its process group when the rank is done, SIGTERM
first, SIGKILL after a grace period. The launch script execs the server, so the pid
this module holds is the server's own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import BenchError

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 20.0
HEALTH_POLL_S = 1.0
LOG_TAIL_LINES = 25


def _child_setup(cpus: Sequence[int] | None) -> Callable[[], None]:
    def setup() -> None:  # pragma: no cover - runs in the child between fork and exec
        _die_with_parent()
        if cpus:
            # The node's CPUs: the rank's own thread may have been bound to one core by OpenMP.
            os.sched_setaffinity(0, cpus)
    return setup


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class ServerProcess:
    """A started server: its pid, its log, and how to reach it."""

    popen: subprocess.Popen
    log_path: Path
    label: str                          # e.g. "vllm on vNUMA node 0"
    started_at: float

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def check_alive(self) -> None:
        """BenchError (with the log's tail) when the server has exited."""
        code = self.exit_code()
        if code is not None:
            raise BenchError(f"{self.label} (pid {self.pid}) exited with code {code}; its log "
                             f"{self.log_path} ends:\n{log_tail(self.log_path)}")

    def wait_healthy(self, probe: Callable[[], bool], timeout_s: float,
                     sleep: Callable[[float], None] = time.sleep) -> float:
        """Seconds from launch until `probe()` is true; BenchError when the server exits or
        the timeout passes first (it is then stopped)."""
        while True:
            self.check_alive()
            if probe():
                return time.monotonic() - self.started_at
            if time.monotonic() - self.started_at > timeout_s:
                self.stop()
                raise BenchError(f"{self.label} (pid {self.pid}) was not healthy {timeout_s:g} s after "
                                 f"launch; its log {self.log_path} ends:\n{log_tail(self.log_path)}")
            sleep(HEALTH_POLL_S)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """Stop the server and everything it started (its process group); its exit code."""
        if self.popen.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.popen.wait(5)
        # Children it left behind in its group (an engine process) go too.
        _signal_group(self.pid, signal.SIGKILL)
        return self.popen.returncode

    def peak_rss_bytes(self) -> dict[str, int]:
        """VmHWM of the server and each process under it, by pid (the worker holds the weights)."""
        return {str(pid): hwm for pid in [self.pid, *descendants(self.pid)]
                if (hwm := vm_field(pid, "VmHWM")) is not None}


def start(script: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, label: str,
          cpus: Sequence[int] | None = None) -> ServerProcess:
    """Launch `script argv...` with `env` added to this process's environment, its output to
    log_path, on `cpus` (the script binds itself within them)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(["bash", script, *argv], stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, **env},
                                 preexec_fn=_child_setup(cpus), close_fds=True)
    return ServerProcess(popen, log_path, label, time.monotonic())


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def vm_field(pid: int, name: str) -> int | None:
    """A /proc/<pid>/status memory field (VmHWM, VmRSS) in bytes; None when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
