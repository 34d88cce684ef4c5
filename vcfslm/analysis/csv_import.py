"""Cells from a CSV of external measurements (published or hand-made tables).

One row per cell. Columns (header names, any order):

    scope            single | cluster   (single means exactly one VM)
    vms              VMs in the run (1 for single)
    ranks_per_vm     ranks per VM (the brief: 4)
    batch_per_rank   concurrent streams per rank
    input_tokens     prompt length
    output_tokens    generated tokens per stream
    ttft_s           p50 TTFT in seconds
    tpot_ms          p50 TPOT in milliseconds
    rank_tps         rank throughput, generated tokens/s
  optional:
    ttft_p90_s, ttft_p99_s, tpot_p90_ms, tpot_p99_ms,
    roofline_tpot_ms (decode floor, ms), roofline_ttft_s (prefill floor, s),
    model (what was measured, e.g. synthetic:phi-3-mini; rows of different models are
    never pooled, and the answer gets a row per model)

Lines starting with `#` are comments. The derived columns that `tables.csv` writes
(streams_per_vm, per_user_tps, ...) are accepted and ignored, so a report's
tables.csv reads back; streams_per_vm, when present, must equal batch x ranks.
Every problem is reported at once with file:line:column and the column name.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

from vcfslm.analysis.cells import CLUSTER, SINGLE, Analysis, Cell, CellKey, Quantiles
from vcfslm.errors import CsvError, Problem

INT_COLUMNS = ("vms", "ranks_per_vm", "batch_per_rank", "input_tokens", "output_tokens")
FLOAT_COLUMNS = ("ttft_s", "tpot_ms", "rank_tps")
REQUIRED = ("scope",) + INT_COLUMNS + FLOAT_COLUMNS
OPTIONAL = ("ttft_p90_s", "ttft_p99_s", "tpot_p90_ms", "tpot_p99_ms", "roofline_tpot_ms", "roofline_ttft_s")
TEXT_COLUMNS = ("model",)
DERIVED = ("streams_per_vm", "streams_cluster", "per_user_tps", "per_user_p90_tps", "per_user_p99_tps",
           "rank_tps_min", "rank_tps_max", "repeats", "roofline_efficiency", "ttft_efficiency", "windows",
           "invalid_windows", "flags", "source")
SCOPES = {"single": SINGLE, "single-vm": SINGLE, "single vm": SINGLE, "cluster": CLUSTER}


def import_csv(path: str | os.PathLike[str]) -> Analysis:
    """Read `path` into an Analysis (no run metadata); raises CsvError listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise CsvError([Problem(str(path), None, None, "", f"cannot read CSV: {exc}")]) from exc
    return parse_csv(text, str(path))


def parse_csv(text: str, filename: str = "<csv>") -> Analysis:
    """Parse CSV text; `filename` is what problems name."""
    problems: list[Problem] = []

    def problem(line: int | None, col: int | None, key: str, message: str) -> None:
        problems.append(Problem(filename, line, col, key, message))

    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    header_line = 0
    cells: list[Cell] = []
    seen: dict[CellKey, int] = {}
    for row in reader:
        line = reader.line_num
        if not any(f.strip() for f in row) or row[0].lstrip().startswith("#"):
            continue
        if header is None:
            header, header_line = [h.strip().lower() for h in row], line
            _check_header(header, line, problem)
            if problems:
                break
            continue
        if len(row) != len(header):
            problem(line, None, "", f"expected {len(header)} fields (as in the header on line {header_line}), "
                                    f"found {len(row)}")
            continue
        before = len(problems)
        cell = _row_to_cell(dict(zip(header, row, strict=True)), header, line, filename, problem)
        if cell is None or len(problems) > before:
            continue
        if cell.key in seen:
            problem(line, None, "", f"duplicate of line {seen[cell.key]} (same scope, vms, ranks, batch, "
                                    "input, output and model)")
            continue
        seen[cell.key] = line
        cells.append(cell)
    if header is None and not problems:
        problem(1, None, "", "empty CSV: expected a header line with " + ", ".join(REQUIRED))
    elif not cells and not problems:
        problem(header_line, None, "", "no data rows after the header")
    if problems:
        raise CsvError(problems)
    return Analysis(cells=cells, metas=[], warnings=[])


