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
import re
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
LOG_TAIL_LINES = 25                 # a log's end, quoted when it holds no error
CAUSE_TAIL_LINES = 8                # ... beside the first error when it does
MAX_CAUSE_LINES = 40                # a longer traceback keeps its head and the frames nearest the raise
CAUSE_HEAD_LINES = 6
TRACEBACK = "Traceback (most recent call last)"
# A line that says something failed: an error-level log line (vLLM's "(EngineCore pid=7)
# ERROR 12-06 ...", uvicorn's "ERROR:    ..."), or an exception's own line at its start
# ("IndexError: ...", after a process tag). Words like "error" inside a warning's prose
# (vLLM's ulimit warning quotes "OSError: [Errno 24]") are not one.
_ERROR_LEVEL = re.compile(r"(^|[\s\]])(ERROR|CRITICAL|FATAL)(:|\s|$)")
_EXCEPTION_LINE = re.compile(r"^(\([^)]*\)\s+)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(:|$)")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


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
                             f"{self.log_path}{log_quote(self.log_path)}")

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
                                 f"launch; its log {self.log_path}{log_quote(self.log_path)}")
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


def log_quote(path: Path) -> str:
    """What of a dead server's log an error quotes (`quote_log`), or that there is none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ": (no log)"
    return quote_log(text)


def quote_log(text: str, tail: int = CAUSE_TAIL_LINES) -> str:
    """A log's first error block (`first_error`) and its last `tail` lines, to follow the
    log's name in an error message; its last LOG_TAIL_LINES lines when it holds no error.

    The cause comes first: a server that dies says why once and then keeps writing (vLLM's
    API server reports the dead engine, shuts down, and the interpreter's exit prints
    hundreds of nanobind leak lines), so the log's end rarely holds it."""
    lines = text.splitlines()
    block = first_error(lines)
    if not block:
        return " ends:\n" + "\n".join(lines[-LOG_TAIL_LINES:])
    end = block[-1]
    later = sum(1 for line in lines[end + 1:] if TRACEBACK in line)
    where = f"line {block[0] + 1} of {len(lines)}" + (f"; {later} more traceback(s) after it" if later else "")
    cause = [lines[i] for i in block]
    if len(cause) > MAX_CAUSE_LINES:
        keep = MAX_CAUSE_LINES - CAUSE_HEAD_LINES
        cause = [*cause[:CAUSE_HEAD_LINES], f"... ({len(cause) - MAX_CAUSE_LINES} lines)", *cause[-keep:]]
    rest = lines[end + 1:][-tail:] if tail > 0 else []
    skipped = len(lines) - end - 1 - len(rest)
    out = [f", from its first error ({where}):", *cause]
    if rest and skipped:
        out.append(f"... {skipped} line(s), then its last {len(rest)}:")
    return "\n".join([*out, *rest])


def first_error(lines: Sequence[str]) -> list[int]:
    """The indices of a log's first error block (empty: none): from its first traceback (and
    the error line that announced it) through the exception it raised, chained ones
    included; without a traceback, its first error line and what continues it.

    Log prefixes are allowed for: a line belongs to the traceback when it carries the prefix
    its "Traceback" line had, digits aside (vLLM repeats "(EngineCore pid=7) ERROR 12-06
    10:00:01 [core.py:842] " on every line of a record); lines without it (another process
    writing meanwhile) are left out."""
    at = next((i for i, line in enumerate(lines) if TRACEBACK in line), None)
    if at is None:
        return _error_lines(lines)
    prefix = lines[at][:lines[at].index(TRACEBACK)]
    shape = re.compile(re.sub(r"\d+", r"\\d+", re.escape(prefix)))

    def body(i: int) -> str | None:
        m = shape.match(lines[i])
        return None if m is None else lines[i][m.end():]

    block = [at - 1, at] if at > 0 and body(at - 1) is not None and _is_error(lines[at - 1]) else [at]
    for i in range(at + 1, len(lines)):
        text = body(i)
        if text is None or not text.strip():
            continue
        block.append(i)
        if text.startswith((" ", "\t", TRACEBACK, *_CHAINED)):
            continue                          # a frame, or the next exception of a chain
        # The exception's own line: the block ends here unless a chained one follows.
        following = next((t for j in range(i + 1, len(lines)) if (t := body(j)) and t.strip()), "")
        if not following.startswith(_CHAINED):
            break
    return block


def _is_error(line: str) -> bool:
    return bool(_ERROR_LEVEL.search(line) or _EXCEPTION_LINE.match(line))


def _error_lines(lines: Sequence[str], most: int = 10) -> list[int]:
    """The first error line and the indented or error lines right after it (at most `most`)."""
    first = next((i for i, line in enumerate(lines) if _is_error(line)), None)
    if first is None:
        return []
    end = first
    while end + 1 < len(lines) and end - first + 1 < most and (
            lines[end + 1].startswith((" ", "\t")) or _is_error(lines[end + 1])):
        end += 1
    return list(range(first, end + 1))


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
