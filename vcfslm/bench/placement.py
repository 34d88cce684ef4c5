"""Placement facts of a rank: where its threads may run, where its memory lives, and
what the CPU and the PyTorch build can do for bf16.

The parsers are pure functions of text (tested on samples); `placement_facts()` reads
/proc, /sys and (when present) `numactl --show` for the calling process. torch is
passed in by the worker, so this module imports nothing heavy.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..engine.cpuinfo import parse_cpu_flags
from ..topology import format_cpu_list, parse_cpu_list
from .pages import huge_pages_facts

BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx512_vnni")
_NUMA_MAPS_NODE = re.compile(r"\bN(\d+)=(\d+)\b")
_NUMA_MAPS_PAGESIZE = re.compile(r"\bkernelpagesize_kB=(\d+)\b")


def parse_numa_maps(text: str) -> dict[int, int]:
    """Resident bytes per NUMA node from /proc/<pid>/numa_maps text."""
    per_node: dict[int, int] = {}
    for line in text.splitlines():
        size = _NUMA_MAPS_PAGESIZE.search(line)
        page = int(size.group(1)) * 1024 if size else 4096
        for node, pages in _NUMA_MAPS_NODE.findall(line):
            per_node[int(node)] = per_node.get(int(node), 0) + int(pages) * page
    return dict(sorted(per_node.items()))


def parse_numactl_show(text: str) -> dict[str, Any]:
    """`numactl --show` as a dict: policy, preferred node, cpubind/nodebind/membind lists."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key in ("physcpubind", "cpubind", "nodebind", "membind", "preferred"):
            out[key] = [int(v) for v in value.split()] if value else []
        elif key in ("policy", "preferred node"):
            out[key.replace(" ", "_")] = value
    return out


def parse_status_binding(status: str) -> dict[str, str]:
    """CPUs and memory nodes a task may use, from /proc/<pid>/status text.

    {"cpus": "0-23", "mems": "0"}; keys are absent when the text lacks them.
    """
    out: dict[str, str] = {}
    for line in status.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == "Cpus_allowed_list":
            out["cpus"] = value.strip()
        elif sep and key == "Mems_allowed_list":
            out["mems"] = value.strip()
    return out


def parse_task_cpu(stat: str) -> int | None:
    """The CPU a task last ran on: field 39 of /proc/<pid>/task/<tid>/stat.

    The command name (field 2) is in parentheses and may hold spaces, so fields are
    counted after its closing parenthesis.
    """
    _, sep, rest = stat.rpartition(")")
    fields = rest.split()
    # rest starts at field 3 (state); field 39 is at index 36.
    if not sep or len(fields) < 37:
        return None
    try:
        return int(fields[36])
    except ValueError:
        return None


