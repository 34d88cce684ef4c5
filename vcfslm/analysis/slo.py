"""SLOs, the Concurrency Crossover Point and the sizing law (pure functions).

Crossover for (SLO, context): the largest tested streams-per-VM that meets the SLO
before the first failing load. A value exactly at the limit meets it (<=). When a
load passes again after a failure the data are non-monotonic; the threshold stays
below the first failure (the conservative reading) and the report says so.

Sizing: nodes = ceil(peak streams / threshold), with headroom h the threshold is
derated to threshold x (1 - h) first.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vcfslm import contract
from vcfslm.analysis.cells import CLUSTER, PERCENTILES, SCOPE_TITLES, SINGLE, Cell
from vcfslm.errors import Problem, SloSpecError, UsageError

TPOT, TTFT = "TPOT", "TTFT"


# ---------------------------------------------------------------- SLOs


@dataclass(frozen=True)
class Slo:
    """A latency commitment; a limit of None means the indicator is not constrained."""

    name: str
    tpot_ms: float | None = None
    ttft_s: float | None = None

    @property
    def title(self) -> str:
        return self.name if self.name.upper().startswith("SLO") else f"SLO-{self.name}"

    def describe(self) -> str:
        parts = []
        if self.tpot_ms is not None:
            parts.append(f"TPOT ≤ {_num(self.tpot_ms)} ms")
        if self.ttft_s is not None:
            parts.append(f"TTFT ≤ {_num(self.ttft_s)} s")
        return f"{self.title} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tpot_ms": self.tpot_ms, "ttft_s": self.ttft_s}


DEFAULT_SLOS: tuple[Slo, ...] = tuple(Slo(name, **limits) for name, limits in contract.DEFAULT_SLOS.items())

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TERM = re.compile(r"^\s*(?P<ind>[A-Za-z]+)\s*(?P<op><=|≤|<|>=|=)?\s*(?P<num>[0-9]*\.?[0-9]+)?\s*(?P<unit>[A-Za-z]*)\s*$")
_UNITS = {"ms": 1e-3, "s": 1.0}


def _num(x: float) -> str:
    return f"{x:g}"


def parse_slo(text: str, source: str = "--slo") -> Slo:
    """Parse `name:tpot<=150ms,ttft<=2s` (units ms or s; tpot defaults to ms, ttft to s).

    Every problem is reported at once as an SloSpecError naming `source`.
    """
    problems: list[str] = []
    name, sep, body = text.partition(":")
    name = name.strip()
    if not sep:
        raise SloSpecError([Problem(source, None, None, text,
                                      "expected NAME:tpot<=VALUE[ms|s],ttft<=VALUE[s|ms]")])
    if not _NAME.match(name):
        problems.append(f"SLO name {name!r} must be letters, digits, '-', '_' or '.'")
    limits: dict[str, float] = {}
    offset = len(text) - len(body)
    for term in body.split(","):
        where = f"at character {offset + 1}"
        offset += len(term) + 1
        m = _TERM.match(term)
        if not term.strip():
            problems.append(f"empty condition {where}")
            continue
        if not m or not m.group("num"):
            problems.append(f"cannot read condition {term.strip()!r} {where}; expected e.g. tpot<=150ms")
            continue
        ind, op, unit = m.group("ind").lower(), m.group("op"), m.group("unit").lower()
        if ind not in ("tpot", "ttft"):
            problems.append(f"unknown indicator {m.group('ind')!r} {where}; use tpot or ttft")
            continue
        if op not in ("<=", "≤"):
            problems.append(f"{ind} needs '<=' {where} (a limit is met when the value is at or below it)")
            continue
        unit = unit or ("ms" if ind == "tpot" else "s")
        if unit not in _UNITS:
            problems.append(f"unknown unit {unit!r} for {ind} {where}; use ms or s")
            continue
        if ind in limits:
            problems.append(f"{ind} given twice {where}")
            continue
        seconds = float(m.group("num")) * _UNITS[unit]
        if seconds <= 0:
            problems.append(f"{ind} limit must be positive {where}")
            continue
        limits[ind] = seconds * 1000.0 if ind == "tpot" else seconds
    if not limits and not problems:
        problems.append("no condition given; expected tpot<=... and/or ttft<=...")
    if problems:
        raise SloSpecError([Problem(source, None, None, f"slo {name or text!r}", p) for p in problems])
    return Slo(name, tpot_ms=_round(limits.get("tpot")), ttft_s=_round(limits.get("ttft")))


def _round(x: float | None) -> float | None:
    # 0.15 s * 1000 is 150.00000000000003; limits are compared with <=, so keep them exact.
    return None if x is None else round(x, 9)


def slos_from_meta(data: Any, source: str = "meta.json slos") -> list[Slo]:
    """SLOs as an inventory records them: {name: {tpot_ms, ttft_s}}, {name: "tpot<=..,ttft<=.."}
    or a list of {name, tpot_ms, ttft_s}; empty -> the defaults A and B."""
    if not data:
        return list(DEFAULT_SLOS)
    items: Iterable[tuple[str, Any]]
    if isinstance(data, Mapping):
        items = data.items()
    elif isinstance(data, list):
        items = [(str(d.get("name", "")), d) if isinstance(d, Mapping) else ("", d) for d in data]
    else:
        raise SloSpecError([Problem(source, None, None, "slos", f"cannot read SLOs from {data!r}")])
    out, problems = [], []
    for name, spec in items:
        if isinstance(spec, str):
            try:
                out.append(parse_slo(f"{name}:{spec}", source))
            except SloSpecError as exc:
                problems.extend(exc.problems)
            continue
        if not isinstance(spec, Mapping):
            problems.append(Problem(source, None, None, f"slos.{name}", f"cannot read {spec!r}"))
            continue
        try:
            tpot = _first(spec, ("tpot_ms", "tpot_ms_max", "max_tpot_ms", "tpot"))
            ttft = _first(spec, ("ttft_s", "ttft_s_max", "max_ttft_s", "ttft"))
        except (TypeError, ValueError):
            problems.append(Problem(source, None, None, f"slos.{name}", f"limits must be numbers: {dict(spec)!r}"))
            continue
        if tpot is None and ttft is None:
            problems.append(Problem(source, None, None, f"slos.{name}", "neither tpot_ms nor ttft_s given"))
            continue
        out.append(Slo(str(name), tpot_ms=tpot, ttft_s=ttft))
    if problems:
        raise SloSpecError(problems)
    return out


def _first(spec: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    for k in keys:
        if spec.get(k) is not None:
            return float(spec[k])
    return None


def resolve_slos(specs: Sequence[str], known: Sequence[Slo]) -> list[Slo]:
    """`--slo` values: a full spec (`name:tpot<=..`) or the name of a known SLO (`B`, `SLO-B`)."""
    if not specs:
        return list(known)
    out, problems = [], []
    index = {_canon(s.name): s for s in known}
    for spec in specs:
        if ":" in spec:
            try:
                out.append(parse_slo(spec))
            except SloSpecError as exc:
                problems.extend(exc.problems)
        elif _canon(spec) in index:
            out.append(index[_canon(spec)])
        else:
            names = ", ".join(s.name for s in known) or "none"
            problems.append(Problem("--slo", None, None, spec,
                                    f"unknown SLO (known: {names}); or give NAME:tpot<=..ms,ttft<=..s"))
    if problems:
        raise SloSpecError(problems)
    return out


def _canon(name: str) -> str:
    n = name.strip().lower()
    return n[4:] if n.startswith("slo-") or n.startswith("slo_") else n


# ------------------------------------------------------------- crossover


@dataclass(frozen=True)
class LoadPoint:
    """One tested load of one context: streams per VM and the chosen percentile's values."""

    streams_per_vm: int
    tpot_ms: float | None
    ttft_s: float | None
    batch_per_rank: int | None = None


