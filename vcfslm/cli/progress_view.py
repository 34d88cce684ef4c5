"""Rendering library progress (vcfslm.progress) for people: bars on a terminal, periodic
whole lines off one.

Off a terminal, a line is printed when it says something new: bytes every 10% or 30 s,
a bench at each new scenario, a long command every 30 s, and always the last one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.progress_bar import ProgressBar

from ..progress import Progress, describe, due

BYTES_EVERY_S = 30.0
BYTES_EVERY_FRACTION = 0.10
QUIET_EVERY_S = 30.0


@dataclass
class _Last:
    at: float
    fraction: float | None
    label: str


def line_due(last: _Last | None, p: Progress, now: float) -> bool:
    """Whether Progress `p` deserves a line off a terminal, given the last line of its key."""
    if p.final or last is None:
        return True
    if p.unit == "windows":  # a bench: one line per scenario (its label names it)
        return p.label != last.label
    if p.label != last.label:
        return True
    if p.unit == "B":
        return due(last.at, last.fraction, now, p.fraction, every_s=BYTES_EVERY_S,
                   every_fraction=BYTES_EVERY_FRACTION)
    return due(last.at, last.fraction, now, p.fraction, every_s=QUIET_EVERY_S)


class ProgressLines:
    """Throttles Progress records into the lines worth printing off a terminal."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], _Last] = {}

    def take(self, p: Progress) -> str | None:
        """The line to print for `p`, or None when it says nothing new yet."""
        now = self._clock()
        key = (p.subject, p.unit)
        with self._lock:
            if not line_due(self._last.get(key), p, now):
                return None
            if p.final:
                self._last.pop(key, None)
            else:
                self._last[key] = _Last(now, p.fraction, p.label)
        return f"{p.subject}: {describe(p)}"


def bar(p: Progress, width: int = 24) -> ProgressBar:
    """A bar for a live table row (pulsing while the size is unknown)."""
    if p.total:
        return ProgressBar(total=p.total, completed=min(p.done, p.total), width=width)
    return ProgressBar(total=None, width=width, pulse=not p.final)


class TerminalBars:
    """rich progress bars on a terminal, one per (subject, unit); text lines print above."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._lock = threading.Lock()
        self._bars: RichProgress | None = None
        self._tasks: dict[tuple[str, str], int] = {}

    def show(self, p: Progress) -> None:
        with self._lock:
            if self._bars is None:
                self._bars = RichProgress(
                    TextColumn("[bold]{task.fields[subject]}[/bold]"), BarColumn(),
                    TextColumn("{task.description}"), console=self._console, transient=False)
                self._bars.start()
            key = (p.subject, p.unit)
            text = escape(describe(p))
            if key not in self._tasks:
                self._tasks[key] = self._bars.add_task(text, total=p.total, subject=escape(p.subject))
            task = self._tasks[key]
            self._bars.update(task, description=text, completed=p.done, total=p.total)
            if p.final:
                if not p.total:
                    self._bars.update(task, total=1, completed=1)
                del self._tasks[key]

    def close(self) -> None:
        with self._lock:
            if self._bars is not None:
                self._bars.stop()
                self._bars = None
                self._tasks.clear()
