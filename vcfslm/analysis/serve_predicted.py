"""The serving simulator's answer beside what a run measured (pure: data in, a table out).

A report whose runs hold both static cells and serving windows of one model and server can
say what `predict --serve` would have answered for those windows before they ran: the same
loads, spec, seeds and SLOs, simulated from the fit on the static cells (the CLI computes it,
vcfslm/sim being a room above this one, and hands it in as `PredictedSeries`). This module
puts each predicted load beside the measured point of the same series and load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vcfslm.analysis.serve_points import ServeKey, ServePoint, describe_key, fmt_load, key_dict
from vcfslm.analysis.serve_threshold import ServeThreshold
from vcfslm.analysis.tables import Table, fmt


@dataclass(frozen=True)
class PredictedLoad:
    """One simulated load of a series: its p50s and, per SLO name, the share that met it."""

    load: float
    ttft_p50_s: float | None
    tpot_p50_ms: float | None
    attainment: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"load": self.load, "ttft_p50_s": self.ttft_p50_s, "tpot_p50_ms": self.tpot_p50_ms,
                "attainment": dict(self.attainment)}


@dataclass(frozen=True)
class PredictedSeries:
    """A measured series' loads as the simulator predicts them, the threshold it predicts per
    SLO name (per rank; None: no load passed) and what the prediction rests on."""

    key: ServeKey
    loads: tuple[PredictedLoad, ...]
    thresholds: dict[str, float | None]
    basis: str

    def to_dict(self) -> dict[str, Any]:
        return {**key_dict(self.key), "basis": self.basis, "thresholds": dict(self.thresholds),
                "loads": [p.to_dict() for p in self.loads]}


def _error(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None or not measured or measured != measured:
        return "–"
    if measured in (float("inf"), float("-inf")) or predicted in (float("inf"), float("-inf")):
        return "–"
    return f"{predicted / measured - 1:+.0%}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


def predicted_table(series: PredictedSeries, points: Sequence[ServePoint], slos: Sequence,
                    thresholds: Sequence[ServeThreshold] = ()) -> Table:
    """Per load of the series: measured and predicted TTFT and TPOT p50 with the prediction's
    error, and each SLO's attainment measured and predicted; the thresholds in the notes."""
    measured = {p.load: p for p in points if p.key == series.key}
    cols = [f"load/rank ({series.key.unit})", "TTFT p50 (s) measured", "predicted", "error",
            "TPOT p50 (ms) measured", "predicted", "error"]
    for s in slos:
        cols += [f"attainment {s.title} measured", "predicted"]
    rows = []
    for pred in sorted(series.loads, key=lambda p: p.load):
        m = measured.get(pred.load)
        ttft = m.ttft_p50_s if m is not None else None
        tpot = m.tpot_p50_ms if m is not None else None
        row = [fmt_load(pred.load), fmt(ttft, 2), fmt(pred.ttft_p50_s, 2), _error(pred.ttft_p50_s, ttft),
               fmt(tpot, 1), fmt(pred.tpot_p50_ms, 1), _error(pred.tpot_p50_ms, tpot)]
        for s in slos:
            got = (m.result.attainment(s.tpot_ms, s.ttft_s, s.ttft_per_token_ms).share
                   if m is not None and m.has_data else None)
            row += [_share(got), _share(pred.attainment.get(s.name))]
        rows.append(row)
    notes = [f"Predicted: {series.basis}."]
    for s in slos:
        if s.name not in series.thresholds:
            continue
        mine = next((t for t in thresholds if t.key == series.key and t.slo.name == s.name), None)
        got = f"{mine.threshold_text} {series.key.unit}" if mine is not None else "–"
        want = series.thresholds[s.name]
        said = f"{fmt_load(want * series.key.per_vm)} {series.key.unit}" if want is not None else "below every load"
        notes.append(f"{s.title} threshold per VM: measured {got}, predicted {said}.")
    return Table(f"Serving predicted beside measured, {describe_key(series.key)}", cols, rows, notes)