def _check_header(header: list[str], line: int, problem) -> None:
    known = set(REQUIRED) | set(OPTIONAL) | set(TEXT_COLUMNS) | set(DERIVED)
    for col, name in enumerate(header, 1):
        if name not in known:
            problem(line, col, name,
                    f"unknown column; known columns: {', '.join(REQUIRED + OPTIONAL + TEXT_COLUMNS)}")
        elif header.index(name) != col - 1:
            problem(line, col, name, "column given twice")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        problem(line, None, "", f"missing required column(s): {', '.join(missing)}")


def _row_to_cell(row: dict[str, str], header: list[str], line: int, filename: str, problem) -> Cell | None:
    def col(name: str) -> int:
        return header.index(name) + 1

    scope_text = row["scope"].strip().lower()
    scope = SCOPES.get(scope_text)
    if scope is None:
        problem(line, col("scope"), "scope", f"{row['scope']!r} is not a scope; use single or cluster")
    ints: dict[str, int] = {}
    for name in INT_COLUMNS:
        raw = row[name].strip()
        try:
            ints[name] = int(raw)
        except ValueError:
            problem(line, col(name), name, f"{raw!r} is not a whole number")
            continue
        if ints[name] <= 0:
            problem(line, col(name), name, f"must be positive, got {ints[name]}")
    floats: dict[str, float | None] = {}
    for name in FLOAT_COLUMNS + OPTIONAL:
        if name not in row:
            floats[name] = None
            continue
        raw = row[name].strip()
        if not raw and name in OPTIONAL:
            floats[name] = None
            continue
        try:
            value = float(raw)
        except ValueError:
            problem(line, col(name), name, f"{raw!r} is not a number" if raw else "value missing")
            continue
        if not math.isfinite(value) or value <= 0:
            problem(line, col(name), name, f"must be a positive number, got {raw}")
            continue
        floats[name] = value
    if scope is not None and "vms" in ints:
        if scope == SINGLE and ints["vms"] != 1:
            problem(line, col("vms"), "vms", f"scope single means one VM, got {ints['vms']}")
        if scope == CLUSTER and ints["vms"] < 2:
            problem(line, col("vms"), "vms", f"scope cluster needs at least 2 VMs, got {ints['vms']}")
    _check_order(floats, ("ttft_s", "ttft_p90_s", "ttft_p99_s"), header, line, problem)
    _check_order(floats, ("tpot_ms", "tpot_p90_ms", "tpot_p99_ms"), header, line, problem)
    if "streams_per_vm" in row and row["streams_per_vm"].strip() and {"batch_per_rank", "ranks_per_vm"} <= ints.keys():
        expected = ints["batch_per_rank"] * ints["ranks_per_vm"]
        if row["streams_per_vm"].strip() != str(expected):
            problem(line, col("streams_per_vm"), "streams_per_vm",
                    f"{row['streams_per_vm'].strip()} does not equal batch_per_rank x ranks_per_vm = {expected}")
    if scope is None or len(ints) < len(INT_COLUMNS) or any(floats.get(n) is None for n in FLOAT_COLUMNS):
        return None
    key = CellKey(scope, ints["vms"], ints["ranks_per_vm"], ints["batch_per_rank"], ints["input_tokens"],
                  ints["output_tokens"], row.get("model", "").strip())
    return Cell(
        key=key,
        ttft_s=Quantiles(floats["ttft_s"], floats["ttft_p90_s"], floats["ttft_p99_s"]),
        tpot_ms=Quantiles(floats["tpot_ms"], floats["tpot_p90_ms"], floats["tpot_p99_ms"]),
        rank_tps=floats["rank_tps"],
        source=f"{Path(filename).name}:{line}",
        origin="csv",
        rank_tps_repeats=(floats["rank_tps"],),
        ttft_repeats=(floats["ttft_s"],),
        tpot_repeats=(floats["tpot_ms"],),
        roofline_tpot_ms=floats["roofline_tpot_ms"],
        roofline_ttft_s=floats["roofline_ttft_s"],
        windows=1,
    )


def _check_order(floats: dict[str, float | None], names: tuple[str, str, str], header, line, problem) -> None:
    """p50 <= p90 <= p99 for the columns present: a swap is a typo worth catching."""
    present = [(n, floats.get(n)) for n in names if floats.get(n) is not None]
    for (lo_name, lo), (hi_name, hi) in zip(present, present[1:], strict=False):
        if hi < lo:
            problem(line, header.index(hi_name) + 1, hi_name, f"{hi:g} is below {lo_name} {lo:g}")
