"""What the performance model is fitted on and predicts for: a run's (or a CSV's) cells as
observations, each with the rates its rank drew on and the model's dims, and a platform
turned into one rank's rates.

A run knows both by itself: each rank recorded its probes (read bandwidth, GEMM rate, the
decode-batch curve) and the model's shape (meta.json `ranks`, else ranks/rank-<n>.json).
A CSV of published measurements knows neither: the platform it was measured on is given
(`--measured-on`), and the model is a known shape (a preset its `model` column names,
else Phi-3-mini). Every preset of `vcfslm.presets` is a shape a prediction can be made for.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import Problem, UsageError
from ..hardware import Platform
from ..presets import PRESET_NAMES, counts_of_source, model_dims
from ..results import RunFile, read_rank_facts
from ..roofline import ModelDims
from .cells import Cell
from .perfmodel import Observation, RankRates, Scenario

# Every preset's shape, by name: what `predict --model` predicts for.
KNOWN_DIMS = {name: model_dims(name) for name in PRESET_NAMES}
# Phi-3-mini, the brief's model: what a CSV of its measurements was made with unless it says.
CSV_DEFAULT_MODEL = "phi-3-mini"
PHI3_MINI_DIMS = KNOWN_DIMS[CSV_DEFAULT_MODEL]
# What a Phi-3-mini-family config has beside what older runs recorded (layers, hidden, vocab).
_PHI3_FAMILY = {"heads": 32, "kv_heads": 32, "head_dim": 96, "intermediate": 8192}


@dataclass(frozen=True)
class RunCalibration:
    """One run's ranks: the rates they drew on and the model they ran."""

    run_id: str
    dims: ModelDims
    rates: RankRates
    threads_per_rank: int
    ranks_per_node: int


@dataclass(frozen=True)
class StreamTransfer:
    """The calibration machine's probes over its STREAM-like triad: what a target's STREAM
    bandwidth is in the units the fit's efficiencies were measured against.

    A spec platform's bandwidth is a STREAM figure (the SR650 V4 review's triad), but eta_w
    was fitted against the rank's own probes: the linears against the decode-batch curve's
    one-row rate, the KV cache against the read probe. Evaluating the target's STREAM figure
    with that eta_w assumes probe = STREAM there, which no machine holds: on a 2-vCPU AMX
    Xeon the engine's step reads at eta_w = 0.98 of its probe but ~0.74 of STREAM, so a
    prediction that assumed 1 came out ~25 % fast (batch-1 TPOT 84 ms where the brief's
    testbed measured ~116: 7.6 GB / 116 ms = 65.5 GB/s, 0.71 of its 92.4 GB/s STREAM share).
    The ratio is a property of the CPU and its kernels, measured on the calibration
    machine in one probe pass (read, triad, then the curve), and carried to the target:
    target read = STREAM x read / triad, target one-row linear rate = STREAM x curve(1) / triad.
    """

    read: float       # probe read_gbs / triad_gbs
    linear: float     # the decode-batch curve's one-row rate / triad_gbs (read without a curve)
    triad_gbs: float  # the calibration machine's triad, for the note

    def text(self) -> str:
        return (f"the target's bandwidth is a STREAM figure: carried into the fit's probe units with this "
                f"machine's probe / triad (triad {self.triad_gbs:.1f} GB/s): x {self.linear:.2f} for the "
                f"linears (decode-batch probe at one row), x {self.read:.2f} for the KV cache (read probe)")


def stream_transfer(observations: Iterable[Observation]) -> StreamTransfer | None:
    """The median probe / triad ratios of the observations' ranks; None when none probed a triad
    (a CSV's rates, older runs)."""
    rates = {o.rates for o in observations if o.rates.triad_gbs}
    if not rates:
        return None
    read = statistics.median(r.read_gbs / r.triad_gbs for r in rates)
    linear = statistics.median((r.decode_gbs[0] if r.decode_gbs else r.read_gbs) / r.triad_gbs for r in rates)
    return StreamTransfer(read, linear, statistics.median(r.triad_gbs for r in rates))


