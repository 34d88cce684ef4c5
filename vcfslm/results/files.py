"""Run files on disk: atomic writes, appending a record, reading a JSON-lines file checked.

A write goes through a temp file in the same folder and a rename, so a reader sees the
old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from vcfslm.errors import Problem, RunFolderError

from .records import FINDINGS, ServeRecord, WindowRecord, build


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; results are ordinary files, so honour the umask instead.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def append_record(path: str | os.PathLike[str], record: WindowRecord | ServeRecord) -> None:
    """Append one record so that a crash leaves either the whole line or none of it.

    The file is rewritten through a temp file + rename: records are small and few
    (one per window), and a torn last line is impossible this way.
    """
    path = Path(path)
    existing = path.read_text(encoding="utf-8") if path.exists() else ""
    if existing and not existing.endswith("\n"):
        existing += "\n"
    atomic_write_text(path, existing + record.to_json() + "\n")


MAX_PROBLEMS = 20     # per file: enough to see the pattern, few enough to read
TORN = "torn last line skipped (no newline at the end and not valid JSON: its writer was stopped mid-line)"


def read_records(path: str | os.PathLike[str], warnings: list[str] | None = None,
                 kind: type = WindowRecord) -> list[Any]:
    """Read a JSON-lines file of records (`kind`: WindowRecord or ServeRecord), each checked
    against its schema.

    A blank line is skipped. A torn last line (no newline at the end and not valid JSON:
    what a killed writer leaves) is skipped too, and said in `warnings` when given. Any
    other bad line raises RunFolderError listing every problem as file:line field: message.
    """
    records, problems = checked_records(Path(path), warnings if warnings is not None else [], kind)
    if problems:
        raise RunFolderError(problems)
    return records


def read_serve_records(path: str | os.PathLike[str], warnings: list[str] | None = None) -> list[ServeRecord]:
    """read_records for a serving.jsonl (or ranks/serve-<n>.jsonl) file."""
    return read_records(path, warnings, ServeRecord)


def checked_records(path: Path, warnings: list[str], kind: type = WindowRecord
                    ) -> tuple[list[Any], list[Problem]]:
    """The good records of a JSON-lines file and the problems of the others (capped, see capped)."""
    findings = FINDINGS[kind]
    lines = read_text(path).split("\n")
    records, problems = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            if lineno == len(lines):         # the last piece: no newline after it
                warnings.append(str(Problem(str(path), lineno, None, "", TORN)))
            else:
                problems.append(Problem(str(path), lineno, getattr(exc, "colno", None), "",
                                        f"not valid JSON: {getattr(exc, 'msg', exc)}"))
            continue
        found = findings(data)
        problems.extend(Problem(str(path), lineno, None, key, message) for key, message in found)
        if not found:
            records.append(build(kind, data))
    return records, capped(problems, path)


def capped(problems: Sequence[Problem], path: Path) -> list[Problem]:
    """The first MAX_PROBLEMS problems of file `path` and a line counting the rest."""
    shown = list(problems[:MAX_PROBLEMS])
    if len(problems) > MAX_PROBLEMS:
        shown.append(Problem("", None, None, "", f"... and {len(problems) - MAX_PROBLEMS} more problem(s) in {path}"))
    return shown


def read_text(path: Path) -> str:
    """A run file's text; RunFolderError naming it when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFolderError([Problem(str(path), None, None, "", "does not exist")]) from None
    except UnicodeDecodeError as exc:
        raise RunFolderError([Problem(str(path), None, None, "", f"not UTF-8 text (byte {exc.start})")]) from None
    except OSError as exc:
        raise RunFolderError([Problem(str(path), None, None, "", f"cannot read: {exc.strerror or exc}")]) from None


def write_records(path: str | os.PathLike[str], records: Iterable[WindowRecord | ServeRecord]) -> None:
    atomic_write_text(path, "".join(r.to_json() + "\n" for r in records))
