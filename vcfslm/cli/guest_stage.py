"""What `vcfslm guests`, `vcfslm verify` and `vcfslm provision --stage guests|all` share:
the SSH connector they hand to the guest stage, and how a guest run's summary is shown."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from ..errors import PlaybookError
from ..guest.transport import open_node


def ssh_connector(inventory, reporter, trust_new_hosts: bool = False):
    """The guest stage's Connector: the inventory's SSH settings, one connection per node."""
    def connect(node, *, log_dir: Path, wait_s: float):
        return open_node(inventory, node, log_dir=log_dir, trust_new_hosts=trust_new_hosts,
                         reporter=reporter, wait_s=wait_s)

    return connect


def bench_connector(inventory, reporter, log_dir: Path, trust_new_hosts: bool = False,
                    wait_s: float = 30.0):
    """The same connector for a cluster bench, called with a node alone (logs in the run's folder)."""
    return partial(ssh_connector(inventory, reporter, trust_new_hosts), log_dir=log_dir, wait_s=wait_s)


def summary_table(summary, title: str) -> Table:
    table = Table(title=title)
    for col in ("host", "changed", "ok", "failed", "time", "result"):
        table.add_column(col, justify="right" if col in ("changed", "ok", "failed", "time") else "left")
    for h in summary.hosts:
        if h.error:
            result = f"[red]{escape(h.error.splitlines()[0])}[/red]"
        else:
            result = "[green]ok[/green]" + (f" ({escape(h.note)})" if h.note else "")
        table.add_row(h.host, str(h.changed), str(h.ok), str(h.failed), f"{h.duration:.1f}s", result)
    return table


def summary_json(summary) -> dict[str, Any]:
    return {"ok": summary.ok, "dry_run": summary.dry_run, "duration_s": round(summary.duration, 3),
            "log_dir": str(summary.log_dir) if summary.log_dir else None,
            "hosts": [{**h.row(), "steps": [
                {"playbook": s.playbook, "step": s.name, "type": s.kind, "status": s.status,
                 "commands": s.commands, "duration_s": round(s.duration, 3), "error": s.error}
                for s in h.steps],
                "facts": h.records["facts"].to_json() if "facts" in h.records else None}
                for h in summary.hosts]}


def fail_if_any(summary) -> None:
    """PlaybookError (exit 1) naming every failed host, after the others have run."""
    if not summary.ok:
        lines = [f"  {h.host}: {h.error}" for h in summary.failed_hosts]
        raise PlaybookError(f"{len(lines)} of {len(summary.hosts)} host(s) failed "
                            f"(command logs: {summary.log_dir}):\n" + "\n".join(lines))
