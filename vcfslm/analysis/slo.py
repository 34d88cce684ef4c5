"""The static Concurrency Crossover Point and the sizing law (pure functions); what an SLO is
and how it is named is analysis/slo_spec.py's.

Crossover for (SLO, context, model): the largest tested streams-per-VM that meets the SLO
before the first failing load, each load judged by `vcfslm.serving.judging` (the chosen
percentile of its streams, default p90; an SLO may carry its own). A value exactly at
the limit meets it (<=). When a load passes again after a failure the data are
non-monotonic; the threshold stays below the first failure (the conservative reading)
and the report says so. Each crossover carries its 95 % bootstrap interval (windows
resampled within ranks), from its replicates' thresholds up to their first failing loads,
exclusive (`[4–<16]`), and flags loads judged on too few streams. Cells of different
models are never judged together: each model gets its own crossover, and once there
are several every sentence names its model.

Sizing: nodes = ceil(peak streams / threshold), with headroom h the threshold is
derated to threshold x (1 - h) first (`sizing_law`, the one home of the law and its
sentence, which serving's sizing uses too); the node count carries the interval the
threshold interval's ends imply (`judging.nodes_of`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vcfslm.analysis.cells import (
    CLUSTER,
    PERCENTILES,
    SCOPE_TITLES,
    SINGLE,
    Cell,
    model_text,
    models_of,
)
from vcfslm.analysis.slo_spec import Slo, _num
from vcfslm.errors import UsageError
from vcfslm.serving import judging
from vcfslm.serving.judging import Interval, Replicate, Rule


@dataclass(frozen=True)
class LoadPoint:
    """One tested load of one context: streams per VM and the chosen percentile's values."""

    streams_per_vm: int
    tpot_ms: float | None
    ttft_s: float | None
    batch_per_rank: int | None = None
    samples: int | None = None        # per-stream values the percentile was taken of (None: unknown)


@dataclass(frozen=True)
class Verdict:
    point: LoadPoint
    failing: tuple[str, ...]      # indicators over their limit, in (TPOT, TTFT) order

    @property
    def meets(self) -> bool:
        return not self.failing


def judge(point: LoadPoint, slo: Slo, input_tokens: int = 0) -> Verdict:
    """Which indicators of `point` (its streams' prompts `input_tokens` long) are over the
    SLO's limits (a tie meets the limit)."""
    return Verdict(point, judging.static_failing(point.tpot_ms, point.ttft_s, slo.tpot_ms,
                                                 slo.ttft_limit(input_tokens)))


@dataclass(frozen=True)
class Crossover:
    """The answer for one SLO x context."""

    slo: Slo
    input_tokens: int
    output_tokens: int | None
    percentile: str
    verdicts: tuple[Verdict, ...]
    status: str                   # "crossover" | "none" | "all"
    threshold: int | None         # largest meeting load before the first failure
    first_failing: int | None
    binding: str | None           # "TPOT", "TTFT" or "TPOT and TTFT"
    non_monotonic: tuple[int, ...] = ()   # loads that meet the SLO after a failing one
    scope: str = SINGLE
    notes: tuple[str, ...] = ()
    interval: Interval | None = None       # the threshold's bootstrap interval (None: no samples)
    replicates: tuple[Replicate | None, ...] = field(default=(), compare=False, repr=False)
    few_samples: tuple[str, ...] = ()      # the loads judged on too few streams, said plainly
    model: str = ""                        # the model its cells measured ("" unknown)
    models: int = 1                        # how many models the answer beside it holds: >1 names this one

    @property
    def model_label(self) -> str:
        """The model as a sentence names it: only once the answer holds several."""
        return (model_text(self.model) + ", ") if self.models > 1 else ""

    @property
    def max_tested(self) -> int:
        return self.verdicts[-1].point.streams_per_vm

    @property
    def floor(self) -> Verdict:
        """The lowest tested load: the single-stream floor when it is batch 1 per rank."""
        return self.verdicts[0]

    @property
    def rule(self) -> str:
        """What judged it, for every table and line that shows it."""
        return f"{self.percentile} of streams"

    @property
    def threshold_text(self) -> str:
        return threshold_text(self)

    @property
    def interval_text(self) -> str:
        """`[4–<16]`, or "" without an interval."""
        return "" if self.interval is None else self.interval.text(lambda v: f"{v:g}")

    def summary(self) -> str:
        return crossover_text(self)


