"""`vcfslm bench --serve`: the serving-mode flags and how they resolve into a ServeSpec
(flags > the resumed run's spec > the inventory's bench.serve > defaults)."""

from __future__ import annotations

from typing import Any

import click

from .. import arrivals
from ..errors import Problem, UsageError
from ..servers import SERVERS, ServerSpec
from ..serving import ServeSpec
from ..workloads import Workload, parse_workload
from .common import int_list

# Flags that only mean something with --serve, and static-only flags refused with it.
SERVE_FLAGS = ("rates", "users", "slots", "chunk_tokens", "batched_tokens", "duration", "warmup_s", "cooldown_s", "arrival", "burstiness",
               "think_s", "lengths", "sweep", "sweep_steps", "sweep_precision", "sweep_budget", "server",
               "server_python", "workload", "time_scales")
# Resolved by serve_spec itself, not copied into the spec's fields.
_OWN_RESOLUTION = ("rates", "users", "workload", "time_scales")
STATIC_ONLY = ("batch_sizes", "scenarios", "warmup")
_FLAG_FIELDS = {"duration": "duration_s", "sweep_budget": "sweep_budget_s"}


def float_list(ctx, param, value: str | None) -> list[float] | None:
    """click callback: '0.5,1,2' -> [0.5, 1.0, 2.0] (positive numbers)."""
    if value is None:
        return None
    try:
        values = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None
    if not values or any(not v > 0 for v in values):
        raise click.BadParameter(f"expected positive numbers, got {value!r}")
    return values


