"""Tables of the answer as data, markdown and CSV (no plotting, no file I/O).

- results per scope: rows = input length x batch per rank; streams per VM and
  cluster-wide, TTFT, TPOT, per-user speed, rank throughput, and (when a probe
  ran) TPOT efficiency against the bandwidth floor and TTFT efficiency against the
  compute floor;
- matched-load comparison single VM vs cluster: difference in % and whether it
  lies within the run-to-run spread;
- crossover per SLO x context and sizing per SLO x context;
- a run's own summary (`scenario_rows`), what `bench` prints when it ends;
- serving mode: the serving threshold beside the static crossover (with the nodes it
  asks for), every series' loads, every series' thresholds, sizing from them; a workload
  series (or one whose prompts varied) split by prompt length, as a table and a CSV;
- through one endpoint: the scale-out curve (threshold at N nodes, N × one node's, their
  ratio) and the windows that took a fault.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vcfslm.analysis import below
from vcfslm.analysis.cells import (
    CLUSTER,
    SCOPE_TITLES,
    SINGLE,
    Cell,
    model_text,
    models_of,
    sort_key,
    spread,
)
from vcfslm.analysis.endpoint import (
    FaultWindow,
    ScaleOut,
    deployment_text,
    failing_text,
    load_text,
    seconds_text,
    share_text,
    shares_text,
)
from vcfslm.analysis.lengths import HISTORY_BRIEF, LengthSplit, SeriesLengths
from vcfslm.analysis.serve import ServeComparison
from vcfslm.analysis.serve_points import (
    PCT,
    UNITS,
    ServeKey,
    ServePoint,
    describe_key,
    fmt_load,
    history_of,
    key_dict,
)
from vcfslm.analysis.serve_sizing import ServeSizing
from vcfslm.analysis.serve_threshold import ServeThreshold
from vcfslm.analysis.slo import NOT_ACHIEVABLE, Crossover, Sizing, law_formula

# What a serving threshold's node count divides by.
PER_VM_STREAMS = "streams per VM at threshold"
PREFIX_CACHE = "prefix cache (prompt tokens)"
CACHE_NOTE = ("Prefix cache: the prompt tokens the server's prefix cache held over the prompt tokens sent, "
              "as the server counted them per request.")


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
                    c.streams_per_vm, c.streams_cluster, _raw(c.ttft_s.p50), _raw(c.ttft_s.p90),
                    _raw(c.ttft_s.p99), _raw(c.tpot_ms.p50), _raw(c.tpot_ms.p90), _raw(c.tpot_ms.p99),
                    _raw(c.per_user_tps()), _raw(c.rank_tps), _raw(s[0] if s else None),
                    _raw(s[1] if s else None), c.repeats, _raw(c.roofline_tpot_ms),
                    _raw(c.roofline_efficiency), _raw(c.roofline_ttft_s), _raw(c.ttft_efficiency), c.windows,
                    c.invalid_windows, "; ".join(c.flags), c.source, c.model])
    return buf.getvalue()


def _raw(value: float | None) -> str:
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
             "rank_tps": _finite(c.rank_tps), "roofline_tpot_ms": c.roofline_tpot_ms,
             "efficiency": c.roofline_efficiency, "roofline_ttft_s": c.roofline_ttft_s,
             "ttft_efficiency": c.ttft_efficiency,
             "max_skew_ms": None if c.max_start_skew_s is None else 1000 * c.max_start_skew_s,
             "flags": list(c.flags)}
            for c in sorted(cells, key=sort_key)]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# ------------------------------------------------------------------ serving


def _serve_fmt(value: float | None, digits: int) -> str:
    if value is not None and math.isinf(value):
        return "∞"
    return fmt(value, digits)


def context_column(keys: Sequence[ServeKey]) -> str:
    """The input column's name: a workload series is named by its workload, not a length."""
    return "input tokens or workload" if any(k.workload for k in keys) else "input tokens"


def several_outputs_of(keys: Sequence[ServeKey]) -> bool:
    """Do the fixed contexts differ in output length (a workload's is only its longest reply)?"""
    return len({k.output_tokens for k in keys if not k.workload}) > 1


def _share(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, 1, " %")