@dataclass(frozen=True)
class Origin:
    """Where a context's tested loads come from, as its crossover says it: the scope
    (single VM or cluster), the notes load_points wrote, the model its cells measured
    ("" unknown) and how many models the answer beside it holds (>1 names this one)."""

    scope: str = SINGLE
    notes: Sequence[str] = ()
    model: str = ""
    models: int = 1


def crossover(points: Sequence[LoadPoint], slo: Slo, input_tokens: int, output_tokens: int | None = None,
              percentile: str = judging.DEFAULT_PERCENTILE, origin: Origin = Origin(),
              replicates: Sequence[Replicate | None] = (),
              confidence: float = judging.DEFAULT_CONFIDENCE) -> Crossover:
    """The crossover of one SLO over the tested loads of one context (origin: their scope, notes
    and model; replicates: its bootstrap)."""
    if not points:
        raise ValueError("crossover needs at least one tested load")
    ordered = sorted(points, key=lambda p: p.streams_per_vm)
    verdicts = tuple(judge(p, slo, input_tokens) for p in ordered)
    passing, failing = judging.threshold({float(v.point.streams_per_vm): v.meets for v in verdicts})
    if failing is None:
        status, threshold, binding = "all", ordered[-1].streams_per_vm, None
    else:
        fail = next(v for v in verdicts if v.point.streams_per_vm == failing)
        binding = " and ".join(fail.failing)
        threshold = None if passing is None else int(passing)
        status = "none" if passing is None else "crossover"
    later_passes = tuple(v.point.streams_per_vm for v in verdicts
                         if failing is not None and v.point.streams_per_vm > failing and v.meets)
    share = judging.percentile_value(percentile) / 100.0
    thin = judging.few_samples({str(p.streams_per_vm): p.samples for p in ordered if p.samples is not None},
                               share, "streams")
    thin = (f"{percentile} {thin} streams/VM",) if thin else ()
    return Crossover(slo, input_tokens, output_tokens, percentile, verdicts, status, threshold,
                     None if failing is None else int(failing), binding, later_passes, origin.scope,
                     tuple(origin.notes), judging.interval(replicates, confidence), tuple(replicates), thin,
                     origin.model, origin.models)


# One wording per meaning, for every table, line and JSON answer that says it: the
# threshold when even the lowest tested load fails, and a node count no cluster reaches.
NO_THRESHOLD = "none"
NOT_ACHIEVABLE = "not achievable"


def threshold_text(c: Crossover) -> str:
    """The static threshold as a table shows it: `16`, `≥ 64` (every tested load met the SLO)
    or "none" (even the lowest tested load fails)."""
    if c.status == "none":
        return NO_THRESHOLD
    if c.status == "all":
        return f"≥ {c.max_tested}"
    return str(c.threshold)


def crossover_text(c: Crossover) -> str:
    """One paragraph that says the crossover plainly, edge cases included."""
    head = f"{c.model_label}{c.slo.describe()}, {c.input_tokens}-token inputs, {c.rule}"
    floor = c.floor
    floor_name = ("the single-stream floor" if floor.point.batch_per_rank == 1
                  else "the lowest tested load (no batch-1 data)")
    if c.status == "none":
        text = (f"{head}: not achievable in this configuration. Even {floor_name}, "
                f"{floor.point.streams_per_vm} streams/VM, has {_values(floor, c.slo, c.input_tokens)}; "
                f"{c.binding} binds.")
    elif c.status == "all":
        text = (f"{head}: every tested load meets it, so the threshold is ≥ {c.max_tested} streams/VM "
                f"(the max tested); the true crossover lies above the tested range. "
                f"At {c.max_tested} streams/VM: {_values(c.verdicts[-1], c.slo, c.input_tokens)}.")
    else:
        fail = next(v for v in c.verdicts if not v.meets)
        text = (f"{head}: meets the SLO up to {c.threshold} streams/VM; the first failing load is "
                f"{c.first_failing} streams/VM ({_values(fail, c.slo, c.input_tokens)}); {c.binding} binds.")
    if c.interval is not None:
        text += f" {interval_sentence(c.interval, 'streams/VM')}"
    if c.non_monotonic:
        loads = ", ".join(str(x) for x in c.non_monotonic)
        text += (f" The results are not monotonic: {loads} streams/VM meet(s) the SLO again after "
                 f"{c.first_failing} failed (noise or an untrustworthy window?); the threshold stays "
                 f"below the first failure.")
    if c.status != "none":
        text += (f" {floor_name[0].upper()}{floor_name[1:]}, {floor.point.streams_per_vm} streams/VM: "
                 f"{_values(floor, c.slo, c.input_tokens)}.")
    if c.few_samples:
        text += f" Few samples: {'; '.join(c.few_samples)}."
    for note in c.notes:
        text += f" {note}"
    return text


