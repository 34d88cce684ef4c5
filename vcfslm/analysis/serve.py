"""Serving mode's answer (pure): latency and goodput per load, the serving threshold per
SLO and context, the static crossover beside it, and the sizing law from it.

How the numbers are read (the decisions themselves are vcfslm.serving's, so the
threshold here is the one the in-run sweep bisects towards):

- A serving point is one load of one series: every valid window of every rank and run
  of one (scope, VMs, ranks per VM, load kind, arrival, slots, context) at that load,
  pooled by `serving.load_results`. Invalid windows are left out of every number and
  counted, as in static mode; a load without a valid window is not judged.
- A load meets an SLO when at least the rule's share (`vcfslm.judging`: the attainment,
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
- Workloads never pool (vcfslm.workloads): a series' key names its workload by name and
  digest, and a workload series is named by its workload, not by its longest prompt and
  reply (what its records' input and output tokens are). Its loads are split by prompt
  length, with the prefix cache's share where the server said it (analysis/lengths.py).
- The answer per SLO x context (or workload) reads single-VM series when there are any
  (cluster ones otherwise); of several series the one with the fewest concurrent streams
  per VM at its threshold (the conservative reading).
- Sizing: nodes = ceil(peak streams / serving streams per VM x (1 - headroom)); for a rate
  load also nodes = ceil(peak requests/s / threshold requests/s per VM x (1 - headroom)).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vcfslm import judging, serving
from vcfslm.analysis import below
from vcfslm.analysis.cells import (
    CLUSTER,
    SCOPE_TITLES,
    SINGLE,
    Cell,
    model_text,
    recompile_flag,
    scope_of,
)
from vcfslm.analysis.endpoint import (
    FaultWindow,
    ScaleOut,
    curve_for,
    curve_interval,
    curve_nodes,
    curve_text,
    fault_windows,
    scale_outs,
)
from vcfslm.analysis.lengths import SeriesLengths, cached_share, history_note, series_lengths
from vcfslm.analysis.slo import (
    Crossover,
    Slo,
    check_headroom,
    check_peak_streams,
    crossovers,
    effective_threshold,
    sizing_law,
)
from vcfslm.errors import UsageError
from vcfslm.judging import Interval, Replicate, Rule
from vcfslm.results import ServeRecord
from vcfslm.workloads import MIXES

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
    server: str = "vcfslm"         # who served (vcfslm.servers): series of different servers never mix
    model: str = ""                # what was served (meta.json `model`): series of different models never mix
    # 0: each rank loaded its own server or engine, and a load is per rank. N: one client loaded
    # one endpoint with N nodes behind it (bench --endpoint), and a load is the deployment's;
    # ranks_per_vm is then the servers per node.
    endpoint_nodes: int = 0
    # Its windows took a fault (bench --fault): a server killed in each. Never pooled with
    # windows without one, and never the answer while a series without faults stands beside it.
    faulted: bool = False
    # The workload its requests came from, `name@digest` (vcfslm.workloads); "": the spec's fixed
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


# A workload file's kind as its name carries it (vcfslm.workloads.parse_workload names them).
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
                "ttft_p50_s": _finite(self.ttft_p50_s), "ttft_p90_s": _finite(self.ttft_p90_s),
                "tpot_p50_ms": _finite(self.tpot_p50_ms), "tpot_p90_ms": _finite(self.tpot_p90_ms),
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


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


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


# ------------------------------------------------------------------ points


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


# ---------------------------------------------------------------- thresholds


@dataclass(frozen=True, eq=False)
class ServeThreshold:
    """The serving threshold of one series under one SLO."""

    key: ServeKey
    slo: Slo
    points: tuple[ServePoint, ...]               # every load of the series, ascending
    verdicts: Mapping[float, bool | None]        # per load per rank (None: not judged)
    status: str                                  # "threshold" | "below" | "above" | "unjudged"
    passing: float | None                        # per rank
    failing: float | None                        # per rank
    binding: str | None                          # at the first failing load
    non_monotonic: tuple[float, ...] = ()        # loads per rank passing again after a failure
    notes: tuple[str, ...] = ()
    share: float = judging.DEFAULT_ATTAINMENT    # the attainment it was judged at
    interval: Interval | None = None             # of the threshold load per rank
    streams_interval: Interval | None = None     # of the concurrent streams per VM at it
    # Per bootstrap replicate: its reading and its busy slots per load (what node counts resample).
    replicates: tuple[tuple[Replicate | None, Mapping[float, float]], ...] = ()
    few_samples: tuple[str, ...] = ()            # loads judged on too few requests
    models: int = 1                              # how many models the answer holds: >1 names this one
    below_why: below.Lowering | None = None      # "below": why no lower load passed (analysis/below.py)

    @property
    def model_label(self) -> str:
        """The model as a sentence names it: only once the answer holds several."""
        return (model_text(self.key.model) + ", ") if self.models > 1 else ""

    def point(self, load: float | None) -> ServePoint | None:
        return next((p for p in self.points if p.load == load), None)

    @property
    def judged(self) -> list[ServePoint]:
        return [p for p in self.points if self.verdicts.get(p.load) is not None]

    @property
    def rule(self) -> str:
        return f"{judging.attainment_text(self.share)} attainment"

    def attainment_at(self, p: ServePoint) -> judging.Attainment | None:
        return p.result.attainment(self.slo.tpot_ms, self.slo.ttft_s, self.slo.ttft_per_token_ms) if p.has_data else None

    @property
    def load_per_vm(self) -> float | None:
        return None if self.passing is None else self.passing * self.key.per_vm

    @property
    def failing_per_vm(self) -> float | None:
        return None if self.failing is None else self.failing * self.key.per_vm

    @property
    def streams_per_vm(self) -> float | None:
        """Concurrent streams per VM measured at the threshold load."""
        p = self.point(self.passing)
        return None if p is None else p.streams_per_vm

    @property
    def rate_per_vm(self) -> float | None:
        """Requests/s per VM at the threshold (a rate load only)."""
        return self.load_per_vm if self.key.load_kind == "rate" else None

    @property
    def threshold_text(self) -> str:
        judged = self.judged
        if self.status == "below":
            return f"< {fmt_load(judged[0].load_per_vm)}"
        if self.status == "above":
            return f"≥ {fmt_load(judged[-1].load_per_vm)}"
        if self.status == "unjudged":
            return "–"
        return fmt_load(self.load_per_vm)

    @property
    def interval_text(self) -> str:
        """The threshold load's interval per VM, `[0.5–<1]`, or ""."""
        if self.interval is None:
            return ""
        return self.interval.text(lambda v: fmt_load(v * self.key.per_vm))

    @property
    def streams_text(self) -> str:
        s = self.streams_per_vm
        if s is None or self.status in ("below", "unjudged"):
            return "–"
        return ("≥ " if self.status == "above" else "") + f"{s:.1f}"

    @property
    def first_failing_text(self) -> str:
        if self.failing is None:
            judged = self.judged
            return f"> {fmt_load(judged[-1].load_per_vm)}" if judged else "–"
        return fmt_load(self.failing_per_vm)

    @property
    def interval_per_vm(self) -> Interval | None:
        """The threshold load's interval per VM (the bootstrap's is per rank)."""
        iv, k = self.interval, self.key.per_vm
        if iv is None:
            return None
        return replace(iv, low=None if iv.low is None else iv.low * k, high=None if iv.high is None else iv.high * k)

    def per_vm_replicates(self, which: str) -> list[Replicate | None]:
        """The replicates read per VM: `load` (requests/s or users) or `streams` (busy slots, by
        Little's law, at the replicate's threshold and at its first failing load)."""
        k = self.key.per_vm

        def read(load, active):
            if load is None:
                return None
            return load * k if which == "load" else active.get(load, 0.0) * k

        out: list[Replicate | None] = []
        for rep, active in self.replicates:
            if rep is None or rep.threshold is None:
                out.append(rep if rep is None else Replicate(None, rep.all_pass, read(rep.failing, active)))
                continue
            value, failing = read(rep.threshold, active), read(rep.failing, active)
            # Slots full at both loads: the failing load's streams bound nothing above the threshold's.
            out.append(Replicate(value, rep.all_pass, failing if failing is not None and failing > value else None))
        return out

    def summary(self) -> str:
        return threshold_reason(self)

    def to_dict(self) -> dict[str, Any]:
        per_vm = self.interval_per_vm
        return {**key_dict(self.key), "slo": self.slo.to_dict(), "rule": self.rule, "attainment": self.share,
                "status": self.status,
                "load_unit": f"{self.key.unit} per VM", "threshold_load_per_rank": self.passing,
                "threshold_load_per_vm": self.load_per_vm, "first_failing_load_per_rank": self.failing,
                "first_failing_load_per_vm": self.failing_per_vm,
                "threshold_interval_per_vm": None if per_vm is None else per_vm.to_dict(),
                "threshold_streams_per_vm": self.streams_per_vm, "threshold_is_lower_bound": self.status == "above",
                "streams_interval": None if self.streams_interval is None else self.streams_interval.to_dict(),
                "binding": self.binding, "non_monotonic_loads_per_rank": list(self.non_monotonic),
                "verdicts": [{"load_per_rank": p.load, "load_per_vm": p.load_per_vm,
                              "meets": self.verdicts.get(p.load),
                              "attainment": _finite(a.share) if (a := self.attainment_at(p)) else None,
                              "requests": p.requests} for p in self.points],
                "few_samples": list(self.few_samples), "below": below.to_dict(self.below_why, self.slo.title, self.key),
                "threshold": self.threshold_text, "notes": list(self.notes), "reasoning": self.summary()}


