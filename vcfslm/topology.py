"""Pure vNUMA / NUMA arithmetic: vNUMA node sizes, rank placement and CPU sets.

Guest CPUs are numbered contiguously per vNUMA node (node k owns CPUs
k*size .. (k+1)*size-1); in-guest verification checks that assumption against
`numactl --hardware` before any benchmark runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankSlot:
    """Where one rank of a node runs.

    bind: "node" when the rank owns its whole vNUMA node (numactl --cpunodebind),
    "cpus" when several ranks share a node (numactl --physcpubind).
    """

    local_rank: int
    numa_node: int
    cpus: tuple[int, ...]
    bind: str

    @property
    def cpu_list(self) -> str:
        return format_cpu_list(self.cpus)


def vnuma_node_size(vcpus: int, vnuma_nodes: int) -> int:
    """vCPUs per vNUMA node (the caller has checked divisibility)."""
    return vcpus // vnuma_nodes


def node_cpus(vcpus: int, vnuma_nodes: int, node: int) -> tuple[int, ...]:
    size = vnuma_node_size(vcpus, vnuma_nodes)
    return tuple(range(node * size, (node + 1) * size))


def ranks_per_vnuma_node(ranks_per_node: int, vnuma_nodes: int) -> int:
    """How many ranks share the busiest vNUMA node under block placement."""
    return -(-ranks_per_node // vnuma_nodes)


def rank_slots(vcpus: int, vnuma_nodes: int, ranks_per_node: int, threads_per_rank: int) -> list[RankSlot]:
    """Place ranks on vNUMA nodes in blocks and give each a disjoint CPU set.

    With ranks_per_node == vnuma_nodes and threads == node size (the brief's 4 x 24),
    each rank binds a whole node. Raises ValueError when a rank would span nodes.
    """
    problems = placement_problems(vcpus, vnuma_nodes, ranks_per_node, threads_per_rank)
    if problems:
        raise ValueError("; ".join(problems))
    size = vnuma_node_size(vcpus, vnuma_nodes)
    per_node = ranks_per_vnuma_node(ranks_per_node, vnuma_nodes)
    slots = []
    for r in range(ranks_per_node):
        node = r // per_node
        index = r % per_node
        first = node * size + index * threads_per_rank
        cpus = tuple(range(first, first + threads_per_rank))
        whole = per_node == 1 and threads_per_rank == size
        slots.append(RankSlot(r, node, cpus, "node" if whole else "cpus"))
    return slots


def placement_problems(vcpus: int, vnuma_nodes: int, ranks_per_node: int, threads_per_rank: int) -> list[str]:
    """Why ranks cannot be placed without spanning vNUMA nodes (empty when they can)."""
    if vcpus <= 0 or vnuma_nodes <= 0 or ranks_per_node <= 0 or threads_per_rank <= 0:
        return ["vcpus, vnuma_nodes, ranks_per_node and threads_per_rank must be positive"]
    if vcpus % vnuma_nodes:
        return [f"{vcpus} vCPUs cannot split into {vnuma_nodes} vNUMA nodes"]
    size = vnuma_node_size(vcpus, vnuma_nodes)
    problems = []
    if ranks_per_node * threads_per_rank > vcpus:
        problems.append(f"{ranks_per_node} ranks x {threads_per_rank} threads = "
                        f"{ranks_per_node * threads_per_rank} exceeds {vcpus} vCPUs")
    if threads_per_rank > size:
        problems.append(f"a rank of {threads_per_rank} threads would span two vNUMA nodes "
                        f"of {size} vCPUs")
    per_node = ranks_per_vnuma_node(ranks_per_node, vnuma_nodes)
    if not problems and per_node * threads_per_rank > size:
        problems.append(f"{per_node} ranks of {threads_per_rank} threads do not fit one vNUMA node "
                        f"of {size} vCPUs (a rank would span two nodes)")
    return problems


def cores_per_socket_problems(vcpus: int, cores_per_socket: int, vnuma_nodes: int) -> list[str]:
    """cores_per_socket must divide vcpus and be a multiple or a divisor of the vNUMA node size."""
    if cores_per_socket <= 0:
        return ["cores_per_socket must be positive"]
    problems = []
    if vcpus % cores_per_socket:
        problems.append(f"{cores_per_socket} cores per socket does not divide {vcpus} vCPUs")
    if vnuma_nodes > 0 and vcpus % vnuma_nodes == 0:
        size = vnuma_node_size(vcpus, vnuma_nodes)
        if cores_per_socket % size and size % cores_per_socket:
            problems.append(f"{cores_per_socket} cores per socket is neither a multiple nor a divisor "
                            f"of the vNUMA node size ({size} vCPUs)")
    return problems


def numa_node_affinity(host_numa_nodes: list[int]) -> str:
    """The `numa.nodeAffinity` extraConfig value ("0,1,2,3")."""
    return ",".join(str(n) for n in host_numa_nodes)


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """Compact CPU list as numactl and the kernel write it: 0-23,48-71."""
    cpus = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Inverse of format_cpu_list; also accepts spaces as separators (numactl --hardware)."""
    cpus: list[int] = []
    for part in text.replace(" ", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return tuple(sorted(set(cpus)))
