"""What `vcfslm bench` prints when a run ends, local or cluster: the report's results table
for the run, computed by the report's own aggregator, so a bench and its report agree."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from ..analysis.cells import aggregate
from ..analysis.tables import results_table, scenario_rows
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


def serve_rows(meta, serve_records) -> list[dict]:
    """One row per (context, load): every rank's requests pooled, judged as the sweep judges."""
    from .. import serving
    from ..contract import serve_limits

    limits = serve_limits(meta.slos)
    rows = []
    for (input_tokens, output_tokens) in sorted({(r.input_tokens, r.output_tokens) for r in serve_records}):
        mine = [r for r in serve_records if (r.input_tokens, r.output_tokens) == (input_tokens, output_tokens)]
        for load, res in serving.load_results(mine).items():
            rows.append({
                "input_tokens": input_tokens, "output_tokens": output_tokens, "load_kind": mine[0].load_kind,
                "load_per_rank": load, "requests": res.requests, "unfinished": res.unfinished,
                "ttft_s_p90": _finite(res.ttft_tail()), "tpot_ms_p90": _finite(res.tpot_tail()),
                "mean_active_per_rank": round(res.mean_active, 3),
                "meets": {name: serving.meets(res, lim["tpot_ms"], lim["ttft_s"]) for name, lim in limits.items()},
                "valid": not res.invalid})
    return rows


def print_serve_summary(meta, run_dir: Path, output: str, title: str) -> None:
    from ..results import SERVE_RESULTS, read_serve_records

    path = run_dir / SERVE_RESULTS
    rows = serve_rows(meta, read_serve_records(path) if path.exists() else [])
    if output == "json":
        print_json({"run_id": meta.run_id, "run_dir": str(run_dir), "complete": meta.complete,
                    "serving": rows})
        return
    table = Table(title=f"{title} — serving (p90 over every rank's requests)")
    for col in ("input", "load/rank", "requests", "unfinished", "TTFT p90 s", "TPOT p90 ms", "busy slots",
                "meets"):
        table.add_column(col, justify="left" if col == "input" else "right")
    for r in rows:
        unit = "req/s" if r["load_kind"] == "rate" else "users"
        meets = " ".join(f"{name}:{'yes' if ok else 'no' if ok is False else '-'}" for name, ok in r["meets"].items())
        table.add_row(*(Text(v) for v in (
            f"{r['input_tokens']}/{r['output_tokens']}", f"{r['load_per_rank']:g} {unit}", str(r["requests"]),
            str(r["unfinished"]), _fmt(r["ttft_s_p90"], 3), _fmt(r["tpot_ms_p90"], 1),
            f"{r['mean_active_per_rank']:.2f}", meets + ("" if r["valid"] else "  (invalid)"))))
    console.print(table)
    console.print(f"run dir: {run_dir}" + ("" if meta.complete else "  (incomplete)"))
    console.print(f"next: vcfslm report {run_dir}")


def _finite(value: float) -> float | None:
    import math

    return value if math.isfinite(value) else None


def _fmt(value: float | None, digits: int) -> str:
    return "unfinished" if value is None else f"{value:.{digits}f}"
