"""Tables of the answer as data, markdown and CSV (no plotting, no file I/O); serving's are
in analysis/serve_tables.py.

- results per scope: rows = input length x batch per rank; streams per VM and
  cluster-wide, TTFT, TPOT, per-user speed, rank throughput, and (when a probe
  ran) TPOT efficiency against the bandwidth floor and TTFT efficiency against the
  compute floor;
- matched-load comparison single VM vs cluster: difference in % and whether it
  lies within the run-to-run spread;
- crossover per SLO x context and sizing per SLO x context;
- a run's own summary (`scenario_rows`), what `bench` prints when it ends."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vcfslm.analysis.cells import (
    CLUSTER,
    SCOPE_TITLES,
    SINGLE,
    Cell,
    finite,
    model_text,
    models_of,
    sort_key,
    spread,
)
from vcfslm.analysis.slo import NOT_ACHIEVABLE, Crossover, Sizing, law_formula


@dataclass
class Table:
    """A titled grid of already formatted cells."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        if self.rows:
            out.append("| " + " | ".join(md_cell(c) for c in self.columns) + " |")
            out.append("|" + "|".join("---" for _ in self.columns) + "|")
            out.extend("| " + " | ".join(md_cell(v) for v in row) + " |" for row in self.rows)
        else:
            out.append("_(no rows)_")
        if self.notes:
            out.append("")
            out.extend(f"- {n}" for n in self.notes)
        return "\n".join(out) + "\n"

    def text(self) -> list[str]:
        """Plain aligned lines (no box drawing, no wrapping): what a terminal, a pipe and a test all read."""
        grid = [self.columns] + self.rows
        widths = [max(len(str(r[i])) for r in grid) for i in range(len(self.columns))]

        def line(cells) -> str:
            return "  ".join(str(v).ljust(w) for v, w in zip(cells, widths, strict=True)).rstrip()

        out = [self.title, line(self.columns), line(["-" * w for w in widths])]
        out += [line(r) for r in self.rows] or ["(no rows)"]
        return out + [f"  {n}" for n in self.notes]

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.columns)
        w.writerows(self.rows)
        return buf.getvalue()


def md_cell(text: str) -> str:
    """A value as one markdown table cell: pipes escaped, lines joined."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}{suffix}"


# ------------------------------------------------------------------ results


def results_table(cells: Sequence[Cell], scope: str, tails: bool = False) -> Table:
    """One scope's cells; `tails` adds p90/p99 columns (shown when repeats exist)."""
    cells = [c for c in cells if c.scope == scope]
    models = models_of(cells)
    several_models = len(models) > 1
    configs = sorted({(c.vms, c.ranks_per_vm) for c in cells})
    outputs = sorted({c.output_tokens for c in cells})
    title = SCOPE_TITLES[scope]
    if len(configs) == 1:
        vms, ranks = configs[0]
        title += f" ({vms} VM{'s' if vms > 1 else ''} × {ranks} ranks per VM)"
    if len(outputs) == 1:
        title += f", {outputs[0]} output tokens"
    cols = ["model"] if several_models else []
    if len(configs) > 1:
        cols.append("VMs × ranks/VM")
    cols += ["input tokens"] + (["output tokens"] if len(outputs) > 1 else [])
    cols += ["batch/rank", "streams/VM", "streams cluster-wide", "TTFT p50 (s)"]
    cols += ["TTFT p90 (s)", "TTFT p99 (s)"] if tails else []
    cols += ["TPOT p50 (ms)"] + (["TPOT p90 (ms)", "TPOT p99 (ms)"] if tails else [])
    cols += ["per-user speed (t/s)", "rank throughput p50 (t/s)", "rank t/s over repeats"]
    # Efficiency columns only when some cell has the floor: a column of dashes says nothing.
    tpot_eff = any(c.roofline_efficiency is not None for c in cells)
    ttft_eff = any(c.ttft_efficiency is not None for c in cells)
    cols += (["TPOT efficiency"] if tpot_eff else []) + (["TTFT efficiency"] if ttft_eff else [])
    flagged = any(c.flags for c in cells)      # an empty flags column only widens the table
    cols += ["windows"] + (["flags"] if flagged else [])
    rows = []
    for c in sorted(cells, key=lambda c: (models.index(c.model), c.vms, c.ranks_per_vm, c.input_tokens,
                                          c.output_tokens, c.batch_per_rank)):
        row = [model_text(c.model)] if several_models else []
        row += [f"{c.vms} × {c.ranks_per_vm}"] if len(configs) > 1 else []
        row += [str(c.input_tokens)] + ([str(c.output_tokens)] if len(outputs) > 1 else [])
        row += [str(c.batch_per_rank), str(c.streams_per_vm), str(c.streams_cluster), fmt(c.ttft_s.p50, 2)]
        row += [fmt(c.ttft_s.p90, 2), fmt(c.ttft_s.p99, 2)] if tails else []
        row += [fmt(c.tpot_ms.p50)] + ([fmt(c.tpot_ms.p90), fmt(c.tpot_ms.p99)] if tails else [])
        s = c.rank_tps_spread
        row += [fmt(c.per_user_tps()), fmt(c.rank_tps),
                f"{s[0]:.1f}–{s[1]:.1f} ({c.repeats})" if s else "–"]
        row += [_pct_of(c.roofline_efficiency)] if tpot_eff else []
        row += [_pct_of(c.ttft_efficiency)] if ttft_eff else []
        row += [_windows(c)] + (["; ".join(c.flags)] if flagged else [])
        rows.append(row)
    notes = ["Per-user speed = 1000 / TPOT p50. Streams/VM = batch per rank × ranks per VM.",
             "TTFT/TPOT percentiles pool every stream of every rank and valid window; rank throughput "
             "spread is min–max over repeats of the mean across ranks."]
    if tpot_eff:
        notes.append("TPOT efficiency = decode floor (bytes read per step / probed memory bandwidth, or "
                     "the step's FLOPs / probed bf16 GEMM rate when longer) / measured TPOT p50; 100% is "
                     "decode at its floor.")
    if ttft_eff:
        notes.append("TTFT efficiency = prefill floor (prompt FLOPs / probed bf16 GEMM rate, or one read "
                     "of the weights when longer) / measured TTFT p50; 100% is prefill at its floor.")
    return Table(title, cols, rows, notes)