@dataclass(frozen=True)
class Verdict:
    point: LoadPoint
    failing: tuple[str, ...]      # indicators over their limit, in (TPOT, TTFT) order

    @property
    def meets(self) -> bool:
        return not self.failing


def judge(point: LoadPoint, slo: Slo) -> Verdict:
    """Which indicators of `point` are over the SLO's limits (a tie meets the limit)."""
    failing = []
    if slo.tpot_ms is not None and not _within(point.tpot_ms, slo.tpot_ms):
        failing.append(TPOT)
    if slo.ttft_s is not None and not _within(point.ttft_s, slo.ttft_s):
        failing.append(TTFT)
    return Verdict(point, tuple(failing))


def _within(value: float | None, limit: float) -> bool:
    if value is None or not math.isfinite(value):
        raise ValueError("a load point lacks a value the SLO constrains")
    return value <= limit


@dataclass(frozen=True)
class Crossover:
    """The answer for one SLO x context."""

    slo: Slo
    input_tokens: int
    output_tokens: int | None
    percentile: str
    verdicts: tuple[Verdict, ...]
    status: str                   # "crossover" | "none" | "all"
    threshold: int | None         # largest meeting load before the first failure
    first_failing: int | None
    binding: str | None           # "TPOT", "TTFT" or "TPOT and TTFT"
    non_monotonic: tuple[int, ...] = ()   # loads that meet the SLO after a failing one
    scope: str = SINGLE
    notes: tuple[str, ...] = ()

    @property
    def max_tested(self) -> int:
        return self.verdicts[-1].point.streams_per_vm

    @property
    def floor(self) -> Verdict:
        """The lowest tested load: the single-stream floor when it is batch 1 per rank."""
        return self.verdicts[0]

    @property
    def threshold_text(self) -> str:
        if self.status == "none":
            return "not achievable"
        if self.status == "all":
            return f"≥ {self.max_tested}"
        return str(self.threshold)

    def summary(self) -> str:
        return crossover_text(self)


