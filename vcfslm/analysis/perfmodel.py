"""A calibrated performance model of one rank (pure): fitted on measured cells, it predicts
TTFT and TPOT on other hardware, with a prediction interval and the regime it was fitted in.

The model (times in seconds, one rank, its rates as its probes measured them):

    decode step = linears(batch) / eta_w + batch x context x KV / (bandwidth x eta_kv) + overhead
    TTFT        = linear FLOPs / (GEMM rate x eta_p) + attention FLOPs / (GEMM rate x eta_pa)
                  + weights / (bandwidth x eta_w) + prefill overhead

linears(batch) is the time the step's weights take through the engine's own linear kernel
at that many rows, from the probe's decode-batch curve (`probe.measure_decode_linears`):
the read bandwidth at one row, falling where the kernel turns compute-bound. Without that
curve (older runs, spec-sheet platforms) it is the roofline, max(weights / bandwidth,
linear FLOPs / GEMM rate). KV is the cache bytes per token, the context the mean decode
context; FLOPs come from `vcfslm.roofline`. Each efficiency says how close one part of the
engine runs to what the probes measured, so it carries over to hardware with other rates;
the per-step overhead (dispatch, sampling) is taken as it is.

Why these terms:
- The batch-to-speed knee is measured, not assumed: on this engine a batch-16 step runs
  ~2x its batch-1 time where the max() roofline says 1.1x, because small-row GEMMs reach
  a fraction of the prefill-shaped GEMM rate. A fit on the bandwidth-bound batches (1, 4)
  then still predicts the compute-side ones (8, 16).
- The KV cache has its own efficiency: attention reads it one query row per stream, in
  short blocks, far from the streaming rate the weights get (measured here: ~10x slower
  per byte), so one efficiency for both would miss the rise of TPOT with context.
- Prefill attention (the T^2 part) runs at its own rate: it is not a GEMM over the weights.

Every fit is a least-squares fit of relative error (each observation weighs by 1/measured:
a 10 % miss counts the same at 30 ms and at 300 ms) over the per-repeat p50s of the valid
cells. Coefficients are kept > 0 by fitting every subset of terms and keeping the best
feasible one: a term the cells never exercised is dropped (not identified), and a
prediction where it would matter is flagged. The prediction interval is the 95 % t
interval of a new observation, relative: t x s x sqrt(1 + leverage), s the relative
residual standard deviation.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..roofline import (
    ModelDims,
    decode_linear_flops,
    mean_decode_context,
    prefill_attention_flops,
    prefill_linear_flops,
)


@dataclass(frozen=True)
class RankRates:
    """What one rank can draw on: its share of the NUMA node's read bandwidth, its GEMM rate,
    and (when probed) the weight rate of the engine's linear kernel at each decode batch.

    triad_gbs: the STREAM-like triad the rank's bandwidth probe measured beside read_gbs (a
    run's rates; None elsewhere): what carries a fit to a target whose bandwidth is a STREAM
    figure (`calibration.StreamTransfer`). linear_gbs: without a decode-batch curve, the rate
    one row streams weights through the linear kernel (None: read_gbs).
    """

    read_gbs: float
    gemm_tflops: float
    decode_rows: tuple[int, ...] = ()
    decode_gbs: tuple[float, ...] = ()
    triad_gbs: float | None = None
    linear_gbs: float | None = None

    def __post_init__(self):
        for name in ("read_gbs", "gemm_tflops", "triad_gbs", "linear_gbs"):
            value = getattr(self, name)
            if value is None and name not in ("read_gbs", "gemm_tflops"):
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, not {value!r}")
        if len(self.decode_rows) != len(self.decode_gbs):
            raise ValueError("decode_rows and decode_gbs must pair up")
        if any(not (math.isfinite(g) and g > 0) for g in self.decode_gbs):
            raise ValueError(f"decode_gbs must be positive numbers, not {self.decode_gbs!r}")
        if list(self.decode_rows) != sorted(set(self.decode_rows)) or (self.decode_rows and self.decode_rows[0] < 1):
            raise ValueError(f"decode_rows must be increasing row counts from 1, not {self.decode_rows!r}")

    def seconds_per_weight_byte(self, batch: int) -> float | None:
        """The probe's time per streamed weight byte at `batch` rows; None without the curve.

        Linear between probed rows; beyond the last, compute-bound (time grows with rows).
        Taken non-decreasing in rows (more rows never make a byte cheaper; a dip is noise).
        """
        if not self.decode_rows:
            return None
        per_byte = list(itertools.accumulate((1.0 / (g * 1e9) for g in self.decode_gbs), max))
        rows = self.decode_rows
        if batch <= rows[0]:
            return per_byte[0]
        for (r0, p0), (r1, p1) in itertools.pairwise(zip(rows, per_byte, strict=True)):
            if batch <= r1:
                return p0 + (p1 - p0) * (batch - r0) / (r1 - r0)
        return per_byte[-1] * batch / rows[-1]


@dataclass(frozen=True)
class Scenario:
    batch: int
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Observation:
    """One measured repeat of one cell: its p50 TPOT and TTFT, and where it ran."""

    scenario: Scenario
    tpot_ms: float
    ttft_s: float
    rates: RankRates
    dims: ModelDims
    source: str = ""


@dataclass(frozen=True)
class Terms:
    """The model's inputs for one scenario on one rank: times at the probed rates (s)."""

    linears_s: float             # the step's weights through the linear kernel at this batch
    weights_s: float             # one read of the step's weights at the read bandwidth
    kv_s: float                  # one read of every stream's KV cache at the mean context
    prefill_s: float             # prefill linear FLOPs / GEMM rate
    prefill_attention_s: float   # prefill attention FLOPs / GEMM rate

    @property
    def decode(self) -> tuple[float, ...]:
        return (self.linears_s, self.kv_s, 1.0)

    @property
    def prefill(self) -> tuple[float, ...]:
        return (self.prefill_s, self.prefill_attention_s, 1.0)

    @property
    def knee(self) -> float:
        """linears / pure streaming: 1 on the bandwidth-bound side, growing on the compute side."""
        return self.linears_s / self.weights_s if self.weights_s > 0 else 1.0


