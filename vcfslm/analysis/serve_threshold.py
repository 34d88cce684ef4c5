"""Serving's threshold (pure): the highest load of a series that meets an SLO, judged by
`judging.threshold` over `serving.meets` verdicts, its bootstrap interval, the sentence that
says why, and the answer per SLO x context (the conservative series)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vcfslm.analysis import below
from vcfslm.analysis.cells import (
    CLUSTER,
    SINGLE,
    finite,
    model_text,
)
from vcfslm.analysis.serve_points import (
    LOAD_NAMES,
    PCT,
    ServeKey,
    ServePoint,
    fmt_load,
    key_dict,
    series_of,
)
from vcfslm.analysis.slo_spec import Slo
from vcfslm.serving import decisions as serving
from vcfslm.serving import judging
from vcfslm.serving.judging import Interval, Replicate, Rule


@dataclass(frozen=True, eq=False)
class ServeThreshold:
    """The serving threshold of one series under one SLO."""

    key: ServeKey
    slo: Slo
    points: tuple[ServePoint, ...]               # every load of the series, ascending
    verdicts: Mapping[float, bool | None]        # per load per rank (None: not judged)
    status: str                                  # "threshold" | "below" | "above" | "unjudged"
    passing: float | None                        # per rank
    failing: float | None                        # per rank
    binding: str | None                          # at the first failing load
    non_monotonic: tuple[float, ...] = ()        # loads per rank passing again after a failure
    notes: tuple[str, ...] = ()
    share: float = judging.DEFAULT_ATTAINMENT    # the attainment it was judged at
    interval: Interval | None = None             # of the threshold load per rank
    streams_interval: Interval | None = None     # of the concurrent streams per VM at it
    # Per bootstrap replicate: its reading and its busy slots per load (what node counts resample).
    replicates: tuple[tuple[Replicate | None, Mapping[float, float]], ...] = ()
    few_samples: tuple[str, ...] = ()            # loads judged on too few requests
    models: int = 1                              # how many models the answer holds: >1 names this one
    below_why: below.Lowering | None = None      # "below": why no lower load passed (analysis/below.py)

    @property
    def model_label(self) -> str:
        """The model as a sentence names it: only once the answer holds several."""
        return (model_text(self.key.model) + ", ") if self.models > 1 else ""

    def point(self, load: float | None) -> ServePoint | None:
        return next((p for p in self.points if p.load == load), None)

    @property
    def judged(self) -> list[ServePoint]:
        return [p for p in self.points if self.verdicts.get(p.load) is not None]

    @property
    def rule(self) -> str:
        return f"{judging.attainment_text(self.share)} attainment"

    def attainment_at(self, p: ServePoint) -> judging.Attainment | None:
        return p.result.attainment(self.slo.tpot_ms, self.slo.ttft_s, self.slo.ttft_per_token_ms) if p.has_data else None

    @property
    def load_per_vm(self) -> float | None:
        return None if self.passing is None else self.passing * self.key.per_vm

    @property
    def failing_per_vm(self) -> float | None:
        return None if self.failing is None else self.failing * self.key.per_vm

    @property
    def streams_per_vm(self) -> float | None:
        """Concurrent streams per VM measured at the threshold load."""
        p = self.point(self.passing)
        return None if p is None else p.streams_per_vm

    @property
    def rate_per_vm(self) -> float | None:
        """Requests/s per VM at the threshold (a rate load only)."""
        return self.load_per_vm if self.key.load_kind == "rate" else None

    @property
    def threshold_text(self) -> str:
        judged = self.judged
        if self.status == "below":
            return f"< {fmt_load(judged[0].load_per_vm)}"
        if self.status == "above":
            return f"≥ {fmt_load(judged[-1].load_per_vm)}"
        if self.status == "unjudged":
            return "–"
        return fmt_load(self.load_per_vm)

    @property
    def interval_text(self) -> str:
        """The threshold load's interval per VM, `[0.5–<1]`, or ""."""
        if self.interval is None:
            return ""
        return self.interval.text(lambda v: fmt_load(v * self.key.per_vm))

    @property
    def streams_text(self) -> str:
        s = self.streams_per_vm
        if s is None or self.status in ("below", "unjudged"):
            return "–"
        return ("≥ " if self.status == "above" else "") + f"{s:.1f}"

    @property
    def first_failing_text(self) -> str:
        if self.failing is None:
            judged = self.judged
            return f"> {fmt_load(judged[-1].load_per_vm)}" if judged else "–"
        return fmt_load(self.failing_per_vm)

    @property
    def interval_per_vm(self) -> Interval | None:
        """The threshold load's interval per VM (the bootstrap's is per rank)."""
        iv, k = self.interval, self.key.per_vm
        if iv is None:
            return None
        return replace(iv, low=None if iv.low is None else iv.low * k, high=None if iv.high is None else iv.high * k)

    def per_vm_replicates(self, which: str) -> list[Replicate | None]:
        """The replicates read per VM: `load` (requests/s or users) or `streams` (busy slots, by
        Little's law, at the replicate's threshold and at its first failing load)."""
        k = self.key.per_vm

        def read(load, active):
            if load is None:
                return None
            return load * k if which == "load" else active.get(load, 0.0) * k

        out: list[Replicate | None] = []
        for rep, active in self.replicates:
            if rep is None or rep.threshold is None:
                out.append(rep if rep is None else Replicate(None, rep.all_pass, read(rep.failing, active)))
                continue
            value, failing = read(rep.threshold, active), read(rep.failing, active)
            # Slots full at both loads: the failing load's streams bound nothing above the threshold's.
            out.append(Replicate(value, rep.all_pass, failing if failing is not None and failing > value else None))
        return out

    def summary(self) -> str:
        return threshold_reason(self)

    def to_dict(self) -> dict[str, Any]:
        per_vm = self.interval_per_vm
        return {**key_dict(self.key), "slo": self.slo.to_dict(), "rule": self.rule, "attainment": self.share,
                "status": self.status,
                "load_unit": f"{self.key.unit} per VM", "threshold_load_per_rank": self.passing,
                "threshold_load_per_vm": self.load_per_vm, "first_failing_load_per_rank": self.failing,
                "first_failing_load_per_vm": self.failing_per_vm,
                "threshold_interval_per_vm": None if per_vm is None else per_vm.to_dict(),
                "threshold_streams_per_vm": self.streams_per_vm, "threshold_is_lower_bound": self.status == "above",
                "streams_interval": None if self.streams_interval is None else self.streams_interval.to_dict(),
                "binding": self.binding, "non_monotonic_loads_per_rank": list(self.non_monotonic),
                "verdicts": [{"load_per_rank": p.load, "load_per_vm": p.load_per_vm,
                              "meets": self.verdicts.get(p.load),
                              "attainment": finite(a.share) if (a := self.attainment_at(p)) else None,
                              "requests": p.requests} for p in self.points],
                "few_samples": list(self.few_samples), "below": below.to_dict(self.below_why, self.slo.title, self.key),
                "threshold": self.threshold_text, "notes": list(self.notes), "reasoning": self.summary()}