def crossover(points: Sequence[LoadPoint], slo: Slo, input_tokens: int, output_tokens: int | None = None,
              percentile: str = "p50", scope: str = SINGLE, notes: Sequence[str] = ()) -> Crossover:
    """The crossover of one SLO over the tested loads of one context."""
    if not points:
        raise ValueError("crossover needs at least one tested load")
    ordered = sorted(points, key=lambda p: p.streams_per_vm)
    verdicts = tuple(judge(p, slo) for p in ordered)
    first_fail = next((i for i, v in enumerate(verdicts) if not v.meets), None)
    if first_fail is None:
        status, threshold, failing, binding = "all", ordered[-1].streams_per_vm, None, None
    else:
        failing = ordered[first_fail].streams_per_vm
        binding = " and ".join(verdicts[first_fail].failing)
        threshold = ordered[first_fail - 1].streams_per_vm if first_fail > 0 else None
        status = "crossover" if first_fail > 0 else "none"
    after_fail = verdicts[first_fail + 1:] if first_fail is not None else ()
    later_passes = tuple(v.point.streams_per_vm for v in after_fail if v.meets)
    return Crossover(slo, input_tokens, output_tokens, percentile, verdicts, status, threshold, failing,
                     binding, later_passes, scope, tuple(notes))


def crossover_text(c: Crossover) -> str:
    """One paragraph that says the crossover plainly, edge cases included."""
    head = f"{c.slo.describe()}, {c.input_tokens}-token inputs, {c.percentile}"
    floor = c.floor
    floor_name = ("the single-stream floor" if floor.point.batch_per_rank == 1
                  else "the lowest tested load (no batch-1 data)")
    if c.status == "none":
        text = (f"{head}: not achievable in this configuration. Even {floor_name}, "
                f"{floor.point.streams_per_vm} streams/VM, has {_values(floor, c.slo)}; "
                f"{c.binding} binds.")
    elif c.status == "all":
        text = (f"{head}: every tested load meets it, so the threshold is ≥ {c.max_tested} streams/VM "
                f"(the max tested); the true crossover lies above the tested range. "
                f"At {c.max_tested} streams/VM: {_values(c.verdicts[-1], c.slo)}.")
    else:
        fail = next(v for v in c.verdicts if not v.meets)
        text = (f"{head}: meets the SLO up to {c.threshold} streams/VM; the first failing load is "
                f"{c.first_failing} streams/VM ({_values(fail, c.slo)}); {c.binding} binds.")
    if c.non_monotonic:
        loads = ", ".join(str(x) for x in c.non_monotonic)
        text += (f" The results are not monotonic: {loads} streams/VM meet(s) the SLO again after "
                 f"{c.first_failing} failed (noise or an untrustworthy window?); the threshold stays "
                 f"below the first failure.")
    if c.status != "none":
        text += (f" {floor_name[0].upper()}{floor_name[1:]}, {floor.point.streams_per_vm} streams/VM: "
                 f"{_values(floor, c.slo)}.")
    for note in c.notes:
        text += f" {note}"
    return text


