"""What-if sizing (pure): the fitted performance model applied to a target platform, as the
same answer a measured run gives (table, crossover per SLO, nodes), each figure with its
95 % prediction interval; and the model's honesty check (fit on part of the cells,
predict the rest).

The crossover's interval comes from judging the interval's ends: the optimistic one
(every cell at its lower TTFT/TPOT bound) and the pessimistic one (at the upper bound).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from .cells import SINGLE, Cell, CellKey, Quantiles
from .perfmodel import (
    Observation,
    PerfModel,
    Prediction,
    RankRates,
    Scenario,
    Validation,
    predict,
    validate,
)
from .slo import NOT_ACHIEVABLE, Crossover, Sizing, crossovers, law_formula, size
from .tables import Table, fmt


@dataclass(frozen=True)
class Target:
    """Where the prediction is for: one rank's rates and the VM's ranks."""

    description: str
    rates: RankRates
    ranks_per_node: int
    basis: str = "measured"


@dataclass(frozen=True)
class Threshold:
    """A predicted crossover with the thresholds of its interval's ends."""

    crossover: Crossover
    optimistic: Crossover | None
    pessimistic: Crossover | None

    @property
    def range_text(self) -> str:
        ends = [c.threshold_text for c in (self.pessimistic, self.optimistic) if c is not None]
        if len(ends) < 2:
            return "interval unknown"
        return ends[0] if ends[0] == ends[1] else f"{ends[0]} to {ends[1]}"


@dataclass(frozen=True)
class NodesAnswer:
    sizing: Sizing
    low: int | None       # from the optimistic threshold
    high: int | None      # from the pessimistic threshold


@dataclass
class PredictionResult:
    model: PerfModel
    target: Target
    predictions: list[Prediction]
    thresholds: list[Threshold]
    nodes: list[NodesAnswer] = field(default_factory=list)
    model_name: str = ""      # the model predicted for, when the answer is one of several (or not the fitted one)

    @property
    def for_model(self) -> str:
        """` for MODEL`, the tables' title suffix; "" when there is one model only."""
        return f" for {self.model_name}" if self.model_name else ""


def scenarios_of(observations: Iterable[Observation], batches: Sequence[int] | None = None,
                 inputs: Sequence[int] | None = None, output_tokens: int | None = None) -> list[Scenario]:
    """The scenarios to predict: the measured ones, or the matrix the user asked for."""
    seen = {o.scenario for o in observations}
    batches = batches or sorted({s.batch for s in seen})
    inputs = inputs or sorted({s.input_tokens for s in seen})
    outputs = [output_tokens] if output_tokens else sorted({s.output_tokens for s in seen})
    return [Scenario(b, i, o) for o in outputs for i in inputs for b in batches]


PREDICTED_PERCENTILE = "p50"


def predict_target(model: PerfModel, dims, target: Target, scenarios: Sequence[Scenario], slos: Sequence,
                   peaks: Sequence[int] = (), headroom: float = 0.0, model_name: str = "") -> PredictionResult:
    """The answer for one model shape (`dims`) on the target; model_name titles its tables."""
    preds = [predict(model, dims, target.rates, s) for s in scenarios]
    # The model predicts each cell's median (p50): its crossover is judged there, even for an
    # SLO with a percentile of its own, and its spread is the prediction interval, not a
    # bootstrap of windows.
    slos = [replace(s, percentile=None) for s in slos]
    mid = crossovers(predicted_cells(preds, target.ranks_per_node), slos, PREDICTED_PERCENTILE)
    ends = {}
    for end in ("optimistic", "pessimistic"):
        cells = predicted_cells(preds, target.ranks_per_node, end)
        ends[end] = ({(c.slo.name, c.input_tokens, c.output_tokens): c
                      for c in crossovers(cells, slos, PREDICTED_PERCENTILE)} if cells else {})
    thresholds = [Threshold(c, ends["optimistic"].get(_key(c)), ends["pessimistic"].get(_key(c))) for c in mid]
    nodes = [NodesAnswer(size(t.crossover, peak, headroom), _nodes(t.optimistic, peak, headroom),
                         _nodes(t.pessimistic, peak, headroom))
             for peak in peaks for t in thresholds]
    return PredictionResult(model, target, preds, thresholds, nodes, model_name)


def _key(c: Crossover) -> tuple:
    return (c.slo.name, c.input_tokens, c.output_tokens)


