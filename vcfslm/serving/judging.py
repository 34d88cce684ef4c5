"""The one rule that says whether a load meets an SLO, and how sure that answer is (pure).

Shared by the rank worker (the serving sweep decides with it inside the run) and the
analysis (the answer table, the serving section, `size`, the report), so a threshold
read off a report is the one the sweep bisected towards.

How a load is judged:
- Static windows: every stream of one batch starts and stops together, so the streams
  of a window share its times. A static load meets an SLO when the chosen percentile
  (default p90; the brief's p50 by name) of its pooled per-stream TPOT and of its
  pooled per-stream TTFT are each within their limit.
- Serving: every request has its own times. A serving load meets an SLO when at least
  the stated share (the attainment, default 90 %) of its counted requests met *every*
  limit at once (DistServe's attainment, vLLM's `--goodput`, MLPerf). A request still
  unfinished at the window's cutoff met none.
- A value at its limit meets it (<=).
- An SLO may carry its own percentile (MLPerf's limits are p99): then static cells are
  judged at it and serving loads at that share.
- Too few samples: a percentile q, or an attainment q, judged on fewer than
  `min_samples(q)` values (5 / (1 - q): 50 for p90, 500 for p99) is flagged.

The threshold over ascending loads is the largest passing load before the first failing
one (a later pass is noise, and the conservative reading keeps below the first failure).
Sizing: nodes = ceil(peak / (threshold x (1 - headroom))), exactly.

Confidence: a bootstrap resampled the way the data was drawn. Windows are drawn with
replacement within each rank (a rank's windows are its repeats); for serving, each drawn
window's requests are drawn again with replacement (two stages). Each replicate is judged
by the same rule and says where the threshold lies: at or above its largest passing load
and below its first failing load (an untested load in that gap may pass or fail). The
interval covers both: its low end is the lower `(1 - confidence) / 2` quantile of the
replicates' thresholds, its high end the upper quantile of their first failing loads,
exclusive (`[4–<16]`: at least 4, below 16). A replicate that passed every load has no
failing load: its end is the largest load as a bound (`≥ 16`). Node counts follow from
the interval's ends by the sizing law (`nodes_of`; an exclusive end F gives at least
floor(peak / F) + 1 nodes). Seeded, so a report is repeatable and every rank of a sweep
reaches the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

PERCENTILES = ("p50", "p90", "p99")
DEFAULT_PERCENTILE = "p90"
DEFAULT_ATTAINMENT = 0.90
DEFAULT_CONFIDENCE = 0.95
REPLICATES = 400
TPOT, TTFT = "TPOT", "TTFT"
# The rule a run was judged by before attainment existed: the p90 of TTFT and the p90
# of TPOT, each on its own, for serving; p50 for static cells.
LEGACY_SERVING_RULE = "p90 TTFT and p90 TPOT, each on its own"


def percentile_value(name: str) -> float:
    """`p90` -> 90.0 (ValueError names the known ones)."""
    if name not in PERCENTILES:
        raise ValueError(f"percentile must be one of {', '.join(PERCENTILES)}, not {name!r}")
    return float(name[1:])


def min_samples(share: float) -> int:
    """Fewest values a percentile or attainment at `share` (0..1) needs to be trusted: 5 / (1 - share).

    At the 90th percentile only one value in ten lies above it; with fewer than ~5 of
    those the estimate is one or two requests' worth of noise."""
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), not {share}")
    return math.ceil(5.0 / (1.0 - share) - 1e-9)


@dataclass(frozen=True)
class Rule:
    """How loads are judged: static percentile, serving attainment, interval confidence."""

    percentile: str = DEFAULT_PERCENTILE
    attainment: float = DEFAULT_ATTAINMENT
    confidence: float = DEFAULT_CONFIDENCE
    replicates: int = REPLICATES
    seed: int = 0

    def __post_init__(self):
        percentile_value(self.percentile)
        if not 0 < self.attainment < 1:
            raise ValueError(f"attainment must be a share in (0, 1), e.g. 0.9, not {self.attainment}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), not {self.confidence}")
        if self.replicates < 0:
            raise ValueError("replicates must not be negative")

    def percentile_for(self, slo_percentile: str | None = None) -> str:
        """The static percentile an SLO is judged at: its own when it carries one."""
        return slo_percentile or self.percentile

    def attainment_for(self, slo_percentile: str | None = None) -> float:
        """The serving share an SLO is judged at: its own percentile as a share when it carries one."""
        return percentile_value(slo_percentile) / 100.0 if slo_percentile else self.attainment

    def static_text(self, slo_percentile: str | None = None) -> str:
        return f"{self.percentile_for(slo_percentile)} of streams"

    def serving_text(self, slo_percentile: str | None = None) -> str:
        return f"{attainment_text(self.attainment_for(slo_percentile))} of requests meet every limit"