def _binding(result: serving.LoadResult, slo: Slo, share: float) -> str:
    a = result.attainment(slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms)
    text = a.binding(share)
    # Unfinished requests met no limit: say so when they alone sink the load.
    return text + (" (unfinished requests)" if result.unfinished and result.unfinished > (1 - share) * a.requests
                   else "")


def serve_threshold(points: Sequence[ServePoint], slo: Slo, rule: Rule | None = None) -> ServeThreshold:
    """The threshold of one series (its points, any order) under `slo`, judged by `rule`."""
    if not points:
        raise ValueError("a serving threshold needs at least one load")
    rule = rule or Rule()
    share = rule.attainment_for(slo.percentile)
    ordered = tuple(sorted(points, key=lambda p: p.load))
    verdicts = {p.load: (serving.meets(p.result, slo.tpot_ms, slo.ttft_s, share, slo.ttft_per_token_ms) if p.has_data else None)
                for p in ordered}
    passing, failing = judging.threshold(verdicts)
    if passing is not None and failing is not None:
        status = "threshold"
    elif failing is not None:
        status = "below"
    elif passing is not None:
        status = "above"
    else:
        status = "unjudged"
    fail_point = next((p for p in ordered if p.load == failing), None)
    binding = _binding(fail_point.result, slo, share) if fail_point is not None else None
    later = tuple(p.load for p in ordered if failing is not None and p.load > failing and verdicts[p.load])
    notes = []
    empty = [p for p in ordered if verdicts[p.load] is None]
    if empty:
        notes.append(f"No valid data at {', '.join(fmt_load(p.load_per_vm) for p in empty)} "
                     f"{ordered[0].key.unit}/VM: those loads are not judged.")
    thin = judging.few_samples({fmt_load(p.load_per_vm): p.requests for p in ordered if p.has_data}, share,
                               "requests")
    thin = (f"{judging.attainment_text(share)} attainment {thin} {ordered[0].key.unit}/VM",) if thin else ()
    reps: list = []
    windows = serving.bootstrap_windows({p.load: p.result for p in ordered if p.has_data}, {slo.name: slo.limits()})
    if windows and rule.replicates:
        reps = judging.serving_replicates(windows, {slo.name: share}, rule.replicates, rule.seed)[slo.name]
    t = ServeThreshold(ordered[0].key, slo, ordered, verdicts, status, passing, failing, binding, later,
                       tuple(notes), share, judging.interval([r for r, _ in reps], rule.confidence),
                       None, tuple(reps), thin, below_why=below.of_series(ordered, slo, share, status))
    if reps:
        t = replace(t, streams_interval=judging.interval(t.per_vm_replicates("streams"), rule.confidence))
    return t