def _values(v: Verdict, slo: Slo) -> str:
    parts = []
    if v.point.tpot_ms is not None:
        mark = _mark(v.point.tpot_ms, slo.tpot_ms)
        parts.append(f"TPOT {v.point.tpot_ms:.1f} ms{mark}")
    if v.point.ttft_s is not None:
        mark = _mark(v.point.ttft_s, slo.ttft_s)
        parts.append(f"TTFT {v.point.ttft_s:.2f} s{mark}")
    return ", ".join(parts)


def _mark(value: float, limit: float | None) -> str:
    if limit is None:
        return ""
    return f" {'≤' if value <= limit else '>'} {_num(limit)}"


# ------------------------------------------------------- cells -> crossovers


def contexts(cells: Iterable[Cell]) -> list[tuple[int, int]]:
    """Every (input tokens, output tokens) that has data."""
    return sorted({(c.input_tokens, c.output_tokens) for c in cells if c.has_data})


def load_points(cells: Iterable[Cell], input_tokens: int, output_tokens: int, pct: str = "p50"
                ) -> tuple[list[LoadPoint], str, list[str]]:
    """Load points of one context from single-VM cells (cluster cells when there are none).

    Returns (points, scope used, notes). Two cells at the same streams/VM (e.g. runs
    with different ranks per VM) keep the worse values.
    """
    if pct not in PERCENTILES:
        raise UsageError(f"percentile must be one of {', '.join(PERCENTILES)}, not {pct!r}")
    everything = [c for c in cells if c.input_tokens == input_tokens and c.output_tokens == output_tokens]
    ctx = [c for c in everything if c.has_data]
    scope = SINGLE if any(c.scope == SINGLE for c in ctx) else CLUSTER
    notes = []
    empty = sorted({c.streams_per_vm for c in everything if c.scope == scope and not c.has_data}
                   - {c.streams_per_vm for c in ctx if c.scope == scope})
    if empty:
        notes.append(f"No valid data at {', '.join(map(str, empty))} streams/VM: those loads are not judged.")
    if scope == CLUSTER and ctx:
        notes.append("No single-VM data: read from cluster cells (streams per VM of one cluster VM).")
    by_load: dict[int, list[Cell]] = defaultdict(list)
    for c in ctx:
        if c.scope == scope:
            by_load[c.streams_per_vm].append(c)
    points = []
    for load in sorted(by_load):
        group = by_load[load]
        tpots = [c.tpot_ms.get(pct) for c in group]
        ttfts = [c.ttft_s.get(pct) for c in group]
        if any(v is None for v in tpots + ttfts):
            raise UsageError(f"{pct} values are unknown for {input_tokens}-token inputs at {load} streams/VM "
                             f"(a CSV without {pct} columns, or no TTFT/TPOT measured); try --percentile p50")
        if len(group) > 1:
            notes.append(f"{len(group)} configurations at {load} streams/VM; the worse values are used.")
        points.append(LoadPoint(load, max(tpots), max(ttfts), min(c.batch_per_rank for c in group)))
    return points, scope, notes


def crossovers(cells: Sequence[Cell], slos: Sequence[Slo], pct: str = "p50") -> list[Crossover]:
    """Crossover for every SLO x context with data."""
    out = []
    for slo in slos:
        for inp, outp in contexts(cells):
            points, scope, notes = load_points(cells, inp, outp, pct)
            if points:
                out.append(crossover(points, slo, inp, outp, pct, scope, notes))
    return out