def serve_options(f):
    """The serving flags, in the order --help shows them."""
    options = [
        click.option("--serve", is_flag=True,
                     help="Serving mode: continuous batching under arriving requests (instead of static "
                          "batches); needs --rates or --users (or the inventory's bench.serve)."),
        click.option("--rates", callback=float_list, default=None, metavar="LIST",
                     help="Serve: open-loop arrival rates per rank, requests/s (e.g. 0.5,1,2)."),
        click.option("--users", callback=int_list, default=None, metavar="LIST",
                     help="Serve: closed-loop users per rank (e.g. 4,8,16), instead of --rates."),
        click.option("--slots", type=click.IntRange(min=1), default=None,
                     help="Serve: the batch cap, streams a rank decodes together (default 16)."),
        click.option("--chunk-tokens", type=click.IntRange(min=1), default=None,
                     help="Serve, vcfslm's engine: the most prompt tokens one step takes beside the "
                          "decodes (default: the largest whose FLOPs fit under the decode step's "
                          "bandwidth floor on the rank's probes; the records keep the value used)."),
        click.option("--batched-tokens", type=click.IntRange(min=1), default=None,
                     help="Serve, vcfslm's engine: the most prompt tokens one step takes when two or more "
                          "requests wait to go in, or nothing decodes: several prompts per step "
                          "(default 2048, vLLM's max_num_batched_tokens on its CPU server)."),
        click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Serve: seconds of arrivals per window (default 60)."),
        click.option("--warmup-s", type=click.FloatRange(min=0), default=None,
                     help="Serve: seconds at a window's start excluded from the metrics (default 5)."),
        click.option("--cooldown-s", type=click.FloatRange(min=0), default=None,
                     help="Serve: seconds at a window's end excluded from the metrics (default 5)."),
        click.option("--arrival", type=click.Choice(arrivals.OPEN_LOOP), default=None,
                     help=f"Serve: open-loop arrival process (default {arrivals.DEFAULT})."),
        click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Serve: gamma shape; 1 is Poisson, below 1 burstier (default 1)."),
        click.option("--think-s", type=click.FloatRange(min=0), default=None,
                     help="Serve: closed-loop mean think time between a reply and the next request."),
        click.option("--lengths", type=click.Choice(["fixed", "uniform"]), default=None,
                     help="Serve: request lengths, the nominal ones or uniform in [half, nominal]."),
        click.option("--workload", default=None, metavar="NAME|FILE",
                     help="Serve: what the requests look like: fixed:IN/OUT, a mix (chat, rag), a JSONL "
                          "file of requests (input_tokens, output_tokens; optional arrival_s, conversation, "
                          "turn, prefix_tokens, think_s) or mooncake:FILE (a Mooncake trace). Default: "
                          "--input-tokens and --output-tokens, fixed."),
        click.option("--time-scale", "time_scales", callback=float_list, default=None, metavar="LIST",
                     help="Serve, a replayed workload: speed-ups of its own times (2: twice as fast), as "
                          "loads instead of --rates (each is the trace's mean rate times it)."),
        click.option("--sweep", is_flag=True, default=None,
                     help="Serve: after the loads, bisect towards each SLO's largest passing load (below "
                          "the smallest, halving it, when even that fails)."),
        click.option("--sweep-steps", type=click.IntRange(min=0), default=None,
                     help="Serve: loads the sweep adds per SLO and context, halving below the smallest "
                          "and bisecting (default 3)."),
        click.option("--sweep-precision", type=click.FloatRange(min=0, min_open=True), default=None,
                     metavar="X", help="Serve: after bisecting, add loads inside the gap and windows where the "
                                       "replicates disagree until the threshold's 95%% interval (up to the first "
                                       "failing load) is narrower than X times the threshold (default 0.25) ..."),
        click.option("--sweep-budget", type=click.FloatRange(min=0), default=None, metavar="S",
                     help="Serve: ... or until those extra windows, and every window below the smallest "
                          "load, took S seconds (default 600; 0: none). The run says which stopped it."),
        click.option("--server", type=click.Choice(SERVERS), default=None,
                     help="Serve: who serves, vcfslm's own rank engine or vLLM's CPU server, one per "
                          "vNUMA node, driven over its OpenAI streaming API (default: the inventory's "
                          "bench.serve.server, else vcfslm)."),
        click.option("--server-python", default=None, metavar="PATH",
                     help="Serve --local: the interpreter of the server's own venv (default "
                          "$VCFSLM_VLLM_PYTHON, else .venv-vllm/bin/python, as `make vllm` installs)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def check_serve_flags(serve: bool, given: set[str], resume: bool = False) -> None:
    """Serving flags need --serve; static-only flags are refused with it; a resumed run
    keeps its own spec (its sweep's decisions depend on it)."""
    if resume and given & (set(SERVE_FLAGS) | {"serve"}):
        raise UsageError(f"--resume continues a run with its own settings; drop "
                         f"{_flags(sorted(given & (set(SERVE_FLAGS) | {'serve'})))}")
    if not serve:
        stray = sorted(given & set(SERVE_FLAGS))
        if stray:
            raise UsageError(f"{_flags(stray)} only apply to --serve runs")
        return
    clash = sorted(given & set(STATIC_ONLY))
    if clash:
        raise UsageError(f"{_flags(clash)} do not apply to --serve (--slots is its batch cap, "
                         "--warmup-s/--cooldown-s its warm-up)")
    if "rates" in given and "users" in given:
        raise UsageError("give --rates or --users, not both")


def serve_spec(opts: dict[str, Any], *, inventory: dict[str, Any] | None, previous: ServeSpec | None,
               input_tokens, output_tokens: int, repeats: int, seed: int = 0,
               attainment: float | None = None) -> ServeSpec:
    """The run's ServeSpec (a resumed run's own); UsageError naming the flag when it cannot be one.

    attainment: the inventory's slo.attainment (--attainment wins)."""
    if previous is not None:
        return previous
    fields: dict[str, Any] = {}
    if opts.get("attainment") is not None or attainment is not None:
        fields["attainment"] = opts.get("attainment") if opts.get("attainment") is not None else attainment
    if inventory:
        kind = "users" if inventory.get("users") else "rate"
        loads = inventory.get("users") or inventory.get("rates")
        fields.update({k: v for k, v in inventory.items() if k in ServeSpec.__dataclass_fields__})
        if loads:
            fields.update(load_kind=kind, loads=tuple(float(v) for v in loads))
    for flag in SERVE_FLAGS:
        value = opts.get(flag)
        if value is None or flag in _OWN_RESOLUTION:
            continue
        fields[_FLAG_FIELDS.get(flag, flag)] = value
    if opts.get("rates"):
        fields.update(load_kind="rate", loads=tuple(opts["rates"]))
    elif opts.get("users"):
        fields.update(load_kind="users", loads=tuple(float(u) for u in opts["users"]))
    workload = _workload(opts, inventory or {})
    scales = opts.get("time_scales") or (None if opts.get("rates") or opts.get("users") else
                                         (inventory or {}).get("time_scales"))
    if scales:
        if opts.get("rates") or opts.get("users"):
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
    for key in ("rates", "users", "time_scales"):
        fields.pop(key, None)
    try:
        return ServeSpec.of_record(fields)
    except ValueError as exc:
        raise UsageError([Problem("", None, None, "--serve", str(exc))]) from None


def _workload(opts: dict[str, Any], inventory: dict[str, Any]) -> Workload | None:
    """--workload, else the inventory's bench.serve.workload (its file made absolute by
    inventory.serve_settings), read and checked (WorkloadError: exit 2)."""
    if opts.get("workload"):
        return parse_workload(opts["workload"], source="--workload")
    if inventory.get("workload"):
        return parse_workload(inventory["workload"], source="bench.serve.workload")
    return None


def server_spec(opts: dict[str, Any], *, inventory: dict[str, Any] | None,
                previous: dict[str, Any] | None) -> ServerSpec:
    """The run's ServerSpec: a resumed run's own, else --server over the inventory's
    bench.serve.server and its settings (bench.serve.vllm)."""
    if previous is not None:
        return ServerSpec.of_record(previous)
    name = opts.get("server") or (inventory or {}).get("server") or "vcfslm"
    if name == "vcfslm":
        return ServerSpec()
    settings = dict((inventory or {}).get(name) or {})
    fields = {k: v for k, v in settings.items() if k in ServerSpec.__dataclass_fields__ and v is not None}
    try:
        return ServerSpec(name=name, **fields)
    except ValueError as exc:
        raise UsageError([Problem("", None, None, "--server", str(exc))]) from None


def _flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)