def thresholds(points: Sequence[ServePoint], slos: Sequence[Slo], rule: Rule | None = None) -> list[ServeThreshold]:
    """Every series x SLO (SLO first, then series order)."""
    by_series = series_of(points)
    return [serve_threshold(pts, slo, rule) for slo in slos for pts in by_series.values()]


def _judged(t: ServeThreshold, p: ServePoint) -> str:
    """`attainment 85 % < 90 % (412 requests; p90 TPOT 450.2 ms, p90 TTFT 1.20 s)`."""
    a = t.attainment_at(p)
    if a is None:
        return "no requests"
    mark = "≥" if judging.attains(a, t.share) else "<"
    return (f"attainment {judging.attainment_text(a.share)} {mark} {judging.attainment_text(t.share)} "
            f"({a.requests} requests; {_tails(p)})")


def _tails(p: ServePoint) -> str:
    parts = []
    for name, value, unit, digits in (("TPOT", p.tpot_p90_ms, "ms", 1), ("TTFT", p.ttft_p90_s, "s", 2)):
        if value is None:
            continue
        text = "∞ (unfinished requests)" if math.isinf(value) else f"{value:.{digits}f} {unit}"
        parts.append(f"{PCT} {name} {text}")
    return ", ".join(parts)


def threshold_reason(t: ServeThreshold) -> str:
    """One paragraph: where the threshold lies and why, bounds said plainly."""
    k, unit = t.key, t.key.unit
    head = (f"{t.model_label}{t.slo.describe()}, serving {LOAD_NAMES[k.load_kind]} ({k.arrival}, {k.slots} slots per rank), "
            f"{k.context_phrase}, {t.rule}")
    judged = t.judged
    if t.status == "unjudged":
        text = f"{head}: no load has valid data to judge."
    elif t.status == "below":
        first = judged[0]
        lead = below.alone_text(t.below_why, t.slo.title) or "below the smallest load tried"
        text = (f"{head}: {lead}. Even {fmt_load(first.load_per_vm)} {unit}/VM has {_judged(t, first)}; "
                f"{t.binding} binds. " + below.sentence(t.below_why, t.slo.title, k))
    elif t.status == "above":
        last = judged[-1]
        text = (f"{head}: every load tried meets it, so the threshold is ≥ {fmt_load(last.load_per_vm)} "
                f"{unit}/VM (the largest tried; {last.streams_per_vm:.1f} concurrent streams/VM measured there: "
                f"{_judged(t, last)}).")
    else:
        ok, fail = t.point(t.passing), t.point(t.failing)
        text = (f"{head}: meets it up to {fmt_load(t.load_per_vm)} {unit}/VM ({ok.streams_per_vm:.1f} "
                f"concurrent streams/VM measured; {_judged(t, ok)}); {fmt_load(t.failing_per_vm)} {unit}/VM "
                f"fails on {t.binding} ({_judged(t, fail)}).")
    if t.interval is not None:
        text += (f" {t.interval.confidence:.0%} interval {t.interval_text} {unit}/VM"
                 + (f", {t.streams_interval.text(lambda v: f'{v:.1f}')} streams/VM" if t.streams_interval else "")
                 + f" ({t.interval.replicates} bootstrap replicates: windows within ranks, requests within windows).")
    if t.few_samples:
        text += f" Few samples: {'; '.join(t.few_samples)}."
    if t.non_monotonic:
        loads = ", ".join(fmt_load(v * k.per_vm) for v in t.non_monotonic)
        text += (f" Not monotonic: {loads} {unit}/VM meet(s) it again after {fmt_load(t.failing_per_vm)} failed; "
                 "the threshold stays below the first failure.")
    for note in t.notes:
        text += f" {note}"
    return text


