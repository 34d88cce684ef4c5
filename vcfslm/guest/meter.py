"""Progress of long guest operations, sent to the reporter: bytes pushed by a step's
uploads (one meter over all its files, since a model folder is many shards), and the
elapsed time of a command that runs long (a pip install of torch).

The reporter renders (vcfslm.cli); here only the records and their cadence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..progress import Progress, due, emit_progress, transfer_eta

EMIT_EVERY_S = 0.5        # a terminal bar needs no more; lines off a terminal throttle further
QUIET_FOR_S = 10.0        # a command this short needs no "still running" record
HEARTBEAT_EVERY_S = 1.0


class TransferMeter:
    """Bytes of a set of uploads, reported as one Progress per host and step.

    clock: seconds (time.monotonic); tests pass their own.
    """

    def __init__(self, reporter, subject: str, label: str, total: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter, self.subject, self.label, self.total = reporter, subject, label, total
        self._clock = clock
        self._started = clock()
        self._base = 0            # bytes of the files already finished
        self._done = 0
        self._last_at: float | None = None
        self._last_fraction: float | None = None

    def _record(self, final: bool = False) -> Progress:
        elapsed = self._clock() - self._started
        return Progress(self.subject, self.label, self._done, self.total, "B", elapsed,
                        eta_s=None if final else transfer_eta(self._done, self.total, elapsed),
                        final=final)

    def file_callback(self) -> Callable[[int], None]:
        """A callback for the next file: bytes of that file sent so far."""
        base = self._base

        def sent(n: int) -> None:
            self._done = base + n
            now = self._clock()
            fraction = self._done / self.total if self.total else None
            if due(self._last_at, self._last_fraction, now, fraction, every_s=EMIT_EVERY_S):
                self._last_at, self._last_fraction = now, fraction
                emit_progress(self.reporter, self._record())

        return sent

    def file_done(self, size: int) -> None:
        self._base += size
        self._done = self._base

    def finish(self) -> None:
        emit_progress(self.reporter, self._record(final=True))


def heartbeat_due(elapsed_s: float, quiet_for_s: float = QUIET_FOR_S) -> bool:
    """Whether a running command has run long enough to be worth a record."""
    return elapsed_s >= quiet_for_s


class Heartbeat:
    """While a command runs, a Progress with its elapsed time (unit "s", no total) every
    second once it has run QUIET_FOR_S; a final record when it ends, if any was sent."""

    def __init__(self, reporter, subject: str, label: str, *, every_s: float = HEARTBEAT_EVERY_S,
                 quiet_for_s: float = QUIET_FOR_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter, self.subject, self.label = reporter, subject, label
        self.every_s, self.quiet_for_s, self._clock = every_s, quiet_for_s, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self.sent = 0

    def _tick(self) -> None:
        elapsed = self._clock() - self._started
        if heartbeat_due(elapsed, self.quiet_for_s):
            self.sent += 1
            emit_progress(self.reporter, Progress(self.subject, self.label, elapsed, None, "s", elapsed))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._tick()

    def __enter__(self) -> Heartbeat:
        self._started = self._clock()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.subject}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.sent:
            elapsed = self._clock() - self._started
            emit_progress(self.reporter, Progress(self.subject, self.label, elapsed, None, "s", elapsed,
                                                  final=True))
