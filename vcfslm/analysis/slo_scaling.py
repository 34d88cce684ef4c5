"""The brief's SLOs scaled to the machine and the model that run them (pure: no printing, no torch).

The brief's SLOs (contract.DEFAULT_SLOS) are set for Phi-3-mini on one rank of its
testbed: a vNUMA node of 24 vCPUs of a Xeon 6747P (platforms/vx650v4-6747p.yaml). A small
development machine reads memory and multiplies far slower, so it can never meet them and
every load it tries fails. Decode is bound by reading the weights and prefill by the GEMM
rate, so each limit is scaled by the matching ratio of floors (vcfslm/roofline.py):

    TPOT limit x (model's decode floor here / Phi-3-mini's decode floor on the testbed)
    TTFT limit x (model's prefill floor here / Phi-3-mini's prefill floor on the testbed)

A decode floor is the bytes of one batch-1 decode step (presets.counts: every weight once,
one stream's KV cache at the prompt) over the rank's read bandwidth; a prefill floor is one
prompt's FLOPs over the rank's bf16 GEMM rate, both models at the same prompt length. Each
ratio is the machine's (testbed rank's rate / this rank's) times the model's (its bytes or
FLOPs / Phi-3-mini's). The machine's is taken only when it is above 1 (a faster machine
keeps the brief's SLOs for Phi-3-mini); the model's always, so for Phi-3-mini itself, or
without a model, the scaling is the machine's alone. TPOT is rounded to whole ms and TTFT
to 0.1 s (two significant figures below 1 s).

This machine's figures come from a `vcfslm probe -o json` file or from a run's meta.json
(what its ranks probed); either way the slowest NUMA node or rank is taken, as the slowest
rank decides whether a load meets an SLO. A probe measures a whole NUMA node with all its
threads; when `ranks` ranks split those threads (the lab runs 2 ranks of 1 thread on a
2-vCPU node), each rank gets 1/ranks of the node's GEMM rate, as compute scales with
cores, but the node's whole read bandwidth: on the small machines the lab runs on, one
core reads about as fast as the node (a 2-vCPU EPYC: 33 GB/s from one thread, 27 from the
node's two-thread probe), and two one-thread ranks decoding together each read ~20 GB/s,
so halving the node's figure would halve a rate each rank really gets.

The bandwidth a decode floor is taken at here is the probe's decode-linears rate at one row
(the engine's own packed GEMV reading a weight far larger than the caches) when the probe
has it, else the plain read probe's: the decode-linears rate is the one a decode step
meets, and the plain probe can be far from it (on the 2-vCPU EPYC the demo ran on, 27-30
GB/s against 21-22 in two runs, 21.7 against 24.4 in a third); a floor the engine cannot
approach set a TPOT limit under the batch-1 step however light the load. The testbed's side stays its published STREAM figure
(no decode-linears curve of it is known).

A probe taken while something else ran on the machine reads low, and the limits scaled by
it come out too loose. The probe file says so per NUMA node (its `steadiness`: steady or
busy, and why; vcfslm/steadiness.py), and busy_probe_lines words it for `lab up`, which
prints it under the scaling and suggests rerunning the probe on a quiet machine.

Why floors and not a measured step: the lab's SLOs are set before anything is benchmarked,
from the probe alone, and a floor depends on nothing but the shape and the probe. It tells
what a step costs only when the step is bandwidth-bound; a model whose step is dominated
by fixed per-step overhead (synthetic:tiny: ~1 ms against a floor of microseconds) gets
limits no load can meet. The demo therefore benchmarks a model whose batch-1 decode sits
near its floor on a small machine (one layer of Phi-3-mini and its lm_head, 0.42 GB per
step), and synthetic:tiny, which has no published shape, is scaled by the machine alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import InputError, PlatformError, Problem, RunFolderError
from ..hardware import load_platform
from ..presets import SYNTHETIC_PREFIX, counts_of_source
from ..roofline import decode_step_bytes, prefill_flops
from ..steadiness import recorded
from ..yamldoc import read_document
from .calibration import rank_rates

REFERENCE_PLATFORM = "vx650v4-6747p"   # the brief's testbed (platforms/vx650v4-6747p.yaml)
REFERENCE_MODEL = SYNTHETIC_PREFIX + "phi-3-mini"   # the brief's model, whose SLOs they are
DEFAULT_PROMPT_TOKENS = 16                          # the lab's shortest prompt

Limits = Mapping[str, float | None]


class Rates(NamedTuple):
    """What one rank draws on: read bandwidth (GB/s) and bf16 GEMM rate (TFLOP/s)."""

    read_gbs: float
    gemm_tflops: float


@dataclass(frozen=True)
class ModelCost:
    """What one model costs at a prompt length: the numerators of its two floors."""

    name: str
    prompt_tokens: int
    decode_bytes: float     # one batch-1 decode step: every weight once + one stream's KV at the prompt
    prefill_flops: float    # one prompt of prompt_tokens, batch 1


def model_cost(source: str, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> ModelCost | None:
    """A model's costs from its shape alone (a preset, `synthetic:NAME[,layers=N]`, its hub id
    or a synthetic config file); None when the shape is not known without loading it."""
    if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be a whole number of tokens >= 1; got {prompt_tokens!r}")
    counts = counts_of_source(source)
    if counts is None:
        return None
    dims = counts.dims()
    return ModelCost(name=source, prompt_tokens=prompt_tokens,
                     decode_bytes=decode_step_bytes(dims.step_weight_bytes, dims.kv_bytes_per_token, 1,
                                                    prompt_tokens),
                     prefill_flops=prefill_flops(dims, 1, prompt_tokens))


@dataclass(frozen=True)
class Scaling:
    """A reference rank's rates against this machine's, optionally a model's costs against
    the reference model's, and the factors they give."""

    reference: str
    reference_read_gbs: float
    reference_gemm_tflops: float
    read_gbs: float          # this machine's NUMA node, as probed (the decode linears' rate when known)
    gemm_tflops: float
    ranks: int = 1           # ranks splitting that node's threads (and so its GEMM rate)
    model: ModelCost | None = None
    reference_model: ModelCost | None = None
    plain_read_gbs: float | None = None   # the plain read probe, when read_gbs is the decode linears'

    @property
    def rank_read_gbs(self) -> float:
        return self.read_gbs

    @property
    def rank_gemm_tflops(self) -> float:
        return self.gemm_tflops / self.ranks

    @property
    def machine_tpot_factor(self) -> float:
        return max(1.0, self.reference_read_gbs / self.rank_read_gbs)

    @property
    def machine_ttft_factor(self) -> float:
        return max(1.0, self.reference_gemm_tflops / self.rank_gemm_tflops)

    @property
    def model_tpot_factor(self) -> float:
        """The model's bytes per decode step over the reference model's (1 without a model)."""
        if self.model is None or self.reference_model is None:
            return 1.0
        return self.model.decode_bytes / self.reference_model.decode_bytes

    @property
    def model_ttft_factor(self) -> float:
        """The model's prompt FLOPs over the reference model's (1 without a model)."""
        if self.model is None or self.reference_model is None:
            return 1.0
        return self.model.prefill_flops / self.reference_model.prefill_flops

    @property
    def tpot_factor(self) -> float:
        return self.machine_tpot_factor * self.model_tpot_factor

    @property
    def ttft_factor(self) -> float:
        return self.machine_ttft_factor * self.model_ttft_factor

    @property
    def scales(self) -> bool:
        """True when either limit changes (this machine is slower than the reference, or the
        model is not the reference model)."""
        return self.tpot_factor != 1.0 or self.ttft_factor != 1.0

    @property
    def by_model(self) -> bool:
        return self.model is not None and self.reference_model is not None

    def lines(self, slos: Mapping[str, Limits] | None = None) -> list[str]:
        """Human lines showing the scaling; with `slos`, one more line per SLO scaled."""
        gemm = f"{self.gemm_tflops:.3g}"
        if self.ranks > 1:
            gemm += f" over {self.ranks} ranks ({self.rank_gemm_tflops:.3g} each)"
        read = f"{self.read_gbs:.1f} GB/s"
        if self.plain_read_gbs is not None:
            read += f" as decode's linears read it (plain read probe {self.plain_read_gbs:.1f})"
        figures = (f"read {read} vs the testbed rank's "
                   f"{self.reference_read_gbs:g} (TPOT x{self.machine_tpot_factor:.2f}), bf16 GEMM "
                   f"{gemm} vs {self.reference_gemm_tflops:g} TFLOP/s "
                   f"(TTFT x{self.machine_ttft_factor:.1f}); testbed {self.reference}")
        machine = self.machine_tpot_factor > 1.0 or self.machine_ttft_factor > 1.0
        if self.by_model:
            head = ("SLOs scaled to this machine and model: " if machine else
                    "SLOs scaled to the model (this machine is no slower than the testbed rank): ")
        else:
            head = "SLOs scaled to this machine: " if self.scales else \
                "SLOs as the brief's (this machine is no slower than the testbed rank): "
        out = [head + figures]
        if self.by_model:
            m, ref = self.model, self.reference_model
            out.append(f"model {m.name} vs {ref.name.removeprefix(SYNTHETIC_PREFIX)} at {m.prompt_tokens}-token "
                       f"prompts: decode step {m.decode_bytes / 1e9:.3g} vs {ref.decode_bytes / 1e9:.3g} GB "
                       f"(TPOT x{self.model_tpot_factor:.3g}), prefill {m.prefill_flops / 1e9:.3g} vs "
                       f"{ref.prefill_flops / 1e9:.3g} GFLOP (TTFT x{self.model_ttft_factor:.3g}); "
                       f"together TPOT x{self.tpot_factor:.3g}, TTFT x{self.ttft_factor:.3g}")
        if slos:
            scaled = scale_slos(slos, self)
            out += [f"SLO-{name}: {_limit('TPOT', scaled[name]['tpot_ms'], 'ms')}, "
                    f"{_limit('TTFT', scaled[name]['ttft_s'], 's')} (the brief's "
                    f"{_limit('', limits.get('tpot_ms'), 'ms')}, {_limit('', limits.get('ttft_s'), 's')})"
                    for name, limits in slos.items()]
        return out


