"""Nodes for a peak from a serving threshold (pure): by streams and, for a rate load, by
requests/s, per VM x (1 - headroom); on a measured scale-out curve through one endpoint
where there is one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vcfslm.analysis import below
from vcfslm.analysis.cells import (
    CLUSTER,
    SCOPE_TITLES,
)
from vcfslm.analysis.endpoint import (
    ScaleOut,
    curve_for,
    curve_interval,
    curve_nodes,
    curve_text,
)
from vcfslm.analysis.serve_points import LOAD_NAMES, fmt_load, key_dict
from vcfslm.analysis.serve_threshold import ServeThreshold
from vcfslm.analysis.slo import (
    check_headroom,
    check_peak_streams,
    effective_threshold,
    sizing_law,
)
from vcfslm.errors import UsageError
from vcfslm.serving import judging
from vcfslm.serving.judging import Interval


@dataclass(frozen=True, eq=False)
class ServeSizing:
    """Nodes for a peak under one serving threshold: by streams and, for a rate load, by rate."""

    threshold: ServeThreshold
    peak_streams: int | None
    peak_rps: float | None
    headroom: float
    nodes_by_streams: int | None
    nodes_by_rate: int | None
    reasoning: str
    streams_nodes_interval: Interval | None = None
    rate_nodes_interval: Interval | None = None
    # Sized on the scale-out curve measured through one endpoint (analysis/endpoint.py): what
    # it read ("" : from this threshold alone), and whether a node count it used is a bound.
    curve: str = ""
    curve_bound: bool = False

    @property
    def nodes(self) -> int | None:
        """The answer: by rate when a peak rate was given, else by streams."""
        return self.nodes_by_rate if self.peak_rps is not None else self.nodes_by_streams

    @property
    def bound(self) -> bool:
        return self.curve_bound if self.curve else self.threshold.status == "above"

    @property
    def law_text(self) -> str:
        """`ceil(256 / 20) = 13` (by streams; the headroom applied), or why there is none."""
        if self.curve:
            nodes = self.nodes_by_streams
            return f"on the measured cluster curve, {'at most ' if self.bound else ''}{nodes}" if nodes else \
                "no node count"
        streams = self.threshold.streams_per_vm
        if self.nodes_by_streams is None or self.peak_streams is None or not streams:
            return "no node count"
        eff = effective_threshold(streams, self.headroom)
        return f"ceil({self.peak_streams} / {eff:.3g}) = {'at most ' if self.bound else ''}{self.nodes_by_streams}"

    def nodes_text(self, which: str = "streams") -> str:
        n = self.nodes_by_rate if which == "rate" else self.nodes_by_streams
        if n is None:
            return "–" if self.threshold.status in ("threshold", "above") else below.nodes(self.threshold.below_why)
        return f"≤ {n}" if self.bound else str(n)

    def interval_text(self, which: str = "streams") -> str:
        iv = self.rate_nodes_interval if which == "rate" else self.streams_nodes_interval
        return "" if iv is None else iv.text(lambda v: f"{v:g}", mark="≤ ")

    def answer_text(self, which: str = "streams") -> str:
        """`2000 [1000–<2500] req/s/VM, 3.2 [3.0–<3.9] streams/VM → 80 [66–86] nodes`."""
        t = self.threshold
        parts = [" ".join(x for x in (t.threshold_text, t.interval_text) if x) + f" {t.key.unit}/VM"]
        if t.streams_per_vm is not None and t.status in ("threshold", "above"):
            iv = "" if t.streams_interval is None else " " + t.streams_interval.text(lambda v: f"{v:.1f}")
            parts.append(f"{t.streams_text}{iv} streams/VM")
        nodes = " ".join(x for x in (self.nodes_text(which), self.interval_text(which)) if x)
        tail = below.answer(t.below_why, t.slo.title) if t.status == "below" else f"{nodes} nodes"
        return ", ".join(parts) + f" → {tail}"

    def to_dict(self) -> dict[str, Any]:
        t = self.threshold
        return {"threshold_kind": "serving", **key_dict(t.key), "slo": t.slo.to_dict(), "rule": t.rule,
                "attainment": t.share,
                "status": t.status, "threshold_load_per_vm": t.load_per_vm, "load_unit": f"{t.key.unit} per VM",
                "threshold_interval_per_vm": t.to_dict()["threshold_interval_per_vm"],
                "threshold_streams_per_vm": t.streams_per_vm, "threshold_is_lower_bound": t.status == "above",
                "first_failing_load_per_vm": t.failing_per_vm, "binding": t.binding,
                "peak_streams": self.peak_streams, "peak_rps": self.peak_rps, "headroom": self.headroom,
                "nodes_by_streams": self.nodes_by_streams, "nodes_by_rate": self.nodes_by_rate,
                "nodes_by_streams_interval": None if self.streams_nodes_interval is None
                else self.streams_nodes_interval.to_dict(),
                "nodes_by_rate_interval": None if self.rate_nodes_interval is None
                else self.rate_nodes_interval.to_dict(),
                "nodes": self.nodes, "answer": self.answer_text("rate" if self.peak_rps is not None else "streams"),
                "reasoning": self.reasoning, "threshold": t.summary(), "curve": self.curve or None}


def size(t: ServeThreshold, peak_streams: int | None = None, peak_rps: float | None = None,
         headroom: float = 0.0) -> ServeSizing:
    """The sizing law from a serving threshold, with the reasoning as text."""
    if peak_streams is None and peak_rps is None:
        raise UsageError("give a peak: concurrent streams, or requests/s for a rate load")
    if peak_streams is not None:
        check_peak_streams(peak_streams)
    if peak_rps is not None and not (math.isfinite(peak_rps) and peak_rps > 0):
        raise UsageError(f"peak requests/s must be a positive number, not {peak_rps}")
    check_headroom(headroom)
    if peak_rps is not None and t.key.load_kind != "rate":
        raise UsageError("--peak-rps needs a serving threshold of a rate load (requests/s); this one is "
                         f"{t.key.load_kind}")
    k = t.key
    head = f"{t.model_label}{t.slo.describe()}, serving {LOAD_NAMES[k.load_kind]}, {k.context_phrase}, {t.rule}"
    if t.status in ("below", "unjudged"):
        why = (below.alone_text(t.below_why, t.slo.title) or "even the smallest load tried fails; measure lower "
               f"loads ({below.why_not_lower(t.below_why, k)})" if t.status == "below" else "no load has valid data")
        return ServeSizing(t, peak_streams, peak_rps, headroom, None, None,
                           f"{head}: no node count can be read: {why}.")
    streams, rate = t.streams_per_vm, t.rate_per_vm
    lines = [f"{head}: one VM meets the SLO up to {fmt_load(t.load_per_vm)} {k.unit}/VM, "
             f"{streams:.1f} concurrent streams/VM measured there"
             + (" (every load tried met it, so the true threshold may be higher and these node counts are "
                "upper bounds)" if t.status == "above" else
                f"; {fmt_load(t.failing_per_vm)} {k.unit}/VM fails on {t.binding}") + "."]
    by_streams = by_rate = None
    streams_span = rate_span = None
    conf = t.interval.confidence if t.interval else judging.DEFAULT_CONFIDENCE
    if peak_streams is not None:
        if streams and streams > 0:
            by_streams, _, law = sizing_law(peak_streams, streams, headroom, ".3g")
            lines.append(f"Nodes = {law}" + (f" (headroom {headroom:.0%})" if headroom else "") + ".")
            streams_span = (None if t.streams_interval is None
                            else judging.nodes_of(t.streams_interval, peak_streams, headroom))
        else:
            lines.append("No concurrent streams were measured at the threshold: nodes by streams cannot be read.")
    if peak_rps is not None and rate:
        by_rate, _, law = sizing_law(peak_rps, rate, headroom, ".3g", "g")
        lines.append(f"By rate: nodes = {law}" + (f" (headroom {headroom:.0%})" if headroom else "") + ".")
        per_vm = t.interval_per_vm
        rate_span = None if per_vm is None else judging.nodes_of(per_vm, peak_rps, headroom)
    spans = [f"{label} {iv.text(mark='≤ ')}" for label, iv in (("by streams", streams_span), ("by rate", rate_span))
             if iv is not None and iv.text(mark="≤ ")]
    if spans and t.interval_text:
        lines.append(f"{conf:.0%} interval: threshold {t.interval_text} {k.unit}/VM, nodes {', '.join(spans)} "
                     f"({t.interval.replicates} bootstrap replicates).")
    if t.few_samples:
        lines.append(f"Few samples: {'; '.join(t.few_samples)}.")
    if k.scope == CLUSTER:
        lines.append(f"(Threshold read from {SCOPE_TITLES[CLUSTER]} serving data: no single-VM series.)")
    return ServeSizing(t, peak_streams, peak_rps, headroom, by_streams, by_rate, " ".join(lines),
                       streams_span, rate_span)


def size_on_curve(t: ServeThreshold, curve: ScaleOut, peak_streams: int | None = None,
                  peak_rps: float | None = None, headroom: float = 0.0) -> ServeSizing:
    """Nodes for a peak read off the scale-out curve measured through one endpoint: the fewest
    measured node count that carries it (its threshold, or its busy streams there, less the
    headroom), past the largest measured, that count's capacity per node (its efficiency
    kept). `t` is the answer's threshold it stands beside (checked as `size` checks it)."""
    alone = size(t, peak_streams, peak_rps, headroom)
    k = t.key
    head = f"{t.model_label}{t.slo.describe()}, serving {LOAD_NAMES[k.load_kind]}, {k.context_phrase}, {t.rule}"
    read = curve_text(curve, "rate", f"{k.unit} at the threshold")
    lines = [f"{head}: sized on the cluster curve measured through one endpoint ({read})."]
    found: dict[str, tuple[int | None, Interval | None]] = {}
    bound = False
    for which, peak, unit in (("streams", peak_streams, "concurrent streams"), ("rate", peak_rps, k.unit)):
        if peak is None:
            continue
        caps = curve.capacities(which)
        got = curve_nodes([(n, c) for n, c, _, _ in caps], peak, headroom)
        if got is None:
            lines.append(f"No {which} measured at any node count: nodes by {which} cannot be read.")
            found[which] = (None, None)
            continue
        nodes, extrapolated = got
        used = max(n for n, *_ in caps) if extrapolated else nodes
        row = next(r for r in curve.rows if r.nodes == used)
        bound = bound or row.threshold.status == "above"
        capacity = next(c for n, c, _, _ in caps if n == used)
        derated = f" less {headroom:.0%} headroom" if headroom else ""
        if extrapolated:
            lines.append(f"{peak:g} {unit}: beyond the {used} nodes measured ({capacity:.3g}{derated}), at "
                         f"{capacity / used:.3g} per node, the efficiency measured at {used} nodes kept: "
                         f"{nodes} nodes.")
        else:
            lines.append(f"{peak:g} {unit}: {nodes} node{'s' if nodes > 1 else ''} carry {capacity:.3g}{derated}, "
                         f"measured.")
        found[which] = (nodes, curve_interval(caps, peak, headroom))
    lines.append(f"(One VM's threshold times the nodes would say {alone.nodes_text('rate' if peak_rps else 'streams')}"
                 " nodes.)")
    streams, rate = found.get("streams", (None, None)), found.get("rate", (None, None))
    return ServeSizing(t, peak_streams, peak_rps, headroom, streams[0], rate[0], " ".join(lines),
                       streams[1], rate[1], curve=read, curve_bound=bound)


def sized(t: ServeThreshold, curves: Sequence[ScaleOut], peak_streams: int | None = None,
          peak_rps: float | None = None, headroom: float = 0.0) -> ServeSizing:
    """Sizing for `t`: on the measured cluster curve of its SLO and context when one exists
    (analysis/endpoint.py), else from its threshold alone."""
    curve = curve_for(curves, t)
    if curve is None:
        return size(t, peak_streams, peak_rps, headroom)
    return size_on_curve(t, curve, peak_streams, peak_rps, headroom)
