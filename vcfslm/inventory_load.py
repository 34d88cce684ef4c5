"""Reading the inventory: `load_inventory(path)` returns a validated, frozen `Inventory`
(vcfslm.inventory's schema) or raises `InventoryError` listing every problem at once, each
naming the file, line, column and key path (`cluster.yaml:14:5 vm.vnuma_nodes: ...`): the
schema's own, a secret written in the file, and the rules across sections the schema cannot
state per field (`semantic_problems`). Nothing is contacted while loading."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from . import footprint, presets, topology
from .errors import InventoryError, Problem
from .inventory import GUEST_OVERHEAD_BYTES, Inventory
from .yamldoc import Key, load_mapping, pydantic_problems, read_document

# A key naming one of these words (as a whole word) holds a secret, unless it names an env var.
SECRET_KEY_RE = re.compile(r"(^|[_.-])(password|passwd|pwd|secret|token|apikey|api_key)($|[_.-])",
                           re.IGNORECASE)


def semantic_problems(inv: Inventory) -> list[tuple[Key, str]]:
    """Cross-field rules pydantic cannot express per field: (key path, message) pairs."""
    out: list[tuple[Key, str]] = []
    vm, bench = inv.vm, inv.bench
    if vm.vcpus % vm.vnuma_nodes:
        out.append((("vm", "vnuma_nodes"),
                    f"{vm.vcpus} vCPUs cannot split into {vm.vnuma_nodes} vNUMA nodes"))
    else:
        for msg in topology.cores_per_socket_problems(vm.vcpus, vm.cores_per_socket, vm.vnuma_nodes):
            out.append((("vm", "cores_per_socket"), msg))
        placement = topology.placement_problems(vm.vcpus, vm.vnuma_nodes, bench.ranks_per_node,
                                                bench.threads_per_rank)
        for msg in placement:
            out.append((("bench", "threads_per_rank"), msg))
        if bench.serve.server == "vllm" and not placement:
            out.extend(_vllm_problems(inv))
    if vm.host_numa_nodes and len(set(vm.host_numa_nodes)) != len(vm.host_numa_nodes):
        out.append((("vm", "host_numa_nodes"), "host NUMA nodes must be unique"))
    if vm.host_numa_nodes and len(vm.host_numa_nodes) < vm.vnuma_nodes:
        out.append((("vm", "host_numa_nodes"),
                    f"{len(vm.host_numa_nodes)} host NUMA node(s) cannot back {vm.vnuma_nodes} "
                    "vNUMA nodes"))
    for field_name in ("name", "host", "management_ip", "bench_ip"):
        seen: dict[str, int] = {}
        for i, node in enumerate(inv.nodes):
            value = str(getattr(node, field_name))
            if value in seen:
                out.append((("nodes", i, field_name),
                            f"{value} is already used by nodes[{seen[value]}]"))
            else:
                seen[value] = i
    # The bench network is known by its netmask: node 0's bench IP fixes the subnet.
    bench_net = inv.placement.networks.bench.network_of(inv.nodes[0].bench_ip)
    mgmt = inv.placement.networks.management
    mgmt_net = mgmt.network_of(mgmt.gateway) if mgmt.gateway else None
    for i, node in enumerate(inv.nodes):
        if node.bench_ip not in bench_net:
            out.append((("nodes", i, "bench_ip"),
                        f"{node.bench_ip} is outside the bench network {bench_net}"))
        if mgmt_net is not None and node.management_ip not in mgmt_net:
            out.append((("nodes", i, "management_ip"),
                        f"{node.management_ip} is outside the management network {mgmt_net} "
                        f"(gateway {mgmt.gateway})"))
    out.extend(_model_problems(inv))
    out.extend(_memory_problems(inv))
    out.extend(_service_problems(inv))
    return out


def _service_problems(inv: Inventory) -> list[tuple[Key, str]]:
    """The deployment's nodes exist, and its ports do not collide on one node."""
    service, names = inv.serve, [n.name for n in inv.nodes]
    out: list[tuple[Key, str]] = []
    for i, name in enumerate(service.nodes or ()):
        if name not in names:
            out.append((("serve", "nodes", i), f"no node is named {name!r} (nodes: {', '.join(names)})"))
    serving = service.nodes or names
    if service.router.node is not None and service.router.node not in serving:
        out.append((("serve", "router", "node"),
                    f"{service.router.node!r} runs no server of the deployment (serving nodes: {', '.join(serving)})"))
    servers = range(service.port, service.port + inv.vm.vnuma_nodes)
    others = {("serve", "front_door", "port"): service.front_door.port,
              ("serve", "router", "port"): service.router.port,
              ("serve", "router", "prometheus_port"): service.router.prometheus_port}
    seen: dict[int, Key] = {}
    for key, port in others.items():
        if port in servers:
            out.append((key, f"port {port} is one of the servers' ({servers.start}-{servers.stop - 1}, "
                             f"serve.port + vNUMA node)"))
        elif port in seen:
            out.append((key, f"port {port} is already serve.{'.'.join(map(str, seen[port][1:]))}"))
        seen.setdefault(port, key)
    return out


