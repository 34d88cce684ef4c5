"""Playbooks: YAML lists of typed steps, loaded with file:line errors, run in order per host.

    # playbooks/example.yaml
    name: example                      # optional, defaults to the file name
    description: what it prepares      # optional
    steps:
      - name: NUMA tools               # optional label
        sudo: true                     # optional: run as root when the guest user is not root
        timeout: 600                   # optional: seconds per command
        packages: {apt: [numactl], dnf: [numactl]}   # exactly one step type and its arguments
      - file: {path: "{{ workdir }}/launch", state: directory}

Step types and their arguments are the models in `steps.py`. String arguments
may reference variables as `{{ dotted.name }}` (no expressions: playbooks are
data); a string that is only one reference takes the variable's value as is
(null, list, bool). Variables: see `VARIABLES` and `host_variables()`.
"""

from __future__ import annotations

import difflib
import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import (
    CommandFailed,
    PlaybookError,
    PlaybookSpecError,
    Problem,
    TransportError,
    VcfslmError,
)
from ..guest_layout import GuestPaths, guest_paths, model_ref, model_slug
from ..resources import resource_dir
from ..serving.servers import HTTP_BACKENDS
from . import facts as F
from . import vllm
from .context import HostContext
from .ops import Op, Shell, Upload, describe, execute
from .steps import STEP_TYPES

COMMON_KEYS = {"name", "sudo", "timeout"}
TOP_KEYS = {"name", "description", "steps"}
REF = re.compile(r"\{\{\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*\}\}")
WHOLE_REF = re.compile(r"^\s*\{\{\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*\}\}\s*$")
DEFAULT_PLAYBOOKS = ("base", "pytorch", "model", "launch", "verify")


def default_playbooks(inventory) -> tuple[str, ...]:
    """The playbooks a guest stage runs for this inventory: DEFAULT_PLAYBOOKS, and before
    verify the one installing bench.serve.server's HTTP server (vllm) when it names one."""
    backend = HTTP_BACKENDS.get(inventory.bench.serve.server)
    if backend is None:
        return DEFAULT_PLAYBOOKS
    at = DEFAULT_PLAYBOOKS.index("verify")
    return (*DEFAULT_PLAYBOOKS[:at], Path(backend.playbook).stem, *DEFAULT_PLAYBOOKS[at:])


# --------------------------------------------------------------------------- variables


def torch_requirement(spec: str) -> str:
    """guest.torch ("2.13.0", "2.11.*", ">=2.8") as a requirement ("torch==2.13.0")."""
    spec = spec.strip()
    if not spec:
        return "torch"
    return f"torch=={spec}" if spec[0].isdigit() else f"torch{spec}"


def host_variables(inventory, node) -> dict[str, Any]:
    """The variables of one host: for playbook references and template contexts."""
    paths = guest_paths(inventory)
    g = inventory.guest
    return {
        "inventory": inventory, "node": node, "nodes": list(inventory.nodes),
        "guest": g, "vm": inventory.vm, "bench": inventory.bench,
        **{k: getattr(paths, k) for k in GuestPaths.__dataclass_fields__},
        "guest_python": g.python,
        "model": g.model, "model_ref": model_ref(inventory), "model_slug": model_slug(g.model),
        "torch_requirement": torch_requirement(g.torch),
        "offline": g.wheelhouse is not None,
        "wheelhouse": _local_path(inventory, g.wheelhouse),
        "find_links": [paths.wheelhouse_dir] if g.wheelhouse else [],
        "rank_slots": inventory.rank_slots(),
        "ranks_per_node": inventory.bench.ranks_per_node,
        "threads_per_rank": inventory.bench.threads_per_rank,
        "use_numactl": True,
        "bench_ip": str(node.bench_ip), "bench_mtu": inventory.placement.networks.bench.mtu,
        # vLLM's CPU server (playbooks/vllm.yaml)
        "vllm": inventory.bench.serve.vllm,
        "vllm_requirements": vllm.requirements(inventory.bench.serve.vllm.version),
        "vllm_extra_index_urls": [g.torch_index_url] if g.torch_index_url else [],
        "vllm_unused": list(vllm.UNUSED),
        "vllm_kv_cache_gib": vllm.default_kv_cache_gib(inventory),
        "vllm_scripts": vllm.launch_scripts(inventory),
        # The running service (playbooks/serve.yaml)
        "serve_requirements": list(vllm.SERVE_REQUIREMENTS),
        "sh": shlex.quote,
    }


