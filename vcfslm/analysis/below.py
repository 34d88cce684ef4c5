"""The serving answer when even the smallest load measured fails an SLO (pure): why no
threshold was found above it, in the sweep's own terms (vcfslm.serving.lowering).

The recorded loads are asked what the sweep would do next with no budget left to spend:
- a request alone misses the SLO (`lowering.ALONE`): no load meets it, said plainly; the
  threshold column keeps `< n` and the nodes say "not achievable";
- otherwise the threshold lies below the loads measured (`< n`, nodes "below range"), and
  the note says why the sweep did not go lower: its steps or budget ran out, or the run
  did not sweep (`lowering.LOWER`: a lower load was there to try), the windows were too
  short to judge a lower load (`lowering.FEW`), or there was none (`lowering.FLOOR`).
Loads in the sentences are per VM: a series key's `per_vm` times the sweep's per-rank load,
in the key's `unit`. A threshold built without a reason (None) reads as below the range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vcfslm.serving import decisions as serving
from vcfslm.serving import lowering
from vcfslm.serving.lowering import Lowering

NOT_ACHIEVABLE = "not achievable"
BELOW_RANGE = "below range"


def why_below(results: Mapping[float, serving.LoadResult], limit: Mapping[str, Any], share: float,
              load_kind: str) -> Lowering:
    """What the sweep would do below these loads (per rank) with its budget unspent."""
    unbounded = serving.RefineRule(budget_s=math.inf, load_kind=load_kind, steps=1)
    return lowering.lower_load(results, limit, share, unbounded)


def of_series(points: Sequence[Any], slo: Any, share: float, status: str) -> Lowering | None:
    """`why_below` for a series' points (analysis.serve_points.ServePoint) under an SLO (analysis.slo_spec.Slo)
    judged at `share`; None unless its status is "below"."""
    if status != "below":
        return None
    return why_below({p.load: p.result for p in points if p.has_data}, slo.limits(), share, points[0].key.load_kind)


def _lower(low: Lowering, key: Any) -> str:
    """The lower load the sweep would try, per VM: `0.5 req/s/VM`."""
    return f"{low.load * key.per_vm:.3g} {key.unit}/VM" if low.load is not None else "–"


def alone_text(low: Lowering | None, slo_title: str) -> str:
    """`a single request misses TPOT, so no load meets SLO-A`, or ""."""
    if low is None or low.kind != lowering.ALONE or low.alone is None:
        return ""
    return f"a single request misses {low.alone.binding}, so no load meets {slo_title}"


def why_not_lower(low: Lowering | None, key: Any) -> str:
    """Why the sweep did not go lower, in a few words ("" for a request alone, or no reason)."""
    if low is None or low.kind == lowering.ALONE:
        return ""
    lower = _lower(low, key)
    if low.kind == lowering.FEW:
        return f"windows too short to judge {lower}: about {low.expected:.2g} requests per window"
    if low.kind == lowering.FLOOR:
        return "1 user is the fewest" if low.load is None else f"{lower} has no valid window"
    return f"the sweep's budget ran out before {lower}, or it did not sweep"


def note(low: Lowering | None, slo_title: str, key: Any) -> str:
    """The table's note: which of the two it is, in a few words."""
    why = why_not_lower(low, key)
    return alone_text(low, slo_title) or "below the loads measured" + (f": {why}" if why else "")


def sentence(low: Lowering | None, slo_title: str, key: Any) -> str:
    """The reasoning's closing sentences: why the threshold was not found above the loads measured."""
    if low is None:
        return "Measure lower loads to find the threshold."
    a = low.alone
    ran = (f" {a.good} of the {a.requests} requests that ran alone met it." if a is not None and a.requests
           else " No request ran alone (its whole time with none other in flight).")
    if low.kind == lowering.ALONE:
        return (f"Of the {a.requests} requests that ran alone (none other in flight), {a.requests - a.good} "
                "missed it, and fewer requests in flight cannot do better.")
    lower = _lower(low, key)
    if low.kind == lowering.FEW:
        why = (f" Lower loads were not judged: {lower} would leave about {low.expected:.2g} requests per window, "
               "under one. Measure with longer windows to find it.")
    elif low.kind == lowering.FLOOR:
        why = (" No lower load to try: 1 user is the fewest." if low.load is None
               else f" {lower} was measured without a valid window.")
    else:
        why = (" Lower loads were not measured (the sweep's steps or budget ran out, or the run did not "
               f"sweep). Measure lower loads to find the threshold ({lower} next).")
    return f"The threshold, if any, lies below the loads measured.{ran}{why}"


def answer(low: Lowering | None, slo_title: str) -> str:
    """What follows `< n unit/VM → ` in an answer line."""
    if low is not None and low.kind == lowering.ALONE:
        return f"{NOT_ACHIEVABLE}: {alone_text(low, slo_title)}"
    return f"{BELOW_RANGE} nodes"


def nodes(low: Lowering | None) -> str:
    """The nodes column's text under a threshold below the loads measured."""
    return NOT_ACHIEVABLE if low is not None and low.kind == lowering.ALONE else BELOW_RANGE


def to_dict(low: Lowering | None, slo_title: str, key: Any) -> dict[str, Any] | None:
    """The JSON of it: the kind (vcfslm.serving.lowering's), the note, the lower load per VM, the lone requests."""
    if low is None:
        return None
    a = low.alone
    return {"kind": low.kind, "note": note(low, slo_title, key),
            "next_load_per_vm": None if low.load is None else low.load * key.per_vm,
            "alone_requests": None if a is None else a.requests, "alone_met": None if a is None else a.good,
            "alone_binding": None if a is None else a.binding or None,
            "expected_requests_per_window": None if low.expected is None else round(low.expected, 2)}