def _conservative(t: ServeThreshold) -> tuple:
    rank = {"below": 0, "threshold": 1, "above": 2, "unjudged": 3}[t.status]
    return (rank, t.streams_per_vm if t.streams_per_vm is not None else 0.0)


def primary(all_thresholds: Sequence[ServeThreshold]) -> list[ServeThreshold]:
    """Per SLO x context x workload x load kind x server x model the threshold the answer reads:
    single-VM series first, and of several the fewest streams per VM (a notes entry says so).
    Servers, models and workloads are never pooled: vLLM's threshold and vcfslm's own, two
    models', or a chat mix's and a trace's, stand side by side."""
    groups: dict[tuple, list[ServeThreshold]] = {}
    for t in all_thresholds:
        groups.setdefault((t.slo, t.key.input_tokens, t.key.output_tokens, t.key.workload, t.key.load_kind,
                           t.key.server, t.key.model), []).append(t)
    out = []
    for ts in groups.values():
        faulted = all(t.key.faulted for t in ts)
        ts = ts if faulted else [t for t in ts if not t.key.faulted]
        scope = SINGLE if any(t.key.scope == SINGLE for t in ts) else CLUSTER
        mine = sorted((t for t in ts if t.key.scope == scope), key=_conservative)
        chosen = mine[0]
        notes = list(chosen.notes)
        if faulted:
            notes.append("Every window of this context took a fault (a server killed in it): a threshold under "
                         "faults, not the deployment's capacity.")
        if scope == CLUSTER:
            notes.append("No single-VM serving data: read from cluster series (per VM of one cluster VM).")
        if len(mine) > 1:
            notes.append(f"{len(mine)} serving configurations of this context; the one with the fewest "
                         "concurrent streams per VM at its threshold is used.")
        if tuple(notes) != chosen.notes:
            chosen = replace(chosen, notes=tuple(notes))
        out.append(chosen)
    return out


