"""`vcfslm bench --serve`: the serving settings (flags over the inventory's bench.serve, as
bench_options declares them) as a ServeSpec, and who serves as a ServerSpec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import Problem, UsageError
from ..servers import ServerSpec
from ..serving import ServeSpec
from ..workloads import Workload, parse_workload


def serve_of(fields: Mapping[str, Any], flags: Mapping[str, Any], inventory: Mapping[str, Any], *,
             input_tokens, output_tokens: int, repeats: int, seed: int = 0) -> ServeSpec:
    """The run's ServeSpec; UsageError naming the flag when it cannot be one.

    fields: the ServeSpec fields the settings resolved (each flag over bench.serve). The
    load is resolved here: --rates, --users or --time-scale (with a replayed --workload)
    over bench.serve's rates, users or time_scales."""
    fields = dict(fields)
    if inventory.get("users") or inventory.get("rates"):
        kind = "users" if inventory.get("users") else "rate"
        fields.update(load_kind=kind, loads=tuple(float(v) for v in inventory.get("users") or inventory["rates"]))
    if flags.get("rates"):
        fields.update(load_kind="rate", loads=tuple(flags["rates"]))
    elif flags.get("users"):
        fields.update(load_kind="users", loads=tuple(float(u) for u in flags["users"]))
    workload = _workload(flags, inventory)
    scales = flags.get("time_scales") or (None if flags.get("rates") or flags.get("users") else
                                          inventory.get("time_scales"))
    if scales:
        if flags.get("rates") or flags.get("users"):
            raise UsageError("give --time-scale or --rates/--users, not both")
        if workload is None or not workload.replay:
            raise UsageError([Problem("", None, None, "--time-scale", "only a workload whose requests carry their "
                                      "arrival times (a trace, a JSONL file with arrival_s) has a time scale")])
        fields.update(load_kind="rate", loads=tuple(round(workload.rate_of_scale(v), 6) for v in scales))
    if "loads" not in fields:
        raise UsageError([Problem("", None, None, "--rates/--users",
                                  "serving needs a load: --rates (requests/s per rank) or --users, "
                                  "or bench.serve.rates/users in the inventory")])
    if workload is not None and workload.kind == "fixed":
        input_tokens, output_tokens, workload = [workload.input_tokens], workload.output_tokens, None
    elif workload is not None:
        # A workload's one context is its longest prompt and reply: what sizes a server's KV cache.
        input_tokens, output_tokens = [workload.max_input], max(2, workload.max_output)
    fields.update(input_tokens=tuple(input_tokens), output_tokens=output_tokens, repeats=repeats, seed=seed,
                  workload=workload)
    try:
        return ServeSpec.of_record(fields)
    except ValueError as exc:
        raise UsageError([Problem("", None, None, "--serve", str(exc))]) from None


def _workload(flags: Mapping[str, Any], inventory: Mapping[str, Any]) -> Workload | None:
    """--workload, else the inventory's bench.serve.workload (its file made absolute by
    inventory.serve_settings), read and checked (WorkloadError: exit 2)."""
    if flags.get("workload"):
        return parse_workload(flags["workload"], source="--workload")
    if inventory.get("workload"):
        return parse_workload(inventory["workload"], source="bench.serve.workload")
    return None


def server_of(name: str, settings: Mapping[str, Any] | None) -> ServerSpec:
    """Who serves: `name` (--server over bench.serve.server), started with its settings
    (bench.serve.<name>, e.g. bench.serve.vllm)."""
    if name == "vcfslm":
        return ServerSpec()
    fields = {k: v for k, v in (settings or {}).items() if k in ServerSpec.__dataclass_fields__ and v is not None}
    try:
        return ServerSpec(name=name, **fields)
    except ValueError as exc:
        raise UsageError([Problem("", None, None, "--server", str(exc))]) from None