def attainment_text(share: float) -> str:
    return f"{share * 100:.4g} %"


# ------------------------------------------------------------------ one load


def within(value: float | None, limit: float | None) -> bool:
    """A limit of None constrains nothing; a value at the limit meets it."""
    return limit is None or (value is not None and not math.isnan(value) and value <= limit)


def static_failing(tpot_ms: float | None, ttft_s: float | None, limit_tpot_ms: float | None,
                   limit_ttft_s: float | None) -> tuple[str, ...]:
    """Which indicators of a static load (its percentile values) are over their limits, TPOT first."""
    out = []
    for name, value, limit in ((TPOT, tpot_ms, limit_tpot_ms), (TTFT, ttft_s, limit_ttft_s)):
        if limit is None:
            continue
        if value is None or not math.isfinite(value):
            raise ValueError(f"a load lacks the {name} value the SLO constrains")
        if value > limit:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class Attainment:
    """How the counted requests of one load fared against one SLO's limits."""

    requests: int            # counted: finished + unfinished
    good: int                # met every limit at once
    tpot_good: int           # met the TPOT limit (finished requests only)
    ttft_good: int           # met the TTFT limit

    @property
    def share(self) -> float:
        return self.good / self.requests if self.requests else math.nan

    def binding(self, share: float) -> str:
        """The limits that keep the load below `share`: each on its own, else both together."""
        if not self.requests:
            return ""
        over = [name for name, g in ((TPOT, self.tpot_good), (TTFT, self.ttft_good))
                if g / self.requests < share]
        if over:
            return " and ".join(over)
        return "TPOT and TTFT together"


def attainment(ttft_s: Sequence[float], tpot_ms: Sequence[float], unfinished: int,
               limit_tpot_ms: float | None, limit_ttft_s: float | None, *,
               input_tokens: Sequence[int] = (), ttft_per_token_ms: float | None = None) -> Attainment:
    """Attainment of the finished requests' (ttft, tpot) pairs plus `unfinished` that met nothing.

    With `ttft_per_token_ms` each request's TTFT limit grows with its prompt: `limit_ttft_s`
    plus that many ms per prompt token (`input_tokens`, one per request), as prefill does."""
    good = tpot_good = ttft_good = 0
    limits = ttft_limits(limit_ttft_s, ttft_per_token_ms, input_tokens, len(ttft_s))
    for f, p, lf in zip(ttft_s, tpot_ms, limits, strict=True):
        ok_p, ok_f = within(p, limit_tpot_ms), within(f, lf)
        tpot_good += ok_p
        ttft_good += ok_f
        good += ok_p and ok_f
    return Attainment(len(ttft_s) + unfinished, good, tpot_good, ttft_good)


def ttft_limits(limit_ttft_s: float | None, ttft_per_token_ms: float | None, input_tokens: Sequence[int],
                count: int) -> list[float | None]:
    """Each of `count` requests' TTFT limit: the fixed one, or grown by its prompt's tokens."""
    if not ttft_per_token_ms:
        return [limit_ttft_s] * count
    if len(input_tokens) != count:
        raise ValueError(f"a TTFT limit per prompt token needs each request's prompt length: "
                         f"{len(input_tokens)} lengths for {count} requests")
    return [(limit_ttft_s or 0.0) + ttft_per_token_ms / 1000.0 * n for n in input_tokens]


def attains(a: Attainment, share: float) -> bool | None:
    """Does the load meet the SLO at `share`? None: no request to judge."""
    if a.requests == 0:
        return None
    # Counted exactly: 9 of 10 good meets 90 % (a float share could fall a hair short).
    return Fraction(a.good, a.requests) >= Fraction(str(share))


