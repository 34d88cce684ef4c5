"""The serving sweep below its grid (pure): when even the smallest load tried fails an SLO,
which lower load to measure next, or why there is none.

The rank workers and the endpoint client decide with it inside the run
(bench/windows.py's `sweep_input`); the analysis asks it the same question of the
recorded loads (analysis/below.py), so an answer that stays below the loads measured says
why in the sweep's own terms.

- Lower: the smallest failing load halved, rounded as the sweep rounds loads (three
  significant digits; users are whole numbers, so the fewest is 1 user), until a load
  passes. Bisection and refinement then go on between that load and the first failing one.
- A request ran alone when no other counted request of its window was in flight at any
  time between its arrival and its last token (`arrival_s`, `e2e_s`). A window with an
  unfinished or failed request gives none (that request's times are unknown), and the
  warm-up's and cool-down's requests are not recorded, so an overlap with them is not seen.
  The requests that ran alone, pooled over every load of the context, are judged as a load
  is; when they miss the limits by more than the attainment allows, no load can meet the
  SLO (no load does better than its requests alone), and the sweep stops and says which
  limit a single request misses. Judged on fewer than `fewest(share)` of them, the
  missing ones are taken as having met every limit: a failure then stands whatever they do.
- Too few: a lower load's windows hold about (lower / smallest failing) x the requests the
  smallest failing load's windows held. Under one request per window on average
  (`MIN_WINDOW_REQUESTS`) a window is often empty and a verdict rests on a request or two,
  so the sweep stops and says the windows are too short to go lower. (Above it a verdict
  on few requests stands, flagged as few samples, as the grid's own loads are: with fewer
  than `fewest(share)` every request must meet the limits, which errs towards failing.)
- Budget: each lower load is one of the sweep's `sweep_steps` for that SLO (bisection takes
  the rest), and the windows below the grid count against `sweep_budget_s` as refinement's
  extra windows do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vcfslm.serving import decisions as serving
from vcfslm.serving import judging

# What lower_load says (Lowering.kind).
LOWER = "lower"          # measure Lowering.load next
BRACKET = "bracket"      # nothing to lower: a load passes, or none has failed
ALONE = "alone"          # requests that ran alone miss the SLO: no load meets it
FLOOR = "floor"          # no lower load to try (1 user, or the lower load has no valid window)
FEW = "few"              # the lower load's windows would hold too few requests to judge
BUDGET = "budget"        # the sweep's steps or seconds are spent
# The fewest requests a lower load's windows must hold on average to be judged.
MIN_WINDOW_REQUESTS = 1.0


def fewest(share: float) -> int:
    """The fewest requests an attainment at `share` can be judged on with one miss still
    passing: ceil(1 / (1 - share)), 10 at 90 %, 100 at 99 % (counted exactly)."""
    return math.ceil(1 / (1 - Fraction(str(share))))


def slo_title(name: str) -> str:
    """`A` -> `SLO-A`, as the answer names an SLO."""
    return name if name.upper().startswith("SLO") else f"SLO-{name}"


# ------------------------------------------------------------------ requests that ran alone


def alone_indices(record: Any) -> list[int]:
    """The indices (into the record's per-request lists) of the counted requests that ran
    alone: no other counted request of the window in flight between their arrival and their
    last token. None in a window with an unfinished or failed request."""
    n = len(record.ttft_s)
    arrivals = list(getattr(record, "arrival_s", ()) or ())
    e2e = list(getattr(record, "e2e_s", ()) or ())
    if record.unfinished or getattr(record, "failed", 0) or len(arrivals) != n or len(e2e) != n:
        return []
    order = sorted(range(n), key=lambda i: arrivals[i])
    out, latest = [], -math.inf          # latest: the last token of every request that arrived before
    for k, i in enumerate(order):
        start, end = arrivals[i], arrivals[i] + e2e[i]
        following = arrivals[order[k + 1]] if k + 1 < n else math.inf
        if start >= latest and end <= following:
            out.append(i)
        latest = max(latest, end)
    return sorted(out)


@dataclass(frozen=True)
class Alone:
    """How the requests that ran alone fared against one SLO's limits."""

    requests: int            # that ran alone
    good: int                # of them, met every limit
    tpot_good: int
    ttft_good: int
    share: float             # the attainment the SLO is judged at

    @property
    def judged(self) -> judging.Attainment:
        """Their attainment with the requests short of `fewest(share)` taken as good."""
        pad = max(0, fewest(self.share) - self.requests)
        return judging.Attainment(self.requests + pad, self.good + pad, self.tpot_good + pad, self.ttft_good + pad)

    @property
    def fails(self) -> bool:
        """Do they miss the SLO by more than the attainment allows, whatever the missing ones do?"""
        return self.requests > 0 and judging.attains(self.judged, self.share) is False

    @property
    def binding(self) -> str:
        """The limit a single request misses (`TPOT`, `TTFT`, `TPOT and TTFT`, ...); "" unless it fails."""
        return self.judged.binding(self.share) if self.fails else ""


def alone(results: Mapping[float, serving.LoadResult], limit: Mapping[str, Any], share: float) -> Alone:
    """The requests that ran alone in any valid window of these loads, judged against `limit`
    ({tpot_ms, ttft_s[, ttft_per_token_ms]})."""
    ttft: list[float] = []
    tpot: list[float] = []
    inputs: list[int] = []
    for res in results.values():
        for r in res.windows:
            mine = alone_indices(r)
            prompts = serving.request_inputs(r)
            ttft += [r.ttft_s[i] for i in mine]
            tpot += [r.tpot_ms[i] for i in mine]
            inputs += [prompts[i] for i in mine]
    a = judging.attainment(ttft, tpot, 0, limit.get("tpot_ms"), limit.get("ttft_s"), input_tokens=inputs,
                           ttft_per_token_ms=limit.get("ttft_per_token_ms"))
    return Alone(a.requests, a.good, a.tpot_good, a.ttft_good, share)


# ------------------------------------------------------------------ the next lower load


@dataclass(frozen=True)
class Lowering:
    """What the sweep does below its smallest failing load for one SLO: measure `load`
    (kind LOWER), or nothing, and why (`kind`, `reason`). Loads are per rank (the endpoint's:
    the deployment's), as the sweep measures them."""

    kind: str
    reason: str = ""
    load: float | None = None        # the load to measure next (LOWER), or the one that was not measured
    failing: float | None = None     # the smallest failing load
    binding: str = ""                # what fails there
    alone: Alone | None = None
    expected: float | None = None    # requests per window the lower load would hold (FEW)

    @property
    def stopped(self) -> bool:
        """Did lowering end without a passing load (the answer stays below the loads measured)?"""
        return self.kind not in (LOWER, BRACKET)


def halved(load: float, load_kind: str) -> float | None:
    """Half the load, rounded as the sweep rounds loads; None below 1 user."""
    if load_kind == "users":
        return float(int(load) // 2) if load >= 2 else None
    return serving.round_rate(load / 2)


def lower_load(results: Mapping[float, serving.LoadResult], limit: Mapping[str, Any], share: float,
               rule: serving.RefineRule, steps_taken: int = 0, spent_s: float = 0.0, slo: str = "the SLO"
               ) -> Lowering:
    """The next lower load to measure for one SLO (`limit`, judged at `share`), or why none:
    a load already passes, requests that ran alone miss it, no lower load (1 user), too few
    requests at the lower load, or the budget (`rule.steps` loads per SLO, `steps_taken` so
    far; `rule.budget_s` seconds, `spent_s` so far) is spent."""
    verdicts = {load: serving.meets_limit(res, limit, share) for load, res in results.items()}
    passing, failing = judging.threshold(verdicts)
    if failing is None or passing is not None:
        return Lowering(BRACKET)
    res = results[failing]
    binding = res.attainment(limit.get("tpot_ms"), limit.get("ttft_s"), limit.get("ttft_per_token_ms")).binding(share)
    base = {"failing": failing, "binding": binding}
    lone = alone(results, limit, share)
    if lone.fails:
        return Lowering(ALONE, f"a single request misses {lone.binding}: no load meets {slo_title(slo)} "
                               f"({lone.requests - lone.good} of the {lone.requests} requests that ran alone "
                               "missed it)", alone=lone, **base)
    fails = f"{failing:g} fails on {binding}"
    lower = halved(failing, rule.load_kind)
    if lower is None:
        return Lowering(FLOOR, f"{fails}; 1 user is the fewest", alone=lone, **base)
    if lower in results:
        return Lowering(FLOOR, f"{fails}; {lower:g} has no valid window", lower, alone=lone, **base)
    expected = res.requests / max(1, len(res.windows)) * lower / failing
    if expected < MIN_WINDOW_REQUESTS:
        return Lowering(FEW, f"{fails}; {lower:g} would leave about {expected:.2g} requests per window, too few "
                             "to judge: longer windows would measure lower", lower, alone=lone,
                        expected=expected, **base)
    if steps_taken >= rule.steps:
        return Lowering(BUDGET, f"{fails}; no sweep step left (of {rule.steps})", lower, alone=lone, **base)
    if rule.budget_s <= 0 or spent_s >= rule.budget_s:
        return Lowering(BUDGET, f"{fails}; budget of {rule.budget_s:g} s spent ({spent_s:.0f} s of "
                                "extra windows)", lower, alone=lone, **base)
    return Lowering(LOWER, f"{fails}; {lower:g} next", lower, alone=lone, **base)
