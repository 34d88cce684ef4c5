"""The report's opening answer and its reasoning, as data (pure: no rendering, no files).

- `summary_rows`: one row per SLO x context x model — the model, single-VM threshold, first failing
  load, binding indicator and nodes for each peak, each with its 95 % bootstrap interval
  (`8 [4–<16]`, `32 [17–64]`). A bound is marked: "≥ 64" when every tested load met the
  SLO (the crossover lies above the tested range, so the node counts are "≤"), "none"
  when even the lowest tested load fails. Models are never folded into one row: the
  rows of one SLO and context stand side by side, one per model.
- `slo_reasons`: per SLO, what the rule is (said once) and one line per context
  saying why its row reads as it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vcfslm.analysis.cells import CLUSTER, model_text
from vcfslm.analysis.slo import NOT_ACHIEVABLE, Crossover, Sizing, Verdict, law_formula
from vcfslm.analysis.slo_spec import Slo
from vcfslm.analysis.tables import Table


@dataclass(frozen=True)
class SummaryRow:
    """One line of the answer, every value already in its reading form."""

    slo: str                     # the SLO's title, e.g. "SLO-B" (limits are said above the table)
    input_tokens: int
    output_tokens: int | None
    threshold: str               # "16", "≥ 64" or "none"
    first_failing: str           # "32", "> 64" (nothing failed up to the max tested) or "4"
    binding: str                 # "TPOT", "TTFT", "TPOT and TTFT" or "–"
    nodes: tuple[str, ...]       # per peak: "16", "≤ 4" or "not achievable"
    note: str = ""
    model: str = ""              # what the run benchmarked ("" unknown: a CSV without a model column)


def threshold_text(c: Crossover) -> str:
    """`8 [4–<16]`: the threshold ("none", "≥ 64" for the bounds) and its interval when known."""
    text = c.threshold_text
    return f"{text} {c.interval_text}" if c.interval_text else text


def first_failing_text(c: Crossover) -> str:
    return f"> {c.max_tested}" if c.first_failing is None else str(c.first_failing)


def nodes_text(s: Sizing) -> str:
    """`32 [17–64]`; "≤ 4" when every tested load passed (fewer nodes may do); "not achievable"."""
    if s.nodes is None:
        return NOT_ACHIEVABLE
    text = s.nodes_text
    return f"{text} {s.interval_text}" if s.interval_text else text


def row_note(c: Crossover) -> str:
    notes = []      # "none" needs no note: the threshold and nodes columns say it
    if c.non_monotonic:
        notes.append(f"not monotonic: passes again at {', '.join(map(str, c.non_monotonic))}")
    if c.few_samples:
        notes.append("few samples: " + "; ".join(c.few_samples))
    if c.scope == CLUSTER:
        notes.append("read from cluster cells (no single-VM data)")
    return "; ".join(notes)


def sizings_of(c: Crossover, sizings: Sequence[Sizing]) -> list[Sizing]:
    return [s for s in sizings if s.crossover == c]


def peaks_of(sizings: Sequence[Sizing]) -> list[int]:
    """The peak loads, in the order given, once each."""
    return list(dict.fromkeys(s.peak_streams for s in sizings))


def summary_rows(crossovers: Sequence[Crossover], sizings: Sequence[Sizing]) -> list[SummaryRow]:
    """The answer table's rows, in crossover order (SLO, then context, then model)."""
    peaks = peaks_of(sizings)
    rows = []
    for c in crossovers:
        mine = {s.peak_streams: s for s in sizings_of(c, sizings)}
        rows.append(SummaryRow(c.slo.title, c.input_tokens, c.output_tokens, threshold_text(c),
                               first_failing_text(c), c.binding or "–",
                               tuple(nodes_text(mine[p]) if p in mine else "–" for p in peaks), row_note(c),
                               c.model))
    return rows


def summary_table(crossovers: Sequence[Crossover], sizings: Sequence[Sizing], percentile: str = "p50",
                  headroom: float = 0.0) -> Table:
    """The answer as a Table: columns that say nothing (one output length, no notes) are left out."""
    rows = summary_rows(crossovers, sizings)
    peaks = peaks_of(sizings)
    several_outputs = len({r.output_tokens for r in rows}) > 1
    with_notes = any(r.note for r in rows)
    # The model column is always there: an answer names what it sized, and two models'
    # rows are told apart by it.
    cols = ["model", "SLO", "input tokens"] + (["output tokens"] if several_outputs else [])
    cols += ["threshold (streams/VM)", "first failing (streams/VM)", "binding"]
    cols += [f"nodes for {p} streams" for p in peaks] + (["note"] if with_notes else [])
    grid = []
    for r in rows:
        line = [model_text(r.model), r.slo, str(r.input_tokens)] + ([str(r.output_tokens)] if several_outputs else [])
        line += [r.threshold, r.first_failing, r.binding, *r.nodes] + ([r.note] if with_notes else [])
        grid.append(line)
    rules = ", ".join(dict.fromkeys(c.rule for c in crossovers)) or f"{percentile} of streams"
    title = f"Single-VM threshold and nodes per SLO and input length ({rules}"
    title += f", headroom {headroom:.0%})" if headroom else ")"
    notes = ["Threshold: the largest tested streams/VM that meets the SLO before the first failing load. "
             f"Nodes = {law_formula(headroom='headroom' if headroom else None)}.",
             "“≥ n”: every tested load met the SLO, so the threshold is at least n and the node count "
             "“≤” an upper bound; “none”: even the lowest tested load fails, and no node count helps.",
             "[a–<b]: the 95 % bootstrap interval (windows resampled within ranks, each replicate judged "
             "by the same rule): at least a and below b, the first failing load of the replicates, so it "
             "covers the untested gap too; the node counts follow from its ends."]
    return Table(title, cols, grid, notes)