def serve_answer_table(comparisons: Sequence[ServeComparison], sizings: Sequence[ServeSizing],
                       headroom: float = 0.0) -> Table:
    """Per SLO x context (or workload, a row each): the serving threshold, the static crossover
    beside it, their ratio and the nodes the serving threshold asks for."""
    peaks = list(dict.fromkeys(s.peak_streams for s in sizings if s.peak_streams is not None))
    keys = [c.threshold.key for c in comparisons]
    several_outputs = several_outputs_of(keys)
    several_servers = len({c.threshold.key.server for c in comparisons}) > 1
    several_models = len({c.threshold.key.model for c in comparisons}) > 1
    notes_of = {id(c): "; ".join(x for x in (_serve_note(c), _curve_note(c.threshold, sizings)) if x)
                for c in comparisons}
    with_notes = any(notes_of.values())
    cols = ["model"] if several_models else []
    cols += ["SLO", context_column(keys)] + (["output tokens"] if several_outputs else [])
    cols += ["server"] if several_servers else []
    cols += ["load", "threshold (per VM)", "first failing (per VM)", "binding", "streams/VM at threshold",
             "static crossover (streams/VM)", "serving / static"]
    cols += [f"nodes for {p} streams" for p in peaks] + (["note"] if with_notes else [])
    rows = []
    for c in comparisons:
        t = c.threshold
        mine = {s.peak_streams: s for s in sizings if s.threshold is t}
        row = [model_text(t.key.model)] if several_models else []
        row += [t.slo.title, t.key.context_text] + ([t.key.output_text] if several_outputs else [])
        row += [t.key.server] if several_servers else []
        streams = t.streams_text + (f" {t.streams_interval.text(lambda v: f'{v:.1f}')}"
                                    if t.streams_interval and t.status in ("threshold", "above") else "")
        row += [UNITS[t.key.load_kind], " ".join(x for x in (t.threshold_text, t.interval_text) if x),
                t.first_failing_text, t.binding or "–", streams, c.static_text, c.ratio_text]
        row += [" ".join(x for x in (mine[p].nodes_text(), mine[p].interval_text()) if x) if p in mine else "–"
                for p in peaks]
        row += [notes_of[id(c)]] if with_notes else []
        rows.append(row)
    rules = ", ".join(dict.fromkeys(c.threshold.rule for c in comparisons)) or "attainment"
    title = f"Serving threshold per SLO and {'context or workload' if any(k.workload for k in keys) else 'context'} "
    title += f"(continuous batching, {rules}"
    title += f", headroom {headroom:.0%})" if headroom else ")"
    notes = ["Threshold: the largest load tried at which the stated share of requests met every limit at once "
             "(TTFT with the queue, and TPOT), before the first failing load; an unfinished request met none. "
             "“< n”: even the smallest load tried fails, and the note says why none lower was found: a single "
             "request misses the SLO (none meets it), or the sweep's budget ran out; “≥ n”: every load tried "
             "meets it. [a–<b]: the 95 % bootstrap interval (windows within ranks, requests within windows): "
             "at least a and below b, the first failing load of the replicates.",
             "Streams/VM at threshold: time-averaged busy slots × ranks per VM (Little's law, measured). "
             "Serving / static: those streams over the static-batch crossover, given only where the static "
             "percentile is the same share as the attainment (p90 beside 90 %). "
             f"Nodes = {law_formula(PER_VM_STREAMS, 'headroom' if headroom else None)}."]
    return Table(title, cols, rows, notes)


def _curve_note(t: ServeThreshold, sizings: Sequence[ServeSizing]) -> str:
    curves = {s.curve for s in sizings if s.threshold is t and s.curve}
    return f"nodes on the measured cluster curve ({'; '.join(sorted(curves))})" if curves else ""


def _serve_note(c: ServeComparison) -> str:
    t = c.threshold
    notes = []
    if t.non_monotonic:
        notes.append("not monotonic: passes again at " + ", ".join(
            fmt_load(v * t.key.per_vm) for v in t.non_monotonic))
    if t.status == "below":
        notes.append(below.note(t.below_why, t.slo.title, t.key))
    if t.key.scope == CLUSTER:
        notes.append("read from cluster series")
    if t.few_samples:
        notes.append("few samples: " + "; ".join(t.few_samples))
    if c.note:
        notes.append(c.note)
    if history_of(t.key, t.points):
        notes.append(HISTORY_BRIEF)
    return "; ".join(notes)


