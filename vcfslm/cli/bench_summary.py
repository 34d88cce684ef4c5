"""What `vcfslm bench` prints when a run ends, local or cluster: the report's results table
for the run, computed by the report's own aggregator, so a bench and its report agree."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..analysis.cells import aggregate
from ..analysis.report import judging_rule
from ..analysis.serve import analyse, series_of
from ..analysis.slo import slos_from_meta
from ..analysis.tables import results_table, scenario_rows, serve_answer_table, serve_points_table
from ..results import read_run
from ..results.vllm_results import write_vllm_results
from .common import console, print_json


def print_run_summary(meta, records, run_dir: Path, output: str, title: str) -> None:
    """The run's cells as a table (or `--output json`), its folder and the next command."""
    if meta.matrix.get("serve"):
        print_serve_summary(meta, run_dir, output, title)
        return
    analysis = aggregate([(meta, records)])
    if output == "json":
        print_json({"run_id": meta.run_id, "run_dir": str(run_dir), "complete": meta.complete,
                    "scenarios": scenario_rows(analysis.cells), "warnings": analysis.warnings})
        return
    for scope in analysis.scopes():
        table = results_table(analysis.cells, scope)
        console.print(rich_table(table, f"{title} — {table.title}"))
    for warning in analysis.warnings:
        console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    console.print(f"run dir: {run_dir}" + ("" if meta.complete else "  (incomplete)"))
    console.print(f"next: vcfslm report {run_dir}")


def rich_table(table, title: str | None = None) -> Table:
    """An analysis table (plain strings) as a rich Table, under the console's pipe policy."""
    out = Table(title=title or table.title, caption="\n".join(table.notes) or None)
    for i, col in enumerate(table.columns):
        out.add_column(col, justify="left" if i == 0 else "right")
    for row in table.rows:
        out.add_row(*(Text(str(v)) for v in row))  # figures and flags, never markup
    return out



def print_serve_summary(meta, run_dir: Path, output: str, title: str) -> None:
    """A serving run's loads (the report's serving tables, judged as its sweep judged them)."""
    slos = slos_from_meta(meta.slos or None)
    rule, _ = judging_rule([meta])
    run = read_run(run_dir, require_records=False)
    served = analyse([run], slos, rule=rule)
    # Every serving run also leaves its requests as `vllm bench serve --save-result` would.
    exported = write_vllm_results(run_dir) if run.serve_records else []
    if output == "json":
        print_json({"run_id": meta.run_id, "run_dir": str(run_dir), "complete": meta.complete,
                    "serving": served.to_dict(), "vllm_results": [str(p) for p in exported]})
        return
    for points in series_of(served.points).values():
        table = serve_points_table(points, slos)
        console.print(rich_table(table, f"{title} — {table.title}"))
    if served.comparisons:
        console.print(rich_table(serve_answer_table(served.comparisons, ())))
    for warning in served.warnings:
        console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    if exported:
        console.print(f"vLLM-layout results: {exported[0].parent} ({len(exported)} file(s))")
    console.print(f"run dir: {run_dir}" + ("" if meta.complete else "  (incomplete)"))
    console.print(f"next: vcfslm report {run_dir}")