def interval_sentence(iv: Interval, unit: str) -> str:
    """`95 % interval [4–<16] streams/VM (400 bootstrap replicates, windows resampled within ranks).`"""
    return (f"{iv.confidence:.0%} interval {iv.text()} {unit} ({iv.replicates} bootstrap replicates, "
            "windows resampled within ranks).")


def _values(v: Verdict, slo: Slo, input_tokens: int = 0) -> str:
    parts = []
    if v.point.tpot_ms is not None:
        mark = _mark(v.point.tpot_ms, slo.tpot_ms)
        parts.append(f"TPOT {v.point.tpot_ms:.1f} ms{mark}")
    if v.point.ttft_s is not None:
        mark = _mark(v.point.ttft_s, slo.ttft_limit(input_tokens))
        parts.append(f"TTFT {v.point.ttft_s:.2f} s{mark}")
    return ", ".join(parts)


def _mark(value: float, limit: float | None) -> str:
    if limit is None:
        return ""
    return f" {'≤' if value <= limit else '>'} {_num(limit)}"


# ------------------------------------------------------- cells -> crossovers


def contexts(cells: Iterable[Cell]) -> list[tuple[int, int]]:
    """Every (input tokens, output tokens) that has data."""
    return sorted({(c.input_tokens, c.output_tokens) for c in cells if c.has_data})


def _context_cells(cells: Iterable[Cell], input_tokens: int, output_tokens: int, model: str | None = None
                   ) -> tuple[list[Cell], str, list[str]]:
    """The cells one context's crossover reads (single-VM ones, else cluster ones), their scope, notes;
    model: only that model's cells (None: every cell, for inputs of one model)."""
    everything = [c for c in cells if c.input_tokens == input_tokens and c.output_tokens == output_tokens
                  and (model is None or c.model == model)]
    ctx = [c for c in everything if c.has_data]
    scope = SINGLE if any(c.scope == SINGLE for c in ctx) else CLUSTER
    notes = []
    empty = sorted({c.streams_per_vm for c in everything if c.scope == scope and not c.has_data}
                   - {c.streams_per_vm for c in ctx if c.scope == scope})
    if empty:
        notes.append(f"No valid data at {', '.join(map(str, empty))} streams/VM: those loads are not judged.")
    if scope == CLUSTER and ctx:
        notes.append("No single-VM data: read from cluster cells (streams per VM of one cluster VM).")
    return [c for c in ctx if c.scope == scope], scope, notes


def load_points(cells: Iterable[Cell], input_tokens: int, output_tokens: int, pct: str = judging.DEFAULT_PERCENTILE,
                model: str | None = None) -> tuple[list[LoadPoint], str, list[str]]:
    """Load points of one context from single-VM cells (cluster cells when there are none).

    Returns (points, scope used, notes). Two cells at the same streams/VM (e.g. runs
    with different ranks per VM) keep the worse values.
    """
    if pct not in PERCENTILES:
        raise UsageError(f"percentile must be one of {', '.join(PERCENTILES)}, not {pct!r}")
    mine, scope, notes = _context_cells(cells, input_tokens, output_tokens, model)
    by_load: dict[int, list[Cell]] = defaultdict(list)
    for c in mine:
        by_load[c.streams_per_vm].append(c)
    points = []
    for load in sorted(by_load):
        group = by_load[load]
        tpots = [c.tpot_ms.get(pct) for c in group]
        ttfts = [c.ttft_s.get(pct) for c in group]
        if any(v is None for v in tpots + ttfts):
            raise UsageError(f"{pct} values are unknown for {input_tokens}-token inputs at {load} streams/VM "
                             f"(a CSV without {pct} columns, or no TTFT/TPOT measured); try --percentile p50")
        if len(group) > 1:
            notes.append(f"{len(group)} configurations at {load} streams/VM; the worse values are used.")
        samples = [c.samples for c in group]
        points.append(LoadPoint(load, max(tpots), max(ttfts), min(c.batch_per_rank for c in group),
                                None if None in samples else min(samples)))
    return points, scope, notes


