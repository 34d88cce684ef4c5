"""Serving split by prompt length, and the prefix cache (pure).

A workload's requests vary in length (vcfslm.serving.workloads), and a series' tails pool short
prompts with long ones: a load whose p90 TTFT meets the SLO may still fail most of its
longest prompts. Here a series' loads are split into the prompt-length buckets of
`vcfslm.serving.workloads.length_bucket`: per bucket the finished requests, their p50 and p90 TTFT
and TPOT, and per SLO the share of them that met every limit at once. Records carry
per-request lengths only for finished requests, so unfinished ones cannot be put in a
bucket: they are counted apart (they met no SLO, whatever their length).

The loads split: every load of the series when it has few, else the loads its thresholds
are read at (each SLO's threshold load and first failing load).

The prefix cache: where a server reports what its cache held (`request_cached_tokens`,
vLLM's usage details), the share of prompt tokens served from it. vcfslm's engine has no
prefix cache, so a multi-turn workload on it prefills each turn's history again.

Duck-typed on analysis/serve.py's points and thresholds (`key`, `load`, `has_data`,
`result.windows`, `slo`, `passing`, `failing`), so it imports nothing of that module and
that module may call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vcfslm.analysis.cells import finite
from vcfslm.serving import decisions as serving
from vcfslm.serving import judging
from vcfslm.serving.workloads import bucket_order, length_bucket

# A series with at most this many loads is split at every load: a table that short hides nothing.
FEW_LOADS = 4
# The server whose records say nothing of a prefix cache because it has none.
ENGINE = "vcfslm"
HISTORY_NOTE = ("vcfslm's engine has no prefix cache: each turn's history is prefilled again, so its TTFT "
                "grows with the conversation; a server with one (vLLM's prefix caching) reuses the history")
# The same in a table cell beside the answer.
HISTORY_BRIEF = "vcfslm's engine has no prefix cache: each turn's history prefilled again"


@dataclass(frozen=True)
class LengthBucket:
    """The finished requests of one prompt-length bucket at one load."""

    label: str                        # length_bucket's label, e.g. "256–1023"
    requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    meets: Mapping[str, float]        # SLO name -> share of the bucket's requests within every limit
    prompt_tokens: int
    cached_tokens: int | None = None  # None: the server did not say what its cache held

    @property
    def cached_share(self) -> float | None:
        return share_of(self.cached_tokens, self.prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"bucket": self.label, "requests": self.requests, "ttft_p50_s": finite(self.ttft_p50_s),
                "ttft_p90_s": finite(self.ttft_p90_s), "tpot_p50_ms": finite(self.tpot_p50_ms),
                "tpot_p90_ms": finite(self.tpot_p90_ms), "meets": dict(self.meets),
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "cached_share": self.cached_share}


@dataclass(frozen=True)
class LengthSplit:
    """One load split by prompt length: its buckets (shortest first) and the unfinished requests,
    which no bucket can hold."""

    load: float                       # per rank (or at the endpoint), as the series' points
    buckets: tuple[LengthBucket, ...]
    unfinished: int
    roles: tuple[str, ...] = ()       # what the answer reads here: "SLO-A threshold", "SLO-B first failing"

    @property
    def cached_share(self) -> float | None:
        known = [b for b in self.buckets if b.cached_tokens is not None]
        if not known:
            return None
        return share_of(sum(b.cached_tokens or 0 for b in known), sum(b.prompt_tokens for b in known))

    def to_dict(self) -> dict[str, Any]:
        return {"load": self.load, "roles": list(self.roles), "unfinished": self.unfinished,
                "cached_share": self.cached_share, "buckets": [b.to_dict() for b in self.buckets]}


@dataclass(frozen=True, eq=False)
class SeriesLengths:
    """A serving series' loads split by prompt length, with what to say beside them."""

    key: Any                          # the series' ServeKey
    splits: tuple[LengthSplit, ...]
    every_load: bool = True           # False: only the loads its thresholds read
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """Its loads and notes (the series' key is the caller's to add)."""
        return {"every_load": self.every_load, "loads": [s.to_dict() for s in self.splits],
                "notes": list(self.notes)}



def share_of(part: int | None, whole: int) -> float | None:
    return None if part is None or whole <= 0 else part / whole


def _valid(records: Iterable[Any]) -> list[Any]:
    return [r for r in records if r.valid]


def _cached_of(r: Any) -> list[int | None]:
    """A record's cached tokens per finished request; None each where its server did not say."""
    cached = list(getattr(r, "request_cached_tokens", None) or ())
    return cached if len(cached) == len(r.ttft_s) else [None] * len(r.ttft_s)