def _nodes(c: Crossover | None, peak: int, headroom: float) -> int | None:
    return size(c, peak, headroom).nodes if c is not None else None


def predicted_cells(preds: Sequence[Prediction], ranks_per_node: int, end: str = "mid") -> list[Cell]:
    """Predictions as single-VM cells, so the crossover and sizing code judges them as it
    judges measured ones. end: mid (the prediction), optimistic or pessimistic (the interval's
    lower or upper bound; no cells when an interval is unknown)."""
    out = []
    for p in preds:
        tpot, ttft = p.tpot_ms, p.ttft_s
        if end != "mid":
            if p.tpot_interval is None or p.ttft_interval is None:
                return []
            i = 0 if end == "optimistic" else 1
            tpot, ttft = p.tpot_interval[i], p.ttft_interval[i]
        s = p.scenario
        out.append(Cell(key=CellKey(SINGLE, 1, ranks_per_node, s.batch, s.input_tokens, s.output_tokens),
                        ttft_s=Quantiles(ttft), tpot_ms=Quantiles(tpot), rank_tps=p.rank_tps,
                        source="predicted", origin="predicted"))
    return out


# ------------------------------------------------------------------ tables


def prediction_table(result: PredictionResult) -> Table:
    ranks = result.target.ranks_per_node
    rows = []
    for p in result.predictions:
        s = p.scenario
        rows.append([str(s.input_tokens), str(s.batch), str(s.batch * ranks), _with_interval(p.ttft_s, p.ttft_interval, 2),
                     _with_interval(p.tpot_ms, p.tpot_interval, 1), fmt(1000.0 / p.tpot_ms if p.tpot_ms else None, 1),
                     _with_interval(p.rank_tps, p.rank_tps_interval, 1), "; ".join(p.flags) or "–"])
    return Table(f"Predicted p50 per rank on {result.target.description}{result.for_model} "
                 "(95 % prediction interval)",
                 ["input tokens", "batch/rank", "streams/VM", "TTFT s", "TPOT ms", "tok/s/user", "rank tok/s",
                  "extrapolation"], rows)


def _with_interval(value: float, interval: tuple[float, float] | None, digits: int) -> str:
    if interval is None:
        return f"{value:.{digits}f} [?]"
    return f"{value:.{digits}f} [{interval[0]:.{digits}f}–{interval[1]:.{digits}f}]"


def threshold_table(result: PredictionResult) -> Table:
    rows = [[t.crossover.slo.name, str(t.crossover.input_tokens), t.crossover.threshold_text, t.range_text,
             t.crossover.binding or "–"] for t in result.thresholds]
    return Table(f"Predicted crossover{result.for_model} (streams per VM still meeting the SLO at p50)",
                 ["SLO", "input tokens", "threshold", "interval", "binding"], rows)


def nodes_table(result: PredictionResult) -> Table:
    rows = []
    for n in result.nodes:
        s, c = n.sizing, n.sizing.crossover
        nodes = str(s.nodes) if s.nodes is not None else NOT_ACHIEVABLE
        span = "–" if n.low is None or n.high is None else (str(n.low) if n.low == n.high else f"{n.low} to {n.high}")
        rows.append([c.slo.name, str(c.input_tokens), str(s.peak_streams), nodes, span])
    return Table(f"Predicted nodes{result.for_model} ({law_formula()})",
                 ["SLO", "input tokens", "peak streams", "nodes", "interval"], rows)


