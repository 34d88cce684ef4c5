"""What an SLO is (pure): its limits (TTFT, TPOT, TTFT per prompt token, an optional
percentile of its own), its name, the `--slo` text it is parsed from, the form a run's
meta.json keeps it in, and which of the known SLOs a user's names pick."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vcfslm import contract
from vcfslm.analysis.cells import (
    PERCENTILES,
)
from vcfslm.errors import Problem, SloSpecError


@dataclass(frozen=True)
class Slo:
    """A latency commitment; a limit of None means the indicator is not constrained."""

    name: str
    tpot_ms: float | None = None
    ttft_s: float | None = None
    percentile: str | None = None     # its own percentile (e.g. MLPerf's p99); None: the rule's
    # The TTFT limit grows by this many ms per prompt token (`ttft<=2s+1ms/tok`): a long
    # prompt's prefill is allowed its time. None: one TTFT limit for every prompt.
    ttft_per_token_ms: float | None = None

    def ttft_limit(self, input_tokens: int) -> float | None:
        """The TTFT limit of a request with this prompt."""
        if not self.ttft_per_token_ms:
            return self.ttft_s
        return (self.ttft_s or 0.0) + self.ttft_per_token_ms / 1000.0 * input_tokens

    @property
    def title(self) -> str:
        return self.name if self.name.upper().startswith("SLO") else f"SLO-{self.name}"

    def describe(self) -> str:
        parts = []
        if self.tpot_ms is not None:
            parts.append(f"TPOT ≤ {_num(self.tpot_ms)} ms")
        if self.ttft_per_token_ms:
            parts.append(f"TTFT ≤ {_num(self.ttft_s or 0.0)} s + {_num(self.ttft_per_token_ms)} ms/prompt token")
        elif self.ttft_s is not None:
            parts.append(f"TTFT ≤ {_num(self.ttft_s)} s")
        if self.percentile:
            parts.append(f"at {self.percentile}")
        return f"{self.title} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "tpot_ms": self.tpot_ms, "ttft_s": self.ttft_s}
        if self.ttft_per_token_ms:
            out["ttft_per_token_ms"] = self.ttft_per_token_ms
        if self.percentile:
            out["percentile"] = self.percentile
        return out

    def limits(self) -> dict[str, Any]:
        """What the serving worker and meta.json keep of it: {tpot_ms, ttft_s[, percentile]}."""
        return {k: v for k, v in self.to_dict().items() if k != "name"}


DEFAULT_SLOS: tuple[Slo, ...] = tuple(Slo(name, **limits) for name, limits in contract.DEFAULT_SLOS.items())
PRESETS: dict[str, Slo] = {name: Slo(name, float(p["tpot_ms"]), float(p["ttft_s"]), p.get("percentile"))
                           for name, p in contract.SLO_PRESETS.items()}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TERM = re.compile(r"^\s*(?P<ind>[A-Za-z]+)\s*(?P<op><=|≤|<|>=|=)?\s*(?P<num>[0-9]*\.?[0-9]+)?\s*(?P<unit>[A-Za-z]*)\s*"
                   r"(?:\+\s*(?P<per>[0-9]*\.?[0-9]+)\s*(?P<per_unit>ms|s)\s*/\s*tok(?:en)?s?\s*)?$")
_UNITS = {"ms": 1e-3, "s": 1.0}


def _num(x: float) -> str:
    return f"{x:g}"


def parse_slo(text: str, source: str = "--slo") -> Slo:
    """Parse `name:tpot<=150ms,ttft<=2s[,p99]` (units ms or s; tpot defaults to ms, ttft to s;
    a percentile term makes the SLO judged at it instead of the rule's).

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
    limits: dict[str, Any] = {}
    offset = len(text) - len(body)
    for term in body.split(","):
        where = f"at character {offset + 1}"
        offset += len(term) + 1
        m = _TERM.match(term)
        if not term.strip():
            problems.append(f"empty condition {where}")
            continue
        if term.strip().lower() in PERCENTILES:
            if "percentile" in limits:
                problems.append(f"percentile given twice {where}")
            limits["percentile"] = term.strip().lower()
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
        if m.group("per") is not None:
            if ind != "ttft":
                problems.append(f"only ttft may grow per prompt token {where} (ttft<=2s+1ms/tok)")
                continue
            per_ms = float(m.group("per")) * _UNITS[m.group("per_unit")] * 1000.0
            if per_ms <= 0:
                problems.append(f"a per-token TTFT allowance must be positive {where}")
                continue
            limits["ttft_per_token"] = per_ms
        seconds = float(m.group("num")) * _UNITS[unit]
        if seconds <= 0:
            problems.append(f"{ind} limit must be positive {where}")
            continue
        limits[ind] = seconds * 1000.0 if ind == "tpot" else seconds
    if not (limits.keys() & {"tpot", "ttft"}) and not problems:
        problems.append("no condition given; expected tpot<=... and/or ttft<=...")
    if problems:
        raise SloSpecError([Problem(source, None, None, f"slo {name or text!r}", p) for p in problems])
    return Slo(name, tpot_ms=_round(limits.get("tpot")), ttft_s=_round(limits.get("ttft")),
               percentile=limits.get("percentile"), ttft_per_token_ms=_round(limits.get("ttft_per_token")))


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
        pct = spec.get("percentile")
        if pct is not None and pct not in PERCENTILES:
            problems.append(Problem(source, None, None, f"slos.{name}.percentile",
                                    f"must be one of {', '.join(PERCENTILES)}, not {pct!r}"))
            continue
        per_token = spec.get("ttft_per_token_ms")
        if per_token is not None and (isinstance(per_token, bool) or not isinstance(per_token, int | float)
                                      or per_token <= 0):
            problems.append(Problem(source, None, None, f"slos.{name}.ttft_per_token_ms",
                                    f"must be a positive number of ms, not {per_token!r}"))
            continue
        out.append(Slo(str(name), tpot_ms=tpot, ttft_s=ttft, percentile=pct,
                       ttft_per_token_ms=float(per_token) if per_token is not None else None))
    if problems:
        raise SloSpecError(problems)
    return out


def _first(spec: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    for k in keys:
        if spec.get(k) is not None:
            return float(spec[k])
    return None


def resolve_slos(specs: Sequence[str], known: Sequence[Slo]) -> list[Slo]:
    """`--slo` values: a full spec (`name:tpot<=..`), the name of a known SLO (`B`, `SLO-B`)
    or of a preset (`mlperf-server`; the run's own SLO of that name wins)."""
    if not specs:
        return list(known)
    out, problems = [], []
    index = {_canon(s.name): s for s in PRESETS.values()} | {_canon(s.name): s for s in known}
    for spec in specs:
        if ":" in spec:
            try:
                out.append(parse_slo(spec))
            except SloSpecError as exc:
                problems.extend(exc.problems)
        elif _canon(spec) in index:
            out.append(index[_canon(spec)])
        else:
            names = ", ".join(dict.fromkeys([s.name for s in known] + list(PRESETS))) or "none"
            problems.append(Problem("--slo", None, None, spec,
                                    f"unknown SLO (known: {names}); or give NAME:tpot<=..ms,ttft<=..s"))
    if problems:
        raise SloSpecError(problems)
    return out


def _canon(name: str) -> str:
    n = name.strip().lower()
    return n[4:] if n.startswith("slo-") or n.startswith("slo_") else n