def service_model_problems(inv: Inventory) -> list[tuple[Key, str]]:
    """What `serve up` needs of the model beyond what every inventory needs: vLLM serves a
    folder or a hub id, never a synthetic shape."""
    if inv.guest.model.startswith("synthetic:"):
        return [(("guest", "model"), SERVER_NEEDS_FOLDER.format(server="vllm", model=inv.guest.model)
                 .replace("bench.serve.server vllm", "serve up"))]
    return []


def serve_settings(inv: Inventory) -> dict[str, Any]:
    """bench.serve as the run's settings read it: a workload file relative to the inventory's
    folder made absolute, so it reads the same from any working folder."""
    out = inv.bench.serve.model_dump()
    workload = out.get("workload")
    if workload and inv.source not in ("<memory>", "<inventory>"):
        prefix, _, path = workload.rpartition(":") if workload.startswith("mooncake:") else ("", "", workload)
        if path.endswith((".jsonl", ".json")) and not Path(path).expanduser().is_absolute():
            absolute = str(Path(inv.source).resolve().parent / path)
            out["workload"] = f"{prefix}:{absolute}" if prefix else absolute
    return out


def located(inv: Inventory, pairs: list[tuple[Key, str]]) -> InventoryError:
    """Problems found after loading, placed at their file, line and key (the source is read again)."""
    try:
        text = Path(inv.source).read_text()
    except OSError:
        text = "{}"
    _, locate = load_mapping(text, inv.source, InventoryError, "the inventory must be a mapping")
    return InventoryError(_ordered([locate(k, m) for k, m in pairs]))


def _vllm_problems(inv: Inventory) -> list[tuple[Key, str]]:
    """vLLM runs one server per vNUMA node on its rank's CPUs, less the reserved ones."""
    bench = inv.bench
    out: list[tuple[Key, str]] = []
    per_node = topology.ranks_per_vnuma_node(bench.ranks_per_node, inv.vm.vnuma_nodes)
    if per_node > 1:
        out.append((("bench", "ranks_per_node"),
                    f"bench.serve.server vllm runs one server per vNUMA node: {bench.ranks_per_node} ranks "
                    f"on {inv.vm.vnuma_nodes} vNUMA node(s) would share one (at most "
                    f"{inv.vm.vnuma_nodes}, one per vNUMA node)"))
    reserved = bench.serve.vllm.reserved_cores
    if reserved >= bench.threads_per_rank:
        out.append((("bench", "serve", "vllm", "reserved_cores"),
                    f"{reserved} reserved core(s) leave none of a rank's {bench.threads_per_rank} CPUs "
                    f"(bench.threads_per_rank) to its vLLM server"))
    if inv.guest.model.startswith("synthetic:"):
        out.append((("guest", "model"), SERVER_NEEDS_FOLDER.format(server="vllm", model=inv.guest.model)))
    return out


SERVER_NEEDS_FOLDER = ("bench.serve.server {server} serves a model folder, not {model}: write one with "
                       "`vcfslm model write SOURCE models/NAME` (synthetic:tiny-64 for a tiny model: vLLM's CPU "
                       "attention takes no head of 16) and set guest.model to it")