def rank_rates(p: Platform, transfer: StreamTransfer | None = None) -> RankRates:
    """What one rank of `p` draws on. transfer: the fit's probe / triad ratios, applied to a
    spec platform's (STREAM) bandwidth; a measured platform is already in probe units."""
    read_gbs = p.bandwidth_gbs / p.ranks_per_numa_node
    gemm = p.gemm_tflops_per_cpu * p.threads
    curve = p.decode_linears
    if curve is None:
        if transfer is not None and p.basis == "spec":
            return RankRates(read_gbs * transfer.read, gemm, linear_gbs=read_gbs * transfer.linear)
        return RankRates(read_gbs, gemm)
    # One row streams at the rank's bandwidth; the extra time of more rows is compute, which
    # scales with the threads.
    base = 1.0 / curve.gbs[0]
    per_byte = [base * curve.read_gbs / read_gbs + max(1.0 / g - base, 0.0) * curve.threads / p.threads
                for g in curve.gbs]
    return RankRates(read_gbs, gemm, tuple(curve.rows), tuple(1.0 / t for t in per_byte))


def run_calibration(run: RunFile) -> RunCalibration:
    """The rates and dims a run recorded; UsageError (exit 2) naming what is missing."""
    meta = run.meta
    facts = _rank_facts(run)
    where = str(run.path)
    probes = [f["probe"]["read_gbs"] for f in facts if _num((f.get("probe") or {}).get("read_gbs"))]
    triads = [f["probe"]["triad_gbs"] for f in facts if _num((f.get("probe") or {}).get("triad_gbs"))]
    gemms = [f["gemm"]["tflops"] for f in facts if _num((f.get("gemm") or {}).get("tflops"))]
    missing = []
    if not probes:
        missing.append("the bandwidth probe (the run was made with --no-probe?)")
    if not gemms:
        missing.append("the GEMM-rate probe (a run older than the GEMM probe)")
    model = next((f["model"] for f in facts if f.get("model")), None)
    dims = _dims(model) if model else None
    if dims is None:
        missing.append("the model's shape (ranks/rank-<n>.json `model`)")
    if missing:
        raise UsageError([Problem(where, None, None, "", f"cannot calibrate on this run: it lacks {m}")
                          for m in missing])
    rows, gbs = _curve(facts)
    rates = RankRates(statistics.median(probes), statistics.median(gemms), rows, gbs,
                      triad_gbs=statistics.median(triads) if triads else None)
    return RunCalibration(meta.run_id, dims, rates, meta.threads_per_rank, meta.ranks_per_node)


def _rank_facts(run: RunFile) -> list[dict[str, Any]]:
    """Each rank's facts: meta.json's `ranks`, completed from ranks/rank-<n>.json (older runs
    kept only a part in meta.json)."""
    files = {str(f.get("rank")): f for f in read_rank_facts(run.path / "ranks")}
    out = []
    for rank in sorted(set(run.meta.ranks) | set(files), key=lambda r: int(r) if str(r).isdigit() else 0):
        merged = dict(files.get(rank, {}))
        merged.update({k: v for k, v in (run.meta.ranks.get(rank) or {}).items() if v is not None})
        out.append(merged)
    return out


def named_dims(model: str) -> ModelDims | None:
    """The shape a model's name stands for without a run's facts: a preset's name, a synthetic
    source (`synthetic:qwen2.5-7b`) or a preset's hub id; None for any other name."""
    if model in KNOWN_DIMS:
        return KNOWN_DIMS[model]
    counts = counts_of_source(model)
    return counts.dims() if counts is not None else None


def _dims(model: dict[str, Any]) -> ModelDims | None:
    facts = dict(model)
    if facts.get("hidden") == 3072 and facts.get("vocab") == 32064:
        for key, value in _PHI3_FAMILY.items():
            facts.setdefault(key, value)
    try:
        return ModelDims.from_facts(facts)
    except KeyError:
        return None


def _curve(facts: Sequence[dict[str, Any]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The median decode-batch curve of the ranks that measured one (all on the same rows)."""
    curves = [f["decode_linears"] for f in facts if isinstance(f.get("decode_linears"), dict)]
    if not curves or len({tuple(c["rows"]) for c in curves}) != 1:
        return (), ()
    rows = tuple(int(r) for r in curves[0]["rows"])
    return rows, tuple(statistics.median(c["gbs"][i] for c in curves) for i in range(len(rows)))


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def observations(cells: Iterable[Cell], dims: ModelDims, rates: RankRates, source: str) -> list[Observation]:
    """One observation per measured repeat of each cell with data (a CSV cell: its p50 once)."""
    out = []
    for c in cells:
        if not c.has_data:
            continue
        s = Scenario(c.batch_per_rank, c.input_tokens, c.output_tokens)
        pairs = list(zip(c.tpot_repeats, c.ttft_repeats, strict=False)) or [(c.tpot_ms.p50, c.ttft_s.p50)]
        out.extend(Observation(s, tpot, ttft, rates, dims, source) for tpot, ttft in pairs)
    return out