def few_samples(counts: Mapping[str, int], share: float, what: str) -> str | None:
    """One flag for the loads (name -> values judged) too thin for a percentile or attainment at
    `share`, e.g. `p90 judged on fewer than 50 streams at 4 (8), 16 (32) streams/VM`; None: all enough."""
    need = min_samples(share)
    thin = [f"{load} ({n})" for load, n in counts.items() if n < need]
    if not thin:
        return None
    return f"judged on fewer than {need} {what} at {', '.join(thin)}"


# ------------------------------------------------------------------ over loads


def threshold(verdicts: Mapping[float, bool | None]) -> tuple[float | None, float | None]:
    """(largest passing load below the first failing one, that first failing load).

    Loads are taken ascending and the first failure ends the search, even if a higher
    load passes again. Loads without a verdict are ignored."""
    passing = failing = None
    for load in sorted(verdicts):
        verdict = verdicts[load]
        if verdict is None:
            continue
        if not verdict:
            failing = load
            break
        passing = load
    return passing, failing


def nodes_required(peak: float, per_vm: float, headroom: float = 0.0) -> int:
    """The sizing law: ceil(peak / (per-VM threshold x (1 - headroom))), computed exactly."""
    if not peak > 0:
        raise ValueError(f"peak must be positive, not {peak}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), not {headroom}")
    if not per_vm > 0:
        raise ValueError("threshold must be positive")
    effective = Fraction(str(per_vm)) * (1 - Fraction(str(headroom)))
    return math.ceil(Fraction(str(peak)) / effective)


# ------------------------------------------------------------------ intervals


@dataclass(frozen=True)
class Interval:
    """The central `confidence` share of a bootstrapped threshold (or node count).

    low/high None: that end is "none" (the replicate failed even the lowest load: no
    threshold, no node count). An end that is a bound (every tested load passed in
    that replicate) is flagged, so a threshold reads "≥ 8" and a node count "≤ 4".
    high_open: the high end is a first failing load, exclusive: the threshold is below it
    (`<16`); it is never a bound at the same time."""

    low: float | None
    high: float | None
    low_bound: bool = False
    high_bound: bool = False
    replicates: int = 0
    confidence: float = DEFAULT_CONFIDENCE
    high_open: bool = False

    def text(self, fmt=lambda v: f"{v:g}", none: str = "none", mark: str = "≥ ") -> str:
        """`[4–<8]`, `[none–<4]`, `[8–≥ 16]` (mark "≤ " for node counts), `[32–64]` for inclusive
        ends; "none" or a bound at both ends says nothing more: ""."""
        if self.low == self.high and (self.low is None or (self.low_bound and self.high_bound)):
            return ""
        def end(v, bound, open_=False):
            return none if v is None else ("<" if open_ else mark if bound else "") + fmt(v)
        return f"[{end(self.low, self.low_bound)}–{end(self.high, self.high_bound, self.high_open)}]"

    def to_dict(self) -> dict[str, Any]:
        # "high" is the first failing load when high_is_exclusive (the threshold is below it).
        return {"low": self.low, "high": self.high, "low_is_lower_bound": self.low_bound,
                "high_is_lower_bound": self.high_bound, "high_is_exclusive": self.high_open,
                "replicates": self.replicates, "confidence": self.confidence}


@dataclass(frozen=True)
class Replicate:
    """One bootstrap replicate's reading: its threshold (None: none passes), whether it
    passed every tested load (so the threshold is a lower bound), and its first failing
    load (None: every load passed, or not known): the threshold lies in [threshold, failing)."""

    threshold: float | None
    all_pass: bool
    failing: float | None = None


def replicate_of(verdicts: Mapping[float, bool | None]) -> Replicate | None:
    """The threshold reading of one replicate's verdicts (None: nothing judged)."""
    passing, failing = threshold(verdicts)
    if passing is None and failing is None:
        return None
    return Replicate(passing, failing is None, failing)


def _upper(r: Replicate) -> tuple[tuple[int, float], float | None, bool, bool]:
    """Where a replicate's threshold ends above, as (sort key, value, is a bound, is exclusive):
    none (it failed the lowest load) lowest, then its first failing load (exclusive), or its
    threshold when no failing load is known; an all-pass replicate's threshold (a bound) highest."""
    if r.threshold is None:
        return (0, -math.inf), None, False, False
    if r.all_pass:
        return (2, r.threshold), r.threshold, True, False
    if r.failing is not None:
        return (1, r.failing), r.failing, False, True
    return (1, r.threshold), r.threshold, False, False


