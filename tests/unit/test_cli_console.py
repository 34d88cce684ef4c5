"""The CLI's console policy: whole lines and whole table cells off a terminal, whatever
the width; each of stdout and stderr ends its own lines."""

from __future__ import annotations

import sys

import pytest
from rich.table import Table

from vcfslm.cli.console import (
    LINE_ENDS,
    make_console,
    markdown_table,
    off_terminal_width,
    table_lines,
)
from vcfslm.cli.progress_view import ProgressLines, line_due
from vcfslm.progress import Progress

LONG = "/tmp/" + "very-long-folder-name/" * 12 + "lab"


class Captured:
    """What the test wrote to stdout and stderr so far (pytest's capsys)."""

    def __init__(self, capsys) -> None:
        self.capsys, self.out, self.err = capsys, "", ""

    def read(self) -> Captured:
        got = self.capsys.readouterr()
        self.out, self.err = self.out + got.out, self.err + got.err
        return self


@pytest.fixture
def streams(capsys, monkeypatch):
    monkeypatch.setattr(LINE_ENDS, "open", {"stdout": False, "stderr": False})
    return Captured(capsys)


def test_off_terminal_width():
    assert off_terminal_width({}) == 4096
    assert off_terminal_width({"COLUMNS": "40"}) == 40
    assert off_terminal_width({"COLUMNS": "wide"}) == 4096


@pytest.mark.parametrize("columns", [None, "40", "20"])
def test_long_text_is_one_line_off_a_terminal(streams, monkeypatch, columns):
    if columns:
        monkeypatch.setenv("COLUMNS", columns)
    else:
        monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()
    console.print(f"lab {LONG}: everything was running")
    console.print("[bold]slm-01[/bold]: TPOT 3770.264 ms  TTFT 0.0104 s  0.303 tok/s  (invalid)")
    assert streams.read().out.splitlines() == [
        f"lab {LONG}: everything was running",
        "slm-01: TPOT 3770.264 ms  TTFT 0.0104 s  0.303 tok/s  (invalid)"]


def test_tables_off_a_terminal_are_markdown_with_every_cell_whole(streams, monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    table = Table(title="run 20250101-120000-local: 1 rank(s)")
    table.add_column("batch/rank", justify="right")
    table.add_column("TPOT p50 (ms)", justify="right")
    table.add_column("state")
    table.add_row("16", "245.123456", "[green]running[/green]")
    table.add_row("1", "0.9", f"a|b {LONG}")
    make_console().print(table)
    assert streams.read().out.splitlines() == [
        "run 20250101-120000-local: 1 rank(s)",
        f"| batch/rank | TPOT p50 (ms) | state{' ' * len(LONG)} |",
        f"| ---------: | ------------: | {'-' * (len(LONG) + 5)} |",
        f"|         16 |    245.123456 | running{' ' * (len(LONG) - 2)} |",
        f"|          1 |           0.9 | a\\|b {LONG} |"]
    assert "…" not in streams.read().out


def test_table_lines_without_header_and_centered():
    assert table_lines(None, ["a", "b"], [["x", "yy"]], ["center", "left"], show_header=False) == \
        ["|  x  | yy  |"]


def test_markdown_table_keeps_a_caption():
    table = Table("k", caption="2 rows")
    table.add_row("1")
    assert markdown_table(table).splitlines()[-1] == "2 rows"


def test_a_line_left_open_on_one_stream_is_ended_before_the_other_writes(streams):
    LINE_ENDS.write("stdout", "vcsim")             # e.g. a prompt or a partial write
    make_console(stderr=True).print("slm-01: stopped")
    LINE_ENDS.write("stdout", "done\n")
    assert streams.read().out == "vcsim\ndone\n"
    assert streams.read().err == "slm-01: stopped\n"
    LINE_ENDS.write("stderr", "half")
    LINE_ENDS.end_all()
    assert streams.read().err.endswith("half\n")


def test_progress_lines_off_a_terminal():
    now = [0.0]
    lines = ProgressLines(clock=lambda: now[0])
    gib = 1024**3

    def push(done, final=False):
        return lines.take(Progress("slm-01", "model: push 4 file(s)", done * gib, 10 * gib, "B", now[0] or 1,
                                   final=final))

    assert push(0.1).startswith("slm-01: model: push 4 file(s), 102 MiB / 10 GiB, 1%")
    now[0] = 5
    assert push(0.5) is None                  # neither 10% more nor 30 s later
    assert push(1.2) is not None              # 10% more
    now[0] = 40
    assert push(1.3) is not None              # 30 s later
    now[0] = 41
    assert "done in" in push(10, final=True)  # the last one always


def test_bench_lines_come_once_per_scenario():
    last = None
    first = Progress("bench", "scenario 1/12 (batch 1, input 128)", 0, 48, "windows", 0)
    assert line_due(last, first, 0)
    lines = ProgressLines(clock=lambda: 0.0)
    assert lines.take(first) is not None
    assert lines.take(Progress("bench", first.label, 1, 48, "windows", 30)) is None
    assert lines.take(Progress("bench", "scenario 2/12 (batch 1, input 512)", 4, 48, "windows", 90)) \
        is not None


def test_under_a_live_display_the_console_writes_to_the_real_stream(streams, monkeypatch):
    # rich's Live swaps sys.stdout for a proxy that prints through the console: the console
    # must write past it, or it would print into itself forever
    from rich.file_proxy import FileProxy

    console = make_console()
    monkeypatch.setattr(sys, "stdout", FileProxy(console, sys.stdout))
    console.print("slm-01: step 3/20 pytorch: torch")
    monkeypatch.undo()
    assert streams.read().out == "slm-01: step 3/20 pytorch: torch\n"