def thread_cpus(task_dir: str | Path = "/proc/self/task") -> dict[int, dict[str, Any]]:
    """Each thread of this process: the CPU it last ran on and the CPUs it may use."""
    threads: dict[int, dict[str, Any]] = {}
    for entry in sorted(Path(task_dir).iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        if not entry.name.isdigit():
            continue
        cpu = parse_task_cpu(_read(str(entry / "stat")))
        allowed = parse_status_binding(_read(str(entry / "status"))).get("cpus")
        if cpu is not None:
            threads[int(entry.name)] = {"cpu": cpu, "allowed": allowed}
    return threads


def placement_problems(*, process_cpus: str | None, process_mems: str | None,
                       intended_cpus: str | None, intended_node: int | None,
                       threads: dict[int, dict[str, Any]] | None = None,
                       memory_node: int | None = None) -> list[str]:
    """Why a rank did not run where it was meant to (pure; [] when it did or nothing was meant).

    process_cpus/process_mems: what the process was given at start (numactl's binding,
    read before OpenMP bound its threads); intended_*: what the rank wrapper asked for;
    threads: thread_cpus(); memory_node: the node holding most of the rank's memory.
    """
    problems: list[str] = []
    given = set(parse_cpu_list(process_cpus)) if process_cpus else None
    if intended_cpus and given is not None and given != set(parse_cpu_list(intended_cpus)):
        problems.append(f"placement: process CPUs {process_cpus} != intended {intended_cpus}")
    if intended_node is not None and process_mems:
        mems = set(parse_cpu_list(process_mems))
        if mems != {intended_node}:
            problems.append(f"placement: memory nodes {process_mems} != intended node {intended_node}")
    if intended_node is not None and memory_node is not None and memory_node != intended_node:
        problems.append(f"placement: most memory on node {memory_node}, intended node {intended_node}")
    if given is not None and threads:
        outside = sorted({t["cpu"] for t in threads.values() if t["cpu"] not in given})
        if outside:
            problems.append(f"placement: threads ran on CPU(s) {format_cpu_list(outside)} outside "
                            f"{process_cpus}")
    return problems


def single_cpu_threads(threads: dict[int, dict[str, Any]]) -> list[int]:
    """CPUs of the threads bound to one CPU each, sorted (one CPU may appear several times).

    Under OMP_PROC_BIND the OpenMP threads are bound one per core; threads the main thread
    starts afterwards (gloo, compile workers) inherit its single core, so a core listed
    more than once is that, not two compute threads sharing it.
    """
    cpus = []
    for info in threads.values():
        allowed = info.get("allowed")
        if allowed and len(parse_cpu_list(allowed)) == 1:
            cpus.append(info["cpu"])
    return sorted(cpus)


def dominant_node(bytes_per_node: dict[int, int]) -> int | None:
    """The NUMA node holding most of the memory, None when unknown."""
    if not bytes_per_node:
        return None
    return max(bytes_per_node, key=lambda n: bytes_per_node[n])


def node_cpu_lists(sys_node_dir: str | Path = "/sys/devices/system/node") -> dict[int, tuple[int, ...]]:
    """CPUs of each online NUMA node ({0: all CPUs} when the kernel shows no NUMA)."""
    nodes: dict[int, tuple[int, ...]] = {}
    root = Path(sys_node_dir)
    for entry in sorted(root.glob("node[0-9]*")):
        try:
            cpus = parse_cpu_list((entry / "cpulist").read_text().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(entry.name[4:])] = cpus
    if not nodes:
        nodes[0] = tuple(sorted(os.sched_getaffinity(0)))
    return dict(sorted(nodes.items()))


def nodes_of_cpus(cpus: Iterable[int], node_cpus: dict[int, tuple[int, ...]]) -> list[int]:
    """NUMA nodes that own any of `cpus`."""
    wanted = set(cpus)
    return [node for node, owned in node_cpus.items() if wanted & set(owned)]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def numactl_show() -> dict[str, Any]:
    """This process's NUMA policy from `numactl --show` ({} when numactl is absent)."""
    exe = shutil.which("numactl")
    if not exe:
        return {}
    try:
        done = subprocess.run([exe, "--show"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_numactl_show(done.stdout) if done.returncode == 0 else {}


def bf16_facts(torch_module: Any | None = None, flags: set[str] | None = None) -> dict[str, Any]:
    """What the CPU and the PyTorch build offer bf16 inference (AMX / oneDNN hints)."""
    flags = parse_cpu_flags(_read("/proc/cpuinfo")) if flags is None else flags
    facts: dict[str, Any] = {"cpu_flags": sorted(f for f in BF16_FLAGS if f in flags),
                             "amx": "amx_bf16" in flags and "amx_tile" in flags,
                             "avx512_bf16": "avx512_bf16" in flags}
    if torch_module is not None:
        torch = torch_module
        facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        facts["mkldnn"] = bool(torch.backends.mkldnn.is_available())
        try:
            facts["onednn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            facts["onednn_bf16"] = False
        # oneDNN dispatches bf16 GEMMs to AMX tiles when the CPU has them and oneDNN
        # can use bf16 at all; the engine's packed weights are laid out for that path.
        facts["amx_in_use_likely"] = facts["amx"] and facts["onednn_bf16"]
    return facts


def versions(torch_module: Any | None = None) -> dict[str, str]:
    """Python, vcfslm, and (when given) torch / transformers versions."""
    from .. import __version__

    out = {"python": platform.python_version(), "vcfslm": __version__}
    if torch_module is not None:
        out["torch"] = torch_module.__version__
        try:
            import transformers

            out["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
    return out


def start_binding() -> dict[str, str]:
    """The CPUs and memory nodes this process was given (call before OpenMP starts).

    OpenMP under OMP_PROC_BIND binds the main thread to one core when its runtime
    starts; after that os.sched_getaffinity(0) reports that one core, not numactl's set.
    """
    return parse_status_binding(_read("/proc/self/status"))


def placement_facts(torch_module: Any | None = None, binding: dict[str, str] | None = None
                    ) -> dict[str, Any]:
    """Where this process runs and what it runs on (one dict per rank, kept per record).

    binding: start_binding() as read at process start (default: read now).
    """
    binding = binding or start_binding()
    affinity = sorted(parse_cpu_list(binding["cpus"])) if binding.get("cpus") else \
        sorted(os.sched_getaffinity(0))
    node_cpus = node_cpu_lists()
    memory = parse_numa_maps(_read("/proc/self/numa_maps"))
    threads = thread_cpus()
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_affinity": format_cpu_list(affinity),
        "cpus": len(affinity),
        "memory_nodes_allowed": binding.get("mems"),
        "thread_cpus": {str(tid): t["cpu"] for tid, t in threads.items()},
        "single_cpu_threads": single_cpu_threads(threads),
        "cpu_numa_nodes": nodes_of_cpus(affinity, node_cpus),
        "memory_numa_nodes": {str(k): v for k, v in memory.items()},
        "memory_numa_node": dominant_node(memory),
        "numa_policy": numactl_show(),
        "intended_numa_node": _int_or_none(os.environ.get("VCFSLM_NUMA_NODE")),
        "intended_cpus": os.environ.get("VCFSLM_CPUS"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        **huge_pages_facts(),
        "versions": versions(torch_module),
    }
    if torch_module is not None:
        facts["threads"] = torch_module.get_num_threads()
    facts.update(bf16_facts(torch_module))
    # VCFSLM_PIN: what the rank wrapper pinned with (numactl | taskset | none); unset for
    # a wrapper that predates it, which always pinned when it could.
    pinned_by = os.environ.get("VCFSLM_PIN")
    facts["pinned_by"] = pinned_by
    cpus_applied = pinned_by != "none"
    memory_applied = pinned_by in (None, "numactl")
    facts["problems"] = placement_problems(
        process_cpus=binding.get("cpus"), process_mems=binding.get("mems"),
        intended_cpus=facts["intended_cpus"] if cpus_applied else None,
        intended_node=facts["intended_numa_node"] if memory_applied else None,
        threads=threads, memory_node=facts["memory_numa_node"])
    return facts


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None