# ---------------------------------------------------------------- the comparison


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


# ---------------------------------------------------------------- sizing


@dataclass(frozen=True, eq=False)
class ServeSizing:
    """Nodes for a peak under one serving threshold: by streams and, for a rate load, by rate."""

    threshold: ServeThreshold
    peak_streams: int | None
    peak_rps: float | None
    headroom: float
    nodes_by_streams: int | None
    nodes_by_rate: int | None
    reasoning: str
    streams_nodes_interval: Interval | None = None
    rate_nodes_interval: Interval | None = None
    # Sized on the scale-out curve measured through one endpoint (analysis/endpoint.py): what
    # it read ("" : from this threshold alone), and whether a node count it used is a bound.
    curve: str = ""
    curve_bound: bool = False

    @property
    def nodes(self) -> int | None:
        """The answer: by rate when a peak rate was given, else by streams."""
        return self.nodes_by_rate if self.peak_rps is not None else self.nodes_by_streams

    @property
    def bound(self) -> bool:
        return self.curve_bound if self.curve else self.threshold.status == "above"

    @property
    def law_text(self) -> str:
        """`ceil(256 / 20) = 13` (by streams; the headroom applied), or why there is none."""
        if self.curve:
            nodes = self.nodes_by_streams
            return f"on the measured cluster curve, {'at most ' if self.bound else ''}{nodes}" if nodes else \
                "no node count"
        streams = self.threshold.streams_per_vm
        if self.nodes_by_streams is None or self.peak_streams is None or not streams:
            return "no node count"
        eff = effective_threshold(streams, self.headroom)
        return f"ceil({self.peak_streams} / {eff:.3g}) = {'at most ' if self.bound else ''}{self.nodes_by_streams}"

    def nodes_text(self, which: str = "streams") -> str:
        n = self.nodes_by_rate if which == "rate" else self.nodes_by_streams
        if n is None:
            return "–" if self.threshold.status in ("threshold", "above") else below.nodes(self.threshold.below_why)
        return f"≤ {n}" if self.bound else str(n)

    def interval_text(self, which: str = "streams") -> str:
        iv = self.rate_nodes_interval if which == "rate" else self.streams_nodes_interval
        return "" if iv is None else iv.text(lambda v: f"{v:g}", mark="≤ ")

    def answer_text(self, which: str = "streams") -> str:
        """`2000 [1000–<2500] req/s/VM, 3.2 [3.0–<3.9] streams/VM → 80 [66–86] nodes`."""
        t = self.threshold
        parts = [" ".join(x for x in (t.threshold_text, t.interval_text) if x) + f" {t.key.unit}/VM"]
        if t.streams_per_vm is not None and t.status in ("threshold", "above"):
            iv = "" if t.streams_interval is None else " " + t.streams_interval.text(lambda v: f"{v:.1f}")
            parts.append(f"{t.streams_text}{iv} streams/VM")
        nodes = " ".join(x for x in (self.nodes_text(which), self.interval_text(which)) if x)
        tail = below.answer(t.below_why, t.slo.title) if t.status == "below" else f"{nodes} nodes"
        return ", ".join(parts) + f" → {tail}"

    def to_dict(self) -> dict[str, Any]:
        t = self.threshold
        return {"threshold_kind": "serving", **key_dict(t.key), "slo": t.slo.to_dict(), "rule": t.rule,
                "attainment": t.share,
                "status": t.status, "threshold_load_per_vm": t.load_per_vm, "load_unit": f"{t.key.unit} per VM",
                "threshold_interval_per_vm": t.to_dict()["threshold_interval_per_vm"],
                "threshold_streams_per_vm": t.streams_per_vm, "threshold_is_lower_bound": t.status == "above",
                "first_failing_load_per_vm": t.failing_per_vm, "binding": t.binding,
                "peak_streams": self.peak_streams, "peak_rps": self.peak_rps, "headroom": self.headroom,
                "nodes_by_streams": self.nodes_by_streams, "nodes_by_rate": self.nodes_by_rate,
                "nodes_by_streams_interval": None if self.streams_nodes_interval is None
                else self.streams_nodes_interval.to_dict(),
                "nodes_by_rate_interval": None if self.rate_nodes_interval is None
                else self.rate_nodes_interval.to_dict(),
                "nodes": self.nodes, "answer": self.answer_text("rate" if self.peak_rps is not None else "streams"),
                "reasoning": self.reasoning, "threshold": t.summary(), "curve": self.curve or None}


