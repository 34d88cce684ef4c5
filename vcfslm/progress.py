"""Progress reporting seam: library code reports here, the CLI renders it (rich).

Nothing below the CLI prints; drivers call `reporter.update(subject, status)` for
per-subject state (one line per VM, host or rank) and `reporter.log(message)` for
events worth keeping in the scrollback.
"""

from __future__ import annotations

import threading
from typing import Protocol


class Reporter(Protocol):
    def update(self, subject: str, status: str) -> None:
        """Set the current status line of `subject` (a VM, a host, a rank)."""

    def log(self, message: str) -> None:
        """Record one event line."""


class NullReporter:
    """Discards everything (library default)."""

    def update(self, subject: str, status: str) -> None:
        pass

    def log(self, message: str) -> None:
        pass


class RecordingReporter:
    """Keeps every call; thread-safe; for tests and for summaries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.updates: list[tuple[str, str]] = []
        self.messages: list[str] = []

    def update(self, subject: str, status: str) -> None:
        with self._lock:
            self.updates.append((subject, status))

    def log(self, message: str) -> None:
        with self._lock:
            self.messages.append(message)

    def last(self, subject: str) -> str | None:
        with self._lock:
            for s, status in reversed(self.updates):
                if s == subject:
                    return status
        return None