def _binding(result: serving.LoadResult, slo: Slo, share: float) -> str:
    a = result.attainment(slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms)
    text = a.binding(share)
    # Unfinished requests met no limit: say so when they alone sink the load.
    return text + (" (unfinished requests)" if result.unfinished and result.unfinished > (1 - share) * a.requests
                   else "")


def serve_threshold(points: Sequence[ServePoint], slo: Slo, rule: Rule | None = None) -> ServeThreshold:
    """The threshold of one series (its points, any order) under `slo`, judged by `rule`."""
    if not points:
        raise ValueError("a serving threshold needs at least one load")
    rule = rule or Rule()
    share = rule.attainment_for(slo.percentile)
    ordered = tuple(sorted(points, key=lambda p: p.load))
    verdicts = {p.load: (serving.meets(p.result, slo.tpot_ms, slo.ttft_s, share, slo.ttft_per_token_ms) if p.has_data else None)
                for p in ordered}
    passing, failing = judging.threshold(verdicts)
    if passing is not None and failing is not None:
        status = "threshold"
    elif failing is not None:
        status = "below"
    elif passing is not None:
        status = "above"
    else:
        status = "unjudged"
    fail_point = next((p for p in ordered if p.load == failing), None)
    binding = _binding(fail_point.result, slo, share) if fail_point is not None else None
    later = tuple(p.load for p in ordered if failing is not None and p.load > failing and verdicts[p.load])
    notes = []
    empty = [p for p in ordered if verdicts[p.load] is None]
    if empty:
        notes.append(f"No valid data at {', '.join(fmt_load(p.load_per_vm) for p in empty)} "
                     f"{ordered[0].key.unit}/VM: those loads are not judged.")
    thin = judging.few_samples({fmt_load(p.load_per_vm): p.requests for p in ordered if p.has_data}, share,
                               "requests")
    thin = (f"{judging.attainment_text(share)} attainment {thin} {ordered[0].key.unit}/VM",) if thin else ()
    reps: list = []
    windows = serving.bootstrap_windows({p.load: p.result for p in ordered if p.has_data}, {slo.name: slo.limits()})
    if windows and rule.replicates:
        reps = judging.serving_replicates(windows, {slo.name: share}, rule.replicates, rule.seed)[slo.name]
    t = ServeThreshold(ordered[0].key, slo, ordered, verdicts, status, passing, failing, binding, later,
                       tuple(notes), share, judging.interval([r for r, _ in reps], rule.confidence),
                       None, tuple(reps), thin, below_why=below.of_series(ordered, slo, share, status))
    if reps:
        t = replace(t, streams_interval=judging.interval(t.per_vm_replicates("streams"), rule.confidence))
    return t


def thresholds(points: Sequence[ServePoint], slos: Sequence[Slo], rule: Rule | None = None) -> list[ServeThreshold]:
    """Every series x SLO (SLO first, then series order)."""
    by_series = series_of(points)
    return [serve_threshold(pts, slo, rule) for slo in slos for pts in by_series.values()]