def serve_points_table(points: Sequence[ServePoint], slos: Sequence, with_model: bool = False) -> Table:
    """One series' loads: latency tails, goodput per SLO, concurrency, requests, validity
    (with_model: its title names the model, for inputs of several)."""
    key = points[0].key
    unit = key.unit
    # Through one endpoint the load is the whole deployment's, not a rank's.
    offered = f"load at the endpoint ({unit})" if key.endpoint_nodes else f"load/rank ({unit})"
    cols = [offered, f"load/VM ({unit})", "requests", "unfinished", "TTFT p50 (s)",
            f"TTFT {PCT} (s)", "TPOT p50 (ms)", f"TPOT {PCT} (ms)", "streams/VM", "completed (req/s/VM)"]
    cols += [f"goodput {s.title} (req/s/VM)" for s in slos]
    cols += [f"attainment {s.title}" for s in slos]
    # Only where the server said what its prefix cache held: a column of dashes says nothing.
    cached = any(p.cached_share is not None for p in points)
    cols += [PREFIX_CACHE] if cached else []
    flagged = any(p.flags for p in points)
    cols += ["windows"] + (["flags"] if flagged else [])
    rows = []
    for p in sorted(points, key=lambda p: p.load):
        row = [fmt_load(p.load), fmt_load(p.load_per_vm), str(p.requests), str(p.unfinished),
               _serve_fmt(p.ttft_p50_s, 2), _serve_fmt(p.ttft_p90_s, 2), _serve_fmt(p.tpot_p50_ms, 1),
               _serve_fmt(p.tpot_p90_ms, 1), fmt(p.streams_per_vm, 1), fmt(p.completed_per_vm, 2)]
        row += [fmt(p.goodput_per_vm.get(s.name), 2) for s in slos]
        row += [_attainment_text(p, s) for s in slos]
        row += [_share(p.cached_share)] if cached else []
        row += [f"{p.windows - p.invalid_windows}/{p.windows}"] + (["; ".join(p.flags)] if flagged else [])
        rows.append(row)
    title = f"Serving, {model_text(key.model) + ', ' if with_model else ''}{describe_key(key)}"
    notes = ["Tails pool every counted request of every rank and valid window; ∞: the tail reaches an "
             "unfinished request. Goodput: requests per second per VM that met every limit of the SLO; "
             "attainment: the share of counted requests that did (unfinished ones met none)."]
    notes += [CACHE_NOTE] if cached else []
    history = history_of(key, points)
    notes += [history + "."] if history else []
    return Table(title, cols, rows, notes)


def _attainment_text(p: ServePoint, slo) -> str:
    if not p.has_data:
        return "–"
    return f"{p.result.attainment(slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms).share * 100:.1f} %"


def serve_thresholds_table(thresholds: Sequence[ServeThreshold]) -> Table:
    """Every series x SLO (the answer reads one per SLO and context)."""
    several_models = len({t.key.model for t in thresholds}) > 1
    cols = (["model"] if several_models else []) + [
        "SLO", "series", "rule", "threshold (per VM)", "95% interval", "first failing (per VM)", "binding",
        "streams/VM at threshold"]
    rows = [([model_text(t.key.model)] if several_models else [])
            + [t.slo.title, describe_key(t.key), t.rule, f"{t.threshold_text} {t.key.unit}", t.interval_text or "–",
               t.first_failing_text, t.binding or "–", t.streams_text] for t in thresholds]
    return Table("Serving threshold of every series", cols, rows)


def serve_sizing_table(sizings: Sequence[ServeSizing]) -> Table:
    """Sizing from serving thresholds; the by-rate columns only when a peak rate was given."""
    by_rate = any(s.peak_rps is not None for s in sizings)
    cols = ["SLO", context_column([s.threshold.key for s in sizings]), "load", "peak streams"]
    cols += ["peak req/s"] if by_rate else []
    cols += ["rule", "streams/VM at threshold", "threshold (per VM)", "headroom", "nodes by streams"]
    cols += ["nodes by rate"] if by_rate else []
    rows = []
    for s in sizings:
        t = s.threshold
        row = [t.slo.title, t.key.context_text, UNITS[t.key.load_kind],
               "–" if s.peak_streams is None else str(s.peak_streams)]
        row += ["–" if s.peak_rps is None else f"{s.peak_rps:g}"] if by_rate else []
        row += [t.rule, t.streams_text, " ".join(x for x in (t.threshold_text, t.interval_text) if x),
                f"{s.headroom:.0%}", " ".join(x for x in (s.nodes_text("streams"), s.interval_text("streams")) if x)]
        row += [" ".join(x for x in (s.nodes_text("rate"), s.interval_text("rate")) if x)] if by_rate else []
        rows.append(row)
    return Table("Sizing from the serving threshold", cols, rows,
                 [f"Nodes by streams = {law_formula(PER_VM_STREAMS, 'headroom')}; "
                  f"by rate = {law_formula('threshold req/s per VM', 'headroom', 'peak req/s')}. “≤ n”: every load "
                  "tried met the SLO, so fewer nodes may do. [a–b]: the 95 % bootstrap interval, from the "
                  "threshold's ends."])


