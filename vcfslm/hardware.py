"""Platform files: the hardware a prediction is made for (`vcfslm predict --platform`).

A platform is one VM on one host, as the ranks see it: its vNUMA nodes, the read
bandwidth of one node, the bf16 GEMM rate per vCPU, and how many ranks of how many
threads run on it. It comes from a YAML file (`platforms/*.yaml`, spec sheets and
reviews), from `vcfslm probe -o json` run on the machine itself (measured), or from the
command line (`--bandwidth-gbs`, `--gemm-tflops`). `analysis.calibration.rank_rates()`
turns it into what one rank draws on, the input of `vcfslm.analysis.perfmodel`:

- bandwidth belongs to the node, so the ranks sharing a node share it; a spec platform's
  is a STREAM figure, carried into the fit's probe units with the calibration machine's
  probe / triad ratios (`calibration.StreamTransfer`), a measured one is the probe's own;
- the GEMM rate scales with a rank's threads (prefill is compute-bound: the brief's
  "TTFT scales with core count");
- a measured decode-batch curve (probe JSON) is rescaled to the rank's share: its
  one-row time per byte with the bandwidth share, the extra time of more rows with the
  threads.

Errors name the file, line and key (exit 2), as the inventory's do.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import PlatformError, Problem
from .resources import resource_dir
from .yamldoc import load_mapping, pydantic_problems, read_document, validation_message

# Bounds that no CPU server reaches: beyond them a value is a typo (GB/s for MB/s, a
# whole machine's figure given per vCPU), refused instead of predicted from.
MAX_NODE_GBS = 2000.0           # HBM-class; DDR5 12-channel sockets are ~600
MAX_TFLOPS_PER_CPU = 20.0       # AMX peak per core is ~4
MAX_NUMA_NODES = 64
MAX_CPUS_PER_NODE = 1024


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class DecodeCurve(_Model):
    """The probe's decode-batch linear rates of one rank, as measured (`decode_linears`)."""

    rows: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    gbs: list[Annotated[float, Field(gt=0, le=MAX_NODE_GBS)]] = Field(min_length=1)
    threads: Annotated[int, Field(ge=1)] = Field(description="Threads the curve was measured with.")
    read_gbs: Annotated[float, Field(gt=0, le=MAX_NODE_GBS)] = Field(
        description="The rank's read bandwidth when it was measured.")

    @model_validator(mode="after")
    def _paired(self):
        if len(self.rows) != len(self.gbs):
            raise ValueError(f"rows ({len(self.rows)}) and gbs ({len(self.gbs)}) must pair up")
        if self.rows != sorted(set(self.rows)):
            raise ValueError("rows must be increasing")
        return self


