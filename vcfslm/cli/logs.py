"""`-v` / `-vv`: the package's log records on stderr, through the console's line policy.

    (none)  warnings only
    -v      info: what each stage decided (and the per-rank progress lines)
    -vv     debug: vCenter session retries and tasks, SSH connects and reconnects,
            compile events of the rank engine (in each rank's own log on the guest)

Only `vcfslm.*` loggers are configured; third-party libraries keep their own level.
"""

from __future__ import annotations

import logging

from .console import LINE_ENDS

LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class StderrLines(logging.Handler):
    """Each record as one whole line on stderr, after any open stdout line has ended."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            LINE_ENDS.write("stderr", self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never take the command down
            self.handleError(record)


def configure_logging(verbose: int) -> logging.Handler:
    """Route `vcfslm.*` records at the level `verbose` asks for; returns the handler.

    Idempotent: a second call (a second command in one process, as in tests) replaces
    the handler rather than adding another."""
    logger = logging.getLogger("vcfslm")
    for old in [h for h in logger.handlers if isinstance(h, StderrLines)]:
        logger.removeHandler(old)
    handler = StderrLines()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(LEVELS[min(max(verbose, 0), len(LEVELS) - 1)])
    return handler