def _judged(t: ServeThreshold, p: ServePoint) -> str:
    """`attainment 85 % < 90 % (412 requests; p90 TPOT 450.2 ms, p90 TTFT 1.20 s)`."""
    a = t.attainment_at(p)
    if a is None:
        return "no requests"
    mark = "≥" if judging.attains(a, t.share) else "<"
    return (f"attainment {judging.attainment_text(a.share)} {mark} {judging.attainment_text(t.share)} "
            f"({a.requests} requests; {_tails(p)})")


def _tails(p: ServePoint) -> str:
    parts = []
    for name, value, unit, digits in (("TPOT", p.tpot_p90_ms, "ms", 1), ("TTFT", p.ttft_p90_s, "s", 2)):
        if value is None:
            continue
        text = "∞ (unfinished requests)" if math.isinf(value) else f"{value:.{digits}f} {unit}"
        parts.append(f"{PCT} {name} {text}")
    return ", ".join(parts)


def threshold_reason(t: ServeThreshold) -> str:
    """One paragraph: where the threshold lies and why, bounds said plainly."""
    k, unit = t.key, t.key.unit
    head = (f"{t.model_label}{t.slo.describe()}, serving {LOAD_NAMES[k.load_kind]} ({k.arrival}, {k.slots} slots per rank), "
            f"{k.context_phrase}, {t.rule}")
    judged = t.judged
    if t.status == "unjudged":
        text = f"{head}: no load has valid data to judge."
    elif t.status == "below":
        first = judged[0]
        lead = below.alone_text(t.below_why, t.slo.title) or "below the smallest load tried"
        text = (f"{head}: {lead}. Even {fmt_load(first.load_per_vm)} {unit}/VM has {_judged(t, first)}; "
                f"{t.binding} binds. " + below.sentence(t.below_why, t.slo.title, k))
    elif t.status == "above":
        last = judged[-1]
        text = (f"{head}: every load tried meets it, so the threshold is ≥ {fmt_load(last.load_per_vm)} "
                f"{unit}/VM (the largest tried; {last.streams_per_vm:.1f} concurrent streams/VM measured there: "
                f"{_judged(t, last)}).")
    else:
        ok, fail = t.point(t.passing), t.point(t.failing)
        text = (f"{head}: meets it up to {fmt_load(t.load_per_vm)} {unit}/VM ({ok.streams_per_vm:.1f} "
                f"concurrent streams/VM measured; {_judged(t, ok)}); {fmt_load(t.failing_per_vm)} {unit}/VM "
                f"fails on {t.binding} ({_judged(t, fail)}).")
    if t.interval is not None:
        text += (f" {t.interval.confidence:.0%} interval {t.interval_text} {unit}/VM"
                 + (f", {t.streams_interval.text(lambda v: f'{v:.1f}')} streams/VM" if t.streams_interval else "")
                 + f" ({t.interval.replicates} bootstrap replicates: windows within ranks, requests within windows).")
    if t.few_samples:
        text += f" Few samples: {'; '.join(t.few_samples)}."
    if t.non_monotonic:
        loads = ", ".join(fmt_load(v * k.per_vm) for v in t.non_monotonic)
        text += (f" Not monotonic: {loads} {unit}/VM meet(s) it again after {fmt_load(t.failing_per_vm)} failed; "
                 "the threshold stays below the first failure.")
    for note in t.notes:
        text += f" {note}"
    return text


def _conservative(t: ServeThreshold) -> tuple:
    rank = {"below": 0, "threshold": 1, "above": 2, "unjudged": 3}[t.status]
    return (rank, t.streams_per_vm if t.streams_per_vm is not None else 0.0)


def primary(all_thresholds: Sequence[ServeThreshold]) -> list[ServeThreshold]:
    """Per SLO x context x workload x load kind x server x model the threshold the answer reads:
    single-VM series first, and of several the fewest streams per VM (a notes entry says so).
    Servers, models and workloads are never pooled: vLLM's threshold and vcfslm's own, two
    models', or a chat mix's and a trace's, stand side by side."""
    groups: dict[tuple, list[ServeThreshold]] = {}
    for t in all_thresholds:
        groups.setdefault((t.slo, t.key.input_tokens, t.key.output_tokens, t.key.workload, t.key.load_kind,
                           t.key.server, t.key.model), []).append(t)
    out = []
    for ts in groups.values():
        faulted = all(t.key.faulted for t in ts)
        ts = ts if faulted else [t for t in ts if not t.key.faulted]
        scope = SINGLE if any(t.key.scope == SINGLE for t in ts) else CLUSTER
        mine = sorted((t for t in ts if t.key.scope == scope), key=_conservative)
        chosen = mine[0]
        notes = list(chosen.notes)
        if faulted:
            notes.append("Every window of this context took a fault (a server killed in it): a threshold under "
                         "faults, not the deployment's capacity.")
        if scope == CLUSTER:
            notes.append("No single-VM serving data: read from cluster series (per VM of one cluster VM).")
        if len(mine) > 1:
            notes.append(f"{len(mine)} serving configurations of this context; the one with the fewest "
                         "concurrent streams per VM at its threshold is used.")
        if tuple(notes) != chosen.notes:
            chosen = replace(chosen, notes=tuple(notes))
        out.append(chosen)
    return out
