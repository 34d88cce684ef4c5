"""The run spec of `vcfslm bench`, made from the declared settings (bench_options.SETTINGS):
the flags over the resumed run's own spec, else over the inventory, over the one default.

`check_flags` refuses a flag given where its declaration says it does not apply (exit 2,
naming the flag); `resolve` builds the RunSpec. Both are pure: what needs a file, the
network or SSH comes in as an argument (the resumed run's meta.json, read by
`Resumed.read`; the endpoint's model and the deployment's nodes, as `ask`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..analysis.slo import PRESETS, resolve_slos
from ..bench.local import NODE_NAME
from ..contract import Matrix, new_run_id, select_nodes, serve_matrix
from ..errors import Problem, UsageError
from ..inventory import serve_settings
from ..results import RunMeta, read_meta
from ..runspec import EndpointSpec, ProbeSpec, RunSpec
from ..servers import VLLM, ServerSpec
from .bench_options import (
    BY_NAME,
    ENDPOINT,
    ENDPOINT_FLAGS,
    FIELD_FLAGS,
    JUDGING,
    MODES,
    SETTINGS,
    UNSET,
    flag_text,
)
from .bench_serve import serve_of, server_of

# What a mode fixes, whatever the flags: a local run is one node; a run through an endpoint
# is one process on this machine, loading vLLM's OpenAI API.
FIXED: dict[str, dict[str, Any]] = {"local": {"nodes": (NODE_NAME,)},
                                    "cluster": {},
                                    "endpoint": {"ranks": 1, "threads": 1, "nodes": (),
                                                 "server": ServerSpec(name=VLLM.name)}}
# Through a deployment, its servers' own setting comes before the bench's.
DEPLOYED = {"serve.slots": "serve.max_num_seqs"}


@dataclass(frozen=True)
class Resumed:
    """The run a --resume continues: its folder and its meta.json."""

    run_dir: Path
    meta: RunMeta

    @classmethod
    def read(cls, resume: str, runs_dir: str) -> Resumed:
        """RUN (an id under runs_dir, or its folder); UsageError when no run is there."""
        run_dir = Path(resume) if Path(resume).is_dir() else Path(runs_dir) / resume
        if not (run_dir / "meta.json").exists():
            raise UsageError(f"--resume: no run at {run_dir} (expected {run_dir}/meta.json)")
        return cls(run_dir, read_meta(run_dir))

    @property
    def source(self) -> str:
        return str(self.run_dir / "meta.json")

    @property
    def kind(self) -> str:
        return "serve" if self.meta.matrix.get("serve") else "static"


def run_mode(flags: Mapping[str, Any], resumed: Resumed | None) -> str:
    """local, cluster or endpoint: the endpoint's flags (or a resumed run through one), --local, else the cluster."""
    if flags.keys() & ENDPOINT_FLAGS or (resumed is not None and resumed.meta.mode == "endpoint"):
        return "endpoint"
    return "local" if flags.get("local") else "cluster"


def check_resume_flags(flags: Mapping[str, Any]) -> None:
    """A --resume continues what the run recorded: refuse what it may not change (before reading it)."""
    fixed = sorted(n for n in flags if not BY_NAME[n].resume)
    if not fixed:
        return
    if any(BY_NAME[n].group == JUDGING for n in fixed):
        raise UsageError("--resume continues a run with its own SLOs and rule; drop --slo, --percentile "
                         "and --attainment")
    if any(BY_NAME[n].group == ENDPOINT for n in fixed):
        raise UsageError(f"--resume continues an endpoint run where it went; drop {flag_text(fixed)}")
    raise UsageError(f"--resume continues a run with its own settings; drop {flag_text(fixed)}")


