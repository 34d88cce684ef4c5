"""Shared click options and rendering helpers for the command modules."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from ..errors import InventoryError, Problem, RunFolderError, UsageError
from ..inventory_load import load_inventory
from ..results import atomic_write_json, read_meta
from .console import LINE_ENDS, make_console
from .progress_view import ProgressLines, TerminalBars

INVENTORY_ENV = "VCFSLM_INVENTORY"
STATE_FILE_ENV = "VCFSLM_STATE"

# The console policy (vcfslm/cli/console.py): rich on a terminal, whole lines off one.
console = make_console()
err_console = make_console(stderr=True)


def state_file() -> Path:
    """Small state file remembering the inventory `provision` last used."""
    return Path(os.environ.get(STATE_FILE_ENV, "~/.vcfslm/state.json")).expanduser()


def remember_inventory(path: str | Path) -> None:
    atomic_write_json(state_file(), {"inventory": str(Path(path).resolve())})


def resolve_inventory_path(given: str | None) -> Path:
    """The inventory: the argument, else $VCFSLM_INVENTORY, else the one provision last used."""
    if given:
        return Path(given)
    if os.environ.get(INVENTORY_ENV):
        return Path(os.environ[INVENTORY_ENV])
    try:
        remembered = json.loads(state_file().read_text()).get("inventory")
    except (OSError, ValueError):
        remembered = None
    if remembered:
        return Path(remembered)
    raise InventoryError([Problem("", None, None, "", "no inventory given: pass INVENTORY (or -i), "
                                                      f"set {INVENTORY_ENV}, or run provision once")])


def load(given: str | None):
    """Resolve and load the inventory (InventoryError on any problem)."""
    return load_inventory(resolve_inventory_path(given))


def inventory_argument(f):
    """Optional INVENTORY argument (default: $VCFSLM_INVENTORY, then the last provisioned)."""
    return click.argument("inventory", required=False, metavar="[INVENTORY]")(f)


def inventory_option(f):
    """-i/--inventory option (default: $VCFSLM_INVENTORY, then the last provisioned)."""
    return click.option("-i", "--inventory", "inventory", default=None, metavar="FILE",
                        help=f"Inventory YAML (default: ${INVENTORY_ENV}, then the last provisioned).")(f)


def int_list(ctx, param, value: str | None) -> list[int] | None:
    """click callback: '1,4,8' -> [1, 4, 8]."""
    if value is None:
        return None
    try:
        values = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return values


def output_option(f):
    return click.option("--output", "-o", "output", type=click.Choice(["text", "json"]),
                        default="text", show_default=True, help="Output format.")(f)


def to_jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def print_json(value: Any) -> None:
    LINE_ENDS.write("stdout", json.dumps(to_jsonable(value), indent=2, sort_keys=True, default=str) + "\n")


class RichReporter:
    """Renders library progress (vcfslm.progress) on stderr: one whole line per record;
    sized work as bars on a terminal, as periodic lines off one.

    quiet: nothing but `log` events dropped too (JSON output); verbose: show `detail`.
    Use as a context manager so a terminal's bars are closed.
    """

    def __init__(self, console: Console = err_console, quiet: bool = False, verbose: bool = False):
        self.console = console
        self.quiet = quiet
        self.verbose = verbose
        self._lines = ProgressLines()
        self._bars = TerminalBars(console)

    def __enter__(self) -> RichReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._bars.close()

    def update(self, subject: str, status: str) -> None:
        if not self.quiet:
            self.console.print(f"[bold]{escape(subject)}[/bold]: {escape(status)}", soft_wrap=True)

    def log(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, markup=False, soft_wrap=True)

    def detail(self, subject: str, status: str) -> None:
        if self.verbose:
            self.update(subject, status)

    def progress(self, p) -> None:
        if self.quiet:
            return
        if self.console.is_terminal:
            self._bars.show(p)
            return
        line = self._lines.take(p)
        if line is not None:
            self.console.print(line, markup=False, soft_wrap=True)


def latest_run(runs_dir: Path) -> Path:
    """The newest run dir under `runs_dir` (by meta.json `created`, then name)."""
    candidates = []  # a folder whose meta.json is unreadable is not a candidate
    for d in runs_dir.iterdir() if runs_dir.is_dir() else ():
        if (d / "meta.json").is_file():
            try:
                created = read_meta(d).created or ""
            except RunFolderError:
                continue
            candidates.append((created, d.name, d))
    if not candidates:
        raise UsageError(f"no run dirs under {runs_dir}/ to size from; pass --results RUN|CSV "
                         "(a run dir from `vcfslm bench` or a CSV of measurements)")
    return max(candidates)[2]