def _pct_of(ratio: float | None) -> str:
    return fmt(None if ratio is None else 100 * ratio, 0, "%")


def _windows(c: Cell) -> str:
    if not c.windows and c.expected_windows is None:
        return "–"
    text = f"{c.windows - c.invalid_windows}/{c.windows}"
    if c.expected_windows and c.expected_windows != c.windows:
        text += f" of {c.expected_windows}"
    return text


# ------------------------------------------------------- matched-load comparison

# (label, attribute of Cell for the p50, attribute with per-repeat values, True if higher is better)
METRICS = (("TTFT (s)", "ttft", "ttft_repeats", False, 2),
           ("TPOT (ms)", "tpot", "tpot_repeats", False, 1),
           ("rank throughput (t/s)", "tps", "rank_tps_repeats", True, 1))


@dataclass(frozen=True)
class Comparison:
    """One metric of one matched per-rank load: single VM vs a cluster."""

    input_tokens: int
    output_tokens: int
    batch_per_rank: int
    cluster_vms: int
    metric: str
    single: float
    cluster: float
    diff_pct: float                  # (cluster - single) / single x 100
    cluster_not_worse: bool
    within_spread: bool | None       # None: fewer than two repeats on a side
    model: str = ""

    @property
    def verdict(self) -> str:
        if self.cluster_not_worse:
            return "cluster equal or better"
        if self.within_spread is None:
            return "cluster worse; spread unknown (need ≥ 2 repeats per scope)"
        return "cluster worse, within run-to-run spread" if self.within_spread else \
            "cluster worse, beyond run-to-run spread"


def _p50(cell: Cell, metric: str) -> float:
    return {"ttft": cell.ttft_s.p50, "tpot": cell.tpot_ms.p50, "tps": cell.rank_tps}[metric]


