"""Read-only checks over an observed snapshot, before anything is changed (pure).

Problems come in two scopes. Cluster-wide ones (datacenter, cluster, datastore,
resource pool, port groups, template) stop everything: `PreflightError` lists
them all and nothing is changed. Per-node ones (its ESXi host missing, outside
the cluster, too few NUMA nodes, too little memory) block only that node: the
others are still provisioned and the run exits 1 naming the blocked nodes.
A missing folder is not a problem: it is created, as a planned change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PreflightError
from .desired import (
    effective_hardware,
    hardware_number,
    lowest,
    max_hardware,
    vnuma_path,
    vnuma_reason,
)
from .state import Snapshot


@dataclass(frozen=True)
class PreflightResult:
    """What preflight found: problems by scope, warnings, and the facts the plan needs."""

    problems: tuple[str, ...] = ()
    node_problems: dict[str, list[str]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    api_version: str = ""
    session_api_version: str = ""
    vnuma_path: str = ""
    vnuma_reason: str = ""
    hardware_version: str = ""
    host_cpu_mhz: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        """PreflightError listing every cluster-wide problem (and per-node ones with them)."""
        if self.problems:
            every = list(self.problems)
            for node, msgs in self.node_problems.items():
                every.extend(f"{node}: {m}" for m in msgs)
            raise PreflightError(every)


def effective_api_version(snapshot: Snapshot, host_names: list[str]) -> str:
    """The lowest of vCenter's API version and the named hosts' (a VM runs on its host)."""
    versions = [snapshot.hosts[h].api_version for h in host_names if h in snapshot.hosts]
    return lowest(snapshot.api_version, *versions)


def check(inv, snapshot: Snapshot) -> PreflightResult:
    """Every problem at once; see the module docstring for the two scopes."""
    place = inv.placement
    problems: list[str] = []
    warnings: list[str] = []
    if snapshot.datacenter is None:
        problems.append(f"datacenter '{place.datacenter}' not found")
    else:
        if snapshot.cluster is None:
            problems.append(f"cluster '{place.cluster}' not found in datacenter '{place.datacenter}'")
        if place.datastore not in snapshot.datastores:
            problems.append(f"datastore '{place.datastore}' not found" + _known(snapshot.datastores))
        if place.resource_pool and snapshot.cluster is not None \
                and place.resource_pool.strip("/") not in snapshot.resource_pools:
            problems.append(f"resource pool '{place.resource_pool}' not found in cluster "
                            f"'{place.cluster}'")
        for role, net in (("management", place.networks.management), ("bench", place.networks.bench)):
            if net.portgroup not in snapshot.networks:
                problems.append(f"{role} port group '{net.portgroup}' not found"
                                + _known(snapshot.networks))
        problems.extend(_template_problems(place, snapshot))
        folder = place.folder.strip("/")
        if folder and folder not in snapshot.folders:
            warnings.append(f"folder '{folder}' does not exist yet: it will be created")

    hosts = [n.host for n in inv.nodes]
    api = effective_api_version(snapshot, hosts)
    hardware = effective_hardware(inv.vm.hardware_version, api)
    session = snapshot.session_api_version or api
    # pyVmomi serializes nothing newer than the session's release: the path follows the older.
    path = vnuma_path(lowest(api, session), hardware)
    reason = vnuma_reason(api, session, hardware, snapshot.session_api_pinned)
    if hardware_number(hardware) < hardware_number(inv.vm.hardware_version):
        warnings.append(f"vm.hardware_version {inv.vm.hardware_version} is newer than API {api} "
                        f"creates (vmx-{max_hardware(api)}): using {hardware}")
    node_problems = _node_problems(inv, snapshot) if snapshot.datacenter is not None else {}
    return PreflightResult(
        problems=tuple(problems), node_problems=node_problems, warnings=tuple(warnings),
        api_version=api, session_api_version=session, vnuma_path=path, vnuma_reason=reason,
        hardware_version=hardware,
        host_cpu_mhz={h.name: h.cpu_mhz for h in snapshot.hosts.values()},
    )


def _known(names) -> str:
    names = sorted(names)
    if not names:
        return ""
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f" (found: {shown})"


def _template_problems(place, snapshot: Snapshot) -> list[str]:
    lib = place.library_item
    if lib is not None:
        if snapshot.library_items is None:
            return [f"content library item '{lib[0]}/{lib[1]}' cannot be checked: the Automation "
                    "API (content library) is not reachable"]
        if f"{lib[0]}/{lib[1]}" not in snapshot.library_items:
            return [f"content library item '{lib[1]}' not found in library '{lib[0]}'"]
        return []
    if place.template not in snapshot.vms:
        return [f"template '{place.template}' not found in datacenter '{place.datacenter}'"]
    return []


def _node_problems(inv, snapshot: Snapshot) -> dict[str, list[str]]:
    vm = inv.vm
    need_bytes = vm.memory_gb * 1024**3
    out: dict[str, list[str]] = {}
    for node in inv.nodes:
        msgs: list[str] = []
        host = snapshot.hosts.get(node.host)
        if host is None:
            msgs.append(f"ESXi host '{node.host}' not found in datacenter '{inv.placement.datacenter}'")
        else:
            if snapshot.cluster is not None and host.cluster != snapshot.cluster:
                msgs.append(f"ESXi host '{node.host}' is not in cluster '{snapshot.cluster}'")
            if host.connection_state != "connected":
                msgs.append(f"ESXi host '{node.host}' is {host.connection_state}")
            if host.numa_nodes < vm.vnuma_nodes:
                msgs.append(f"ESXi host '{node.host}' has {host.numa_nodes} NUMA node(s); "
                            f"{vm.vnuma_nodes} vNUMA nodes need at least {vm.vnuma_nodes}")
            bad = [n for n in vm.host_numa_nodes if n >= host.numa_nodes]
            if bad:
                msgs.append(f"vm.host_numa_nodes {bad} do not exist on '{node.host}' "
                            f"(NUMA nodes 0-{host.numa_nodes - 1})")
            if vm.reserve_all_memory and host.memory_bytes < need_bytes:
                msgs.append(f"ESXi host '{node.host}' has {host.memory_bytes / 1024**3:.0f} GiB; "
                            f"a fully reserved {vm.memory_gb} GiB VM does not fit")
        if node.name in snapshot.duplicate_vms:
            msgs.append(f"more than one VM is named '{node.name}' in the datacenter")
        if msgs:
            out[node.name] = msgs
    return out
