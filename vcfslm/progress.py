"""Progress reporting seam: library code reports here, the CLI renders it (rich).

Nothing below the CLI prints; drivers call `reporter.update(subject, status)` for
per-subject state (one line per VM, host or rank), `reporter.log(message)` for
events worth keeping in the scrollback, and `emit_progress(reporter, Progress)` for
work with a size (bytes pushed, bench windows) or only a duration (a long install).
`emit_detail(reporter, subject, status)` is for fine-grained state (one rank of a
bench) that the CLI shows only when asked (-v).

Reporters may implement `progress` and `detail`; the helpers fall back to `update`
for those that do not, so every reporter keeps working.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol


class Reporter(Protocol):
    def update(self, subject: str, status: str) -> None:
        """Set the current status line of `subject` (a VM, a host, a rank)."""

    def log(self, message: str) -> None:
        """Record one event line."""


@dataclass(frozen=True)
class Progress:
    """How far one piece of work is.

    subject: who does it (a host, "bench"); label: what ("model: push 3 files");
    done/total: in `unit` ("B" bytes, "windows", ...), total None when unknown;
    eta_s: seconds left when the producer can tell; final: the work has ended.
    """

    subject: str
    label: str
    done: float
    total: float | None
    unit: str
    elapsed_s: float
    eta_s: float | None = None
    final: bool = False

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(1.0, max(0.0, self.done / self.total))

    @property
    def rate(self) -> float | None:
        """`unit` per second so far."""
        return self.done / self.elapsed_s if self.elapsed_s > 0 else None


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, 3 significant figures)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"  # pragma: no cover - loop always returns


def format_duration(seconds: float) -> str:
    """65 -> '1m05s'; 3725 -> '1h02m'; 9.4 -> '9s'."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def describe(p: Progress) -> str:
    """One plain line for a Progress (what a reporter without `progress` shows)."""
    if p.unit == "B":
        amount = f"{format_bytes(p.done)}" + (f" / {format_bytes(p.total)}" if p.total else "")
    elif p.total is None and p.unit == "s":
        amount = ""
    else:
        amount = f"{p.done:g}" + (f"/{p.total:g}" if p.total else "") + f" {p.unit}"
    parts = [p.label]
    if amount:
        parts.append(amount)
    if p.fraction is not None:
        parts.append(f"{p.fraction:.0%}")
    if p.unit == "B" and p.rate is not None:
        parts.append(f"{format_bytes(p.rate)}/s")
    parts.append(("done in " if p.final else "elapsed ") + format_duration(p.elapsed_s))
    if p.eta_s is not None and not p.final:
        parts.append(f"ETA {format_duration(p.eta_s)}")
    return ", ".join(parts)


def transfer_eta(done: float, total: float | None, elapsed_s: float) -> float | None:
    """Seconds left at the average rate so far (None before anything moved)."""
    if not total or done <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, (total - done) * elapsed_s / done)


def due(last_at: float | None, last_fraction: float | None, now: float, fraction: float | None,
        *, every_s: float, every_fraction: float | None = None) -> bool:
    """Whether a throttled progress line is due: the first one, `every_s` seconds since the
    last, or `every_fraction` more of the work done since the last."""
    if last_at is None:
        return True
    if now - last_at >= every_s:
        return True
    return (every_fraction is not None and fraction is not None and last_fraction is not None
            and fraction - last_fraction >= every_fraction)


def emit_progress(reporter, progress: Progress) -> None:
    """Send `progress` to the reporter (as a status line if it has no `progress`)."""
    method = getattr(reporter, "progress", None)
    if method is not None:
        method(progress)
    else:
        reporter.update(progress.subject, describe(progress))


def emit_detail(reporter, subject: str, status: str) -> None:
    """Fine-grained status (shown with -v); a plain update for reporters without `detail`."""
    method = getattr(reporter, "detail", None)
    if method is not None:
        method(subject, status)
    else:
        reporter.update(subject, status)


class NullReporter:
    """Discards everything (library default)."""

    def update(self, subject: str, status: str) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def progress(self, progress: Progress) -> None:
        pass

    def detail(self, subject: str, status: str) -> None:
        pass


class RecordingReporter:
    """Keeps every call; thread-safe; for tests and for summaries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.updates: list[tuple[str, str]] = []
        self.messages: list[str] = []
        self.progresses: list[Progress] = []
        self.details: list[tuple[str, str]] = []

    def update(self, subject: str, status: str) -> None:
        with self._lock:
            self.updates.append((subject, status))

    def log(self, message: str) -> None:
        with self._lock:
            self.messages.append(message)

    def progress(self, progress: Progress) -> None:
        with self._lock:
            self.progresses.append(progress)

    def detail(self, subject: str, status: str) -> None:
        with self._lock:
            self.details.append((subject, status))

    def last(self, subject: str) -> str | None:
        with self._lock:
            for s, status in reversed(self.updates):
                if s == subject:
                    return status
        return None