# ------------------------------------------------------------- reasoning


@dataclass(frozen=True)
class SloReasons:
    """Why the rows of one SLO read as they do."""

    slo: Slo
    headline: str                # the SLO and its thresholds in one line
    rule: str                    # the SLO's limits at the judged percentile
    contexts: tuple[str, ...]    # one line per context


def reasoning_intro(headroom: float = 0.0) -> str:
    """What every SLO's reasoning shares, said once above them."""
    return ("A value at a limit meets it. The threshold is the largest tested load before the first failing "
            f"one; nodes = {law_formula(headroom=f'{headroom:g}' if headroom else None)}. Per-rank latency does not change with scale-out, so each added node adds the same capacity.")


def slo_reasons(crossovers: Sequence[Crossover], sizings: Sequence[Sizing], headroom: float = 0.0
                ) -> list[SloReasons]:
    """One entry per SLO (in crossover order), each with a line per context."""
    out = []
    for slo in dict.fromkeys(c.slo for c in crossovers):
        mine = [c for c in crossovers if c.slo == slo]
        pct = mine[0].percentile
        limits = " and ".join(f"{pct} {name} ≤ {limit:g} {unit}" for name, limit, unit in
                              (("TPOT", slo.tpot_ms, "ms"), ("TTFT", slo.ttft_s, "s")) if limit is not None)
        if slo.ttft_per_token_ms:
            limits += f" + {slo.ttft_per_token_ms:g} ms per prompt token"
        rule = f"A load meets {slo.title} when its {limits}."
        several_outputs = len({c.output_tokens for c in mine}) > 1
        headline = f"{slo.describe()}: " + "; ".join(
            (NOT_ACHIEVABLE if c.status == "none" else f"{threshold_text(c)} streams/VM")
            + f" at {_ctx(c, several_outputs)}" for c in mine)
        lines = tuple(context_reason(c, sizings_of(c, sizings), several_outputs) for c in mine)
        out.append(SloReasons(slo, headline, rule, lines))
    return out


def _ctx(c: Crossover, with_output: bool = False) -> str:
    return c.model_label + f"{c.input_tokens} input tokens" + (f" / {c.output_tokens} output" if with_output else "")


def context_reason(c: Crossover, sizings: Sequence[Sizing], with_output: bool = False) -> str:
    """One context of one SLO in a sentence or three; the SLO itself is named by the caller."""
    head = f"{_ctx(c, with_output)}: "
    if c.status == "none":
        floor = c.floor
        which = "the single-stream floor" if floor.point.batch_per_rank == 1 else "the lowest tested load"
        return (head + f"not achievable. Even {which}, {floor.point.streams_per_vm} streams/VM, has "
                f"{values(floor, c.slo, c.input_tokens)}; {c.binding} binds. More nodes add capacity, not per-user speed."
                + _extra(c))
    if c.status == "all":
        last = c.verdicts[-1]
        text = (head + f"every tested load meets it (at {c.max_tested} streams/VM: {values(last, c.slo, c.input_tokens)}), "
                f"so the threshold is ≥ {c.max_tested} and the node counts are upper bounds.")
    else:
        fail = next(v for v in c.verdicts if not v.meets)
        ok = next(v for v in c.verdicts if v.point.streams_per_vm == c.threshold)
        text = (head + f"meets it up to {c.threshold} streams/VM ({values(ok, c.slo, c.input_tokens)}); {c.first_failing} "
                f"fails on {c.binding} ({values(fail, c.slo, c.input_tokens)}).")
    return text + _nodes(c, sizings) + _extra(c)


def _nodes(c: Crossover, sizings: Sequence[Sizing]) -> str:
    bound = " at most" if c.status == "all" else ""
    parts = [f"{s.peak_streams} streams → ceil({s.peak_streams} / {s.effective_threshold:g}) = {s.nodes}{bound}"
             + (f" {s.interval_text}" if s.interval_text else "")
             for s in sizings if s.nodes is not None]
    span = f" The threshold's 95 % interval is {c.interval_text} streams/VM." if c.interval_text else ""
    return ((" Nodes: " + "; ".join(parts) + ".") if parts else "") + span


def _extra(c: Crossover) -> str:
    text = ""
    if c.non_monotonic:
        text += (f" Not monotonic: {', '.join(map(str, c.non_monotonic))} streams/VM meet(s) it again after "
                 f"{c.first_failing} failed (noise or an untrustworthy window?); the threshold stays below "
                 "the first failure.")
    if c.few_samples:
        text += f" Few samples: {'; '.join(c.few_samples)}."
    for note in c.notes:
        text += f" {note}"
    return text


def values(v: Verdict, slo: Slo, input_tokens: int = 0) -> str:
    """`TPOT 125.0 ms ≤ 130, TTFT 0.60 s ≤ 3`: each measured value against its limit."""
    parts = []
    for name, value, limit, unit, digits in (("TPOT", v.point.tpot_ms, slo.tpot_ms, "ms", 1),
                                             ("TTFT", v.point.ttft_s, slo.ttft_limit(input_tokens), "s", 2)):
        if value is None:
            continue
        mark = "" if limit is None else f" {'≤' if value <= limit else '>'} {limit:g}"
        parts.append(f"{name} {value:.{digits}f} {unit}{mark}")
    return ", ".join(parts)