def _strata(cells: Iterable[Cell], input_tokens: int, output_tokens: int, model: str | None = None
            ) -> dict[float, list]:
    """Per load, the ranks' windows the bootstrap resamples (loads without any are left out)."""
    mine, _, _ = _context_cells(cells, input_tokens, output_tokens, model)
    by_load: dict[int, list[Cell]] = defaultdict(list)
    for c in mine:
        by_load[c.streams_per_vm].append(c)
    # A load measured in several configurations is judged on its worse one; resampling
    # their windows together would mix them, so such a context gets no interval.
    if any(len(group) > 1 or not group[0].strata for group in by_load.values()):
        return {}
    return {float(load): list(group[0].strata) for load, group in by_load.items()}


def crossovers(cells: Sequence[Cell], slos: Sequence[Slo], pct: str = judging.DEFAULT_PERCENTILE,
               rule: Rule | None = None) -> list[Crossover]:
    """Crossover for every SLO x context x model with data, each at its SLO's percentile (else
    `pct`), with its bootstrap interval when the cells hold their windows. The models of one
    SLO and context stand next to each other, in the order of the cells."""
    rule = rule or Rule(percentile=pct)
    models = models_of(c for c in cells if c.has_data)
    out = []
    for slo in slos:
        q = slo.percentile or pct
        for inp, outp in contexts(cells):
            for model in models:
                points, scope, notes = load_points(cells, inp, outp, q, model)
                if not points:
                    continue
                strata = _strata(cells, inp, outp, model) if rule.replicates else {}
                reps = judging.static_replicates(strata, [(slo.tpot_ms, slo.ttft_limit(inp))], q, rule.replicates,
                                                 rule.seed)[0] if strata else []
                origin = Origin(scope, notes, model, len(models))
                out.append(crossover(points, slo, inp, outp, q, origin, reps, rule.confidence))
    return out


# ---------------------------------------------------------------- sizing


@dataclass(frozen=True)
class Sizing:
    """How many nodes a peak load needs under one SLO and context."""

    crossover: Crossover
    peak_streams: int
    headroom: float
    effective_threshold: float | None
    nodes: int | None
    reasoning: str
    nodes_interval: Interval | None = None

    @property
    def nodes_text(self) -> str:
        """`32`, `≤ 4` (every tested load passed), or "not achievable"."""
        if self.nodes is None:
            return NOT_ACHIEVABLE
        return f"≤ {self.nodes}" if self.crossover.status == "all" else str(self.nodes)

    @property
    def interval_text(self) -> str:
        return "" if self.nodes_interval is None else self.nodes_interval.text(lambda v: f"{v:g}", mark="≤ ")

    def answer_text(self) -> str:
        """`8 [4–<16] streams/VM → 32 [17–64] nodes`: the threshold and the node count with their intervals."""
        c = self.crossover
        # No threshold: the sentence says so in words ("not achievable streams/VM → ...").
        value = NOT_ACHIEVABLE if c.status == "none" else c.threshold_text
        thr = " ".join(x for x in (value, c.interval_text) if x)
        nodes = " ".join(x for x in (self.nodes_text, self.interval_text) if x)
        return f"{thr} streams/VM → {nodes} nodes"

    def to_dict(self) -> dict[str, Any]:
        c = self.crossover
        return {
            "model": c.model, "slo": c.slo.to_dict(), "input_tokens": c.input_tokens,
            "output_tokens": c.output_tokens, "percentile": c.percentile, "rule": c.rule, "scope": c.scope, "status": c.status,
            "threshold_streams_per_vm": c.threshold, "threshold_is_lower_bound": c.status == "all",
            "threshold_interval": None if c.interval is None else c.interval.to_dict(),
            "first_failing_streams_per_vm": c.first_failing, "binding": c.binding,
            "non_monotonic_loads": list(c.non_monotonic), "few_samples": list(c.few_samples),
            "peak_streams": self.peak_streams,
            "headroom": self.headroom, "effective_threshold": self.effective_threshold,
            "nodes": self.nodes, "nodes_interval": None if self.nodes_interval is None else self.nodes_interval.to_dict(),
            "answer": self.answer_text(), "reasoning": self.reasoning, "crossover": c.summary(),
        }


def nodes_required(peak_streams: int, threshold: int, headroom: float = 0.0) -> int:
    """The sizing law: ceil(peak / (threshold x (1 - headroom))), computed exactly."""
    _check_sizing_inputs(peak_streams, headroom)
    return judging.nodes_required(peak_streams, threshold, headroom)