class Platform(_Model):
    """One VM on one host, as its ranks see it."""

    name: str = Field(min_length=1)
    description: str = ""
    numa_nodes: Annotated[int, Field(ge=1, le=MAX_NUMA_NODES)] = Field(
        description="vNUMA nodes of the VM (the brief: 4).")
    cpus_per_numa_node: Annotated[int, Field(ge=1, le=MAX_CPUS_PER_NODE)] = Field(
        description="vCPUs of one vNUMA node.")
    bandwidth_gbs: Annotated[float, Field(gt=0, le=MAX_NODE_GBS)] = Field(
        description="Read bandwidth of one vNUMA node, all its CPUs reading (GB/s = 1e9 B/s).")
    gemm_tflops_per_cpu: Annotated[float, Field(gt=0, le=MAX_TFLOPS_PER_CPU)] = Field(
        description="bf16 GEMM rate per vCPU (TFLOP/s); a rank's rate is this x its threads.")
    ranks_per_node: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Ranks per VM; null = one per vNUMA node.")
    threads_per_rank: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Threads per rank; null = the vNUMA node's CPUs shared by its ranks.")
    decode_linears: DecodeCurve | None = Field(
        None, description="Measured decode-batch curve of one rank (from `vcfslm probe -o json`).")
    basis: str = Field("spec", pattern="^(spec|measured)$",
                       description="spec: figures from data sheets and reviews; measured: from the probes.")
    sources: dict[str, str] = Field(default_factory=dict, description="Where each figure comes from.")

    @property
    def ranks(self) -> int:
        return self.ranks_per_node or self.numa_nodes

    @property
    def ranks_per_numa_node(self) -> int:
        return max(1, math.ceil(self.ranks / self.numa_nodes))

    @property
    def threads(self) -> int:
        return self.threads_per_rank or max(1, self.cpus_per_numa_node // self.ranks_per_numa_node)

    @model_validator(mode="after")
    def _fits(self):
        for problem in layout_problems(self):
            raise ValueError(problem)
        return self

    def with_changes(self, *, ranks_per_node: int | None = None, threads_per_rank: int | None = None,
                     vnuma_nodes: int | None = None) -> Platform:
        """The same host with another VM layout. Bandwidth belongs to the sockets: more vNUMA
        nodes split the same total, fewer join it; the vCPUs are split the same way."""
        data = self.model_dump()
        if vnuma_nodes is not None and vnuma_nodes != self.numa_nodes:
            total_gbs = self.bandwidth_gbs * self.numa_nodes
            total_cpus = self.cpus_per_numa_node * self.numa_nodes
            data.update(numa_nodes=vnuma_nodes, bandwidth_gbs=total_gbs / vnuma_nodes,
                        cpus_per_numa_node=max(1, total_cpus // vnuma_nodes))
            if ranks_per_node is None:
                data["ranks_per_node"] = None
            if threads_per_rank is None:
                data["threads_per_rank"] = None
        if ranks_per_node is not None:
            data["ranks_per_node"] = ranks_per_node
            if threads_per_rank is None:
                data["threads_per_rank"] = None
        if threads_per_rank is not None:
            data["threads_per_rank"] = threads_per_rank
        return _validated(data, lambda loc: ("--ranks-per-node/--threads-per-rank/--vnuma-nodes", ""))

    def describe(self) -> str:
        return (f"{self.name}: {_n(self.numa_nodes, 'vNUMA node')} x {_n(self.cpus_per_numa_node, 'vCPU')}, "
                f"{self.bandwidth_gbs:.1f} GB/s per node, {self.gemm_tflops_per_cpu:.3g} TFLOP/s per vCPU "
                f"({self.basis}); {_n(self.ranks, 'rank')} x {_n(self.threads, 'thread')}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def layout_problems(p: Platform) -> list[str]:
    """Why the ranks do not fit the VM's vNUMA nodes (a rank never spans two)."""
    out = []
    ranks = p.ranks
    if ranks > p.numa_nodes and ranks % p.numa_nodes:
        out.append(f"ranks_per_node {ranks} does not split evenly over {p.numa_nodes} vNUMA nodes")
    if p.threads * p.ranks_per_numa_node > p.cpus_per_numa_node:
        out.append(f"threads_per_rank {p.threads} x {p.ranks_per_numa_node} rank(s) per vNUMA node needs "
                   f"{p.threads * p.ranks_per_numa_node} vCPUs; a node has {p.cpus_per_numa_node}")
    return out


# ---------------------------------------------------------------- loading


def load_platform(path: str | Path) -> Platform:
    """A platform file: YAML (platforms/*.yaml) or the JSON `vcfslm probe -o json` printed; a
    name without a folder that is not a file here is looked up among the shipped platforms."""
    path = Path(path)
    if not path.exists() and path.parent == Path("."):
        shipped = resource_dir("platforms") / (path.name if path.suffix else f"{path.name}.yaml")
        if shipped.exists():
            path = shipped
    label = str(path)
    text = read_document(path, PlatformError)
    if text.lstrip().startswith("["):
        return platform_from_probe(_json(text, label), label)
    return parse_platform(text, label)


def _json(text: str, label: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PlatformError([Problem(label, getattr(exc, "lineno", None), getattr(exc, "colno", None), "",
                                     f"not valid JSON: {exc}")]) from None


def parse_platform(text: str, label: str = "<platform>") -> Platform:
    data, locate = load_mapping(text, label, PlatformError, "a platform file is a mapping (name, numa_nodes, "
                                "cpus_per_numa_node, bandwidth_gbs, gemm_tflops_per_cpu, ...)")
    try:
        return Platform.model_validate(data)
    except ValidationError as exc:
        raise PlatformError(pydantic_problems(exc, data, locate, Platform)) from None


def _validated(data: dict, where: Callable[[tuple], tuple[str, str]]) -> Platform:
    """A Platform built from values that come from no file; where(loc) -> (source, key) names a
    finding's origin (a flag, a probe file's field)."""
    try:
        return Platform.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            source, key = where(tuple(err["loc"]))
            problems.append(Problem(source, None, None, key, validation_message(err)))
        raise PlatformError(problems) from None


def platform_from_probe(rows: Any, label: str = "<probe>") -> Platform:
    """A measured platform from `vcfslm probe -o json` (one object per NUMA node)."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise PlatformError([Problem(label, None, None, "", "expected the JSON list `vcfslm probe -o json` "
                                                            "prints (one object per NUMA node)")])
    problems = []
    for i, r in enumerate(rows):
        for key in ("read_gbs", "threads"):
            if not _positive(r.get(key)):
                problems.append(Problem(label, None, None, f"[{i}].{key}", "missing or not a positive number"))
        gemm = r.get("gemm") or {}
        if not (_positive(gemm.get("tflops")) and _positive(gemm.get("threads"))):
            problems.append(Problem(label, None, None, f"[{i}].gemm",
                                    "missing the GEMM rate (probe run with --no-gemm, or an older vcfslm)"))
    if problems:
        raise PlatformError(problems)
    curves = [r.get("decode_linears") for r in rows if r.get("decode_linears")]
    curve = None
    if curves and len({tuple(c["rows"]) for c in curves}) == 1:
        curve = {"rows": curves[0]["rows"], "threads": curves[0]["threads"],
                 "gbs": [statistics.median(c["gbs"][i] for c in curves) for i in range(len(curves[0]["rows"]))],
                 "read_gbs": statistics.median(r["read_gbs"] for r in rows)}
    data = {
        "name": f"probed ({len(rows)} NUMA node{'s' if len(rows) != 1 else ''})",
        "description": f"measured by vcfslm probe ({label})",
        "numa_nodes": len(rows),
        "cpus_per_numa_node": int(statistics.median(r["threads"] for r in rows)),
        "bandwidth_gbs": statistics.median(r["read_gbs"] for r in rows),
        "gemm_tflops_per_cpu": statistics.median(r["gemm"]["tflops"] / r["gemm"]["threads"] for r in rows),
        "decode_linears": curve, "basis": "measured",
        "sources": {"bandwidth": "vcfslm probe read_gbs", "gemm": "vcfslm probe gemm"},
    }
    return _validated(data, lambda loc: (label, ".".join(map(str, loc))))


def platform_from_flags(bandwidth_gbs: float, gemm_tflops: float, *, numa_nodes: int = 1,
                        threads_per_rank: int = 1, ranks_per_node: int | None = None) -> Platform:
    """A platform from `--bandwidth-gbs` (per NUMA node) and `--gemm-tflops` (per rank)."""
    ranks = ranks_per_node or numa_nodes
    per_node = max(1, math.ceil(ranks / numa_nodes))
    data = {"name": "command line", "numa_nodes": numa_nodes, "cpus_per_numa_node": threads_per_rank * per_node,
            "bandwidth_gbs": bandwidth_gbs, "gemm_tflops_per_cpu": gemm_tflops / threads_per_rank,
            "ranks_per_node": ranks_per_node, "threads_per_rank": threads_per_rank,
            "sources": {"bandwidth": "--bandwidth-gbs", "gemm": "--gemm-tflops"}}
    flag = {"bandwidth_gbs": "--bandwidth-gbs", "gemm_tflops_per_cpu": "--gemm-tflops"}
    return _validated(data, lambda loc: (flag.get(str(loc[0]) if loc else "", "command line"), ""))


def platform_from_run(run_id: str, rates, threads_per_rank: int, ranks_per_node: int) -> Platform:
    """The platform a run measured, as its ranks saw it: one vNUMA node per rank, the rank's
    probed bandwidth as the node's, its GEMM rate over its threads. rates: perfmodel.RankRates."""
    curve = None
    if rates.decode_rows:
        curve = {"rows": list(rates.decode_rows), "gbs": list(rates.decode_gbs), "threads": threads_per_rank,
                 "read_gbs": rates.read_gbs}
    return Platform.model_validate({
        "name": f"as measured by {run_id}", "numa_nodes": ranks_per_node, "cpus_per_numa_node": threads_per_rank,
        "bandwidth_gbs": rates.read_gbs, "gemm_tflops_per_cpu": rates.gemm_tflops / threads_per_rank,
        "ranks_per_node": ranks_per_node, "threads_per_rank": threads_per_rank, "decode_linears": curve,
        "basis": "measured", "sources": {"bandwidth": f"{run_id} probes", "gemm": f"{run_id} probes"}})


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