def length_split(records: Iterable[Any], slos: Sequence[Any], load: float, roles: Sequence[str] = ()
                 ) -> LengthSplit:
    """The valid windows of one load (ServeRecords) split by prompt length (pure)."""
    valid = _valid(records)
    grouped: dict[str, list[tuple[int, float, float, int | None]]] = {}
    for r in valid:
        for prompt, ttft, tpot, cached in zip(r.request_input_tokens, r.ttft_s, r.tpot_ms, _cached_of(r),
                                              strict=True):
            grouped.setdefault(length_bucket(prompt), []).append((prompt, ttft, tpot, cached))
    buckets = tuple(bucket_of(label, grouped[label], slos) for label in sorted(grouped, key=bucket_order))
    return LengthSplit(float(load), buckets, sum(r.unfinished for r in valid), tuple(roles))


def bucket_of(label: str, requests: Sequence[tuple[int, float, float, int | None]], slos: Sequence[Any]
              ) -> LengthBucket:
    """One bucket's figures from its (prompt tokens, TTFT s, TPOT ms, cached tokens) requests."""
    ttft = [t for _, t, _, _ in requests]
    tpot = [p for _, _, p, _ in requests]
    pct = serving.SERVE_PERCENTILE
    meets = {s.name: judging.attainment(ttft, tpot, 0, s.tpot_ms, s.ttft_s, input_tokens=[n for n, *_ in requests],
                                         ttft_per_token_ms=s.ttft_per_token_ms).share for s in slos}
    cached = [c for *_, c in requests]
    known = None if any(c is None for c in cached) else sum(c or 0 for c in cached)
    return LengthBucket(label, len(requests), serving.tail(ttft, 0, 50), serving.tail(ttft, 0, pct),
                        serving.tail(tpot, 0, 50), serving.tail(tpot, 0, pct), meets,
                        sum(n for n, *_ in requests), known)


def cached_share(records: Iterable[Any]) -> float | None:
    """Prompt tokens served from the server's prefix cache over the prompt tokens sent, over the
    valid windows whose server said (None: none did)."""
    said = [r for r in _valid(records) if r.request_cached_tokens and len(r.request_cached_tokens) == len(r.ttft_s)]
    if not said:
        return None
    return share_of(sum(sum(r.request_cached_tokens) for r in said), sum(sum(r.request_input_tokens) for r in said))


def varied_lengths(records: Iterable[Any]) -> bool:
    """Did the requests differ in prompt length (a workload, or lengths drawn per request)?"""
    return len({n for r in _valid(records) for n in r.request_input_tokens}) > 1


def carries_history(records: Iterable[Any]) -> bool:
    """Did some request carry its conversation's earlier turns (a multi-turn workload)?"""
    return any(n > 0 for r in records for n in (getattr(r, "request_prefix_tokens", None) or ()))


def history_note(server: str, records: Iterable[Any]) -> str:
    """The note beside a multi-turn workload served by vcfslm's engine, which reuses no history; ""
    for any other series (a server that caches says so in its cached tokens)."""
    return HISTORY_NOTE if server == ENGINE and carries_history(records) else ""


def load_roles(thresholds: Sequence[Any]) -> dict[float, list[str]]:
    """Per load, the thresholds read there: `SLO-A threshold`, `SLO-B first failing`."""
    roles: dict[float, list[str]] = {}
    for t in thresholds:
        for load, what in ((t.passing, "threshold"), (t.failing, "first failing")):
            if load is not None:
                roles.setdefault(float(load), []).append(f"{t.slo.title} {what}")
    return roles


def split_loads(loads: Sequence[float], roles: Mapping[float, Sequence[str]]) -> list[float]:
    """The loads a series is split at: all of them when few, else those its thresholds read
    (all again when no threshold reads any)."""
    if len(loads) <= FEW_LOADS:
        return sorted(loads)
    read = sorted(load for load in loads if roles.get(load))
    return read or sorted(loads)


def _records(points: Sequence[Any]) -> list[Any]:
    return [r for p in points if p.result is not None for r in p.result.windows]


def wants_split(key: Any, points: Sequence[Any]) -> bool:
    """A series is split by length when it ran a workload or its prompts differed in length."""
    return bool(getattr(key, "workload", "")) or varied_lengths(_records(points))


def series_lengths(series: Mapping[Any, Sequence[Any]], thresholds: Sequence[Any], slos: Sequence[Any]
                   ) -> list[SeriesLengths]:
    """Every series (key -> its points) that ran a workload or varied its prompt lengths, split
    at its chosen loads; `thresholds`: every series x SLO (each series reads its own)."""
    out = []
    for key, points in series.items():
        judged = [p for p in points if p.has_data]
        if not judged or not wants_split(key, judged):
            continue
        roles = load_roles([t for t in thresholds if t.key == key])
        chosen = split_loads([p.load for p in judged], roles)
        splits = tuple(length_split(p.result.windows, slos, p.load, roles.get(p.load, ()))
                       for p in judged if p.load in chosen)
        note = history_note(key.server, _records(judged))
        out.append(SeriesLengths(key, splits, len(splits) == len(judged), (note,) if note else ()))
    return out
