"""In-guest verification, pure: a guest's facts against the inventory -> problems (empty = good).

Catches a VM whose vNUMA settings did not take before any benchmark runs: the
guest must show `vnuma_nodes` nodes of vcpus/vnuma_nodes CPUs each, numbered
contiguously per node (topology's rank CPU sets assume it), memory per node
within 10% of even, the bench IP on an interface with the bench network's MTU,
and every other node's bench IP answering. With `bench.serve.server: vllm`, each
vNUMA node's launch script must bind the CPUs and memory the guest shows for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .. import topology
from ..serving.servers import VLLM
from . import vllm
from .host_facts import (
    CpuInfo,
    GuestFacts,
    Interface,
    NumaHardware,
    Reach,
    interface_of,
    peer_targets,
)

MEMORY_TOLERANCE = 0.10


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def describe_numa(numa: NumaHardware) -> str:
    """'1 node of 2 CPUs' / '4 nodes of 24, 24, 24, 23 CPUs'."""
    sizes = [len(n.cpus) for n in numa.nodes]
    if not sizes:
        return "no NUMA nodes"
    if len(set(sizes)) == 1:
        return f"{_plural(len(sizes), 'node')} of {sizes[0]} CPUs"
    return f"{len(sizes)} nodes of {', '.join(str(s) for s in sizes)} CPUs"


def numa_problems(numa: NumaHardware, vcpus: int, vnuma_nodes: int) -> list[str]:
    """vNUMA shape, contiguous CPU numbering and even memory."""
    if not numa.available:
        return [f"cannot read the NUMA topology: {numa.error}"]
    size = topology.vnuma_node_size(vcpus, vnuma_nodes)
    expected = f"{_plural(vnuma_nodes, 'vNUMA node')} of {size} CPUs"
    sizes = [len(n.cpus) for n in numa.nodes]
    if len(sizes) != vnuma_nodes or any(s != size for s in sizes):
        return [f"expected {expected}, seen {describe_numa(numa)} "
                "(the VM's vNUMA settings did not take, or the inventory's vm.vcpus/vnuma_nodes "
                "do not describe this guest)"]
    problems = []
    wrong = [(node, topology.node_cpus(vcpus, vnuma_nodes, k)) for k, node in enumerate(numa.nodes)
             if tuple(node.cpus) != topology.node_cpus(vcpus, vnuma_nodes, k)]
    if wrong:
        problems.append("CPUs are not numbered contiguously per vNUMA node as rank placement "
                        "assumes: " + "; ".join(
                            f"node {node.id} has {topology.format_cpu_list(node.cpus)} "
                            f"(expected {topology.format_cpu_list(want)})" for node, want in wrong))
    problems.extend(memory_problems(numa))
    return problems


def memory_problems(numa: NumaHardware, tolerance: float = MEMORY_TOLERANCE) -> list[str]:
    """Each node's memory within `tolerance` of an even split."""
    sizes = [n.size_mb for n in numa.nodes]
    if not sizes or any(s is None for s in sizes):
        return ["numactl did not report memory per node"] if sizes else []
    even = sum(sizes) / len(sizes)
    off = [n for n in numa.nodes if abs(n.size_mb - even) > tolerance * even]
    if not off:
        return []
    return [f"memory per vNUMA node is uneven: {', '.join(f'node {n.id} {n.size_mb} MB' for n in numa.nodes)} "
            f"(more than {tolerance:.0%} from the even {even:.0f} MB)"]


def cpu_problems(cpu: CpuInfo, vcpus: int) -> list[str]:
    if cpu.cpus and cpu.cpus != vcpus:
        return [f"expected {vcpus} vCPUs, lscpu shows {cpu.cpus}"]
    if cpu.online and len(cpu.online) != vcpus:
        return [f"expected {vcpus} online vCPUs, lscpu shows {len(cpu.online)} online "
                f"({topology.format_cpu_list(cpu.online)})"]
    return []


