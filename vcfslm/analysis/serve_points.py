"""Serving's measured points (pure): a series' key (`ServeKey`: scope, VMs, ranks, load kind,
arrival, slots, context or workload, model), and one point per load of a series, its valid
windows pooled by `serving.load_results` (`ServePoint`). How they are read:
vcfslm.analysis.serve's docstring."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vcfslm.analysis.cells import (
    CLUSTER,
    SCOPE_TITLES,
    SINGLE,
    finite,
    recompile_flag,
    scope_of,
)
from vcfslm.analysis.lengths import cached_share, history_note
from vcfslm.analysis.slo_spec import Slo
from vcfslm.results import ServeRecord
from vcfslm.serving import decisions as serving
from vcfslm.serving.workloads import MIXES

PCT = f"p{serving.SERVE_PERCENTILE:g}"
UNITS = {"rate": "req/s", "users": "users"}
LOAD_NAMES = {"rate": "requests/s", "users": "users"}
STATUSES = ("threshold", "below", "above", "unjudged")
# The serving section's figures, in order: their one home (analysis.figures.render_serving
# draws them under these names; the report finds the serving section's figures by them).
SERVE_FIGURES = ("fig-7-serve-latency", "fig-8-serve-goodput", "fig-9-serve-vs-static")


@dataclass(frozen=True)
class ServeKey:
    """What one series of serving points shares; its loads vary."""

    scope: str
    vms: int
    ranks_per_vm: int
    load_kind: str                 # "rate" | "users"
    arrival: str                   # one of arrivals.RECORDED
    slots: int
    input_tokens: int
    output_tokens: int
    server: str = "vcfslm"         # who served (vcfslm.serving.servers): series of different servers never mix
    model: str = ""                # what was served (meta.json `model`): series of different models never mix
    # 0: each rank loaded its own server or engine, and a load is per rank. N: one client loaded
    # one endpoint with N nodes behind it (bench --endpoint), and a load is the deployment's;
    # ranks_per_vm is then the servers per node.
    endpoint_nodes: int = 0
    # Its windows took a fault (bench --fault): a server killed in each. Never pooled with
    # windows without one, and never the answer while a series without faults stands beside it.
    faulted: bool = False
    # The workload its requests came from, `name@digest` (vcfslm.serving.workloads); "": the spec's fixed
    # lengths. Workloads never pool, and with one input_tokens / output_tokens are only its
    # longest prompt and reply, so a workload series is named by its workload.
    workload: str = ""

    @property
    def context(self) -> tuple[int, int]:
        return (self.input_tokens, self.output_tokens)

    @property
    def per_vm(self) -> float:
        """What turns a load (or busy slots, or goodput) of the series into one VM's: its ranks
        per VM, or a share of the N nodes behind the endpoint."""
        return 1.0 / self.endpoint_nodes if self.endpoint_nodes else float(self.ranks_per_vm)

    @property
    def load_scope(self) -> str:
        return "at the endpoint" if self.endpoint_nodes else "per rank"

    @property
    def unit(self) -> str:
        return UNITS[self.load_kind]

    @property
    def context_text(self) -> str:
        """What a table's input column says of it: `512`, or the workload's title."""
        return workload_title(self.workload) if self.workload else str(self.input_tokens)

    @property
    def output_text(self) -> str:
        return "–" if self.workload else str(self.output_tokens)

    @property
    def context_phrase(self) -> str:
        """What a sentence says of it: `512-token inputs / 128 output`, or `the chat (mix) workload`."""
        if self.workload:
            return f"the {workload_title(self.workload)} workload"
        return f"{self.input_tokens}-token inputs / {self.output_tokens} output"


def workload_label(r: ServeRecord) -> str:
    """A record's workload as a series keeps it: `name@digest`; "" for the spec's fixed lengths,
    and for a fixed workload (`fixed:IN/OUT`), which is the same requests at the same context."""
    if not r.workload or r.workload.startswith("fixed:"):
        return ""
    return f"{r.workload}@{r.workload_digest}" if r.workload_digest else r.workload


# A workload file's kind as its name carries it (vcfslm.serving.workloads.parse_workload names them).
WORKLOAD_KINDS = (("file:", "requests file"), ("mooncake:", "Mooncake trace"))


def workload_title(label: str) -> str:
    """A workload as a reader names it: `chat (mix)`, `trace.jsonl (requests file, 1a2b3c4d)`. A
    file's digest stays in (shortened): two versions of one file are two workloads."""
    name, at, digest = label.rpartition("@")
    if not at:
        name, digest = label, ""
    if name in MIXES:
        return f"{name} (mix)"
    for prefix, kind in WORKLOAD_KINDS:
        if name.startswith(prefix):
            return f"{name.removeprefix(prefix)} ({kind}{', ' + digest[:8] if digest else ''})"
    return name


