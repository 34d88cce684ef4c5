"""Serving mode's answer (pure): latency and goodput per load (analysis/serve_points.py), the
serving threshold per SLO and context (serve_threshold.py), the static crossover beside it
(here), and the sizing law from it (serve_sizing.py); `analyse` puts them together.

How the numbers are read (the decisions themselves are vcfslm.serving's, so the
threshold here is the one the in-run sweep bisects towards):

- A serving point is one load of one series: every valid window of every rank and run
  of one (scope, VMs, ranks per VM, load kind, arrival, slots, context) at that load,
  pooled by `serving.load_results`. Invalid windows are left out of every number and
  counted, as in static mode; a load without a valid window is not judged.
- A load meets an SLO when at least the rule's share (`vcfslm.serving.judging`: the attainment,
  default 90 %, or the SLO's own percentile as a share) of its counted requests met every
  limit at once, the queue included in TTFT; a request unfinished by the window's cutoff
  met none. Tails (p50, p`SERVE_PERCENTILE`) are shown beside it, not judged.
- Goodput per SLO is `serving.goodput` over the pooled span (rank-seconds), times ranks
  per VM: requests per second per VM that met the SLO.
- Concurrent streams per VM = the time-averaged busy slots of a rank x ranks per VM: the
  load Little's law measures, comparable with static mode's streams per VM.
- The threshold per series and SLO is `judging.threshold` over `serving.meets` verdicts:
  the largest passing load before the first failing one (ascending). "below": even the
  smallest load tried fails, and analysis/below.py says why (a single request misses the
  SLO, or the sweep stopped short); "above": every load tried passes (a lower bound).
  Its 95 % interval comes from a two-stage bootstrap (windows within ranks, then requests
  within windows) and reaches up to the replicates' first failing loads, exclusive
  (`[4–<8]`); the streams interval reads the busy slots at both ends, and the node counts
  follow from the ends. A load judged on fewer requests than its share needs is flagged.
- Workloads never pool (vcfslm.serving.workloads): a series' key names its workload by name and
  digest, and a workload series is named by its workload, not by its longest prompt and
  reply (what its records' input and output tokens are). Its loads are split by prompt
  length, with the prefix cache's share where the server said it (analysis/lengths.py).
- The answer per SLO x context (or workload) reads single-VM series when there are any
  (cluster ones otherwise); of several series the one with the fewest concurrent streams
  per VM at its threshold (the conservative reading).
- Sizing: nodes = ceil(peak streams / serving streams per VM x (1 - headroom)); for a rate
  load also nodes = ceil(peak requests/s / threshold requests/s per VM x (1 - headroom))."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vcfslm.analysis.cells import (
    Cell,
)
from vcfslm.analysis.endpoint import (
    FaultWindow,
    ScaleOut,
    fault_windows,
    scale_outs,
)
from vcfslm.analysis.lengths import SeriesLengths, series_lengths
from vcfslm.analysis.serve_points import ServePoint, key_dict, series_of, serve_points
from vcfslm.analysis.serve_sizing import ServeSizing, sized
from vcfslm.analysis.serve_threshold import ServeThreshold, primary, thresholds
from vcfslm.analysis.slo import Crossover, crossovers
from vcfslm.analysis.slo_spec import Slo
from vcfslm.errors import UsageError
from vcfslm.serving import judging
from vcfslm.serving.judging import Rule


@dataclass(frozen=True, eq=False)
class ServeComparison:
    """A serving threshold and the static crossover of the same SLO and context."""

    threshold: ServeThreshold
    static: Crossover | None
    note: str = ""

    @property
    def comparable(self) -> bool:
        """Both judged at the same share: the static percentile p and the serving attainment p %."""
        c = self.static
        return c is not None and math.isclose(judging.percentile_value(c.percentile) / 100.0, self.threshold.share)

    @property
    def static_streams(self) -> int | None:
        return None if self.static is None or self.static.status == "none" else self.static.threshold

    @property
    def ratio(self) -> float | None:
        """Serving streams per VM / static streams per VM (None when either is unknown, or
        when the two were judged by rules that do not compare)."""
        s, st = self.threshold.streams_per_vm, self.static_streams
        if s is None or not st or self.threshold.status in ("below", "unjudged") or not self.comparable:
            return None
        if self.threshold.status == "above" and self.static.status == "all":
            return None
        return s / st

    @property
    def ratio_text(self) -> str:
        r = self.ratio
        if r is None:
            return "–"
        if self.threshold.status == "above":
            return f"≥ {r:.2f}"
        return ("≤ " if self.static.status == "all" else "") + f"{r:.2f}"

    @property
    def static_text(self) -> str:
        return "–" if self.static is None else self.static.threshold_text

    @property
    def pairing(self) -> str:
        """How the two were judged, side by side."""
        c = self.static
        static = "–" if c is None else c.rule
        return f"static {static}, serving {self.threshold.rule}"

    def to_dict(self) -> dict[str, Any]:
        c = self.static
        return {"model": self.threshold.key.model, "workload": self.threshold.key.workload,
                "slo": self.threshold.slo.name,
                "input_tokens": self.threshold.key.input_tokens,
                "output_tokens": self.threshold.key.output_tokens, "load_kind": self.threshold.key.load_kind,
                "serving_streams_per_vm": self.threshold.streams_per_vm, "serving_status": self.threshold.status,
                "serving_rule": self.threshold.rule,
                "static_streams_per_vm": None if c is None else c.threshold,
                "static_status": None if c is None else c.status,
                "static_percentile": None if c is None else c.percentile, "comparable": self.comparable,
                "static_scope": None if c is None else c.scope, "ratio": self.ratio, "ratio_text": self.ratio_text,
                "note": self.note}


def static_crossovers(cells: Sequence[Cell], slos: Sequence[Slo], rule: Rule | None = None
                      ) -> tuple[list[Crossover], str]:
    """The static crossovers at the rule's percentile (a note when they cannot be had)."""
    rule = rule or Rule()
    if not any(c.has_data for c in cells):
        return [], "no static-batch data among the inputs"
    try:
        return crossovers(cells, slos, rule.percentile, rule), ""
    except UsageError:
        return [], f"static {rule.percentile} values unknown (a CSV without {rule.percentile} columns?)"


