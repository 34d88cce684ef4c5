"""Background processes of the lab: start detached, recognise by pid, stop exactly those.

A pid alone is not an identity (pids are reused), so every started process is
recorded as a `ProcessRecord` with its start time (field 22 of /proc/<pid>/stat)
and a marker string its command line must contain. Nothing here matches
processes by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessRecord:
    """A process the lab started: pid, its start time (clock ticks since boot), a cmdline marker."""

    pid: int
    start_time: int
    marker: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> ProcessRecord:
        return cls(int(data["pid"]), int(data["start_time"]), str(data["marker"]))


def start_detached(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
                   cwd: Path | None = None) -> subprocess.Popen:
    """Start argv in its own session (it outlives the caller), output appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=dict(env) if env is not None else None, cwd=cwd,
                                start_new_session=True, close_fds=True)


def read_stat(pid: int, proc: Path = PROC) -> tuple[str, int, int] | None:
    """(state, ppid, start_time) of a pid from /proc, or None when it does not exist."""
    try:
        raw = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    return parse_stat(raw)


def parse_stat(raw: str) -> tuple[str, int, int] | None:
    """Parse /proc/<pid>/stat; the command name may contain spaces and parentheses."""
    close = raw.rfind(")")
    if close < 0:
        return None
    fields = raw[close + 2:].split()
    # fields[0] is field 3 (state); ppid is field 4; starttime is field 22.
    try:
        return fields[0], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def read_cmdline(pid: int, proc: Path = PROC) -> list[str]:
    """argv of a pid ([] when gone or unreadable)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def record(pid: int, marker: str, proc: Path = PROC) -> ProcessRecord:
    """The identity of a just-started process."""
    stat = read_stat(pid, proc)
    return ProcessRecord(pid, stat[2] if stat else 0, marker)


def is_alive(rec: ProcessRecord, proc: Path = PROC) -> bool:
    """True when the recorded process still runs: same pid, same start time, marker in cmdline."""
    _reap(rec.pid)
    stat = read_stat(rec.pid, proc)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    if rec.start_time and stat[2] != rec.start_time:
        return False
    return any(rec.marker in arg for arg in read_cmdline(rec.pid, proc))


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Pids of every live descendant of pid (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e.name for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        stat = read_stat(int(name), proc)
        if stat is not None and stat[0] not in ("Z", "X"):
            children.setdefault(stat[1], []).append(int(name))
    out: list[int] = []
    queue = list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        out.append(child)
        queue.extend(children.get(child, []))
    return out


def terminate(records: Sequence[ProcessRecord], timeout: float = 5.0,
              proc: Path = PROC) -> list[ProcessRecord]:
    """Stop recorded processes and what they spawned (SIGTERM, then SIGKILL after timeout).

    Returns the records that were alive. Descendants (e.g. the session processes of
    an sshd guest) are found before their parent dies, identified by start time,
    so a recycled pid is never signalled.
    """
    alive = [r for r in records if is_alive(r, proc)]
    targets: list[ProcessRecord] = []
    for rec in alive:
        targets.append(rec)
        for child in descendants(rec.pid, proc):
            stat = read_stat(child, proc)
            if stat is not None:
                targets.append(ProcessRecord(child, stat[2], ""))
    for target in targets:
        _signal(target, signal.SIGTERM, proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_running(t, proc) for t in targets):
        time.sleep(0.05)
    for target in targets:
        if _running(target, proc):
            _signal(target, signal.SIGKILL, proc)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_running(t, proc) for t in targets):
        time.sleep(0.05)
    return alive


def _running(rec: ProcessRecord, proc: Path) -> bool:
    """Same process still there (start time matches) and not a zombie."""
    _reap(rec.pid)
    stat = read_stat(rec.pid, proc)
    return (stat is not None and stat[0] not in ("Z", "X")
            and (rec.start_time == 0 or stat[2] == rec.start_time))


def _signal(rec: ProcessRecord, sig: int, proc: Path) -> None:
    if _running(rec, proc):
        try:
            os.kill(rec.pid, sig)
        except ProcessLookupError:
            pass


def _reap(pid: int) -> None:
    """Collect the exit status when pid is our own child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    except OSError:
        pass