def _memory_problems(inv: Inventory) -> list[tuple[Key, str]]:
    """Will the replicas fit: all of them in the VM, and each vNUMA node's in that node's
    memory (a rank is bound to its node's memory; numactl --membind fails past it)?"""
    shape = footprint.shape_of(inv.guest.model)
    if shape is None:
        return []
    bench = inv.bench
    context = max(bench.input_tokens) + bench.output_tokens
    batch = max(bench.batch_sizes)
    per_rank = footprint.rank_memory_bytes(shape, batch, context)
    gib = 1024**3
    replica = footprint.replica_breakdown(shape, batch, context)
    need = bench.ranks_per_node * per_rank + GUEST_OVERHEAD_BYTES
    have = inv.vm.memory_gb * gib
    if need > have:
        return [(("vm", "memory_gb"),
                 f"{inv.vm.memory_gb} GiB is too small: {bench.ranks_per_node} replicas x ({replica}) + "
                 f"{GUEST_OVERHEAD_BYTES // gib} GiB guest overhead = {need / gib:.1f} GiB")]
    nodes = inv.vm.vnuma_nodes
    per_node = topology.ranks_per_vnuma_node(bench.ranks_per_node, nodes)
    node_memory = (have - GUEST_OVERHEAD_BYTES) / nodes
    short = footprint.node_shortfall(shape, per_node, batch, context, node_memory)
    if short is None:
        return []
    return [(("guest", "model"),
             f"{inv.guest.model} does not fit a vNUMA node: {per_node} replica(s) x ({replica}) = "
             f"{short / gib:.1f} GiB, and a node holds {node_memory / gib:.1f} GiB "
             f"(vm.memory_gb {inv.vm.memory_gb} less {GUEST_OVERHEAD_BYTES // gib} GiB guest overhead, "
             f"over {nodes} vNUMA nodes)")]


def _model_problems(inv: Inventory) -> list[tuple[Key, str]]:
    """A synthetic source must name a preset (or a config file that reads as a decoder config)."""
    model = inv.guest.model
    if not model.startswith(presets.SYNTHETIC_PREFIX):
        return []
    try:
        spec = presets.parse_synthetic(model)
        if spec.config_path is not None:
            presets.config_values(spec)
    except presets.SyntheticSpecError as exc:
        return [(("guest", "model"), str(exc))]
    return []


# --------------------------------------------------------------------- loading


def load_inventory(path: str | Path) -> Inventory:
    """Read, parse and validate an inventory file; InventoryError lists every problem."""
    return parse_inventory(read_document(path, InventoryError), str(path))


def parse_inventory(text: str, label: str = "<inventory>") -> Inventory:
    """Validate inventory YAML text; `label` names it in error messages."""
    data, locate = load_mapping(text, label, InventoryError, "the inventory must be a mapping of keys "
                                                             "(name, vcenter, placement, vm, nodes, ...)")
    problems = [locate(k, m) for k, m in _secret_keys(data)]
    try:
        inv = Inventory.model_validate(data)
    except ValidationError as exc:
        # a secret's key is already reported, with better advice
        secrets = {k for k, _ in _secret_keys(data)}
        problems.extend(pydantic_problems(exc, data, locate, Inventory, skip=secrets))
        raise InventoryError(_ordered(problems)) from None
    problems.extend(locate(k, m) for k, m in semantic_problems(inv))
    if problems:
        raise InventoryError(_ordered(problems))
    inv._source = label
    return inv


def _ordered(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line or 0, p.column or 0, p.key))


def _secret_keys(data: Any, key: Key = ()) -> list[tuple[Key, str]]:
    """Keys that look like a secret written in the file (refused: secrets come from elsewhere)."""
    out: list[tuple[Key, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            name = str(k).lower()
            if SECRET_KEY_RE.search(name) and not name.endswith("_env") and v not in (None, ""):
                out.append((key + (str(k),), "secrets are not written in the inventory; set "
                                             "vcenter.password_env (an environment variable), use "
                                             "the keyring, or answer the prompt"))
            else:
                out.extend(_secret_keys(v, key + (str(k),)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.extend(_secret_keys(v, key + (i,)))
    return out