def _limit(metric: str, limit: float | None, unit: str) -> str:
    """`TPOT <= 377 ms`, or `377 ms` without a metric; a None limit is `any` (no limit)."""
    if limit is None:
        return f"{metric} any".strip()
    return f"{metric} <= {limit:g} {unit}".removeprefix(" <= ")


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def reference_rates(reference: str = REFERENCE_PLATFORM) -> tuple[str, Rates]:
    """A platform's name and one rank's rates on it (`reference`: a shipped name or a file)."""
    platform = load_platform(reference)
    rates = rank_rates(platform)
    return platform.name, Rates(rates.read_gbs, rates.gemm_tflops)


def scaling_for(read_gbs: float, gemm_tflops: float, reference: str = REFERENCE_PLATFORM, *,
                model: ModelCost | None = None, ranks: int = 1, plain_read_gbs: float | None = None) -> Scaling:
    """The scaling from `reference`'s rank running Phi-3-mini to a rank reading `read_gbs` and
    multiplying at `gemm_tflops` (a NUMA node's figures, its threads split among `ranks` ranks) and running
    `model` (None: Phi-3-mini, so the machine's ratio alone). `plain_read_gbs`: the plain
    read probe's figure when `read_gbs` is the decode linears' (the lines show both)."""
    for what, value, unit in (("read_gbs", read_gbs, "GB/s"), ("gemm_tflops", gemm_tflops, "TFLOP/s")):
        if not _positive(value):
            raise ValueError(f"{what} must be a positive number of {unit}; got {value!r}")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1; got {ranks!r}")
    name, ref = reference_rates(reference)
    reference_model = None if model is None else model_cost(REFERENCE_MODEL, model.prompt_tokens)
    return Scaling(reference=name, reference_read_gbs=ref.read_gbs,
                   reference_gemm_tflops=ref.gemm_tflops, read_gbs=float(read_gbs), gemm_tflops=float(gemm_tflops),
                   ranks=ranks, model=model, reference_model=reference_model, plain_read_gbs=plain_read_gbs)