def validation_table(v: Validation) -> Table:
    rows = [[c.source or "–", str(c.scenario.input_tokens), str(c.scenario.batch),
             f"{c.measured_ttft_s:.3f}", f"{c.predicted_ttft_s:.3f}", f"{c.ttft_error:+.1%}",
             f"{c.measured_tpot_ms:.1f}", f"{c.predicted_tpot_ms:.1f}", f"{c.tpot_error:+.1%}",
             "; ".join(c.flags) or "–"] for c in v.cells]
    notes = [f"median |error|: TPOT {_pct(v.median_abs('tpot'))}, TTFT {_pct(v.median_abs('ttft'))} "
             f"over {len(v.cells)} held-out cells"]
    return Table("Held-out cells: measured p50 vs predicted",
                 ["run", "input tokens", "batch/rank", "TTFT s", "predicted", "error", "TPOT ms", "predicted",
                  "error", "extrapolation"], rows, notes)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def split(observations: Sequence[Observation], threads: dict[str, int], fit_batches: Sequence[int] | None,
          fit_threads: int | None) -> tuple[list[Observation], list[Observation]]:
    """(fit set, held-out set): by batch, by the run's threads per rank, or both.

    threads: run source -> its threads per rank. Without either filter the smaller half of
    the measured batches is fitted.
    """
    if fit_batches is None and fit_threads is None:
        batches = sorted({o.scenario.batch for o in observations})
        fit_batches = batches[:max(1, len(batches) // 2)]

    def fitted(o: Observation) -> bool:
        return ((fit_batches is None or o.scenario.batch in fit_batches)
                and (fit_threads is None or threads.get(o.source) == fit_threads))

    fit = [o for o in observations if fitted(o)]
    return fit, [o for o in observations if not fitted(o)]


def check_validation(fit: Sequence[Observation], held: Sequence[Observation]) -> list[str]:
    """Why a validation split cannot be made (empty sides)."""
    out = []
    if len(fit) < 2:
        out.append(f"the fit set holds {len(fit)} measured repeat(s); it needs at least 2")
    if not held:
        out.append("nothing is held out to predict: every cell is in the fit set")
    return out


def median_rates(observations: Sequence[Observation]) -> str:
    """A one-line description of the rates the fit set's ranks drew on."""
    bw = statistics.median(o.rates.read_gbs for o in observations)
    gemm = statistics.median(o.rates.gemm_tflops for o in observations)
    curve = any(o.rates.decode_rows for o in observations)
    return (f"read {bw:.1f} GB/s, GEMM {gemm:.3f} TFLOP/s per rank"
            + (", decode-batch curve probed" if curve else ", no decode-batch curve (roofline knee)"))


# ------------------------------------------------------------- the report


@dataclass(frozen=True)
class ModelSection:
    """The performance model as the report states it: fitted on every valid cell of the runs,
    its in-sample error per cell, and the honesty check (fit on the smaller half of the
    batches, predict the rest)."""

    model: PerfModel | None
    in_sample: Validation | None = None
    held_out: Validation | None = None
    fit_batches: tuple[int, ...] = ()
    reason: str = ""          # why there is no model (no probes, too few cells)

    def lines(self) -> list[str]:
        if self.model is None:
            return [f"Not fitted: {self.reason}."]
        out = list(self.model.statement())
        if self.held_out is not None and self.held_out.cells:
            out.append(f"Check: fitted on batches {', '.join(map(str, self.fit_batches))} only, the other cells "
                       f"are predicted with median |error| TPOT {_pct(self.held_out.median_abs('tpot'))}, "
                       f"TTFT {_pct(self.held_out.median_abs('ttft'))} ({len(self.held_out.cells)} cells; "
                       "`vcfslm predict --validate` for more splits).")
        return out


def model_section(runs: Sequence) -> ModelSection:
    """Fit the model on runs (RunFiles) that carry their probes; a reason when it cannot."""
    from ..errors import InputError
    from .calibration import observations, run_calibration
    from .cells import aggregate
    from .perfmodel import fit_model

    if not runs:
        return ModelSection(None, reason="no run folders (a CSV carries no probes)")
    obs = []
    try:
        for run in runs:
            cal = run_calibration(run)
            obs += observations(aggregate([run]).cells, cal.dims, cal.rates, cal.run_id)
    except InputError as exc:
        return ModelSection(None, reason=exc.problems[0].message)
    try:
        model = fit_model(obs)
    except ValueError as exc:
        return ModelSection(None, reason=str(exc))
    fit, held = split(obs, {}, None, None)
    held_out = None
    if not check_validation(fit, held):
        try:
            held_out = validate(fit_model(fit), held)
        except ValueError:
            held_out = None
    return ModelSection(model, validate(model, obs), held_out, tuple(sorted({o.scenario.batch for o in fit})))


def model_table(section: ModelSection) -> Table | None:
    if section.in_sample is None:
        return None
    rows = [[c.source or "–", str(c.scenario.input_tokens), str(c.scenario.batch), f"{c.measured_ttft_s:.3f}",
             f"{c.predicted_ttft_s:.3f}", f"{c.ttft_error:+.1%}", f"{c.measured_tpot_ms:.1f}",
             f"{c.predicted_tpot_ms:.1f}", f"{c.tpot_error:+.1%}"] for c in section.in_sample.cells]
    return Table("Performance model vs measured (fitted on every valid cell)",
                 ["run", "input tokens", "batch/rank", "TTFT s", "model", "error", "TPOT ms", "model", "error"],
                 rows)