NO_STATIC_FOR_WORKLOADS = "a workload's lengths vary: no static crossover"


def compare(primaries: Sequence[ServeThreshold], cells: Sequence[Cell], rule: Rule | None = None
            ) -> list[ServeComparison]:
    """Each answer threshold beside the static crossover of the same SLO and context; the
    ratio only where the static percentile and the serving attainment are the same share."""
    statics, why = static_crossovers(cells, list(dict.fromkeys(t.slo for t in primaries)), rule)
    index = {(c.slo, c.input_tokens, c.output_tokens, c.model): c for c in statics}
    out = []
    for t in primaries:
        if t.key.workload:
            # Static batches run one fixed context; a workload's lengths vary, so none compares.
            out.append(ServeComparison(t, None, NO_STATIC_FOR_WORKLOADS))
            continue
        c = index.get((t.slo, t.key.input_tokens, t.key.output_tokens, t.key.model))
        note = why if c is None and why else ("no static crossover of this context" if c is None else "")
        if c is not None:
            ranks = {cell.ranks_per_vm for cell in cells if cell.scope == c.scope and cell.has_data
                     and (cell.input_tokens, cell.output_tokens) == t.key.context and cell.model == t.key.model}
            if ranks and ranks != {t.key.ranks_per_vm}:
                note = (f"static cells have {', '.join(map(str, sorted(ranks)))} ranks per VM, the serving "
                        f"series {t.key.ranks_per_vm}")
        comparison = ServeComparison(t, c, note)
        if c is not None and not comparison.comparable:
            comparison = ServeComparison(t, c, f"no ratio: {comparison.pairing} do not compare")
        out.append(comparison)
    return out


@dataclass
class ServeAnalysis:
    """Serving mode's part of a report."""

    points: list[ServePoint]
    thresholds: list[ServeThreshold]            # every series x SLO
    primaries: list[ServeThreshold]             # the answer per SLO x context x load kind
    comparisons: list[ServeComparison]
    sizings: list[ServeSizing]
    warnings: list[str] = field(default_factory=list)
    rule: Rule = field(default_factory=Rule)
    scale_outs: list[ScaleOut] = field(default_factory=list)   # curves through one endpoint
    faults: list[FaultWindow] = field(default_factory=list)    # windows that took a fault
    lengths: list[SeriesLengths] = field(default_factory=list)  # loads split by prompt length

    def size_for(self, t: ServeThreshold, peak_streams: int | None = None, peak_rps: float | None = None,
                 headroom: float = 0.0) -> ServeSizing:
        """Sizing for one of its thresholds, on a measured cluster curve where there is one."""
        return sized(t, self.scale_outs, peak_streams, peak_rps, headroom)

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule.serving_text(), "attainment": self.rule.attainment,
                "points": [p.to_dict() for p in self.points],
                "thresholds": [t.to_dict() for t in self.thresholds],
                "answer": [t.to_dict() for t in self.primaries],
                "comparisons": [c.to_dict() for c in self.comparisons],
                "sizings": [s.to_dict() for s in self.sizings], "warnings": list(self.warnings),
                "scale_out": [c.to_dict() for c in self.scale_outs],
                "faults": [f.to_dict() for f in self.faults],
                "length_buckets": [{**key_dict(s.key), **s.to_dict()} for s in self.lengths]}


def has_serving(runs: Sequence[Any]) -> bool:
    return any(getattr(r, "serve_records", None) for r in runs)


def analyse(runs: Sequence[Any], slos: Sequence[Slo], cells: Sequence[Cell] = (),
            peaks: Sequence[int] = (), headroom: float = 0.0, rule: Rule | None = None) -> ServeAnalysis:
    """Serving points, thresholds, the static comparison and sizing of `runs` (RunFiles);
    `cells`: the static cells of every input (the crossover beside each threshold)."""
    rule = rule or Rule()
    points, warnings = serve_points(runs, slos)
    every = thresholds(points, slos, rule)
    answer = primary(every)
    models = len({t.key.model for t in answer})
    if models > 1:                      # every sentence of the answer names its model
        answer = [replace(t, models=models) for t in answer]
    curves = scale_outs(every)
    sizings = [sized(t, curves, peak, None, headroom) for t in answer for peak in peaks]
    return ServeAnalysis(points, every, answer, compare(answer, cells, rule), sizings, warnings, rule, curves,
                         fault_windows(runs), series_lengths(series_of(points), every, slos))