# ---------------------------------------------------------------- sizing


@dataclass(frozen=True)
class Sizing:
    """How many nodes a peak load needs under one SLO and context."""

    crossover: Crossover
    peak_streams: int
    headroom: float
    effective_threshold: float | None
    nodes: int | None
    reasoning: str

    def to_dict(self) -> dict[str, Any]:
        c = self.crossover
        return {
            "slo": c.slo.to_dict(), "input_tokens": c.input_tokens, "output_tokens": c.output_tokens,
            "percentile": c.percentile, "scope": c.scope, "status": c.status,
            "threshold_streams_per_vm": c.threshold, "threshold_is_lower_bound": c.status == "all",
            "first_failing_streams_per_vm": c.first_failing, "binding": c.binding,
            "non_monotonic_loads": list(c.non_monotonic), "peak_streams": self.peak_streams,
            "headroom": self.headroom, "effective_threshold": self.effective_threshold,
            "nodes": self.nodes, "reasoning": self.reasoning, "crossover": c.summary(),
        }


def nodes_required(peak_streams: int, threshold: int, headroom: float = 0.0) -> int:
    """The sizing law: ceil(peak / (threshold x (1 - headroom))), computed exactly."""
    _check_sizing_inputs(peak_streams, headroom)
    if threshold <= 0:
        raise ValueError("threshold must be positive")
    effective = Fraction(threshold) * (1 - Fraction(str(headroom)))
    return math.ceil(Fraction(peak_streams) / effective)


def _check_sizing_inputs(peak_streams: int, headroom: float) -> None:
    if peak_streams <= 0:
        raise UsageError(f"peak streams must be a positive whole number, not {peak_streams}")
    if not 0 <= headroom < 1:
        raise UsageError(f"headroom must be in [0, 1), e.g. 0.1 for 10%, not {headroom}")


def size(c: Crossover, peak_streams: int, headroom: float = 0.0) -> Sizing:
    """Nodes for `peak_streams` under crossover `c`, with the reasoning as text."""
    _check_sizing_inputs(peak_streams, headroom)
    head = f"{c.slo.describe()}, {c.input_tokens}-token inputs, {c.percentile}"
    if c.status == "none":
        floor = c.floor
        reasoning = (f"{head}: no node count suffices. The SLO is not achievable in this configuration: "
                     f"the lowest tested load ({floor.point.streams_per_vm} streams/VM) already has "
                     f"{_values(floor, c.slo)}. Adding nodes adds capacity, not per-user speed.")
        return Sizing(c, peak_streams, headroom, None, None, reasoning)
    threshold = c.threshold
    assert threshold is not None
    nodes = nodes_required(peak_streams, threshold, headroom)
    effective = float(Fraction(threshold) * (1 - Fraction(str(headroom))))
    lines = [f"{head}: one VM meets the SLO up to {threshold} streams"
             + (" (every tested load met it, so the true threshold may be higher and this node count "
                "is an upper bound)" if c.status == "all" else
                f"; {c.first_failing} streams/VM fails on {c.binding}") + "."]
    if c.non_monotonic:
        lines.append(f"Non-monotonic data: {', '.join(map(str, c.non_monotonic))} streams/VM passed again after "
                     f"{c.first_failing} failed; the threshold below the first failure is used.")
    if headroom:
        lines.append(f"Headroom {headroom:.0%}: plan {threshold} × (1 − {headroom:g}) = {effective:g} streams per VM.")
    lines.append(f"Nodes = ceil({peak_streams} / {effective:g}) = ceil({peak_streams / effective:.2f}) = {nodes}.")
    lines.append("Per-rank latency does not change with scale-out, so each added node adds the same capacity.")
    if c.scope == CLUSTER:
        lines.append(f"(Threshold read from {SCOPE_TITLES[CLUSTER]} cells: no single-VM data.)")
    return Sizing(c, peak_streams, headroom, effective, nodes, " ".join(lines))