def interval(replicates: Sequence[Replicate], confidence: float = DEFAULT_CONFIDENCE) -> Interval | None:
    """Where the threshold lies, `confidence` sure: from the lower quantile of the replicates'
    thresholds ("none" below every load) to the upper quantile of their first failing loads
    (exclusive), so the interval covers the gap between tested loads as well as the sampling."""
    reps = [r for r in replicates if r is not None]
    if not reps:
        return None
    lo, hi = _ends(len(reps), confidence)
    # None sorts below every load; an all-pass replicate at the same load ranks above a
    # replicate that failed just above it (its true threshold may be higher).
    lows = sorted(reps, key=lambda r: (-math.inf if r.threshold is None else r.threshold, r.all_pass))
    a = lows[lo]
    _key, high, high_bound, high_open = sorted((_upper(r) for r in reps), key=lambda u: u[0])[hi]
    return Interval(a.threshold, high, a.all_pass, high_bound, len(reps), confidence, high_open)


def nodes_of(iv: Interval, peak: float, headroom: float = 0.0) -> Interval:
    """The node counts a threshold interval (per-VM capacity) implies by the sizing law.

    Its low threshold gives the most nodes (an upper bound "≤" when that end is a bound;
    None, no count suffices, when it is "none"); its high end the fewest: an exclusive end F
    (the threshold is below F) gives floor(peak / (F x (1 - headroom))) + 1, a bound "≥ H"
    gives "≤ ceil(peak / H')", an inclusive end ceil(peak / H'). Node counts are whole: both
    ends are inclusive."""
    def most(v):
        return nodes_required(peak, v, headroom) if v is not None and v > 0 else None

    if iv.high is None or not iv.high > 0:
        fewest = None
    elif iv.high_open:
        if not peak > 0:
            raise ValueError(f"peak must be positive, not {peak}")
        effective = Fraction(str(iv.high)) * (1 - Fraction(str(headroom)))
        fewest = math.floor(Fraction(str(peak)) / effective) + 1
    else:
        fewest = most(iv.high)
    return Interval(fewest, most(iv.low), iv.high_bound, iv.low_bound, iv.replicates, iv.confidence)


def nodes_interval(replicates: Sequence[Replicate], peak: float, headroom: float = 0.0,
                   confidence: float = DEFAULT_CONFIDENCE) -> Interval | None:
    """The node counts the replicates' threshold interval implies (`nodes_of`); the replicates
    read in per-VM capacity (e.g. streams per VM at their threshold and failing loads)."""
    iv = interval(replicates, confidence)
    return None if iv is None else nodes_of(iv, peak, headroom)


def _ends(n: int, confidence: float) -> tuple[int, int]:
    """Indices of the lower and upper ends of the central `confidence` share of n sorted values."""
    alpha = (1.0 - confidence) / 2.0
    lo = max(0, math.ceil(alpha * n) - 1)
    hi = min(n - 1, math.ceil((1.0 - alpha) * n) - 1)
    return lo, hi


# ------------------------------------------------------------------ resampling


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def static_replicates(loads: Mapping[float, Sequence[Sequence[tuple[Sequence[float], Sequence[float]]]]],
                      limits: Sequence[tuple[float | None, float | None]], pct: str, replicates: int = REPLICATES,
                      seed: int = 0) -> list[list[Replicate | None]]:
    """Bootstrap replicates of a static crossover, per limit pair (tpot_ms, ttft_s).

    loads: per load (streams per VM), its strata (ranks), each a list of windows, each
    window (per-stream TTFT s, per-stream TPOT ms). Every replicate draws each stratum's
    windows again with replacement and judges the pooled streams at `pct`; the same
    draws serve every limit pair (common random numbers)."""
    import numpy as np

    q = percentile_value(pct)
    rng = _rng(seed)
    draws: dict[float, tuple[np.ndarray, np.ndarray]] = {}
    for load, strata in loads.items():
        ttft_rows, tpot_rows = [], []
        for windows in strata:
            if not windows:
                continue
            pick = rng.integers(0, len(windows), size=(replicates, len(windows)))
            ttft_rows.append(_gather([w[0] for w in windows], pick))
            tpot_rows.append(_gather([w[1] for w in windows], pick))
        if not ttft_rows:
            continue
        ttft = np.concatenate(ttft_rows, axis=1)
        tpot = np.concatenate(tpot_rows, axis=1)
        draws[load] = (_row_percentile(ttft, q), _row_percentile(tpot, q))
    out = []
    for limit_tpot, limit_ttft in limits:
        reps = []
        for i in range(replicates):
            verdicts = {load: bool(within(tp[i], limit_tpot) and within(tf[i], limit_ttft))
                        for load, (tf, tp) in draws.items()}
            reps.append(replicate_of(verdicts))
        out.append(reps)
    return out


