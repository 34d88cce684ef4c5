"""The error tree. Everything vcfslm raises on purpose derives from VcfslmError.

    VcfslmError                     exit 1 unless a subclass says otherwise
    ├── InventoryError              exit 2: bad user input (inventory, playbook, CSV, flags);
    │                                carries one Problem per finding, all at once
    ├── VCenterError                vCenter refused or failed (preflight, a task, the session)
    │   └── PreflightError          read-only checks failed; nothing was changed
    ├── TransportError              SSH could not connect / lost the connection
    │   ├── HostKeyError            unknown or changed host key (refused)
    │   └── CommandFailed(result)   a remote command exited non-zero
    ├── PlaybookError               a playbook step failed on a host
    └── BenchError                  a benchmark rank/node failed or timed out

The CLI turns these into a message on stderr and the exit code; it never shows a
traceback for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence


class VcfslmError(Exception):
    """Base class; `exit_code` is what the CLI exits with."""

    exit_code = 1


@dataclass(frozen=True)
class Problem:
    """One finding in a user's file: where it is and what is wrong.

    file: path as the user gave it; line/column: 1-based, None when unknown;
    key: dotted key path (`vm.vnuma_nodes`, `nodes[2].bench_ip`).
    """

    file: str
    line: int | None
    column: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        key = f" {self.key}:" if self.key else ""
        return f"{where}{key} {self.message}"


class InventoryError(VcfslmError):
    """Bad user input; every problem found is listed, one per line."""

    exit_code = 2

    def __init__(self, problems: Sequence[Problem] | str):
        if isinstance(problems, str):
            problems = [Problem("", None, None, "", problems)]
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class UsageError(VcfslmError):
    """Bad command-line usage that click itself cannot catch (exit 2)."""

    exit_code = 2


class VCenterError(VcfslmError):
    """vCenter refused or failed."""


class PreflightError(VCenterError):
    """Read-only checks failed; `problems` lists every one; nothing was changed."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("preflight failed:\n" + "\n".join(f"  - {p}" for p in self.problems))


class TransportError(VcfslmError):
    """SSH could not connect, or the connection dropped."""


class HostKeyError(TransportError):
    """A host key is unknown (and not trusted on first use) or has changed."""


class CommandFailed(TransportError):
    """A remote command exited non-zero; shows the command, exit code and last output lines."""

    def __init__(self, result: Any, host: str = "", tail_lines: int = 20):
        self.result = result
        self.host = host
        out = (getattr(result, "stderr", "") or "").strip() or (getattr(result, "stdout", "") or "").strip()
        tail = "\n".join(out.splitlines()[-tail_lines:])
        prefix = f"{host}: " if host else ""
        msg = f"{prefix}command failed (exit {result.exit}): {result.cmd}"
        if tail:
            msg += "\n" + "\n".join(f"  | {line}" for line in tail.splitlines())
        super().__init__(msg)


class PlaybookError(VcfslmError):
    """A playbook step failed on a host."""


class BenchError(VcfslmError):
    """A benchmark rank or node failed, or the run timed out."""