def _local_path(inventory, value: str | None) -> str | None:
    """An inventory's local path, relative ones taken from the inventory file's folder."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_absolute() and Path(inventory.source).exists():
        path = Path(inventory.source).resolve().parent / path
    return str(path)


# Names a playbook may reference, and (for load-time checks) the model behind each.
def _variable_models() -> dict[str, Any]:
    from .. import inventory as inv

    return {"inventory": inv.Inventory, "node": inv.Node, "guest": inv.Guest, "vm": inv.VMSpec,
            "bench": inv.Bench, "vllm": inv.Vllm}


VARIABLES = ("inventory", "node", "nodes", "guest", "vm", "bench", *GuestPaths.__dataclass_fields__,
             "guest_python", "model", "model_ref", "model_slug", "torch_requirement", "offline", "wheelhouse",
             "find_links", "rank_slots", "ranks_per_node", "threads_per_rank", "use_numactl",
             "bench_ip", "bench_mtu", "vllm", "vllm_requirements", "vllm_extra_index_urls", "vllm_unused",
             "vllm_kv_cache_gib", "vllm_scripts", "serve_requirements")


def lookup(variables: dict[str, Any], dotted: str) -> Any:
    """Resolve `a.b.c` through dict keys and attributes; KeyError names the missing part."""
    value: Any = variables
    for i, part in enumerate(dotted.split(".")):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif not isinstance(value, dict) and hasattr(value, part):
            value = getattr(value, part)
        else:
            raise KeyError(".".join(dotted.split(".")[:i + 1]))
    return value


def interpolate(value: Any, variables: dict[str, Any]) -> Any:
    """Replace `{{ name }}` references in strings (recursively through lists and dicts)."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str) or "{{" not in value:
        return value
    whole = WHOLE_REF.match(value)
    if whole:
        return lookup(variables, whole.group(1))

    def one(m: re.Match) -> str:
        found = lookup(variables, m.group(1))
        if found is None:
            raise KeyError(f"{m.group(1)} (it is null)")
        return str(found)

    return REF.sub(one, value)


def references(value: Any) -> list[str]:
    """Every `{{ name }}` referenced in a value."""
    if isinstance(value, dict):
        return [r for v in value.values() for r in references(v)]
    if isinstance(value, list):
        return [r for v in value for r in references(v)]
    if isinstance(value, str):
        return REF.findall(value)
    return []


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class PlaybookStep:
    """One step as written: its type, raw arguments and where it is."""

    index: int
    kind: str
    args: dict[str, Any]
    name: str
    sudo: bool
    timeout: float | None
    file: str
    line: int
    arg_lines: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def resolve(self, variables: dict[str, Any]):
        """The typed step with this host's variables filled in (PlaybookError when invalid)."""
        try:
            args = interpolate(self.args, variables)
        except KeyError as exc:
            raise PlaybookError(f"{self.where}: unknown variable {exc.args[0]!r}") from None
        try:
            return STEP_TYPES[self.kind].model_validate(args)
        except ValidationError as exc:
            raise PlaybookError(f"{self.where}: {self.kind}: " + "; ".join(
                _error_text(e) for e in exc.errors(include_url=False))) from None


@dataclass(frozen=True)
class Playbook:
    name: str
    path: str
    description: str
    steps: tuple[PlaybookStep, ...]


def playbook_path(name: str | Path) -> Path:
    """A playbook file: a path as given, else `<name>.yaml` in the shipped playbooks/ folder."""
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return path
    return resource_dir("playbooks") / f"{name}.yaml"


def available_playbooks() -> list[str]:
    return sorted(p.stem for p in resource_dir("playbooks").glob("*.yaml"))


def load_playbooks(names: list[str | Path], inventory=None) -> list[Playbook]:
    """Load several playbooks, reporting every problem of every file at once."""
    out, problems = [], []
    for name in names:
        try:
            out.append(load_playbook(name, inventory))
        except PlaybookSpecError as exc:
            problems.extend(exc.problems)
    if problems:
        raise PlaybookSpecError(problems)
    return out


def load_playbook(name: str | Path, inventory=None) -> Playbook:
    """Parse and check a playbook; with an inventory also validate every step's arguments
    as the first node would see them. PlaybookSpecError lists each problem with file:line."""
    path = playbook_path(name)
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        known = ", ".join(available_playbooks())
        raise PlaybookSpecError([Problem(label, None, None, "", f"no such playbook (shipped: {known})")]) from None
    except OSError as exc:
        raise PlaybookSpecError([Problem(label, None, None, "", f"cannot read: {exc.strerror}")]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise PlaybookSpecError([Problem(label, mark.line + 1 if mark else None,
                                      mark.column + 1 if mark else None, "",
                                      f"YAML syntax error: {exc.problem or exc}")]) from None
    playbook, problems = _parse(data, root, label, path.stem)
    if not problems and inventory is not None:
        problems = _validate_with(playbook, inventory)
    if problems:
        raise PlaybookSpecError(problems)
    return playbook


def _line(node: yaml.Node | None) -> tuple[int | None, int | None]:
    return (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else (None, None)


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            if k.value == key:
                return k
    return None


def _value(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if k.value == key:
                return v
    return None


def _parse(data: Any, root: yaml.Node | None, label: str, stem: str) -> tuple[Playbook, list[Problem]]:
    problems: list[Problem] = []

    def problem(node: yaml.Node | None, key: str, message: str) -> None:
        line, col = _line(node)
        problems.append(Problem(label, line, col, key, message))

    empty = Playbook(stem, label, "", ())
    if not isinstance(data, dict):
        problem(root, "", "a playbook is a mapping with `steps:` (a list of steps)")
        return empty, problems
    for key in data:
        if key not in TOP_KEYS:
            problem(_child(root, key), str(key), "unknown key" + _close(key, TOP_KEYS))
    raw_steps = data.get("steps")
    steps_node = _value(root, "steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        problem(steps_node or root, "steps", "`steps` must be a non-empty list")
        return empty, problems
    steps = []
    for i, raw in enumerate(raw_steps):
        node = steps_node.value[i] if isinstance(steps_node, yaml.SequenceNode) else None
        step = _parse_step(i, raw, node, label, problem)
        if step is not None:
            steps.append(step)
    name = data.get("name") or stem
    return Playbook(str(name), label, str(data.get("description") or ""), tuple(steps)), problems


def _parse_step(i: int, raw: Any, node: yaml.Node | None, label: str, problem) -> PlaybookStep | None:
    key = f"steps[{i}]"
    if not isinstance(raw, dict):
        problem(node, key, "a step is a mapping: one step type (" + ", ".join(STEP_TYPES)
                + ") with its arguments, plus optional name/sudo/timeout")
        return None
    kinds = [k for k in raw if k not in COMMON_KEYS]
    if len(kinds) != 1:
        for k in kinds:
            if k not in STEP_TYPES:
                problem(_child(node, k), f"{key}.{k}", f"unknown step type {k!r}"
                        + _close(k, STEP_TYPES) + "; known: " + ", ".join(STEP_TYPES))
        if not kinds:
            problem(node, key, "no step type given; known: " + ", ".join(STEP_TYPES))
        elif all(k in STEP_TYPES for k in kinds):
            problem(node, key, f"one step type per step, got {', '.join(kinds)}")
        return None
    kind = kinds[0]
    if kind not in STEP_TYPES:
        problem(_child(node, kind), f"{key}.{kind}",
                f"unknown step type {kind!r}" + _close(kind, STEP_TYPES) + "; known: " + ", ".join(STEP_TYPES))
        return None
    args = raw[kind] if raw[kind] is not None else {}
    args_node = _value(node, kind)
    ok = True
    if not isinstance(args, dict):
        problem(args_node, f"{key}.{kind}", f"the arguments of {kind} must be a mapping")
        return None
    model: type[BaseModel] = STEP_TYPES[kind]
    for arg in args:
        if arg not in model.model_fields:
            ok = False
            problem(_child(args_node, arg), f"{key}.{kind}.{arg}",
                    f"unknown argument for {kind}" + _close(arg, model.model_fields)
                    + "; known: " + ", ".join(model.model_fields))
    for ref in references(args):
        msg = _unknown_reference(ref)
        if msg:
            ok = False
            line_node = _find_ref_node(args_node, ref)
            problem(line_node or args_node, f"{key}.{kind}", msg)
    name = raw.get("name") or kind
    sudo = raw.get("sudo", False)
    timeout = raw.get("timeout")
    if not isinstance(sudo, bool):
        ok = False
        problem(_child(node, "sudo"), f"{key}.sudo", "sudo must be true or false")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        ok = False
        problem(_child(node, "timeout"), f"{key}.timeout", "timeout must be a positive number of seconds")
    if not ok:
        return None
    line, _ = _line(node)
    arg_lines = {a: _line(_child(args_node, a))[0] for a in args}
    return PlaybookStep(i, kind, args, str(name), sudo, float(timeout) if timeout else None, label,
                        line or 0, arg_lines)


def _unknown_reference(ref: str) -> str | None:
    top, *rest = ref.split(".")
    if top not in VARIABLES:
        return f"unknown variable {ref!r}" + _close(top, VARIABLES)
    models = _variable_models()
    if rest and top in models:
        model, attr = models[top], rest[0]
        if attr not in model.model_fields and not hasattr(model, attr):
            return f"unknown variable {ref!r}" + _close(attr, list(model.model_fields))
    return None


def _find_ref_node(node: yaml.Node | None, ref: str) -> yaml.Node | None:
    """The scalar node that contains a reference (for its line)."""
    if isinstance(node, yaml.ScalarNode):
        return node if ref in REF.findall(str(node.value)) else None
    children = []
    if isinstance(node, yaml.MappingNode):
        children = [v for _, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    for child in children:
        found = _find_ref_node(child, ref)
        if found is not None:
            return found
    return None


def _close(word: Any, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _error_text(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def _validate_with(playbook: Playbook, inventory) -> list[Problem]:
    """Validate every step's arguments as the first node sees them."""
    variables = host_variables(inventory, inventory.nodes[0])
    problems = []
    for step in playbook.steps:
        try:
            args = interpolate(step.args, variables)
            STEP_TYPES[step.kind].model_validate(args)
        except KeyError as exc:
            problems.append(Problem(step.file, step.line, None, f"steps[{step.index}]",
                                    f"unknown variable {exc.args[0]!r}"))
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                arg = str(err["loc"][0]) if err["loc"] else ""
                line = step.arg_lines.get(arg) or step.line
                key = f"steps[{step.index}].{step.kind}" + (f".{arg}" if arg else "")
                problems.append(Problem(step.file, line, None, key, _error_text(err)))
    return problems


# --------------------------------------------------------------------------- running


@dataclass
class StepResult:
    """What one step did on one host."""

    playbook: str
    index: int
    name: str
    kind: str
    status: str  # "changed" | "ok" | "failed"
    commands: list[str] = field(default_factory=list)
    duration: float = 0.0
    error: str | None = None
    connection_lost: bool = False


METERED_BYTES = 4 * 1024 * 1024  # smaller pushes end before a progress line could help


def execute_ops(ops: list[Op], ctx: HostContext, label: str, timeout: float | None) -> None:
    """Run a step's operations, reporting its uploads' bytes (one meter for all of them) and
    the elapsed time of commands that run long."""
    from .meter import Heartbeat, TransferMeter

    if ctx.reporter is None:
        for op in ops:
            execute(op, ctx.transport, timeout)
        return
    sizes = {id(op): Path(op.local).stat().st_size for op in ops
             if isinstance(op, Upload) and op.local is not None}
    total = sum(sizes.values())
    meter = None
    if total >= METERED_BYTES:
        meter = TransferMeter(ctx.reporter, ctx.node.name, f"{label}: push {len(sizes)} file(s)", total)
    for op in ops:
        if meter is not None and id(op) in sizes:
            execute(op, ctx.transport, timeout, progress=meter.file_callback())
            meter.file_done(sizes[id(op)])
        elif isinstance(op, Shell):
            with Heartbeat(ctx.reporter, ctx.node.name, label):
                execute(op, ctx.transport, timeout)
        else:
            execute(op, ctx.transport, timeout)
    if meter is not None:
        meter.finish()


def facts_ahead(steps: Sequence[PlaybookStep], ctx: HostContext) -> list[F.Fact]:
    """The facts the given steps read before changing anything (up to the first step that
    does not resolve: it fails, and the steps after it do not run)."""
    out: list[F.Fact] = []
    for step in steps:
        try:
            out += step.resolve(ctx.variables).facts(ctx, step.sudo)
        except VcfslmError:
            break
    return out


def run_step(playbook: Playbook, step: PlaybookStep, ctx: HostContext, *, dry_run: bool,
             ahead: Sequence[PlaybookStep] = ()) -> StepResult:
    """Plan one step against the host's facts and (unless dry_run) run what it still needs.

    ahead: the steps that follow on this host (of every playbook of the run); when this
    step's facts are not gathered yet, theirs are gathered in the same round trip. A step
    that changes the host drops every cached fact, so later steps read them afresh.
    """
    started = time.monotonic()
    result = StepResult(playbook.name, step.index, step.name, step.kind, "ok")
    try:
        typed = step.resolve(ctx.variables)
        needed = typed.facts(ctx, step.sudo)
        if not all(ctx.has_fact(f) for f in needed):
            ctx.prefetch(needed + facts_ahead(ahead, ctx))
        ops = typed.plan(ctx, step.sudo)
        result.commands = [describe(op, ctx.user) for op in ops]
        if ops and not dry_run:
            try:
                execute_ops(ops, ctx, f"{playbook.name}: {step.name}", step.timeout)
            finally:
                ctx.forget()  # partly or fully changed: facts must be read again
        result.status = "changed" if ops else "ok"
    except VcfslmError as exc:
        result.status, result.error = "failed", str(exc)
        result.connection_lost = isinstance(exc, TransportError) and not isinstance(exc, CommandFailed)
    result.duration = time.monotonic() - started
    return result