def network_problems(interfaces: tuple[Interface, ...], bench_ip: str, mtu: int,
                     interface: str | None = None) -> list[str]:
    """The bench IP must sit on an interface (the named one, if any) with the expected MTU."""
    iface = interface_of(bench_ip, interfaces)
    if iface is None:
        seen = "; ".join(f"{i.name} {', '.join(str(a) for a in i.addresses) or 'no address'}"
                         for i in interfaces) or "no interfaces"
        return [f"bench IP {bench_ip} is on no interface (seen: {seen})"]
    problems = []
    if interface and iface.name != interface:
        problems.append(f"bench IP {bench_ip} is on {iface.name}, but bench.interface is {interface}")
    if iface.mtu != mtu:
        problems.append(f"bench interface {iface.name} has MTU {iface.mtu}, expected {mtu} "
                        "(placement.networks.bench.mtu)")
    if not iface.up:
        problems.append(f"bench interface {iface.name} is down")
    return problems


def reach_problems(reach: dict[str, Reach], peers: dict[str, str]) -> list[str]:
    return [f"bench IP {target.rsplit(':', 1)[0]} of {peers.get(target, '?')} is unreachable "
            f"({r.detail})" for target, r in sorted(reach.items()) if not r.ok]


def server_script_problems(scripts: Mapping[int, str | None], numa: NumaHardware,
                           rank_cpus: Mapping[int, Sequence[int]], reserved: int) -> list[str]:
    """Each vllm-node<N>.sh against the guest's own NUMA facts: its OpenMP threads
    (VLLM_CPU_OMP_THREADS_BIND) and numactl --physcpubind on the CPUs node N has (those of
    its rank, `rank_cpus[N]`, less `reserved`), and numactl --membind=N."""
    problems = []
    seen = {n.id: n.cpus for n in numa.nodes}
    for node, text in sorted(scripts.items()):
        name = VLLM.script_name(node)
        if text is None:
            problems.append(f"{name} is missing (the vllm playbook renders it)")
            continue
        if node not in seen:
            problems.append(f"{name} is for vNUMA node {node}, which the guest does not have "
                            f"(it has {describe_numa(numa)})")
            continue
        try:
            want = vllm.expected_server_cpus(seen[node], rank_cpus.get(node, seen[node]), reserved)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        expected = topology.format_cpu_list(want)
        where = (f"node {node} has CPUs {topology.format_cpu_list(seen[node])}"
                 + (f", {reserved} reserved" if reserved else ""))
        bound = vllm.parse_script(text)
        for label, cpus in (("VLLM_CPU_OMP_THREADS_BIND", bound.threads_bind),
                            ("numactl --physcpubind", bound.physcpubind)):
            if cpus is None:
                problems.append(f"{name} sets no {label} (expected {expected}: {where})")
            elif cpus != want:
                problems.append(f"{name} binds {label}={topology.format_cpu_list(cpus)}, expected "
                                f"{expected} ({where})")
        if bound.membind is None:
            problems.append(f"{name} sets no numactl --membind (expected {node})")
        elif bound.membind != node:
            problems.append(f"{name} binds memory to node {bound.membind} (--membind), expected {node}")
    return problems


def verify_guest(inventory, node_name: str, facts: GuestFacts) -> list[str]:
    """Every problem found on one guest, as messages naming expected vs seen."""
    vm = inventory.vm
    node = inventory.node(node_name)
    problems: list[str] = []
    if facts.numa is not None:
        problems.extend(numa_problems(facts.numa, vm.vcpus, vm.vnuma_nodes))
    numa_ok = facts.numa is not None and not problems
    if facts.cpu is not None and not problems:
        problems.extend(cpu_problems(facts.cpu, vm.vcpus))
    if facts.interfaces is not None:
        problems.extend(network_problems(facts.interfaces, str(node.bench_ip),
                                         inventory.placement.networks.bench.mtu,
                                         inventory.bench.interface))
    if facts.reach is not None:
        problems.extend(reach_problems(facts.reach, facts.peers))
    # The scripts are checked on a guest whose NUMA shape is right (else that is the problem).
    if facts.server_scripts is not None and numa_ok:
        problems.extend(server_script_problems(facts.server_scripts, facts.numa, vllm.node_cpus(inventory),
                                               inventory.bench.serve.vllm.reserved_cores))
    return problems


__all__ = ["GuestFacts", "peer_targets", "verify_guest"]
