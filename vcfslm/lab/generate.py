"""The lab's generated files, as pure functions: its inventory document and its env file.

The inventory follows the project's schema (vcfslm/inventory.py) and names the
simulator's objects (DC0, DC0_C0, DC0_C0_H<i>, LocalDS_0, "VM Network",
DC0_DVPG0, the lab template). Its VM shape is this machine's real one (the
guests are this machine), so in-guest NUMA verification passes for real.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import footprint, presets, topology, vm_settings
from ..contract import DEFAULT_SLOS
from ..inventory import GUEST_OVERHEAD_BYTES
from . import vcsim as sim

LAB_NAME = "lab"
VM_FOLDER = "vcfslm-lab"
PASSWORD_ENV = "VCFSLM_VCENTER_PASSWORD"
INVENTORY_ENV = "VCFSLM_INVENTORY"
LOOPBACK_NETMASK = "255.0.0.0"   # 127.0.0.0/8: management and bench addresses all live on `lo`
LOOPBACK_MTU = 65536
SIM_HOST_NUMA_NODES = 4          # the simulated VX650 V4 host (vcsim/main.go)
# The schema adds a fixed 8 GiB guest-OS overhead to the model replicas; below 9 GiB a lab
# machine could not describe itself although synthetic:tiny needs only megabytes.
# The lab VMs' memory: fixed, because this machine's NUMA-visible memory moves (memory
# ballooning) and a changing size would make every `lab up` a restart-pending change.
# 16 GiB holds the inventory's 8 GiB guest overhead plus two tiny replicas, or one
# Phi-3-mini replica (DEMO_MODEL=synthetic:phi-3-mini).
LAB_MEMORY_GB = 16
SYS_NODES = Path("/sys/devices/system/node")
LAB_TORCH = "2.13.0"             # the torch the lab's guests install (constraints.txt pins the same)
# The lab's model when none is named: the test suite's tiny Phi-3 (megabytes, compiles in
# seconds), under the quick matrix below. `lab up --model` names another (`make demo` does).
LAB_MODEL = "synthetic:tiny"
QUICK_BATCHES = [1, 2]
# Any other model gets the brief's batches per rank (its 4, 16, 32 and 64 streams per VM).
BRIEF_BATCHES = [1, 4, 8, 16]
LAB_INPUT_TOKENS = [16, 32]
LAB_OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class LabBench:
    """What the lab benchmarks: the guests' model (which sets the matrix, bench_section), the
    inventory's SLOs (None: the brief's) and comment lines saying where they come from."""

    model: str = LAB_MODEL
    slos: Mapping[str, Mapping[str, float]] | None = None
    slo_notes: Sequence[str] = ()


@dataclass(frozen=True)
class MachineShape:
    """What a lab guest really sees: CPUs, NUMA nodes, memory. own_cores: the CPUs are the
    guest's own (lab up --cores-per-node), not the machine's shared by every guest."""

    cpus: int
    numa_nodes: int
    memory_gib: int
    own_cores: bool = False


@dataclass(frozen=True)
class LabNode:
    """One lab node: its simulated ESXi host and its loopback sshd guest."""

    name: str
    host: str
    management_ip: str
    bench_ip: str
    ssh_port: int


@dataclass(frozen=True)
class LabVcenter:
    """The lab's vCenter (its vcsim): where it listens, who logs in, the CA its TLS is
    verified with, and the template VMs are cloned from."""

    host: str
    port: int
    user: str
    ca_bundle: str
    template: str


@dataclass(frozen=True)
class LabGuestLogin:
    """How the lab's guests are reached and where they work: the SSH user, key and
    known_hosts file, and the work folder the guests share."""

    user: str
    ssh_key: str
    known_hosts: str
    workdir: str


def machine_shape(sys_nodes: Path = SYS_NODES, meminfo: Path = Path("/proc/meminfo"),
                  cpus: Sequence[int] | None = None) -> MachineShape:
    """This machine's CPUs (usable by us), NUMA nodes and NUMA-visible memory; with `cpus` (a
    guest's own, lab up --cores-per-node) those CPUs and the NUMA nodes they are on."""
    if cpus is not None:
        count = len(cpus)
    else:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    nodes = sorted(p for p in sys_nodes.glob("node[0-9]*") if (p / "meminfo").exists())
    kib = sum(_meminfo_kib((p / "meminfo").read_text()) for p in nodes) if nodes else 0
    if not kib:
        try:
            kib = _meminfo_kib(meminfo.read_text())
        except OSError:
            kib = 0
    numa_nodes = len(nodes) if cpus is None else len(_nodes_holding(nodes, cpus))
    return MachineShape(cpus=max(count, 1), numa_nodes=max(numa_nodes, 1),
                        memory_gib=kib // (1024 * 1024), own_cores=cpus is not None)


def _nodes_holding(nodes: Sequence[Path], cpus: Sequence[int]) -> list[Path]:
    """The NUMA node folders whose cpulist holds any of `cpus`."""
    wanted = set(cpus)
    out = []
    for node in nodes:
        try:
            listed = set(topology.parse_cpu_list((node / "cpulist").read_text().strip()))
        except (OSError, ValueError):
            continue
        if listed & wanted:
            out.append(node)
    return out


def _meminfo_kib(text: str) -> int:
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if "MemTotal" in parts:
            return int(parts[parts.index("MemTotal") + 1])
    return 0


def vm_section(shape: MachineShape) -> dict[str, Any]:
    """The `vm:` block sized to the machine: all CPUs, one vNUMA node per NUMA node when even."""
    vnuma = shape.numa_nodes
    if vnuma > SIM_HOST_NUMA_NODES or shape.cpus % vnuma:
        vnuma = 1
    return {
        "vcpus": shape.cpus,
        "cores_per_socket": shape.cpus // vnuma,
        "vnuma_nodes": vnuma,
        "memory_gb": LAB_MEMORY_GB,
        "reserve_all_memory": True,
        "hardware_version": sim.TEMPLATE_HARDWARE_VERSION,
        "host_numa_nodes": list(range(vnuma)),
        "advanced": {},
        # Each vCenter setting the inventory names, as the settings table's lab row says.
        **vm_settings.lab_values(),
    }


def lab_vnuma_nodes(shape: MachineShape) -> int:
    """The lab VM's vNUMA nodes: one per NUMA node of this machine when its CPUs split evenly."""
    return int(vm_section(shape)["vnuma_nodes"])


def lab_ranks(shape: MachineShape, model: str = LAB_MODEL) -> tuple[int, int]:
    """(ranks per VM, threads per rank): up to 2 ranks of 1 thread, as the brief runs several
    replicas per VM; one rank with all of a vNUMA node's CPUs when two replicas of `model`
    would not fit the lab VM's memory (the full Phi-3-mini: ~7.6 GB each).

    A VM of its own cores (shape.own_cores) runs one rank per vNUMA node with all its CPUs
    (K=1: one rank of one thread). Such a rank binds its node (numactl --cpunodebind), which
    the kernel narrows to the guest's cpuset; ranks sharing a node bind CPU numbers
    (--physcpubind) counted from 0 as in a VM, which are another guest's here."""
    vnuma = lab_vnuma_nodes(shape)
    ranks = vnuma if shape.own_cores else min(2, shape.cpus)
    threads = shape.cpus // vnuma if shape.own_cores else 1
    model_shape = footprint.shape_of(model)
    if model_shape is not None and ranks > 1:
        per_rank = footprint.rank_memory_bytes(model_shape, max(lab_batches(model)),
                                               max(LAB_INPUT_TOKENS) + LAB_OUTPUT_TOKENS)
        if ranks * per_rank + GUEST_OVERHEAD_BYTES > LAB_MEMORY_GB * 1024**3:
            return 1, shape.cpus // vnuma
    return ranks, threads


def ranks_per_numa_node(shape: MachineShape, model: str = LAB_MODEL) -> int:
    """How many of the lab's ranks split one of this machine's NUMA nodes' threads: what
    the SLO scaling divides a probed node's GEMM rate by."""
    ranks, _ = lab_ranks(shape, model)
    return topology.ranks_per_vnuma_node(ranks, lab_vnuma_nodes(shape))


def lab_batches(model: str) -> list[int]:
    """Batches per rank: the quick pair for the test suite's tiny models, the brief's for any other."""
    spec = model.removeprefix(presets.SYNTHETIC_PREFIX).split(",")[0]
    return list(QUICK_BATCHES if model.startswith(presets.SYNTHETIC_PREFIX) and spec in presets.TEST_MODELS
                else BRIEF_BATCHES)


def bench_section(shape: MachineShape, port: int, model: str = LAB_MODEL) -> dict[str, Any]:
    """The lab's matrix: with synthetic:tiny a small one that finishes in seconds (up to 2
    ranks of 1 thread, batches 1 and 2); with another model the brief's batches per rank."""
    ranks, threads = lab_ranks(shape, model)
    return {
        "ranks_per_node": ranks,
        "threads_per_rank": threads,
        "batch_sizes": lab_batches(model),
        "input_tokens": list(LAB_INPUT_TOKENS),
        "output_tokens": LAB_OUTPUT_TOKENS,
        "warmup": 1,
        "repeats": 2,
        "port": port,
        # The measurement mode: torch.compile over one packed copy of the weights.
        "compile": "compile",
    }


def serve_section(vllm_venv: str | None = None) -> dict[str, Any]:
    """The `bench.serve:` block: vLLM's settings for guests that share this machine.

    vllm_venv: an installed vLLM venv on this machine (the guests use it as it is, as they
    use the seeded venv for torch); None = the guest stage makes <workdir>/vllm-venv."""
    return {"vllm": {
        "venv": vllm_venv,
        # A lab machine has a few cores: the server and the client share each node's.
        "reserved_cores": 0,
        # The guests share this machine's loopback ports; each has a bench address of its own.
        "listen": "bench",
    }}


def lab_inventory(*, vcenter: LabVcenter, nodes: Sequence[LabNode], guest: LabGuestLogin,
                  bench_port: int, shape: MachineShape,
                  slos: Mapping[str, Mapping[str, float]] | None = None,
                  vllm_venv: str | None = None, model: str = LAB_MODEL) -> dict[str, Any]:
    """The lab inventory as a plain document (dump it as YAML); `slos`: None = the brief's;
    `vllm_venv`: the installed vLLM venv the guests use (None: none, see serve_section);
    `model`: the guest's model source, which sets the matrix (bench_section)."""
    return {
        "name": LAB_NAME,
        "vcenter": {
            "host": vcenter.host,
            "port": vcenter.port,
            "user": vcenter.user,
            "password_env": PASSWORD_ENV,
            "ca_bundle": vcenter.ca_bundle,
            "insecure": False,
        },
        "placement": {
            "datacenter": sim.DATACENTER,
            "cluster": sim.CLUSTER,
            "datastore": sim.DATASTORE,
            "folder": VM_FOLDER,
            "template": vcenter.template,
            "networks": {
                "management": {"portgroup": sim.MANAGEMENT_PORTGROUP, "netmask": LOOPBACK_NETMASK,
                               "mtu": LOOPBACK_MTU},
                "bench": {"portgroup": sim.BENCH_PORTGROUP, "netmask": LOOPBACK_NETMASK,
                          "mtu": LOOPBACK_MTU},
            },
        },
        "vm": vm_section(shape),
        "nodes": [
            {
                "name": n.name,
                "host": n.host,
                "management_ip": n.management_ip,
                "bench_ip": n.bench_ip,
                "ssh_port": n.ssh_port,
                # vcsim reports this as the VM's guest IP: it points at the node's sshd guest.
                "advanced": {"SET.guest.ipAddress": n.management_ip},
            }
            for n in nodes
        ],
        "guest": {
            "user": guest.user,
            "ssh_key": guest.ssh_key,
            "known_hosts": guest.known_hosts,
            "python": "python3",
            "torch": LAB_TORCH,
            "torch_index_url": None,
            "wheelhouse": None,
            "model": model,
            # One machine, one user: the guests share this folder (and its venv);
            # per-node files go in node-named subfolders.
            "workdir": guest.workdir,
            # The service runs as the lab's user: its test folders are private to that user.
            "service_user": guest.user,
        },
        "bench": {**bench_section(shape, bench_port, model), "serve": serve_section(vllm_venv)},
        "slos": {name: dict(limits) for name, limits in (slos or DEFAULT_SLOS).items()},
    }


def fresh_guest_document(document: dict[str, Any], *, wheelhouse: str, workdir: str,
                         management_mtu: int, bench_mtu: int, bench_netmask: str) -> dict[str, Any]:
    """The lab inventory for fresh guests (lab/fresh.py): each guest has its own root and
    network namespace, so its work folder is its own, SSH is on port 22 as root, the bench
    network is a jumbo-frame /24, and pip installs from the operator's wheelhouse alone."""
    doc = {**document, "placement": {**document["placement"]}, "guest": {**document["guest"]},
           "bench": {**document["bench"]}}
    if "serve" in doc["bench"]:
        # A fresh guest sees none of this machine's folders (no vLLM venv of the operator's)
        # and has a loopback of its own.
        serve = doc["bench"]["serve"] = {**doc["bench"]["serve"]}
        serve["vllm"] = {**serve.get("vllm", {}), "venv": None, "listen": "loopback"}
    networks = doc["placement"]["networks"] = {k: dict(v) for k, v in
                                               document["placement"]["networks"].items()}
    networks["management"].update(netmask="255.255.255.255", mtu=management_mtu)
    networks["bench"].update(netmask=bench_netmask, mtu=bench_mtu)
    doc["guest"].update(workdir=workdir, wheelhouse=wheelhouse, torch_index_url=None)
    # torch.compile's Inductor builds C++ on the guest; a template without a compiler runs
    # the decode step eager (`bench --compile compile` needs g++ baked into the template).
    doc["bench"]["compile"] = "eager"
    return doc


INVENTORY_HEADER = """\
# vcfslm local lab inventory, generated by `vcfslm lab up` (rewritten on every `up`).
# vCenter is the lab's vcsim (TLS verified with the lab CA); nodes are loopback sshd
# guests on this machine. The password is in the lab's env file, never here:
#   . {env_file}
"""


def inventory_header(env_file: str | Path, notes: Sequence[str] = ()) -> str:
    """The inventory's comment header, with `notes` (how its SLOs were scaled, say) as comment lines."""
    return INVENTORY_HEADER.format(env_file=env_file) + "".join(f"# {line}\n" for line in notes)


def env_file_text(password: str, inventory: str) -> str:
    """The lab env file: `. lab.env` (or `set -a; . lab.env`) exports the password and inventory."""
    return (
        "# vcfslm lab credentials and inventory (generated by `vcfslm lab up`; keep private)\n"
        f"export {PASSWORD_ENV}={shlex.quote(password)}\n"
        f"export {INVENTORY_ENV}={shlex.quote(inventory)}\n"
    )


def parse_env_file(text: str) -> dict[str, str]:
    """KEY=value pairs of an env file (optional `export`, shell quoting, # comments)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, sep, value = line.partition("=")
        if not sep:
            continue
        words = shlex.split(value) if value else [""]
        out[key.strip()] = words[0] if words else ""
    return out


def lab_nodes(count: int, ports: Mapping[str, int]) -> list[LabNode]:
    """The first `count` lab nodes; `ports` maps node name to its sshd port."""
    from . import guests

    return [LabNode(name=guests.node_name(i), host=sim.host_name(i),
                    management_ip=guests.management_address(i),
                    bench_ip=guests.bench_address(i), ssh_port=ports[guests.node_name(i)])
            for i in range(count)]


def guests_inventory(guests: Sequence[Any], workdir: str, *, bench_port: int = 29500,
                     ranks_per_node: int | None = None, vllm_venv: str | None = None) -> dict[str, Any]:
    """A lab inventory for running sshd guests alone (no vcsim behind it): for the guest
    stage's tests and benchmarks, which never contact vCenter.

    bench_port: the rendezvous port (a benchmark picks a free one: node 0's store binds it
    on every address); ranks_per_node: None = the lab's default for this machine;
    vllm_venv: an installed vLLM venv the guests use (see serve_section).
    """
    doc = lab_inventory(
        vcenter=LabVcenter(host="127.0.0.1", port=443, user="lab", ca_bundle="/dev/null",
                           template="lab-template"),
        nodes=[LabNode(name=g.name, host=f"DC0_C0_H{i}", management_ip=g.address,
                       bench_ip=g.bench_address, ssh_port=g.port) for i, g in enumerate(guests)],
        guest=LabGuestLogin(user=guests[0].user, ssh_key=guests[0].key,
                            known_hosts=guests[0].known_hosts, workdir=workdir),
        bench_port=bench_port, shape=machine_shape(), vllm_venv=vllm_venv)
    if ranks_per_node is not None:
        doc["bench"]["ranks_per_node"] = ranks_per_node
    return doc
