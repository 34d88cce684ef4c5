"""The run contract: the facts that bind inventory, guest, bench, cli and analysis, each
stated once.

Every stage that needs one of these imports it from here and never re-derives it:

- compile modes of the decode step, and their legacy names;
- the default SLOs and the named presets;
- the guest layout (where the guest stage puts the venv, scripts, models and runs) and the
  model reference the worker on a guest is given;
- node selection (`--nodes N` / `--hosts A,B`), and a cluster run's nodes as the bench
  drives them (`NodeTarget`, sliced from the inventory by `targets_of`, in the CLI);
- the rendezvous budget of a cluster run (torchrun's and the workers' process group);
- the scenario matrix, its `--scenarios` filter, and its encoding on the worker's command
  line;
- run ids;
- the progress-line format the worker writes and the operator parses;
- the `RunMeta` builder.

Pure: no I/O beyond `Path.is_dir` on the operator's model path, no third-party imports.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from . import presets, topology
from .errors import InventoryError, Problem
from .results import RunMeta
from .servers import VLLM

# The decode step's compile modes, as runs record them (meta.json matrix.compile, each
# record's placement.compile_mode). Earlier versions offered Inductor freezing and GEMM
# autotuning, which held a second copy of the weights; those names now mean "compile".
COMPILE_MODES = ("compile", "eager")
LEGACY_COMPILE_MODES = {"autotune": "compile", "freezing": "compile", "default": "compile"}
# Every name a user or an old run may give (the CLI's and the worker's choices).
ACCEPTED_COMPILE_MODES = (*COMPILE_MODES, *LEGACY_COMPILE_MODES)
# Modes whose figures are the instrument's: eager leaves every op between the linears
# unfused, so its TPOT carries per-op overhead and is a baseline, not a measurement.
MEASUREMENT_MODES = ("compile",)


def normalize_compile_mode(mode: str) -> str:
    """A compile mode by its current name ('autotune' -> 'compile'); ValueError if unknown."""
    mode = LEGACY_COMPILE_MODES.get(mode, mode)
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; known: {', '.join(COMPILE_MODES)}")
    return mode


# ------------------------------------------------------------------ SLOs

# The brief's two service levels per user: SLO-A (interactive chat) and SLO-B (relaxed).
# The inventory's default `slos` and the report's default when a run names none.
DEFAULT_SLOS: dict[str, dict[str, float]] = {"A": {"tpot_ms": 130.0, "ttft_s": 3.0},
                                             "B": {"tpot_ms": 200.0, "ttft_s": 5.0}}

# Named SLOs a user may ask for by name (`--slo mlperf-server`) beside the inventory's.
# Each carries the percentile its source judges at: static cells are judged there, and a
# serving load by that share of its requests. `source` is what `--help` cites.
SLO_PRESETS: dict[str, dict[str, object]] = {
    "A": {**DEFAULT_SLOS["A"], "source": "the brief's SLO-A: low-latency conversational workloads"},
    "B": {**DEFAULT_SLOS["B"], "source": "the brief's SLO-B: streaming assistants (5 tokens/s per user)"},
    "mlperf-server": {"tpot_ms": 100.0, "ttft_s": 2.0, "percentile": "p99",
                      "source": "MLPerf Inference (datacenter) Llama-3.1-8B Server scenario: "
                                "TTFT 2 s, TPOT 100 ms at p99"},
    "mlperf-interactive": {"tpot_ms": 30.0, "ttft_s": 0.5, "percentile": "p99",
                           "source": "MLPerf Inference (datacenter) Llama-3.1-8B Interactive scenario: "
                                     "TTFT 0.5 s, TPOT 30 ms at p99"},
}


def presets_help() -> str:
    """One line per preset for `--help`: its name, limits and source."""
    return "; ".join(f"{name} ({p['source']})" for name, p in SLO_PRESETS.items())


# ------------------------------------------------------------------ guest layout


@dataclass(frozen=True)
class GuestPaths:
    """Where the guest stage puts things on every guest; the bench stage reads the same places."""

    workdir: str
    venv: str
    python: str
    torchrun: str
    launch_dir: str
    env_file: str
    rank_script: str
    hosts_file: str
    runs_dir: str
    models_dir: str
    wheels_dir: str
    wheelhouse_dir: str
    inductor_cache_dir: str
    # vLLM's CPU server (bench.serve.server: vllm): a venv of its own, never vcfslm's; its
    # entry file and one launch script per vNUMA node (vllm-node<N>.sh) are in launch_dir.
    vllm_venv: str
    vllm_python: str
    vllm_entry: str


# The Inductor cache of ranks that run on this machine (`bench --local`, the lab's guests)
# when TORCHINDUCTOR_CACHE_DIR does not name one: kept across runs, so a graph compiled
# once is loaded, not compiled, by every later run of the same torch and shapes.
HOST_INDUCTOR_CACHE = "~/.cache/vcfslm/inductor"


def host_inductor_cache(explicit: str | None, environ) -> Path:
    """`explicit`, else $TORCHINDUCTOR_CACHE_DIR, else HOST_INDUCTOR_CACHE (user expanded)."""
    return Path(explicit or environ.get("TORCHINDUCTOR_CACHE_DIR") or HOST_INDUCTOR_CACHE).expanduser()


def layout_paths(workdir: str, venv: str, vllm_venv: str) -> GuestPaths:
    """The guest layout under `workdir`, with vcfslm's venv and vLLM's (pure)."""
    work, venv, vllm_venv = workdir.rstrip("/"), venv.rstrip("/"), vllm_venv.rstrip("/")
    launch = f"{work}/launch"
    return GuestPaths(workdir=work, venv=venv, python=f"{venv}/bin/python",
                      torchrun=f"{venv}/bin/torchrun", launch_dir=launch,
                      env_file=f"{launch}/env.sh", rank_script=f"{launch}/rank.sh",
                      hosts_file=f"{launch}/hosts", runs_dir=f"{work}/runs",
                      models_dir=f"{work}/models", wheels_dir=f"{work}/wheels",
                      wheelhouse_dir=f"{work}/wheelhouse",
                      inductor_cache_dir=f"{work}/cache/inductor",
                      vllm_venv=vllm_venv, vllm_python=f"{vllm_venv}/bin/python",
                      vllm_entry=f"{launch}/{VLLM.entry}")


def guest_paths(inventory) -> GuestPaths:
    """The inventory's guest layout (the guest stage's reading; the bench gets it in its
    NodeTargets)."""
    work = inventory.guest.workdir.rstrip("/")
    return layout_paths(work, inventory.guest.venv_path, inventory.bench.serve.vllm.venv_path(work))


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A path the user wrote as one, even before the folder exists on this machine.
_PATH_PREFIXES = ("/", "./", "../", "~")


def model_kind(model: str) -> str | None:
    """'synthetic', 'dir' (a local folder pushed to the guest), 'hub', or None (none of these)."""
    if model.startswith("synthetic:"):
        return "synthetic"
    if model.startswith(_PATH_PREFIXES) or Path(model).expanduser().is_dir():
        return "dir"
    if _HUB_ID.match(model):
        return "hub"
    return None


def model_slug(model: str) -> str:
    """A model source as one folder name (the guest's staged-model folders)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")


def synthetic_config_on_guest(models_dir: str, model: str) -> str:
    """Where a `synthetic:config=PATH` source's config file is staged on a guest."""
    return f"{models_dir.rstrip('/')}/{model_slug(model)}/config.json"


def guest_model(model: str, models_dir: str) -> str:
    """A model source as the worker on a guest names it: synthetic spec (a config file at
    its staged place under `models_dir`), hub id, or staged folder (pure)."""
    if model_kind(model) == "dir":
        return f"{models_dir.rstrip('/')}/{Path(model).expanduser().name}"
    if model_kind(model) == "synthetic":
        spec = presets.parse_synthetic(model)
        if spec.config_path is not None:
            staged = synthetic_config_on_guest(models_dir, model)
            return str(presets.SyntheticSpec(config_path=staged, layers=spec.layers))
    return model


def model_ref(inventory) -> str:
    """The inventory's guest.model as the worker on a guest names it (guest_model)."""
    return guest_model(inventory.guest.model, guest_paths(inventory).models_dir)


# ------------------------------------------------------------------ node selection


# How many hosts one stage works on at once. Both caps are raised or lowered per run
# (`--parallel`) or per inventory (`vcenter.parallel`, `guest.parallel`).
#
# vCenter: each worker keeps one call or task in flight, all on one session, so the cap is
# this run's share of vCenter's concurrency:
# - vCenter executes about 640 concurrent operations before it queues incoming requests and
#   holds 2,000 sessions before it refuses logins (VMware performance blog, "vCenter Limits
#   for Tasks Running at the Same Time", 2021-02; the same SOAP limits in "Endpoint Limits
#   for Concurrent REST Requests from vCenter APIs", 2022-07). 64 is a tenth of the 640,
#   the rest left to the other tenants of a shared vCenter.
# - vpxd's resource manager charges clones and migrations against a cost limit per host
#   (vpxd.ResourceManager.maxCostPerEsx6xHost = 16; 8 before ESXi 6.0) and per datastore
#   (maxCostPerEsx6xDs = 128) (Broadcom KB 326281; a provisioning operation costs a host 1,
#   vSphere 6.x "Limits on Simultaneous Migrations") and queues, never fails, what is over
#   them. One VM per host keeps every destination host far below its limit; the template's
#   host and datastore are charged by every clone, and vCenter itself queues the surplus,
#   so more workers only move that wait into vCenter's queue while the other steps
#   (reconfigure, customize, power on) run on all hosts at once.
# - 64 takes a 64-host workload domain in one wave instead of four.
# SSH to guests has no such shared server: the operator's file descriptors and CPU are
# the limit.
VCENTER_PARALLEL_CAP = 64
GUEST_PARALLEL_CAP = 64


def parallelism(requested: int | None, items: int, cap: int) -> int:
    """Workers for `items` hosts: what was asked for, else every host up to `cap`; at least 1."""
    wanted = requested if requested is not None else min(items, cap)
    return max(1, min(wanted, max(items, 1)))


def select_nodes(inventory, count: int | None = None, names: Iterable[str] | None = None) -> list:
    """The inventory's nodes named in `names` (in inventory order), else its first `count`
    (all when None). InventoryError names the flag and the nodes the inventory has."""
    nodes = list(inventory.nodes)
    known = [n.name for n in nodes]
    wanted = [n.strip() for n in names or () if n.strip()]
    if wanted:
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise InventoryError([Problem(inventory.source, None, None, "--hosts",
                                          f"unknown node(s) {', '.join(unknown)}; the inventory has "
                                          + ", ".join(sorted(known)))])
        return [n for n in nodes if n.name in set(wanted)]
    count = len(nodes) if count is None else count
    if count < 1 or count > len(nodes):
        raise InventoryError([Problem(inventory.source, None, None, "--nodes",
                                      f"{count} nodes asked, the inventory has {len(nodes)}")])
    return nodes[:count]


@dataclass(frozen=True)
class NodeTarget:
    """One node of a cluster run as the bench drives it: where SSH reaches it, where its
    ranks meet, the guest layout the guest stage left on it, and where each of its local
    ranks runs (what the rendered rank.sh must apply, which the preflight checks). The CLI
    slices these from the inventory (`targets_of`); nothing below it reads the inventory."""

    name: str
    address: str                         # management IP (SSH)
    ssh_port: int
    bench_ip: str                        # the bench network; node 0's is the rendezvous
    rdzv_port: int                       # torchrun's static rendezvous, on node 0's bench IP
    paths: GuestPaths
    slots: tuple[topology.RankSlot, ...]


def targets_of(inventory, names: Sequence[str], ranks: int | None = None,
               threads: int | None = None) -> tuple[NodeTarget, ...]:
    """The inventory's nodes named in `names` (inventory order) as NodeTargets, each with
    `ranks` ranks of `threads` threads placed on the VM's vNUMA nodes (default: the
    inventory's bench settings). InventoryError when a name is unknown (select_nodes) or
    the ranks do not fit the VM the inventory describes."""
    vm, bench = inventory.vm, inventory.bench
    ranks = ranks or bench.ranks_per_node
    threads = threads or bench.threads_per_rank
    try:
        slots = tuple(topology.rank_slots(vm.vcpus, vm.vnuma_nodes, ranks, threads))
    except ValueError as exc:
        raise InventoryError([Problem(inventory.source, None, None, "vm",
                                      f"{ranks} rank(s) of {threads} thread(s) per node: {exc}")]) from None
    paths = guest_paths(inventory)
    return tuple(NodeTarget(n.name, str(n.management_ip), int(n.ssh_port), str(n.bench_ip), int(bench.port),
                            paths, slots)
                 for n in select_nodes(inventory, names=names))


# ------------------------------------------------------------------ the rendezvous

# How long the ranks of a cluster run may take to meet grows with the cluster: torchrun's
# static rendezvous waits for every node's agent at node 0's store, and each worker's gloo
# group then reads every other rank's address from that store. The launcher hands the
# budget to torchrun (--rdzv-conf timeout=) and to the workers (--timeout); the operator
# reports it.
#
# The base is torch's own static-rendezvous default (a cold guest importing torch, a slow
# VM): small runs wait no less than torchrun would by itself.
RDZV_BASE_S = 600
# Per node: its torchrun starts only after the operator's SSH launch reaches it, and the
# launches go out in waves of the guest fan-out; a loaded guest starts later still.
RDZV_PER_NODE_S = 5
# Per rank pair: gloo's full mesh makes every rank read every other rank's key from
# node 0's one store (world_size^2 reads, each ~8 bytes x world_size), then connect.
RDZV_PER_RANK_PAIR_S = 0.002
# The worker's process-group timeout also bounds every collective, and a barrier waits
# for the slowest rank's window: it never drops below the worker's own default.
COLLECTIVE_TIMEOUT_S = 1800


def rendezvous_timeout_s(nodes: int, ranks_per_node: int = 1) -> int:
    """Seconds the ranks of a `nodes` x `ranks_per_node` run may take to meet (whole seconds:
    torchrun's static rendezvous reads its `timeout` as an int)."""
    world = max(1, nodes) * max(1, ranks_per_node)
    return math.ceil(RDZV_BASE_S + RDZV_PER_NODE_S * max(1, nodes) + RDZV_PER_RANK_PAIR_S * world * world)


def process_group_timeout_s(nodes: int, ranks_per_node: int = 1) -> int:
    """The worker's gloo timeout: its init waits for every rank (the rendezvous budget), its
    collectives for the slowest window (never less than COLLECTIVE_TIMEOUT_S)."""
    return max(COLLECTIVE_TIMEOUT_S, rendezvous_timeout_s(nodes, ranks_per_node))


# ------------------------------------------------------------------ the scenario matrix

Scenario = tuple[int, int, int]    # (batch per rank, input tokens, output tokens)


def scenario_patterns(text: str | None) -> list[str]:
    """`--scenarios '1x*,16x128'` as its patterns ([] = every scenario)."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def scenario_selected(scenario: Scenario, patterns: Sequence[str]) -> bool:
    """Whether BATCHxINPUT matches one of the patterns ('*' wildcard); no patterns, all do."""
    return not patterns or any(fnmatchcase(f"{scenario[0]}x{scenario[1]}", p) for p in patterns)


@dataclass(frozen=True)
class Matrix:
    """What a run measures: the scenarios (batch x input, one output length) and windows."""

    batch_sizes: tuple[int, ...]
    input_tokens: tuple[int, ...]
    output_tokens: int
    warmup: int = 1
    repeats: int = 3

    def scenarios(self, pattern: str | None = None) -> list[Scenario]:
        """Run order: batch, then input length; only those `pattern` selects."""
        patterns = scenario_patterns(pattern)
        return [(b, i, self.output_tokens) for b in sorted(set(self.batch_sizes))
                for i in sorted(set(self.input_tokens))
                if scenario_selected((b, i, self.output_tokens), patterns)]

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "input_tokens": list(self.input_tokens),
                "output_tokens": self.output_tokens, "warmup": self.warmup, "repeats": self.repeats}

    def to_json(self) -> str:
        """The matrix as the launcher hands it to the worker (`--matrix`): one JSON object,
        so the worker reads the same typed values instead of re-parsing comma lists."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Matrix:
        """`to_json`'s inverse, every field required; ValueError says which one is wrong (the
        worker's usage error)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")

        def count(name: str) -> int:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
            return value

        def positives(name: str) -> tuple[int, ...]:
            values = data.get(name)
            if (not isinstance(values, list) or not values
                    or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values)):
                raise ValueError(f"{name}: expected a list of positive integers, got {values!r}")
            return tuple(values)

        return cls(positives("batch_sizes"), positives("input_tokens"), count("output_tokens"),
                   count("warmup"), count("repeats"))

    @classmethod
    def of_inventory(cls, bench, *, output_tokens: int | None = None,
                     repeats: int | None = None) -> Matrix:
        """The inventory's `bench` matrix, with the run's overrides."""
        return cls(tuple(bench.batch_sizes), tuple(bench.input_tokens),
                   output_tokens or bench.output_tokens, bench.warmup, repeats or bench.repeats)

    @classmethod
    def of_record(cls, matrix: dict[str, Any]) -> Matrix:
        """The matrix as meta.json records it (a scalar where a list belongs is one value)."""
        def ints(value) -> tuple[int, ...]:
            if value is None:
                return ()
            return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))

        outputs = ints(matrix.get("output_tokens"))
        return cls(ints(matrix.get("batch_sizes")), ints(matrix.get("input_tokens")),
                   outputs[0] if outputs else 0, int(matrix.get("warmup", 1) or 0),
                   int(matrix.get("repeats") or 1))


def matrix_record(matrix: Matrix, *, compile_mode: str, scenarios: str | None,
                  seed: int | None = None, serve=None, percentile: str | None = None,
                  server=None) -> dict[str, Any]:
    """meta.json's `matrix`: what the run measures and how (a resume repeats exactly this).
    A serving run adds `serve`: its ServeSpec (vcfslm.serving), whose `attainment` is the
    serving rule; `judging.percentile` is the static rule the run asked for (vcfslm.judging),
    the report's default when it is given none."""
    out = {**matrix.to_dict(), "compile": compile_mode, "scenarios": scenarios}
    if seed is not None:
        out["seed"] = seed
    if percentile is not None:
        out["judging"] = {"percentile": percentile}
    if serve is not None:
        out["serve"] = serve.to_dict()
        if server is not None and not server.in_process:
            out["server"] = server.to_dict()    # an HTTP server served (vcfslm.servers.ServerSpec)
    return out


# ------------------------------------------------------------------ serving runs


def serve_matrix(spec) -> Matrix:
    """The static matrix a serving run's workers take: batch = the slots, the spec's
    contexts. It sizes the numerics gate (run at the slots' batch and context) and makes
    the run's matrix say what shapes were compiled."""
    return Matrix((spec.slots,), tuple(spec.input_tokens), spec.output_tokens, 0, spec.repeats)


def serve_limits(slos: dict[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """SLO name -> {tpot_ms, ttft_s} for the serving worker (goodput, the sweep): the run's
    SLOs, else the defaults."""
    chosen = slos or DEFAULT_SLOS
    return {name: {"tpot_ms": spec.get("tpot_ms"), "ttft_s": spec.get("ttft_s"),
                   **({"ttft_per_token_ms": spec["ttft_per_token_ms"]} if spec.get("ttft_per_token_ms") else {}),
                   **({"percentile": spec["percentile"]} if spec.get("percentile") else {})}
            for name, spec in chosen.items() if isinstance(spec, dict)}


def serve_complete(records: Iterable[Any], spec, world_size: int) -> bool:
    """Every rank has `repeats` windows of every load asked for in every context (a sweep
    may stop its grid early, so there each context needs its first load). Every load
    measured needs all ranks in each window it has: its `repeats` windows when it was
    measured as a grid or bisection load, or the extra windows (numbered from `repeats`)
    the sweep's refinement measured it in when it proposed the load inside a gap."""
    have: dict[tuple, set[tuple[int, int]]] = {}
    for r in records:
        have.setdefault((r.input_tokens, float(r.load)), set()).add((r.rank, r.window))
    ranks = range(world_size)
    full = {(rank, w) for rank in ranks for w in range(spec.repeats)}

    def whole(got: set[tuple[int, int]]) -> bool:
        windows = {w for _, w in got}
        in_grid = any(w < spec.repeats for w in windows)
        return (not in_grid or full <= got) and all((rank, w) in got for rank in ranks for w in windows)

    for input_tokens in spec.input_tokens:
        loads = {load for (i, load) in have if i == input_tokens}
        wanted = {float(min(spec.loads))} if spec.sweep else {float(v) for v in spec.loads}
        if not wanted <= loads or not all(full <= have[(input_tokens, load)] for load in wanted) \
                or not all(whole(have[(input_tokens, load)]) for load in loads):
            return False
    return True


def recorded_scenarios(matrix: dict[str, Any]) -> list[Scenario]:
    """The scenarios a recorded matrix asked for, its `--scenarios` filter applied."""
    return Matrix.of_record(matrix).scenarios(matrix.get("scenarios"))


# ------------------------------------------------------------------ run ids


def new_run_id(prefix: str, nodes: int, now: datetime | None = None) -> str:
    """`<prefix>-<nodes>n-<UTC time>`: the inventory's name for a cluster run, `local` for one
    on this machine. Sorted by name, runs of one prefix sort by time."""
    now = now or datetime.now(timezone.utc)
    return f"{prefix}-{nodes}n-{now.astimezone(timezone.utc):%Y%m%d-%H%M%S}"


# ------------------------------------------------------------------ progress lines

# The worker writes one line per event, this prefix then one JSON object; the operator
# finds it anywhere in a line (torchrun prefixes teed lines with "[defaultN]:").
PROGRESS_PREFIX = "VCFSLM-PROGRESS "


def format_progress(event: dict[str, Any]) -> str:
    """One progress line (no newline) for `event`."""
    return PROGRESS_PREFIX + json.dumps(event, sort_keys=True, default=str)


def parse_progress(text: str) -> dict[str, Any] | None:
    """The progress event on a line, if any (a broken one is ignored, not fatal)."""
    i = text.find(PROGRESS_PREFIX)
    if i < 0:
        return None
    try:
        event = json.loads(text[i + len(PROGRESS_PREFIX):])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


# ------------------------------------------------------------------ run metadata


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
