"""A run's identity and its meta.json (pure): the run id, and the `RunMeta` a run writes from
its spec, a resumed run keeping its earlier facts."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .results import RunMeta


def new_run_id(prefix: str, nodes: int, now: datetime | None = None) -> str:
    """`<prefix>-<nodes>n-<UTC time>`: the inventory's name for a cluster run, `local` for one
    on this machine. Sorted by name, runs of one prefix sort by time."""
    now = now or datetime.now(timezone.utc)
    return f"{prefix}-{nodes}n-{now.astimezone(timezone.utc):%Y%m%d-%H%M%S}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# What a resumed run keeps from its meta.json unless given anew (see RunMeta).
FACT_FIELDS = ("label", "slos", "inventory_sha256", "vcenter", "guests", "versions", "probe", "ranks")
_SCALAR_FACTS = ("label", "inventory_sha256")


def build_run_meta(spec, *, previous: RunMeta | None = None, complete: bool = False,
                   failure: str | None = None, **facts: Any) -> RunMeta:
    """A run's meta.json from its spec (vcfslm.runspec.RunSpec, kept whole as `spec`; the
    matrix, nodes, model, label and SLOs the report reads are the spec's). `previous` is
    the meta of the run being resumed: its creation time stays, and each of FACT_FIELDS not
    given anew is kept from it."""
    unknown = set(facts) - set(FACT_FIELDS)
    if unknown:
        raise TypeError(f"unknown run facts: {', '.join(sorted(unknown))}")
    facts = {"label": spec.label, "slos": spec.slos, **facts}
    kept = {k: facts.get(k) or (getattr(previous, k) if previous else None) for k in FACT_FIELDS}
    kept.update({k: kept[k] or {} for k in FACT_FIELDS if k not in _SCALAR_FACTS})
    return RunMeta(run_id=spec.run_id, created=previous.created if previous else now_iso(),
                   command=list(spec.command), mode=spec.mode, nodes=list(spec.nodes),
                   ranks_per_node=spec.ranks, threads_per_rank=spec.threads, model=spec.model,
                   matrix=spec.matrix_record(), complete=complete, failure=failure, spec=spec.record(), **kept)