def compare(cells: Sequence[Cell]) -> list[Comparison]:
    """Single VM vs cluster at the same batch per rank, input and output length, of the same model."""
    singles = {(c.model, c.input_tokens, c.output_tokens, c.batch_per_rank): c for c in cells
               if c.scope == SINGLE and c.has_data}
    models = models_of(cells)
    out = []
    for cl in sorted((c for c in cells if c.scope == CLUSTER and c.has_data),
                     key=lambda c: (models.index(c.model), c.input_tokens, c.output_tokens, c.batch_per_rank,
                                    c.vms)):
        single = singles.get((cl.model, cl.input_tokens, cl.output_tokens, cl.batch_per_rank))
        if single is None:
            continue
        for label, metric, repeats_attr, higher_better, _ in METRICS:
            a, b = _p50(single, metric), _p50(cl, metric)
            if not (math.isfinite(a) and math.isfinite(b)) or a == 0:
                continue
            not_worse = b >= a if higher_better else b <= a
            sa, sb = spread(getattr(single, repeats_attr)), spread(getattr(cl, repeats_attr))
            within = None if sa is None or sb is None else (sa[0] <= sb[1] and sb[0] <= sa[1])
            out.append(Comparison(cl.input_tokens, cl.output_tokens, cl.batch_per_rank, cl.vms, label,
                                  a, b, (b - a) / a * 100.0, not_worse, within, cl.model))
    return out


def comparison_table(comparisons: Sequence[Comparison]) -> Table:
    several_models = len({c.model for c in comparisons}) > 1
    cols = (["model"] if several_models else []) + [
        "input tokens", "batch/rank", "cluster VMs", "metric", "single VM", "cluster", "difference", "verdict"]
    digits = {label: d for label, _, _, _, d in METRICS}
    rows = [([model_text(c.model)] if several_models else [])
            + [str(c.input_tokens), str(c.batch_per_rank), str(c.cluster_vms), c.metric,
               fmt(c.single, digits[c.metric]), fmt(c.cluster, digits[c.metric]), _pct(c.diff_pct), c.verdict]
            for c in comparisons]
    return Table("Matched per-rank load: single VM vs cluster", cols, rows, [comparison_summary(comparisons)])


def _pct(x: float) -> str:
    return "0.0%" if abs(x) < 0.05 else f"{x:+.1f}%"


def comparison_summary(comparisons: Sequence[Comparison]) -> str:
    """The brief's claim (distribution costs nothing per rank), tested on these data."""
    if not comparisons:
        return "No matched loads: the comparison needs a single-VM and a cluster run of the same matrix."
    worse = [c for c in comparisons if not c.cluster_not_worse]
    beyond = [c for c in worse if c.within_spread is False]
    unknown = [c for c in worse if c.within_spread is None]
    text = (f"The cluster is equal or better in {len(comparisons) - len(worse)} of {len(comparisons)} "
            f"comparisons.")
    if not worse:
        return text + " Distribution shows no per-rank cost on these data."
    text += f" Of the {len(worse)} worse, {len(worse) - len(beyond) - len(unknown)} lie within the run-to-run spread"
    if unknown:
        text += f", {len(unknown)} cannot be judged (fewer than two repeats)"
    if beyond:
        worst = max(beyond, key=lambda c: abs(c.diff_pct))
        text += (f", {len(beyond)} lie beyond it (largest: {worst.metric} {_pct(worst.diff_pct)} at "
                 f"{worst.input_tokens}-token inputs, batch {worst.batch_per_rank}/rank): on these data "
                 "distribution costs more per rank than run-to-run noise explains there.")
    else:
        text += ": no systematic per-rank cost is visible." if not unknown else "."
    return text


# --------------------------------------------------------- crossover, sizing


def crossover_table(crossovers: Sequence[Crossover]) -> Table:
    several_models = len({c.model for c in crossovers}) > 1
    cols = (["model"] if several_models else []) + [
        "SLO", "input tokens", "percentile", "threshold (streams/VM)", "95% interval",
        "first failing (streams/VM)", "binding", "note"]
    rows = []
    for c in crossovers:
        note = {"none": f"{NOT_ACHIEVABLE} in this configuration",
                "all": "every tested load meets it",
                "crossover": ""}[c.status]
        if c.non_monotonic:
            note = (note + "; " if note else "") + \
                f"non-monotonic: passes again at {', '.join(map(str, c.non_monotonic))}"
        if c.few_samples:
            note = (note + "; " if note else "") + "few samples: " + "; ".join(c.few_samples)
        rows.append(([model_text(c.model)] if several_models else [])
                    + [c.slo.describe(), str(c.input_tokens), c.percentile, c.threshold_text,
                       c.interval_text or "–", "–" if c.first_failing is None else str(c.first_failing),
                       c.binding or "–", note])
    return Table("Concurrency crossover point per SLO and context", cols, rows,
                 ["Threshold: the largest tested streams per VM that meets the SLO before the first "
                  "failing load; a value exactly at a limit meets it."])