def check_flags(flags: Mapping[str, Any], mode: str, kind: str, resumed: Resumed | None = None) -> None:
    """Every flag given applies to this run (its mode and kind), as SETTINGS declares."""
    if resumed is not None and resumed.meta.mode != mode:
        side = "with" if resumed.meta.mode == "local" else "without"
        raise UsageError(f"--resume: {resumed.run_dir} is a {resumed.meta.mode} run; resume it {side} --local")
    wrong_kind = [n for n in sorted(flags) if kind not in BY_NAME[n].applies]
    plain = [n for n in wrong_kind if BY_NAME[n].refusal is None]
    if kind == "static" and plain:
        raise UsageError(f"{flag_text(plain)} only apply to --serve runs")
    if kind == "serve" and plain:
        raise UsageError(f"{flag_text(plain)} do not apply to --serve (--slots is its batch cap, "
                         "--warmup-s/--cooldown-s its warm-up)")
    if wrong_kind:
        raise UsageError(BY_NAME[wrong_kind[0]].refusal)
    if "rates" in flags and "users" in flags:
        raise UsageError("give --rates or --users, not both")
    if resumed is not None and kind == "serve":
        # A serving run's loads, contexts and seed are its ServeSpec's: its sweep's decisions depend on them.
        kept = sorted(n for n in flags if (BY_NAME[n].spec or "").startswith("matrix.") or n == "seed")
        if kept:
            raise UsageError(f"--resume continues a run with its own settings; drop {flag_text(kept)}")
    stray = sorted(n for n in flags if mode not in BY_NAME[n].applies)
    if stray and mode == "local":
        raise UsageError(f"--local cannot be combined with {flag_text(stray)}")
    if stray and mode == "cluster":
        raise UsageError(f"{flag_text(stray)} only apply to --local runs")
    if stray:
        raise UsageError(f"{flag_text(stray)} do not apply to a run through an endpoint (no rank, no server of "
                         "its own)")
    if mode == "cluster" and resumed is None and not flags.keys() & {"nodes", "hosts"}:
        raise UsageError("choose a mode: --local (this machine) or --nodes N / --hosts A,B (the cluster)")


def parse_slos(specs: Sequence[str]) -> dict[str, Any] | None:
    """--slo texts as meta.json records SLOs ({name: {tpot_ms, ttft_s}}); None when none given."""
    parsed = resolve_slos(specs, list(PRESETS.values())) if specs else []
    return {s.name: s.limits() for s in parsed} or None


def inventory_view(inv) -> dict[str, Any]:
    """The inventory's values as nested mappings, what SETTINGS' keys name (None: unset)."""
    if inv is None:
        return {}
    view = inv.model_dump(exclude_none=True)
    view["bench"]["serve"] = {k: v for k, v in serve_settings(inv).items() if v is not None}
    return view


