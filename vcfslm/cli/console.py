"""The CLI's one console policy: rich on a terminal; whole lines off one.

On a terminal, rich as usual (it fits output to the terminal, or to $COLUMNS).
Off a terminal (a pipe, a file, CI), a log line must survive `grep` and a table
must keep every figure, so:

- text is soft-wrapped: never broken into lines by rich, whatever the width;
- tables are written as markdown rows, every cell whole (no ellipsis, no fold);
- the width rich lays other renderables out in is $COLUMNS, else a wide one.

stdout and stderr often land in one file (`2>&1`); each stream ends its own
line before the other writes, so a record of one is never glued to the other's.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.table import Table
from rich.text import Text

WIDE = 4096  # off a terminal without $COLUMNS: wide enough that nothing is laid out narrow


def off_terminal_width(environ: dict[str, str] | os._Environ) -> int:
    """The layout width off a terminal: $COLUMNS when it is a number, else WIDE."""
    columns = environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else WIDE


def _plain(cell: Any) -> str:
    """A table cell as one line of plain text (markup applied, then dropped)."""
    if isinstance(cell, Text):
        text = cell.plain
    elif isinstance(cell, str):
        text = Text.from_markup(cell).plain
    else:
        text = str(cell)
    return " ".join(text.split("\n"))


def table_lines(title: str | None, headers: list[str], rows: list[list[str]],
                justify: list[str], show_header: bool = True) -> list[str]:
    """A table as markdown lines: padded to each column's widest cell, nothing cut.

    justify: per column "left" / "right" / "center" (markdown :--, --:, :-:).
    """
    ncols = len(headers)
    rows = [[(r[i] if i < len(r) else "").replace("|", "\\|") for i in range(ncols)] for r in rows]
    heads = [h.replace("|", "\\|") for h in headers]
    widths = [max([len(heads[i]) if show_header else 0, 3, *(len(r[i]) for r in rows)])
              for i in range(ncols)]

    def pad(value: str, i: int) -> str:
        if justify[i] == "right":
            return value.rjust(widths[i])
        if justify[i] == "center":
            return value.center(widths[i])
        return value.ljust(widths[i])

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(pad(c, i) for i, c in enumerate(cells)) + " |"

    out = [title] if title else []
    if show_header:
        rules = {"right": lambda w: "-" * (w - 1) + ":", "center": lambda w: ":" + "-" * (w - 2) + ":"}
        out.append(line(heads))
        out.append("| " + " | ".join(rules.get(justify[i], lambda w: "-" * w)(widths[i])
                                     for i in range(ncols)) + " |")
    out += [line(r) for r in rows]
    return out


def markdown_table(table: Table) -> str:
    """A rich Table as markdown text (see table_lines)."""
    headers = [_plain(c.header) for c in table.columns]
    cells = [[_plain(v) for v in c.cells] for c in table.columns]
    rows = [[col[i] if i < len(col) else "" for col in cells] for i in range(table.row_count)]
    title = _plain(table.title) if table.title else None
    lines = table_lines(title, headers, rows, [c.justify for c in table.columns], table.show_header)
    if table.caption:
        lines.append(_plain(table.caption))
    return "\n".join(lines)


def _std(name: str):
    """sys.stdout or sys.stderr now; under a rich Live (which swaps in a proxy that prints
    through the console) the real stream, or the console would write into itself."""
    stream = getattr(sys, name)
    return getattr(stream, "rich_proxied_file", stream)


class _LineEnds:
    """Which of stdout/stderr has a line open; ends it before the other stream writes."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.open: dict[str, bool] = {"stdout": False, "stderr": False}

    def write(self, name: str, text: str) -> None:
        with self.lock:
            other = "stderr" if name == "stdout" else "stdout"
            if self.open[other]:
                self._end(other)
            stream = _std(name)
            stream.write(text)
            stream.flush()
            if text:
                self.open[name] = not text.endswith("\n")

    def _end(self, name: str) -> None:
        stream = _std(name)
        try:
            stream.write("\n")
            stream.flush()
        except (OSError, ValueError):  # closed at exit
            pass
        self.open[name] = False

    def end_all(self) -> None:
        with self.lock:
            for name, is_open in list(self.open.items()):
                if is_open:
                    self._end(name)


LINE_ENDS = _LineEnds()
atexit.register(LINE_ENDS.end_all)


class StdStream:
    """sys.stdout or sys.stderr looked up at each write (click's CliRunner swaps them),
    keeping line ends (see _LineEnds)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        LINE_ENDS.write(self.name, text)
        return len(text)

    def flush(self) -> None:
        _std(self.name).flush()

    def isatty(self) -> bool:
        stream = _std(self.name)
        return bool(getattr(stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return _std(self.name).fileno()

    @property
    def encoding(self) -> str:
        return getattr(_std(self.name), "encoding", None) or "utf-8"


class PolicyConsole(Console):
    """A rich Console that applies the policy above each time it prints (the stream it
    writes to may be a terminal in one run and a pipe in the next)."""

    @property
    def size(self) -> ConsoleDimensions:
        if self.is_terminal:
            return super().size
        # rich would borrow the width of any std stream that is a terminal (stderr, say),
        # and a pipe's reader has no width at all.
        return ConsoleDimensions(off_terminal_width(os.environ), 25)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        if self.is_terminal:
            super().print(*objects, soft_wrap=soft_wrap, **kwargs)
            return
        if any(isinstance(o, Table) for o in objects):
            for o in objects:
                if isinstance(o, Table):
                    super().print(markdown_table(o), soft_wrap=True, markup=False, highlight=False)
                else:
                    super().print(o, soft_wrap=True, **kwargs)
            return
        super().print(*objects, soft_wrap=True, **kwargs)


def make_console(stderr: bool = False) -> PolicyConsole:
    return PolicyConsole(file=StdStream("stderr" if stderr else "stdout"), highlight=False)