@dataclass(frozen=True, eq=False)
class ServePoint:
    """One load of one series: what users saw and what the VM delivered."""

    key: ServeKey
    load: float                                  # per rank: requests/s or users
    result: serving.LoadResult | None            # valid windows pooled; None without any
    goodput_per_vm: Mapping[str, float] = field(default_factory=dict)   # SLO name -> req/s per VM
    windows: int = 0
    invalid_windows: int = 0
    offered: int = 0
    completed: int = 0
    source: str = ""
    flags: tuple[str, ...] = ()

    @property
    def load_per_vm(self) -> float:
        return self.load * self.key.per_vm

    @property
    def has_data(self) -> bool:
        return self.result is not None and self.result.requests > 0

    def _tail(self, which: str, q: float) -> float | None:
        if not self.has_data:
            return None
        return getattr(self.result, f"{which}_tail")(q)

    @property
    def ttft_p50_s(self) -> float | None:
        return self._tail("ttft", 50)

    @property
    def ttft_p90_s(self) -> float | None:
        return self._tail("ttft", serving.SERVE_PERCENTILE)

    @property
    def tpot_p50_ms(self) -> float | None:
        return self._tail("tpot", 50)

    @property
    def tpot_p90_ms(self) -> float | None:
        return self._tail("tpot", serving.SERVE_PERCENTILE)

    @property
    def streams_per_vm(self) -> float | None:
        """Mean concurrent streams per VM (busy slots, time-averaged) at this load."""
        return None if self.result is None else self.result.mean_active * self.key.per_vm

    @property
    def requests(self) -> int:
        return 0 if self.result is None else self.result.requests

    @property
    def unfinished(self) -> int:
        return 0 if self.result is None else self.result.unfinished

    @property
    def completed_per_vm(self) -> float | None:
        """Finished requests per second per VM (every request, SLO or not)."""
        if self.result is None or self.result.span_s <= 0:
            return None
        return len(self.result.ttft_s) / self.result.span_s * self.key.per_vm

    @property
    def cached_share(self) -> float | None:
        """The share of prompt tokens the server's prefix cache served (None: it did not say)."""
        return None if self.result is None else cached_share(self.result.windows)

    @property
    def valid(self) -> bool:
        return self.invalid_windows == 0 and self.windows > 0

    def to_dict(self) -> dict[str, Any]:
        return {**key_dict(self.key), "load_per_rank": self.load, "load_per_vm": self.load_per_vm,
                "ttft_p50_s": finite(self.ttft_p50_s), "ttft_p90_s": finite(self.ttft_p90_s),
                "tpot_p50_ms": finite(self.tpot_p50_ms), "tpot_p90_ms": finite(self.tpot_p90_ms),
                "tails_infinite": [name for name, v in (("ttft", self.ttft_p90_s), ("tpot", self.tpot_p90_ms))
                                   if v is not None and math.isinf(v)],
                "goodput_per_vm": dict(self.goodput_per_vm), "completed_per_vm": self.completed_per_vm,
                "streams_per_vm": self.streams_per_vm, "requests": self.requests,
                "unfinished": self.unfinished, "offered": self.offered, "completed": self.completed,
                "windows": self.windows, "invalid_windows": self.invalid_windows, "valid": self.valid,
                "cached_share": self.cached_share, "flags": list(self.flags), "source": self.source}


def key_dict(key: ServeKey) -> dict[str, Any]:
    return {"scope": key.scope, "vms": key.vms, "ranks_per_vm": key.ranks_per_vm, "load_kind": key.load_kind,
            "arrival": key.arrival, "slots": key.slots, "input_tokens": key.input_tokens,
            "output_tokens": key.output_tokens, "server": key.server, "model": key.model,
            "endpoint_nodes": key.endpoint_nodes, "faulted": key.faulted, "workload": key.workload}