def looked_up(view: Mapping[str, Any], key: str) -> Any:
    """`bench.serve.slots` in the view; None when any part is missing."""
    value: Any = view
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def flag_values(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The flags given, by the RunSpec field each sets (as that field takes it)."""
    out: dict[str, Any] = {}
    for name, value in flags.items():
        setting = BY_NAME[name]
        if setting.spec is None:
            continue
        if name == "slo_specs":
            value = parse_slos(value)
            if not value:
                continue
        out[setting.spec] = setting.to_spec(value) if setting.to_spec else value
    return out


def resolved_values(flags: Mapping[str, Any], view: Mapping[str, Any], mode: str,
                    ask: Mapping[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """Field -> value: the flag's, else the inventory's, else what `ask` finds out, else the default."""
    out = flag_values(flags)
    for setting in SETTINGS:
        field = setting.spec
        if field is None or field in out:
            continue
        key = DEPLOYED.get(field) if mode == "endpoint" else None
        value = looked_up(view, key) if key else None
        if value is None and setting.inventory and mode in setting.read_in:
            value = looked_up(view, setting.inventory)
        if value is None and ask and field in ask:
            value = ask[field]()
        if value is None and setting.default is not UNSET:
            value = setting.default
        if value is not None:
            out[field] = value
    return out


def _parts(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """{field: value} split into the RunSpec's own fields and its parts' ({"matrix": {...}, ...})."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {"matrix": {}, "serve": {}, "probe": {}, "endpoint": {}}
    for field, value in values.items():
        part, _, name = field.partition(".")
        if name:
            parts[part][name] = value
        else:
            top[field] = value
    return top, parts


def resolve(flags: Mapping[str, Any], inventory, resumed: Resumed | None, mode: str, *,
            command: Sequence[str] = (), ask: Mapping[str, Callable[[], Any]] | None = None) -> RunSpec:
    """The run's spec. flags: the flags given (by parameter name); inventory: the loaded
    inventory or None; resumed: the run a --resume continues; mode: local, cluster or
    endpoint. ask: field -> how to find it out when neither a flag nor the inventory says
    (the model an endpoint serves, a deployment's nodes). UsageError names the flag."""
    if mode not in MODES:
        raise ValueError(f"mode is one of {sorted(MODES)}, got {mode!r}")
    if resumed is not None:
        return _resumed_spec(flags, resumed, command)
    kind = "serve" if flags.get("serve") else "static"
    view = inventory_view(inventory)
    top, parts = _parts(resolved_values(flags, view, mode, ask))
    m = parts["matrix"]
    matrix = Matrix(tuple(m["batch_sizes"]), tuple(m["input_tokens"]), m["output_tokens"], m["warmup"],
                    m["repeats"])
    server_name = top.pop("server")
    serve = server = None
    if kind == "serve" and mode != "endpoint":
        server = server_of(server_name, looked_up(view, f"bench.serve.{server_name}"))
    if kind == "serve":
        serve = serve_of(parts["serve"], flags, looked_up(view, "bench.serve") or {},
                         input_tokens=matrix.input_tokens, output_tokens=matrix.output_tokens,
                         repeats=matrix.repeats, seed=top["seed"])
        matrix = serve_matrix(serve)
    settings = {**top, "mode": mode, "matrix": matrix, "serve": serve, "server": server,
                "probe": ProbeSpec(**parts["probe"]), "command": tuple(command), **FIXED[mode]}
    if mode == "cluster":
        chosen = top.get("nodes")
        settings["nodes"] = tuple(n.name for n in select_nodes(
            inventory, chosen if isinstance(chosen, int) else None, chosen if isinstance(chosen, list) else None))
    if mode == "endpoint":
        settings["endpoint"] = _endpoint(parts["endpoint"])
    if not top.get("run_id"):
        prefix = {"local": NODE_NAME, "cluster": getattr(inventory, "name", "cluster"), "endpoint": "endpoint"}[mode]
        count = max(settings["endpoint"].nodes) if mode == "endpoint" else len(settings["nodes"])
        settings["run_id"] = new_run_id(prefix, count)
    return RunSpec.from_cli(settings, getattr(inventory, "source", ""), FIELD_FLAGS)


def _endpoint(fields: dict[str, Any]) -> EndpointSpec:
    try:
        return EndpointSpec(**fields)
    except ValueError as exc:
        raise UsageError([Problem("", None, None, "--endpoint", str(exc).splitlines()[-1])]) from None


def _resumed_spec(flags: Mapping[str, Any], resumed: Resumed, command: Sequence[str]) -> RunSpec:
    """The spec the run recorded, whole (whatever the inventory says since), with the flags a
    resume may change over it (check_flags refused the others)."""
    spec = RunSpec.of_meta(resumed.meta, resumed.source)
    top, parts = _parts(flag_values({n: v for n, v in flags.items() if BY_NAME[n].resume}))
    changes: dict[str, Any] = {**top, "run_id": resumed.run_dir.name, "command": tuple(command)}
    if parts["matrix"]:
        changes["matrix"] = replace(spec.matrix, **{k: tuple(v) if isinstance(v, list) else v
                                                    for k, v in parts["matrix"].items()})
    if parts["probe"]:
        changes["probe"] = spec.probe.model_copy(update=parts["probe"])
    if parts["endpoint"] and spec.endpoint is not None:
        changes["endpoint"] = spec.endpoint.model_copy(update=parts["endpoint"])
    return spec.replaced(**changes)