def scale_slos(slos: Mapping[str, Limits], scaling: Scaling) -> dict[str, dict[str, float | None]]:
    """The same SLOs with TPOT and TTFT limits scaled (whole ms, 0.1 s; two significant
    figures below 1 ms or 1 s); a None limit stays None."""
    def scaled(value: float | None, factor: float, digits: int | None) -> float | None:
        if value is None:
            return None
        x = value * factor
        return float(f"{x:.2g}") if x < 1 else round(x, digits)

    return {name: {"tpot_ms": scaled(limits.get("tpot_ms"), scaling.tpot_factor, None),
                   "ttft_s": scaled(limits.get("ttft_s"), scaling.ttft_factor, 1)}
            for name, limits in slos.items()}


# ---------------------------------------------------------------- this machine's figures


def _load_json(path: Path, error: type[InputError]) -> Any:
    text = read_document(path, error)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error([Problem(str(path), getattr(exc, "lineno", None), getattr(exc, "colno", None), "",
                             f"not valid JSON: {getattr(exc, 'msg', exc)}")]) from None


def _dig(data: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _slowest(items: list[tuple[str, Any]], paths: Mapping[str, tuple[str, ...]], label: str,
             error: type[InputError], message: str) -> Rates:
    """Each figure's smallest value over `items` ((where, object) pairs); `error` names every
    missing key."""
    problems, values = [], {field: [] for field in paths}
    for where, item in items:
        for field, keys in paths.items():
            value = _dig(item, keys)
            if _positive(value):
                values[field].append(value)
            else:
                problems.append(Problem(label, None, None, ".".join([where, *keys]).lstrip("."),
                                        message))
    if problems:
        raise error(problems)
    return Rates(min(values["read_gbs"]), min(values["gemm_tflops"]))


def _decode_one_row_gbs(node: Any) -> float | None:
    """The decode linears' rate at one row in a probe's node object; None when not probed."""
    curve = node.get("decode_linears") if isinstance(node, dict) else None
    if not isinstance(curve, dict):
        return None
    rows, gbs = curve.get("rows"), curve.get("gbs")
    if not isinstance(rows, list) or not isinstance(gbs, list) or len(rows) != len(gbs) or 1 not in rows:
        return None
    value = gbs[rows.index(1)]
    return float(value) if _positive(value) else None


def probe_rates(path: str | Path) -> Rates:
    """The read GB/s and GEMM TFLOP/s of the slowest NUMA node in a `vcfslm probe -o json` file."""
    path = Path(path)
    rows = _load_json(path, PlatformError)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise PlatformError([Problem(str(path), None, None, "", "expected the JSON list `vcfslm probe -o json` "
                                                                "prints (one object per NUMA node)")])
    return _slowest([(f"[{i}]", r) for i, r in enumerate(rows)],
                    {"read_gbs": ("read_gbs",), "gemm_tflops": ("gemm", "tflops")}, str(path), PlatformError,
                    "missing or not a positive number")


def probe_decode_gbs(path: str | Path) -> float | None:
    """The slowest NUMA node's decode-linears rate at one row in a `vcfslm probe -o json` file
    (the bandwidth a decode step meets); None unless every node probed it. Read it after
    probe_rates, which checks the file."""
    rows = _load_json(Path(path), PlatformError)
    decode = [_decode_one_row_gbs(r) for r in rows] if isinstance(rows, list) and rows else [None]
    return min(decode) if all(decode) else None


def busy_probe_lines(path: str | Path) -> list[str]:
    """Lines saying that a `vcfslm probe -o json` file was taken on a busy machine: one with
    what to do, then one per NUMA node whose probe was busy, with its reasons. Empty when
    every node's probe was steady or the file predates the check (it says nothing either way).
    Read it after probe_rates, which checks the file."""
    rows = _load_json(Path(path), PlatformError)
    busy = []
    for row in rows if isinstance(rows, list) else ():
        verdict = recorded(row)
        if verdict is not None and verdict.busy:
            node = row.get("numa_node")
            busy.append(f"  {'the whole machine' if node is None else f'NUMA node {node}'}: {verdict.summary}")
    if not busy:
        return []
    return [f"warning: the probe in {path} was taken on a busy machine: its figures are likely low, so the "
            f"limits scaled by them are too loose; rerun `vcfslm probe` on a quiet machine, then `lab up "
            f"--slos-from` with it", *busy]


def run_rates(path: str | Path) -> Rates:
    """The read GB/s and GEMM TFLOP/s of a run's slowest rank, from its meta.json (or its folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "meta.json"
    meta = _load_json(path, RunFolderError)
    ranks = meta.get("ranks") if isinstance(meta, dict) else None
    if not isinstance(ranks, dict) or not ranks:
        raise RunFolderError([Problem(str(path), None, None, "ranks", "missing: the run recorded no rank facts")])
    return _slowest([(f"ranks.{rank}", facts) for rank, facts in
                     sorted(ranks.items(), key=lambda kv: (len(kv[0]), kv[0]))],
                    {"read_gbs": ("probe", "read_gbs"), "gemm_tflops": ("gemm", "tflops")}, str(path),
                    RunFolderError, "missing or not a positive number (were the ranks probed?)")