def size(t: ServeThreshold, peak_streams: int | None = None, peak_rps: float | None = None,
         headroom: float = 0.0) -> ServeSizing:
    """The sizing law from a serving threshold, with the reasoning as text."""
    if peak_streams is None and peak_rps is None:
        raise UsageError("give a peak: concurrent streams, or requests/s for a rate load")
    if peak_streams is not None:
        check_peak_streams(peak_streams)
    if peak_rps is not None and not (math.isfinite(peak_rps) and peak_rps > 0):
        raise UsageError(f"peak requests/s must be a positive number, not {peak_rps}")
    check_headroom(headroom)
    if peak_rps is not None and t.key.load_kind != "rate":
        raise UsageError("--peak-rps needs a serving threshold of a rate load (requests/s); this one is "
                         f"{t.key.load_kind}")
    k = t.key
    head = f"{t.model_label}{t.slo.describe()}, serving {LOAD_NAMES[k.load_kind]}, {k.context_phrase}, {t.rule}"
    if t.status in ("below", "unjudged"):
        why = (below.alone_text(t.below_why, t.slo.title) or "even the smallest load tried fails; measure lower "
               f"loads ({below.why_not_lower(t.below_why, k)})" if t.status == "below" else "no load has valid data")
        return ServeSizing(t, peak_streams, peak_rps, headroom, None, None,
                           f"{head}: no node count can be read: {why}.")
    streams, rate = t.streams_per_vm, t.rate_per_vm
    lines = [f"{head}: one VM meets the SLO up to {fmt_load(t.load_per_vm)} {k.unit}/VM, "
             f"{streams:.1f} concurrent streams/VM measured there"
             + (" (every load tried met it, so the true threshold may be higher and these node counts are "
                "upper bounds)" if t.status == "above" else
                f"; {fmt_load(t.failing_per_vm)} {k.unit}/VM fails on {t.binding}") + "."]
    by_streams = by_rate = None
    streams_span = rate_span = None
    conf = t.interval.confidence if t.interval else judging.DEFAULT_CONFIDENCE
    if peak_streams is not None:
        if streams and streams > 0:
            by_streams, _, law = sizing_law(peak_streams, streams, headroom, ".3g")
            lines.append(f"Nodes = {law}" + (f" (headroom {headroom:.0%})" if headroom else "") + ".")
            streams_span = (None if t.streams_interval is None
                            else judging.nodes_of(t.streams_interval, peak_streams, headroom))
        else:
            lines.append("No concurrent streams were measured at the threshold: nodes by streams cannot be read.")
    if peak_rps is not None and rate:
        by_rate, _, law = sizing_law(peak_rps, rate, headroom, ".3g", "g")
        lines.append(f"By rate: nodes = {law}" + (f" (headroom {headroom:.0%})" if headroom else "") + ".")
        per_vm = t.interval_per_vm
        rate_span = None if per_vm is None else judging.nodes_of(per_vm, peak_rps, headroom)
    spans = [f"{label} {iv.text(mark='≤ ')}" for label, iv in (("by streams", streams_span), ("by rate", rate_span))
             if iv is not None and iv.text(mark="≤ ")]
    if spans and t.interval_text:
        lines.append(f"{conf:.0%} interval: threshold {t.interval_text} {k.unit}/VM, nodes {', '.join(spans)} "
                     f"({t.interval.replicates} bootstrap replicates).")
    if t.few_samples:
        lines.append(f"Few samples: {'; '.join(t.few_samples)}.")
    if k.scope == CLUSTER:
        lines.append(f"(Threshold read from {SCOPE_TITLES[CLUSTER]} serving data: no single-VM series.)")
    return ServeSizing(t, peak_streams, peak_rps, headroom, by_streams, by_rate, " ".join(lines),
                       streams_span, rate_span)


