"""The error tree. Everything vcfslm raises on purpose derives from VcfslmError.

    VcfslmError                     exit 1 unless a subclass says otherwise
    ├── InputError                  exit 2: bad user input; carries one Problem per finding,
    │   │                            all at once, each naming file, line and key
    │   ├── InventoryError          the inventory YAML (and node selections against it)
    │   ├── PlaybookSpecError       a playbook YAML (shipped name or path)
    │   ├── SloSpecError            an SLO given on the command line or in a file
    │   ├── RunFolderError          a run folder: meta.json, results.jsonl, ranks/
    │   ├── CsvError                a CSV given to `report --csv` / `size --csv`
    │   ├── PlatformError           a platform file (YAML) or probe JSON given to `predict`
    │   └── UsageError              flags that click itself cannot check
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
        """`file:line:column: key: message`, the parts that are known (as compilers write it)."""
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return ": ".join(part for part in (where, self.key, self.message) if part)


class InputError(VcfslmError):
    """Bad user input; every problem found is listed, one per line."""

    exit_code = 2

    def __init__(self, problems: Sequence[Problem] | str):
        if isinstance(problems, str):
            problems = [Problem("", None, None, "", problems)]
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class InventoryError(InputError):
    """The inventory is wrong, or a selection made against it (--hosts, --nodes) is."""


class PlaybookSpecError(InputError):
    """A playbook file cannot be read or does not follow the playbook schema."""


class SloSpecError(InputError):
    """An SLO specification (`A:130:3`, a YAML/JSON file of SLOs) is wrong."""


class RunFolderError(InputError):
    """A run folder is missing, empty, or holds a record or meta.json that breaks the schema."""


class CsvError(InputError):
    """An imported CSV has a missing column or a value of the wrong kind."""


class PlatformError(InputError):
    """A platform description (YAML, or `vcfslm probe -o json` output) is missing a value or
    holds one no hardware has."""


class WorkloadError(InputError):
    """A workload (`--workload`: a name, a JSONL file of requests, a trace) is wrong."""


class UsageError(InputError):
    """Bad command-line usage that click itself cannot catch."""


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


class ServeError(VcfslmError):
    """The running service could not be brought up, read or taken down on a node."""
