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


def rank_rates(p: Platform) -> RankRates:
    """What one rank of `p` draws on."""
    read_gbs = p.bandwidth_gbs / p.ranks_per_numa_node
    gemm = p.gemm_tflops_per_cpu * p.threads
    curve = p.decode_linears
    if curve is None:
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
    rates = RankRates(statistics.median(probes), statistics.median(gemms), rows, gbs)
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