def size_on_curve(t: ServeThreshold, curve: ScaleOut, peak_streams: int | None = None,
                  peak_rps: float | None = None, headroom: float = 0.0) -> ServeSizing:
    """Nodes for a peak read off the scale-out curve measured through one endpoint: the fewest
    measured node count that carries it (its threshold, or its busy streams there, less the
    headroom), past the largest measured, that count's capacity per node (its efficiency
    kept). `t` is the answer's threshold it stands beside (checked as `size` checks it)."""
    alone = size(t, peak_streams, peak_rps, headroom)
    k = t.key
    head = f"{t.model_label}{t.slo.describe()}, serving {LOAD_NAMES[k.load_kind]}, {k.context_phrase}, {t.rule}"
    read = curve_text(curve, "rate", f"{k.unit} at the threshold")
    lines = [f"{head}: sized on the cluster curve measured through one endpoint ({read})."]
    found: dict[str, tuple[int | None, Interval | None]] = {}
    bound = False
    for which, peak, unit in (("streams", peak_streams, "concurrent streams"), ("rate", peak_rps, k.unit)):
        if peak is None:
            continue
        caps = curve.capacities(which)
        got = curve_nodes([(n, c) for n, c, _, _ in caps], peak, headroom)
        if got is None:
            lines.append(f"No {which} measured at any node count: nodes by {which} cannot be read.")
            found[which] = (None, None)
            continue
        nodes, extrapolated = got
        used = max(n for n, *_ in caps) if extrapolated else nodes
        row = next(r for r in curve.rows if r.nodes == used)
        bound = bound or row.threshold.status == "above"
        capacity = next(c for n, c, _, _ in caps if n == used)
        derated = f" less {headroom:.0%} headroom" if headroom else ""
        if extrapolated:
            lines.append(f"{peak:g} {unit}: beyond the {used} nodes measured ({capacity:.3g}{derated}), at "
                         f"{capacity / used:.3g} per node, the efficiency measured at {used} nodes kept: "
                         f"{nodes} nodes.")
        else:
            lines.append(f"{peak:g} {unit}: {nodes} node{'s' if nodes > 1 else ''} carry {capacity:.3g}{derated}, "
                         f"measured.")
        found[which] = (nodes, curve_interval(caps, peak, headroom))
    lines.append(f"(One VM's threshold times the nodes would say {alone.nodes_text('rate' if peak_rps else 'streams')}"
                 " nodes.)")
    streams, rate = found.get("streams", (None, None)), found.get("rate", (None, None))
    return ServeSizing(t, peak_streams, peak_rps, headroom, streams[0], rate[0], " ".join(lines),
                       streams[1], rate[1], curve=read, curve_bound=bound)


def sized(t: ServeThreshold, curves: Sequence[ScaleOut], peak_streams: int | None = None,
          peak_rps: float | None = None, headroom: float = 0.0) -> ServeSizing:
    """Sizing for `t`: on the measured cluster curve of its SLO and context when one exists
    (analysis/endpoint.py), else from its threshold alone."""
    curve = curve_for(curves, t)
    if curve is None:
        return size(t, peak_streams, peak_rps, headroom)
    return size_on_curve(t, curve, peak_streams, peak_rps, headroom)


# ---------------------------------------------------------------- everything


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