def fmt_load(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def describe_key(key: ServeKey) -> str:
    served = "" if key.server == "vcfslm" else f", {key.server} server"
    requests = (f"workload {workload_title(key.workload)}" if key.workload
                else f"input {key.input_tokens} / output {key.output_tokens}")
    if key.endpoint_nodes:
        faulted = ", a server killed in each window" if key.faulted else ""
        return (f"through one endpoint ({key.endpoint_nodes} node(s) x {key.ranks_per_vm} servers, "
                f"{key.slots} slots, {key.arrival}{served}{faulted}) {requests}")
    return (f"{SCOPE_TITLES[key.scope]} ({key.vms} VM x {key.ranks_per_vm} ranks, {key.slots} slots, "
            f"{key.arrival}{served}) {requests}")


def _spec_of(meta) -> serving.ServeSpec | None:
    data = (meta.matrix or {}).get("serve")
    if not isinstance(data, Mapping):
        return None
    try:
        return serving.ServeSpec.of_record(data)
    except (TypeError, ValueError):
        return None


def serve_points(runs: Sequence[Any], slos: Sequence[Slo]) -> tuple[list[ServePoint], list[str]]:
    """Every serving point of `runs` (RunFiles) with goodput per SLO, plus the warnings of
    their windows (invalid ones, missing ones, runs without a valid window)."""
    groups: dict[tuple[ServeKey, float], list[ServeRecord]] = defaultdict(list)
    sources: dict[tuple[ServeKey, float], set[str]] = defaultdict(set)
    expected: dict[tuple[ServeKey, float], int] = defaultdict(int)
    warnings: list[str] = []
    for run in runs:
        meta, records = run.meta, list(getattr(run, "serve_records", ()) or ())
        if not records:
            continue
        for r in records:
            key = (series_key(meta, r), float(r.load))
            groups[key].append(r)
            sources[key].add(meta.run_id)
        if not any(r.valid for r in records):
            warnings.append(f"run {meta.run_id} has no valid serving window: no serving numbers")
        spec = _spec_of(meta)
        if spec is not None and not spec.sweep:
            seen = {k[0] for k in groups if meta.run_id in sources[k]}
            for series in seen:
                for load in spec.loads:
                    key = (series, float(load))
                    # An endpoint's window is one record; a rank run's, one per rank.
                    expected[key] += spec.repeats * (1 if series.endpoint_nodes else
                                                     max(len(meta.nodes), 1) * meta.ranks_per_node)
    points = []
    for (series, load), records in sorted(groups.items(), key=lambda kv: (_key_order(kv[0][0]), kv[0][1])):
        points.append(make_point(series, load, records, slos, expected.get((series, load)),
                                 ", ".join(sorted(sources[(series, load)]))))
    for series, load in sorted(expected, key=lambda k: (_key_order(k[0]), k[1])):
        if (series, load) not in groups:
            warnings.append(f"serving {describe_key(series)}: no windows recorded at {fmt_load(load)} "
                            f"{series.unit} {series.load_scope} (load missing)")
    for p in points:
        warnings.extend(f"serving {describe_key(p.key)} at {fmt_load(p.load)} {p.key.unit} {p.key.load_scope}: "
                        f"{flag}" for flag in p.flags)
    return points, warnings


def series_key(meta, r: ServeRecord) -> ServeKey:
    """The series a record belongs to. A rank's: the run's scope and VMs. An endpoint's: the
    nodes behind it (one node: single VM), its servers per node."""
    if r.endpoint_nodes:
        n = r.endpoint_nodes
        per_node = max(1, len(r.endpoint_servers) // n)
        return ServeKey(SINGLE if n == 1 else CLUSTER, n, per_node, r.load_kind, r.arrival, r.slots, r.input_tokens,
                        r.output_tokens, r.server, meta.model, n, bool(r.fault), workload_label(r))
    return ServeKey(scope_of(meta), max(len(meta.nodes), 1), r.ranks_per_node, r.load_kind, r.arrival, r.slots,
                    r.input_tokens, r.output_tokens, r.server, meta.model, workload=workload_label(r))


def _key_order(k: ServeKey) -> tuple:
    # Fixed contexts first (by length), then the workloads by name.
    return (k.scope != SINGLE, k.faulted, k.endpoint_nodes, k.vms, k.workload, k.input_tokens, k.output_tokens,
            k.load_kind, k.ranks_per_vm, k.slots, k.arrival)


def make_point(key: ServeKey, load: float, records: Sequence[ServeRecord], slos: Sequence[Slo],
               expected: int | None = None, source: str = "") -> ServePoint:
    """Pool one load's records (valid windows only) and judge its goodput per SLO."""
    valid = [r for r in records if r.valid]
    result = serving.load_results(valid).get(float(load)) if valid else None
    goodput: dict[str, float] = {}
    if result is not None:
        ttft = [v for r in valid for v in r.ttft_s]
        tpot = [v for r in valid for v in r.tpot_ms]
        inputs = [n for r in valid for n in serving.request_inputs(r)]
        per_rank = serving.goodput(ttft, tpot, result.span_s, {s.name: s for s in slos}, inputs)
        goodput = {name: v * key.per_vm for name, v in per_rank.items()}
    invalid = [r for r in records if not r.valid]
    flags = []
    if expected and len(records) < expected:
        flags.append(f"incomplete: {len(records)} of {expected} windows recorded")
    if invalid:
        reasons = sorted({why for r in invalid for why in r.invalid_reasons})
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        flags.append(f"{len(invalid)} invalid window(s) left out{detail}")
        if not valid:
            flags.append("no valid window: no numbers")
    recompiled = recompile_flag(records)
    if recompiled:
        flags.append(recompiled)
    return ServePoint(key, float(load), result, goodput, len(records), len(invalid),
                      sum(r.offered for r in valid), sum(r.completed for r in valid), source, tuple(flags))


def history_of(key: ServeKey, points: Sequence[ServePoint]) -> str:
    """The note beside a multi-turn workload served by vcfslm's engine, which prefills each
    turn's history again; "" for any other series."""
    return history_note(key.server, [r for p in points if p.result is not None for r in p.result.windows])


def series_of(points: Sequence[ServePoint]) -> dict[ServeKey, list[ServePoint]]:
    """Points per series, loads ascending."""
    out: dict[ServeKey, list[ServePoint]] = {}
    for p in sorted(points, key=lambda p: (_key_order(p.key), p.load)):
        out.setdefault(p.key, []).append(p)
    return out