def _gather(windows: Sequence[Sequence[float]], pick):
    """Rows of every picked window's values laid side by side: (replicates, sum of picked sizes).

    Windows of one stratum usually hold the same number of streams; ragged ones are
    padded with NaN, which the percentile ignores."""
    import numpy as np

    width = max(len(w) for w in windows)
    table = np.full((len(windows), width), np.nan)
    for i, w in enumerate(windows):
        table[i, :len(w)] = w
    return table[pick].reshape(pick.shape[0], -1)


def _row_percentile(rows, q: float):
    """Linear-interpolated q-th percentile of each row's values, NaN padding ignored
    (as results.percentile does; numpy's nanpercentile loops in Python per row)."""
    import numpy as np

    ordered = np.sort(rows, axis=1)                        # NaN sorts last
    count = np.sum(~np.isnan(ordered), axis=1)
    pos = np.maximum(count - 1, 0) * (q / 100.0)
    lo = np.floor(pos).astype(int)
    hi = np.ceil(pos).astype(int)
    idx = np.arange(ordered.shape[0])
    out = ordered[idx, lo] + (ordered[idx, hi] - ordered[idx, lo]) * (pos - lo)
    return np.where(count > 0, out, np.nan)


@dataclass(frozen=True)
class ServeWindow:
    """What the serving bootstrap needs of one window: its counted requests, how many of
    them met each SLO, and its busy slots."""

    requests: int
    good: Mapping[str, int]
    mean_active: float


def serving_replicates(loads: Mapping[float, Sequence[Sequence[ServeWindow]]], shares: Mapping[str, float],
                       replicates: int = REPLICATES, seed: int = 0
                       ) -> dict[str, list[tuple[Replicate | None, dict[float, float]]]]:
    """Bootstrap replicates of a serving threshold per SLO name (its share in `shares`).

    loads: per load, its strata (ranks), each a list of ServeWindows. A replicate draws
    each stratum's windows with replacement, then each drawn window's requests with
    replacement (the good ones a binomial draw of its size at its good share). Returns,
    per SLO, each replicate's reading and its mean busy slots per load."""
    import numpy as np

    rng = _rng(seed)
    drawn: dict[float, tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]] = {}
    for load, strata in loads.items():
        totals = np.zeros(replicates)
        goods = {name: np.zeros(replicates) for name in shares}
        active_sum, windows_n = np.zeros(replicates), 0
        for windows in strata:
            if not windows:
                continue
            pick = rng.integers(0, len(windows), size=(replicates, len(windows)))
            sizes = np.array([w.requests for w in windows])[pick]
            totals += sizes.sum(axis=1)
            active_sum += np.array([w.mean_active for w in windows])[pick].sum(axis=1)
            windows_n += len(windows)
            for name in shares:
                p = np.array([w.good.get(name, 0) / w.requests if w.requests else 0.0 for w in windows])[pick]
                goods[name] += rng.binomial(sizes, p).sum(axis=1)
        if windows_n:
            drawn[load] = (totals, goods, active_sum / windows_n)
    out: dict[str, list[tuple[Replicate | None, dict[float, float]]]] = {}
    for name, share in shares.items():
        need = Fraction(str(share))
        reps = []
        for i in range(replicates):
            verdicts = {load: (None if tot[i] == 0 else Fraction(int(g[name][i]), int(tot[i])) >= need)
                        for load, (tot, g, _a) in drawn.items()}
            reps.append((replicate_of(verdicts), {load: float(a[i]) for load, (_t, _g, a) in drawn.items()}))
        out[name] = reps
    return out