def terms(dims: ModelDims, rates: RankRates, s: Scenario) -> Terms:
    context = mean_decode_context(s.input_tokens, s.output_tokens)
    bw = rates.read_gbs * 1e9
    rate = rates.gemm_tflops * 1e12
    weights_s = dims.step_weight_bytes / bw
    per_byte = rates.seconds_per_weight_byte(s.batch)
    if per_byte is None:
        streamed_s = dims.step_weight_bytes / (rates.linear_gbs * 1e9) if rates.linear_gbs else weights_s
        linears_s = max(streamed_s, decode_linear_flops(dims, s.batch) / rate)
    else:
        linears_s = dims.step_weight_bytes * per_byte
    return Terms(
        linears_s=linears_s, weights_s=weights_s,
        kv_s=s.batch * context * dims.kv_bytes_per_token / bw,
        prefill_s=prefill_linear_flops(dims, s.batch, s.input_tokens) / rate,
        prefill_attention_s=prefill_attention_flops(dims, s.batch, s.input_tokens) / rate)


# ------------------------------------------------------------ least squares


@dataclass(frozen=True)
class LinearFit:
    """y ~ sum(coef_i x_i), fitted on relative error; coefficients >= 0 (a dropped term is 0)."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    stderr: tuple[float | None, ...]
    used: tuple[bool, ...]              # terms kept by the fit
    inverse: tuple[tuple[float, ...], ...]   # (X'^T X')^-1 over the kept terms
    s_rel: float | None                 # relative residual SD; None without residual dof
    dof: int
    n: int

    def value(self, x: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.coef, x, strict=True))

    def half_width(self, x: Sequence[float], offset: float = 0.0) -> float | None:
        """The 95 % prediction half-width at x (absolute), None when it cannot be known."""
        y = self.value(x) + offset
        if self.s_rel is None or y <= 0:
            return None
        kept = [v / y for v, u in zip(x, self.used, strict=True) if u]
        leverage = sum(kept[i] * self.inverse[i][j] * kept[j]
                       for i in range(len(kept)) for j in range(len(kept)))
        return t95(self.dof) * self.s_rel * math.sqrt(1.0 + max(leverage, 0.0)) * y


def fit_relative(rows: Sequence[Sequence[float]], y: Sequence[float], names: Sequence[str],
                 required: Sequence[str] = (), offsets: Sequence[float] | None = None) -> LinearFit:
    """Least squares of relative error, y - offset ~ X coef with coef >= 0.

    Every subset of the terms that keeps `required` is solved; the feasible one (all
    coefficients > 0) with the smallest residual wins, ties to fewer terms.
    """
    n, k = len(y), len(names)
    if n == 0:
        raise ValueError("no observations to fit")
    offsets = list(offsets) if offsets is not None else [0.0] * n
    best = None
    must = {names.index(r) for r in required}
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            if not must <= set(subset) or len(subset) > n:
                continue
            a = [[rows[r][j] / y[r] for j in subset] for r in range(n)]
            b = [(y[r] - offsets[r]) / y[r] for r in range(n)]
            solved = _normal_solve(a, b)
            if solved is None:
                continue
            coef, inverse = solved
            if any(c <= 0 for c in coef):
                continue
            sse = sum((b[r] - sum(a[r][i] * coef[i] for i in range(size))) ** 2 for r in range(n))
            # A larger subset must pay for its term: equal residuals keep the smaller one.
            if best is None or sse < best[0] * (1 - 1e-6) - 1e-15:
                best = (sse, subset, coef, inverse)
    if best is None:
        raise ValueError("no feasible fit: the measurements do not grow with the modelled terms")
    sse, subset, coef, inverse = best
    dof = n - len(subset)
    s_rel = math.sqrt(sse / dof) if dof > 0 else None
    full = [0.0] * k
    err: list[float | None] = [None] * k
    for i, j in enumerate(subset):
        full[j] = coef[i]
        err[j] = s_rel * math.sqrt(max(inverse[i][i], 0.0)) if s_rel is not None else None
    return LinearFit(tuple(names), tuple(full), tuple(err), tuple(j in subset for j in range(k)),
                     tuple(tuple(r) for r in inverse), s_rel, dof, n)


def _normal_solve(a: list[list[float]], b: list[float]):
    """(coef, (A^T A)^-1) of min |A coef - b|, or None when A^T A is singular."""
    m = len(a[0])
    ata = [[sum(row[i] * row[j] for row in a) for j in range(m)] for i in range(m)]
    atb = [sum(row[i] * bi for row, bi in zip(a, b, strict=True)) for i in range(m)]
    inverse = _invert(ata)
    if inverse is None:
        return None
    coef = [sum(inverse[i][j] * atb[j] for j in range(m)) for i in range(m)]
    return coef, inverse


def _invert(matrix: list[list[float]]) -> list[list[float]] | None:
    """Gauss-Jordan inverse with partial pivoting; None when (numerically) singular."""
    m = len(matrix)
    scale = max(abs(v) for row in matrix for v in row) or 1.0
    work = [[v / scale for v in row] + [1.0 if i == j else 0.0 for j in range(m)] for i, row in enumerate(matrix)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(work[r][col]))
        if abs(work[pivot][col]) < 1e-12:
            return None
        work[col], work[pivot] = work[pivot], work[col]
        p = work[col][col]
        work[col] = [v / p for v in work[col]]
        for r in range(m):
            if r != col and work[r][col]:
                f = work[r][col]
                work[r] = [v - f * w for v, w in zip(work[r], work[col], strict=True)]
    return [[v / scale for v in row[m:]] for row in work]


# Two-sided 95 % Student t quantiles; beyond 30 degrees of freedom the normal's 1.96 is close.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t95(dof: int) -> float:
    return _T95[dof - 1] if 1 <= dof <= len(_T95) else 1.96


# ------------------------------------------------------------------ the model

# (coefficient, the efficiency or overhead it stands for) of each part, in Terms order.
DECODE_TERMS = (("1/eta_w", "eta_w"), ("1/eta_kv", "eta_kv"), ("overhead_s", "decode overhead"))
PREFILL_TERMS = (("1/eta_p", "eta_p"), ("1/eta_pa", "eta_pa"), ("overhead_s", "prefill overhead"))
_DECODE_PARTS = ("linears", "KV cache", "overhead")
_PREFILL_PARTS = ("prefill GEMMs", "prefill attention", "overhead")


@dataclass(frozen=True)
class Efficiency:
    """A fitted efficiency (or overhead, in ms) and its standard error; value None = not identified."""

    name: str
    value: float | None
    stderr: float | None
    unit: str = ""

    def text(self) -> str:
        if self.value is None:
            return f"{self.name} not identified"
        err = f" ± {self.stderr:.2g}" if self.stderr is not None else ""
        if self.unit == "ms":
            return f"{self.name} = {self.value:.2f}{err} ms"
        return f"{self.name} = {self.value:.3f}{err}"

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "stderr": self.stderr, "unit": self.unit}


@dataclass(frozen=True)
class Regime:
    """Where the model was fitted: predictions outside it are extrapolations."""

    max_batch: int
    max_input_tokens: int
    dims: tuple[ModelDims, ...]
    knee_max: float               # the largest fitted Terms.knee (1 = all bandwidth-bound)


@dataclass(frozen=True)
class PerfModel:
    decode: LinearFit
    prefill: LinearFit
    regime: Regime
    observations: int
    sources: tuple[str, ...] = ()

    @property
    def inv_eta_w(self) -> float:
        return self.decode.coef[0]

    def efficiencies(self) -> list[Efficiency]:
        """Every efficiency (1 / its coefficient, delta-method error) and both overheads."""
        out = []
        for fit, table in ((self.decode, DECODE_TERMS), (self.prefill, PREFILL_TERMS)):
            for i, (coef_name, name) in enumerate(table):
                c, e, used = fit.coef[i], fit.stderr[i], fit.used[i]
                if coef_name == "overhead_s":
                    out.append(Efficiency(name, c * 1000.0, e * 1000.0 if e is not None else None, "ms"))
                elif not used:
                    out.append(Efficiency(name, None, None))
                else:
                    out.append(Efficiency(name, 1.0 / c, e / (c * c) if e is not None else None))
        return out

    def statement(self) -> list[str]:
        """The model in words and numbers, for the report and the CLI."""
        return [
            "decode step = linears(batch) / eta_w + batch × context × KV / (bandwidth × eta_kv) + overhead;"
            " linears(batch) = the step's weights at the probe's decode-batch linear rate"
            " (without that probe: max(weights / bandwidth, linear FLOPs / GEMM rate))",
            "TTFT = linear FLOPs / (GEMM rate × eta_p) + attention FLOPs / (GEMM rate × eta_pa)"
            " + weights / (bandwidth × eta_w) + prefill overhead",
            f"fitted on {self.observations} repeats from {len(self.sources) or 1} run(s), batch ≤ "
            f"{self.regime.max_batch}, input ≤ {self.regime.max_input_tokens}: "
            + "; ".join(e.text() for e in self.efficiencies()),
            f"relative residual SD: TPOT {_pct(self.decode.s_rel)}, TTFT {_pct(self.prefill.s_rel)}",
        ]

    def to_dict(self) -> dict:
        return {"statement": self.statement(), "efficiencies": [e.to_dict() for e in self.efficiencies()],
                "observations": self.observations, "sources": list(self.sources),
                "fitted": {"max_batch": self.regime.max_batch, "max_input_tokens": self.regime.max_input_tokens},
                "residual_sd": {"tpot": self.decode.s_rel, "ttft": self.prefill.s_rel}}


def _pct(x: float | None) -> str:
    return "unknown (no residual degrees of freedom)" if x is None else f"{x:.1%}"


def fit_model(observations: Sequence[Observation]) -> PerfModel:
    """Fit the decode and the prefill parts on measured repeats; ValueError when it cannot."""
    obs = [o for o in observations if _finite_positive(o.tpot_ms) and _finite_positive(o.ttft_s)]
    if len(obs) < 2:
        raise ValueError(f"need at least 2 measured repeats to fit, got {len(obs)}")
    t = [terms(o.dims, o.rates, o.scenario) for o in obs]
    decode = fit_relative([x.decode for x in t], [o.tpot_ms / 1000.0 for o in obs],
                          [c for c, _ in DECODE_TERMS], required=("1/eta_w",))
    offsets = [x.weights_s * decode.coef[0] for x in t]  # the weight read of a prefill
    prefill = fit_relative([x.prefill for x in t], [o.ttft_s for o in obs], [c for c, _ in PREFILL_TERMS],
                           required=("1/eta_p",), offsets=offsets)
    regime = Regime(max_batch=max(o.scenario.batch for o in obs),
                    max_input_tokens=max(o.scenario.input_tokens for o in obs),
                    dims=tuple(dict.fromkeys(o.dims for o in obs)),
                    knee_max=max(x.knee for x in t))
    return PerfModel(decode, prefill, regime, len(obs), tuple(dict.fromkeys(o.source for o in obs if o.source)))


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class Prediction:
    """Predicted p50 TPOT and TTFT of one scenario, with 95 % prediction intervals and flags."""

    scenario: Scenario
    tpot_ms: float
    tpot_interval: tuple[float, float] | None
    ttft_s: float
    ttft_interval: tuple[float, float] | None
    rank_tps: float
    rank_tps_interval: tuple[float, float] | None
    knee: float
    flags: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        s = self.scenario
        return {"batch_per_rank": s.batch, "input_tokens": s.input_tokens, "output_tokens": s.output_tokens,
                "tpot_ms": self.tpot_ms, "tpot_ms_interval": self.tpot_interval, "ttft_s": self.ttft_s,
                "ttft_s_interval": self.ttft_interval, "rank_tps": self.rank_tps,
                "rank_tps_interval": self.rank_tps_interval,
                "knee": self.knee, "extrapolation": list(self.flags)}


# A decode step is on the compute side when its linears take 1.5x pure streaming: predicting
# there from fits that never passed 1.2x is an extrapolation (the probe's curve carries it,
# the fitted efficiency was measured elsewhere). A term the fit dropped is flagged when, at
# efficiency 1, it would be a tenth of the predicted time.
COMPUTE_SIDE = 1.5
FITTED_BANDWIDTH_SIDE = 1.2
UNIDENTIFIED_MATTERS = 0.1


def predict(model: PerfModel, dims: ModelDims, rates: RankRates, s: Scenario) -> Prediction:
    """The model's p50 TPOT and TTFT for `s` on a rank with `rates`, flagged where it extrapolates."""
    x = terms(dims, rates, s)
    step = model.decode.value(x.decode)
    step_hw = model.decode.half_width(x.decode)
    offset = x.weights_s * model.inv_eta_w
    ttft = model.prefill.value(x.prefill) + offset
    ttft_hw = model.prefill.half_width(x.prefill, offset)
    flags = []
    if s.batch > model.regime.max_batch:
        flags.append(f"batch {s.batch} beyond the largest fitted ({model.regime.max_batch})")
    if s.input_tokens > model.regime.max_input_tokens:
        flags.append(f"input {s.input_tokens} beyond the longest fitted ({model.regime.max_input_tokens})")
    if dims not in model.regime.dims:
        flags.append("another model shape than the fitted one")
    flags += _unidentified(model.decode, x.decode, step, _DECODE_PARTS, "TPOT")
    flags += _unidentified(model.prefill, x.prefill, ttft, _PREFILL_PARTS, "TTFT")
    if x.knee >= COMPUTE_SIDE and model.regime.knee_max < FITTED_BANDWIDTH_SIDE:
        flags.append(f"compute-side decode (linears at {x.knee:.1f}x streaming) where the fitted cells "
                     "were bandwidth-bound")
    tpot_ms = step * 1000.0
    tpot_interval = _interval(tpot_ms, step_hw and step_hw * 1000.0)
    ttft_interval = _interval(ttft, ttft_hw)
    tps_interval = None
    if tpot_interval and ttft_interval:   # slowest and fastest ends together
        tps_interval = (_rank_tps(s, ttft_interval[1], tpot_interval[1] / 1000.0),
                        _rank_tps(s, ttft_interval[0], tpot_interval[0] / 1000.0))
    return Prediction(
        scenario=s, tpot_ms=tpot_ms, tpot_interval=tpot_interval, ttft_s=ttft, ttft_interval=ttft_interval,
        rank_tps=_rank_tps(s, ttft, step), rank_tps_interval=tps_interval, knee=x.knee, flags=tuple(flags))