def check_peak_streams(peak_streams: int) -> None:
    if peak_streams <= 0:
        raise UsageError(f"peak streams must be a positive whole number, not {peak_streams}")


def check_headroom(headroom: float) -> None:
    if not 0 <= headroom < 1:
        raise UsageError(f"headroom must be in [0, 1), e.g. 0.1 for 10%, not {headroom}")


def _check_sizing_inputs(peak_streams: int, headroom: float) -> None:
    check_peak_streams(peak_streams)
    check_headroom(headroom)


def effective_threshold(per_vm: float, headroom: float = 0.0) -> float:
    """per_vm x (1 - headroom), computed exactly as the law does (0.9 x 8 is 7.2, not 7.2000000000000002)."""
    return float(Fraction(str(per_vm)) * (1 - Fraction(str(headroom))))


def sizing_law(peak: float, per_vm: float, headroom: float = 0.0, per_vm_format: str = "g",
               peak_format: str = "") -> tuple[int, float, str]:
    """The sizing law applied, for static and serving thresholds alike: (nodes, the derated
    per-VM threshold, `ceil(256 / 7.2) = ceil(35.56) = 36`). The formats are how the caller
    prints its peak and per-VM values (streams are whole, serving loads are measured)."""
    nodes = judging.nodes_required(peak, per_vm, headroom)
    effective = effective_threshold(per_vm, headroom)
    return nodes, effective, (f"ceil({peak:{peak_format}} / {effective:{per_vm_format}}) = "
                              f"ceil({peak / effective:.2f}) = {nodes}")


def law_formula(per_vm: str = "threshold", headroom: str | None = None, peak: str = "peak streams") -> str:
    """The law in words, for every table title, note and help text that states it:
    `ceil(peak streams / threshold × (1 − headroom))` (no factor without a headroom)."""
    return f"ceil({peak} / {per_vm}" + (f" × (1 − {headroom})" if headroom else "") + ")"


def size(c: Crossover, peak_streams: int, headroom: float = 0.0) -> Sizing:
    """Nodes for `peak_streams` under crossover `c`, with the reasoning as text."""
    _check_sizing_inputs(peak_streams, headroom)
    head = f"{c.model_label}{c.slo.describe()}, {c.input_tokens}-token inputs, {c.rule}"
    span = None if c.interval is None else judging.nodes_of(c.interval, peak_streams, headroom)
    if c.status == "none":
        floor = c.floor
        reasoning = (f"{head}: no node count suffices. The SLO is not achievable in this configuration: "
                     f"the lowest tested load ({floor.point.streams_per_vm} streams/VM) already has "
                     f"{_values(floor, c.slo, c.input_tokens)}. Adding nodes adds capacity, not per-user speed.")
        return Sizing(c, peak_streams, headroom, None, None, reasoning, span)
    threshold = c.threshold
    assert threshold is not None
    nodes, effective, law = sizing_law(peak_streams, threshold, headroom)
    lines = [f"{head}: one VM meets the SLO up to {threshold} streams"
             + (" (every tested load met it, so the true threshold may be higher and this node count "
                "is an upper bound)" if c.status == "all" else
                f"; {c.first_failing} streams/VM fails on {c.binding}") + "."]
    if c.non_monotonic:
        lines.append(f"Non-monotonic data: {', '.join(map(str, c.non_monotonic))} streams/VM passed again after "
                     f"{c.first_failing} failed; the threshold below the first failure is used.")
    if headroom:
        lines.append(f"Headroom {headroom:.0%}: plan {threshold} × (1 − {headroom:g}) = {effective:g} streams per VM.")
    lines.append(f"Nodes = {law}.")
    sizing = Sizing(c, peak_streams, headroom, effective, nodes, "", span)
    if c.interval_text and sizing.interval_text:
        lines.append(f"{span.confidence:.0%} interval: threshold {c.interval_text} streams/VM, nodes "
                     f"{sizing.interval_text} ({span.replicates} bootstrap replicates).")
    if c.few_samples:
        lines.append(f"Few samples: {'; '.join(c.few_samples)}.")
    lines.append("Per-rank latency does not change with scale-out, so each added node adds the same capacity.")
    if c.scope == CLUSTER:
        lines.append(f"(Threshold read from {SCOPE_TITLES[CLUSTER]} cells: no single-VM data.)")
    return Sizing(c, peak_streams, headroom, effective, nodes, " ".join(lines), span)