# ------------------------------------------------------------------ through one endpoint


def scale_out_table(curves: Sequence[ScaleOut]) -> Table:
    """Per SLO and context: the threshold at N nodes behind one endpoint, N × the single node's,
    their ratio (the scale-out efficiency) and how the router split the requests."""
    several_models = len({c.key.model for c in curves}) > 1
    several_servers = len({c.key.server for c in curves}) > 1
    cols = (["model"] if several_models else []) + ["SLO", context_column([c.key for c in curves])]
    cols += ["server"] if several_servers else []
    cols += ["nodes", "threshold (deployment)", "N × 1 node", "efficiency [95 %]", "first failing", "binding",
             "streams at threshold", "requests per server"]
    rows = []
    for c in curves:
        for r in c.rows:
            t = r.threshold
            row = [model_text(c.key.model)] if several_models else []
            row += [c.slo.title, c.key.context_text] + ([c.key.server] if several_servers else [])
            ideal = r.ideal
            row += [str(r.nodes), f"{deployment_text(t)} {c.key.unit}",
                    "–" if ideal is None else f"{'≥ ' if r.single.status == 'above' else ''}{load_text(ideal)}",
                    r.efficiency_text, failing_text(t), t.binding or "–", fmt(r.streams, 1),
                    shares_text(r.split())]
            rows.append(row)
    notes = ["Threshold (deployment): the largest load offered at the endpoint, the whole deployment's, at which "
             "the stated share of requests met every limit at once, with its 95 % bootstrap interval. "
             "Efficiency: the threshold at N nodes over N × the single node's; its interval pairs the two "
             "intervals the cautious way, low(N) / (N × high(1)) to high(N) / (N × low(1)). “≥”: every load "
             "tried passed at N (the efficiency may be higher); “≤”: at one node.",
             "Requests per server: the smallest and largest share of the requests the servers' own counters "
             "finished at the threshold load (vllm:request_success_total), how evenly the router spread them."]
    return Table("Scale-out under serving (through one endpoint)", cols, rows, notes)


def fault_table(faults: Sequence[FaultWindow], slos: Sequence) -> Table:
    """Each window that took a fault: what was killed, when it came back, what failed, and
    the attainment during the fault and after it."""
    cols = ["run", "nodes", "load", "window", "killed", "at (s)", "down (s)", "back (s)", "restart (s)",
            "detect (s)", "failed (counted / all)"]
    names = [s.name for s in slos]
    cols += [f"{s.title} during / after" for s in slos]
    rows = []
    for f in faults:
        d = f.fault
        row = [f.run_id, str(f.nodes), f"{fmt_load(f.load)} {UNITS[f.load_kind]}", str(f.window),
               str(d.get("target", "–")), seconds_text(d.get("at_s"))]
        if "error" in d:
            row += ["–", "–", "–", "–", f"did not happen: {d['error']}"] + ["–"] * len(names)
        else:
            row += [seconds_text(d.get("start_s")), seconds_text(d.get("end_s")) if d.get("end_s") is not None
                    else "not back", seconds_text(d.get("restart_s")), seconds_text(d.get("detect_s")),
                    f"{d.get('failed', 0)} / {d.get('failed_all', 0)}"]
            during, after = d.get("attainment_during") or {}, d.get("attainment_after") or {}
            row += [f"{share_text(during.get(n))} / {share_text(after.get(n))}" for n in names]
        rows.append(row)
    notes = ["Times in seconds from the window's start. Down: the kill; back: the server answered /health "
             "again (polled every 0.5 s from the client); restart = back − down; detect: the kill to the last "
             "failed request sent after it (the router stopped sending to the dead server, or took it back; 0: "
             "only streams in flight at the kill failed). Failed: requests "
             "that failed (5xx, dropped or stalled streams) from the kill on, each a miss, counted ones / "
             "every one. During / after: attainment of the counted requests that arrived from the kill "
             "until it was back, and after."]
    return Table("Faults through the router", cols, rows, notes)


# ------------------------------------------------------------------ by prompt length