def sizing_table(sizings: Sequence[Sizing]) -> Table:
    several_models = len({s.crossover.model for s in sizings}) > 1
    cols = (["model"] if several_models else []) + [
        "SLO", "input tokens", "percentile", "peak streams", "threshold (streams/VM)", "headroom", "nodes",
        "95% interval"]
    rows = []
    for s in sizings:
        c = s.crossover
        rows.append(([model_text(c.model)] if several_models else [])
                    + [c.slo.describe(), str(c.input_tokens), c.percentile, str(s.peak_streams), c.threshold_text,
                       f"{s.headroom:.0%}", s.nodes_text, s.interval_text or "–"])
    return Table(f"Sizing: nodes = {law_formula(headroom='headroom')}", cols, rows,
                 ["“≤ n”: every tested load met the SLO, so fewer nodes may do."])


# ------------------------------------------------------------ machine CSV

CSV_COLUMNS = ["scope", "vms", "ranks_per_vm", "batch_per_rank", "input_tokens", "output_tokens",
               "streams_per_vm", "streams_cluster", "ttft_s", "ttft_p90_s", "ttft_p99_s", "tpot_ms",
               "tpot_p90_ms", "tpot_p99_ms", "per_user_tps", "rank_tps", "rank_tps_min", "rank_tps_max",
               "repeats", "roofline_tpot_ms", "roofline_efficiency", "roofline_ttft_s", "ttft_efficiency",
               "windows", "invalid_windows", "flags", "source", "model"]


def cells_csv(cells: Sequence[Cell]) -> str:
    """One row per cell, full precision; reads back through csv_import."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for c in cells:
        if not c.has_data:
            continue
        s = c.rank_tps_spread
        w.writerow([c.scope, c.vms, c.ranks_per_vm, c.batch_per_rank, c.input_tokens, c.output_tokens,
                    c.streams_per_vm, c.streams_cluster, raw(c.ttft_s.p50), raw(c.ttft_s.p90),
                    raw(c.ttft_s.p99), raw(c.tpot_ms.p50), raw(c.tpot_ms.p90), raw(c.tpot_ms.p99),
                    raw(c.per_user_tps()), raw(c.rank_tps), raw(s[0] if s else None),
                    raw(s[1] if s else None), c.repeats, raw(c.roofline_tpot_ms),
                    raw(c.roofline_efficiency), raw(c.roofline_ttft_s), raw(c.ttft_efficiency), c.windows,
                    c.invalid_windows, "; ".join(c.flags), c.source, c.model])
    return buf.getvalue()


def raw(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.10g}"


# ------------------------------------------------------- a run's own summary


def scenario_rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Per cell, the figures a bench prints for its run (`--output json`'s `scenarios`):
    the report's numbers, from the same cells."""
    return [{"scope": c.scope, "vms": c.vms, "ranks_per_vm": c.ranks_per_vm,
             "batch_per_rank": c.batch_per_rank, "input_tokens": c.input_tokens,
             "output_tokens": c.output_tokens, "ranks": c.ranks_measured, "windows": c.windows,
             "valid_windows": c.windows - c.invalid_windows, "expected_windows": c.expected_windows,
             "ttft_p50_s": c.ttft_s.get("p50"), "ttft_p90_s": c.ttft_s.get("p90"),
             "tpot_p50_ms": c.tpot_ms.get("p50"), "tpot_p90_ms": c.tpot_ms.get("p90"),
             "rank_tps": finite(c.rank_tps), "roofline_tpot_ms": c.roofline_tpot_ms,
             "efficiency": c.roofline_efficiency, "roofline_ttft_s": c.roofline_ttft_s,
             "ttft_efficiency": c.ttft_efficiency,
             "max_skew_ms": None if c.max_start_skew_s is None else 1000 * c.max_start_skew_s,
             "flags": list(c.flags)}
            for c in sorted(cells, key=sort_key)]

