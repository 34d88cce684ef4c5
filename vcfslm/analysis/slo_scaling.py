"""The brief's SLOs scaled to the machine that runs them (pure: no printing, no torch).

The brief's SLOs (contract.DEFAULT_SLOS) are set for one rank of its testbed: a vNUMA
node of 24 vCPUs of a Xeon 6747P (platforms/vx650v4-6747p.yaml). A small development
machine reads memory and multiplies far slower, so it can never meet them and every
load it tries fails. Decode is bound by reading the weights and prefill by the GEMM
rate, so each limit is scaled by the matching ratio:

    TPOT limit x (testbed rank's read GB/s / this rank's read GB/s)
    TTFT limit x (testbed rank's bf16 GEMM TFLOP/s / this rank's)

each factor only when it is above 1 (a faster machine keeps the brief's SLOs), TPOT
rounded to whole ms and TTFT to 0.1 s. This machine's figures come from a
`vcfslm probe -o json` file or from a run's meta.json (what its ranks probed); either
way the slowest NUMA node or rank is taken, as the slowest rank decides whether a load
meets an SLO.
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
from ..yamldoc import read_document
from .calibration import rank_rates

REFERENCE_PLATFORM = "vx650v4-6747p"   # the brief's testbed (platforms/vx650v4-6747p.yaml)

Limits = Mapping[str, float | None]


class Rates(NamedTuple):
    """What one rank draws on: read bandwidth (GB/s) and bf16 GEMM rate (TFLOP/s)."""

    read_gbs: float
    gemm_tflops: float


@dataclass(frozen=True)
class Scaling:
    """A reference rank's rates against this machine's, and the factors they give."""

    reference: str
    reference_read_gbs: float
    reference_gemm_tflops: float
    read_gbs: float
    gemm_tflops: float

    @property
    def tpot_factor(self) -> float:
        return max(1.0, self.reference_read_gbs / self.read_gbs)

    @property
    def ttft_factor(self) -> float:
        return max(1.0, self.reference_gemm_tflops / self.gemm_tflops)

    @property
    def scales(self) -> bool:
        """True when either limit changes (this machine is slower than the reference)."""
        return self.tpot_factor > 1.0 or self.ttft_factor > 1.0

    def lines(self, slos: Mapping[str, Limits] | None = None) -> list[str]:
        """Human lines showing the scaling; with `slos`, one more line per SLO scaled."""
        figures = (f"read {self.read_gbs:.1f} GB/s vs the testbed rank's {self.reference_read_gbs:g}"
                   f" (TPOT x{self.tpot_factor:.2f}), bf16 GEMM {self.gemm_tflops:.3g} vs "
                   f"{self.reference_gemm_tflops:g} TFLOP/s (TTFT x{self.ttft_factor:.1f}); "
                   f"testbed {self.reference}")
        head = "SLOs scaled to this machine: " if self.scales else \
            "SLOs as the brief's (this machine is no slower than the testbed rank): "
        out = [head + figures]
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


def scaling_for(read_gbs: float, gemm_tflops: float, reference: str = REFERENCE_PLATFORM) -> Scaling:
    """The scaling from `reference`'s rank to a rank reading `read_gbs` and multiplying at `gemm_tflops`."""
    for what, value, unit in (("read_gbs", read_gbs, "GB/s"), ("gemm_tflops", gemm_tflops, "TFLOP/s")):
        if not _positive(value):
            raise ValueError(f"{what} must be a positive number of {unit}; got {value!r}")
    name, ref = reference_rates(reference)
    return Scaling(reference=name, reference_read_gbs=ref.read_gbs,
                   reference_gemm_tflops=ref.gemm_tflops, read_gbs=float(read_gbs), gemm_tflops=float(gemm_tflops))


def scale_slos(slos: Mapping[str, Limits], scaling: Scaling) -> dict[str, dict[str, float | None]]:
    """The same SLOs with TPOT and TTFT limits scaled (whole ms, 0.1 s); a None limit stays None."""
    def scaled(value: float | None, factor: float, digits: int | None) -> float | None:
        return None if value is None else round(value * factor, digits)

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