UNFINISHED_ROW = "unfinished (length not recorded)"


def length_table(lengths: SeriesLengths, slos: Sequence, with_model: bool = False) -> Table:
    """One series' loads split by prompt length: per bucket the finished requests, their TTFT and
    TPOT tails and each SLO's share; the unfinished requests on a row of their own."""
    key = lengths.key
    roles = any(split.roles for split in lengths.splits)
    cached = any(split.cached_share is not None for split in lengths.splits)
    cols = [f"load/VM ({key.unit})"] + (["read at"] if roles else [])
    cols += ["prompt tokens", "requests", "TTFT p50 (s)", f"TTFT {PCT} (s)", "TPOT p50 (ms)", f"TPOT {PCT} (ms)"]
    cols += [f"meets {s.title}" for s in slos] + ([PREFIX_CACHE] if cached else [])
    rows = []
    for split in lengths.splits:
        head = [fmt_load(split.load * key.per_vm)] + (["; ".join(split.roles) or "–"] if roles else [])
        rows += [head + _bucket_cells(b, slos) + ([_share(b.cached_share)] if cached else [])
                 for b in split.buckets]
        if split.unfinished:
            rows.append(head + [UNFINISHED_ROW, str(split.unfinished)] + ["–"] * (4 + len(slos))
                        + (["–"] if cached else []))
    title = f"TTFT and TPOT by prompt length, {model_text(key.model) + ', ' if with_model else ''}{describe_key(key)}"
    return Table(title, cols, rows, _length_notes(lengths, cached))


def _bucket_cells(b, slos: Sequence) -> list[str]:
    return ([b.label, str(b.requests), fmt(b.ttft_p50_s, 2), fmt(b.ttft_p90_s, 2), fmt(b.tpot_p50_ms, 1),
             fmt(b.tpot_p90_ms, 1)] + [_share(b.meets.get(s.name)) for s in slos])


def _length_notes(lengths: SeriesLengths, cached: bool) -> list[str]:
    which = ("every load tried" if lengths.every_load
             else "the loads the thresholds are read at (each SLO's threshold and first failing load)")
    notes = [f"Loads: {which}. Prompt tokens: each request's whole prompt, a conversation's history included. "
             f"Tails over the bucket's finished requests; meets: the share of them within every limit of the "
             "SLO at once.",
             "Unfinished requests have no length on record (a window keeps per-request lengths for finished "
             "requests only), so they sit on a row of their own; each met no SLO, and the load's attainment "
             "counts them where these shares do not."]
    notes += [CACHE_NOTE] if cached else []
    return notes + [n + "." for n in lengths.notes]


LENGTH_CSV_KEY = ("model", "scope", "vms", "ranks_per_vm", "server", "workload", "load_kind", "arrival", "slots",
                  "input_tokens", "output_tokens", "endpoint_nodes", "faulted")


def length_buckets_csv(series: Sequence[SeriesLengths], slos: Sequence) -> str:
    """Every split series' buckets as raw numbers, one row per load and bucket (the unfinished
    requests as bucket `unfinished`): what serve-length-buckets.csv holds."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*LENGTH_CSV_KEY, "load", "load_per_vm", "read_at", "bucket", "requests", "ttft_p50_s",
                "ttft_p90_s", "tpot_p50_ms", "tpot_p90_ms", *[f"meets_{s.name}" for s in slos],
                "prompt_tokens", "cached_tokens", "cached_share"])
    for lengths in series:
        keys = key_dict(lengths.key)
        head = [keys[k] for k in LENGTH_CSV_KEY]
        for split in lengths.splits:
            w.writerows(_split_csv_rows(head, split, lengths.key.per_vm, slos))
    return buf.getvalue()


def _split_csv_rows(head: list, split: LengthSplit, per_vm: float, slos: Sequence) -> list[list]:
    at = [_raw(split.load), _raw(split.load * per_vm), "; ".join(split.roles)]
    rows = [head + at + [b.label, b.requests, _raw(b.ttft_p50_s), _raw(b.ttft_p90_s), _raw(b.tpot_p50_ms),
                         _raw(b.tpot_p90_ms), *[_raw(b.meets.get(s.name)) for s in slos], b.prompt_tokens,
                         "" if b.cached_tokens is None else b.cached_tokens, _raw(b.cached_share)]
            for b in split.buckets]
    if split.unfinished:
        rows.append(head + at + ["unfinished", split.unfinished] + [""] * (7 + len(slos)))
    return rows