def _rank_tps(s: Scenario, ttft_s: float, step_s: float) -> float:
    """Generated tokens of the rank / its end-to-end time (the brief's rank throughput)."""
    seconds = ttft_s + (s.output_tokens - 1) * step_s
    return s.batch * s.output_tokens / seconds if seconds > 0 else float("inf")


def _unidentified(fit: LinearFit, x: Sequence[float], total: float, parts: Sequence[str], what: str) -> list[str]:
    """Flags for dropped terms that would matter here (judged at efficiency 1)."""
    return [f"{what}: the {part} term was not identified by the fitted cells"
            for i, part in enumerate(parts)
            if not fit.used[i] and part != "overhead" and total > 0 and x[i] / total >= UNIDENTIFIED_MATTERS]


def _interval(value: float, half: float | None) -> tuple[float, float] | None:
    if half is None:
        return None
    return (max(value - half, 0.0), value + half)


# --------------------------------------------------------------- validation


@dataclass(frozen=True)
class CellError:
    scenario: Scenario
    measured_tpot_ms: float
    predicted_tpot_ms: float
    measured_ttft_s: float
    predicted_ttft_s: float
    flags: tuple[str, ...]
    source: str = ""

    @property
    def tpot_error(self) -> float:
        return self.predicted_tpot_ms / self.measured_tpot_ms - 1.0

    @property
    def ttft_error(self) -> float:
        return self.predicted_ttft_s / self.measured_ttft_s - 1.0


@dataclass(frozen=True)
class Validation:
    model: PerfModel
    cells: tuple[CellError, ...]

    def median_abs(self, which: str) -> float | None:
        errs = [abs(getattr(c, f"{which}_error")) for c in self.cells]
        return statistics.median(errs) if errs else None


def validate(model: PerfModel, held_out: Sequence[Observation]) -> Validation:
    """Predict every held-out cell (the median of its repeats) and compare."""
    by_cell: dict[tuple[Scenario, str], list[Observation]] = {}
    for o in held_out:
        by_cell.setdefault((o.scenario, o.source), []).append(o)
    out = []
    for (scenario, source), group in sorted(by_cell.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
        p = predict(model, group[0].dims, group[0].rates, scenario)
        out.append(CellError(scenario, statistics.median(o.tpot_ms for o in group), p.tpot_ms,
                             statistics.median(o.ttft_s for o in group), p.ttft_s, p.flags, source))
    return Validation(model, tuple(out))


def _order(s: Scenario) -> tuple[int, int, int]:
    return (s.input_tokens, s.output_tokens, s.batch)
