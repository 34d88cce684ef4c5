"""The desired VM per node: a pure function of the inventory and a few vCenter facts.

vNUMA has two paths. vSphere 8.0.0.1+ with virtual hardware vmx-20+ takes
`ConfigSpec.virtualNuma.coresPerNumaNode`; anything older (vcsim 0.24 speaks
API 6.5) takes the advanced setting `numa.vcpu.maxPerVirtualNode`. Either way
`numa.autosize.once=FALSE` stops ESXi from freezing the first topology it saw,
and `numa.nodeAffinity` keeps the VM on the host NUMA nodes the inventory names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from .. import topology, vm_settings
from ..vm_settings import VNUMA_API, carries_settings

OWNER_KEY = "vcfslm.owner"
CUSTOMIZATION_KEY = "vcfslm.customization"
VNUMA_HARDWARE = 20
# Newest virtual hardware each vSphere API release can create (older first).
HARDWARE_BY_API = (
    ((6, 5), 13), ((6, 7), 14), ((6, 7, 2), 15), ((7, 0), 17), ((7, 0, 1), 18),
    ((7, 0, 2), 19), ((8, 0), 20), ((8, 0, 2), 21), ((9, 0), 22),
)
VNUMA_KEY = "numa.vcpu.maxPerVirtualNode"  # the advanced-setting path's vNUMA node size
VIRTUAL_NUMA = "virtualNuma"
ADVANCED = "advanced"


def parse_version(text: str) -> tuple[int, ...]:
    """'8.0.0.1' -> (8, 0, 0, 1); non-numeric parts end the tuple."""
    out = []
    for part in str(text).split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def hardware_number(version: str) -> int:
    """'vmx-21' -> 21 (0 when unreadable)."""
    digits = str(version).removeprefix("vmx-")
    return int(digits) if digits.isdigit() else 0


def max_hardware(api_version: str) -> int:
    """The newest virtual hardware version the given API release creates."""
    api = parse_version(api_version)
    best = HARDWARE_BY_API[0][1]
    for release, hw in HARDWARE_BY_API:
        if api >= release:
            best = hw
    return best


def effective_hardware(wanted: str, api_version: str) -> str:
    """The inventory's hardware version, capped at what the API release supports."""
    return f"vmx-{min(hardware_number(wanted), max_hardware(api_version)):02d}"


def vnuma_path(api_version: str, hardware_version: str) -> str:
    """VIRTUAL_NUMA on vSphere >= 8.0.0.1 with vmx-20+, else ADVANCED (extraConfig)."""
    if parse_version(api_version) >= VNUMA_API and hardware_number(hardware_version) >= VNUMA_HARDWARE:
        return VIRTUAL_NUMA
    return ADVANCED


def lowest(*versions: str) -> str:
    """The oldest of the given API versions ("" ones ignored; "" when none is given)."""
    given = [v for v in versions if v]
    return min(given, key=parse_version) if given else ""


def vnuma_reason(server_api: str, session_api: str, hardware_version: str, pinned: bool = False) -> str:
    """Why vnuma_path(lowest(server_api, session_api), hardware) is what it is, in one clause.

    server_api: the lowest of vCenter's and the hosts'; session_api: what the session
    negotiated (pinned: asked for), "" = the same as server_api.
    """
    api = _dotted(VNUMA_API)
    session_api = session_api or server_api
    session = f"session API {session_api}" + (" (pinned)" if pinned else "")
    hw = hardware_number(hardware_version)
    if parse_version(server_api) < VNUMA_API:
        return f"vCenter/host API {server_api} is older than {api}"
    if parse_version(session_api) < VNUMA_API:
        return (f"{session} is older than {api}, though vCenter speaks {server_api}: "
                "pyVmomi would drop ConfigSpec.virtualNuma from the request")
    if hw < VNUMA_HARDWARE:
        return f"virtual hardware {hardware_version} is older than vmx-{VNUMA_HARDWARE}"
    return f"{session} >= {api} and virtual hardware {hardware_version} >= vmx-{VNUMA_HARDWARE}"


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Nic:
    """One network adapter and the static IPv4 settings customization gives it."""

    portgroup: str
    ip: str
    netmask: str
    gateway: str | None = None
    dns: tuple[str, ...] = ()


@carries_settings
@dataclass(frozen=True)
class DesiredVm:
    """Everything provision converges one VM to; `None` means "not managed".

    The settings of vm_settings.py's table are in `settings`, read as attributes.
    """

    name: str
    owner: str
    host: str
    datacenter: str
    cluster: str
    datastore: str
    folder: str
    resource_pool: str | None
    template: str
    hardware_version: str
    vnuma_path: str
    settings: dict[str, Any] = field(default_factory=dict)
    extra_config: dict[str, str] = field(default_factory=dict)
    nics: tuple[Nic, ...] = ()
    hostname: str = ""

    @property
    def customization_fingerprint(self) -> str:
        """Short hash of what guest customization sets (hostname, IPs, gateway, DNS)."""
        text = repr((self.hostname, self.nics))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def desired_vms(inv, api_version: str, host_cpu_mhz: dict[str, int] | None = None,
                session_api: str = "") -> list[DesiredVm]:
    """One DesiredVm per inventory node, in node order.

    api_version: vCenter's (or the lowest of vCenter and the hosts'), deciding the
    hardware version cap and, with session_api, the vNUMA path; host_cpu_mhz: per ESXi
    host, needed to express a full CPU reservation when latency sensitivity is high;
    session_api: the release the session negotiated (pyVmomi sends nothing newer).
    """
    host_cpu_mhz = host_cpu_mhz or {}
    return [desired_vm(inv, node, api_version, host_cpu_mhz.get(node.host), session_api)
            for node in inv.nodes]


def desired_vm(inv, node, api_version: str, cpu_mhz: int | None = None, session_api: str = "") -> DesiredVm:
    """The desired VM of one node (see desired_vms)."""
    vm = inv.vm
    hardware = effective_hardware(vm.hardware_version, api_version)
    path = vnuma_path(lowest(api_version, session_api), hardware)
    facts = vm_settings.VmFacts(vm, cpu_mhz, virtual_numa=path == VIRTUAL_NUMA)
    nets = inv.placement.networks
    mgmt = nets.management
    nics = (
        Nic(mgmt.portgroup, str(node.management_ip), str(mgmt.netmask),
            str(mgmt.gateway) if mgmt.gateway else None, tuple(str(d) for d in mgmt.dns)),
        Nic(nets.bench.portgroup, str(node.bench_ip), str(nets.bench.netmask), None,
            tuple(str(d) for d in nets.bench.dns)),
    )
    return DesiredVm(
        name=node.name,
        owner=inv.name,
        host=node.host,
        datacenter=inv.placement.datacenter,
        cluster=inv.placement.cluster,
        datastore=inv.placement.datastore,
        folder=inv.placement.folder.strip("/"),
        resource_pool=inv.placement.resource_pool,
        template=inv.placement.template,
        hardware_version=hardware,
        vnuma_path=path,
        settings={s.name: s.want(facts) for s in vm_settings.rows()},
        extra_config=extra_config(inv, node, path),
        nics=nics,
        hostname=node.name,
    )


def extra_config(inv, node, path: str) -> dict[str, str]:
    """extraConfig keys: vNUMA (advanced path), affinity, autosize, the inventory's, the owner."""
    vm = inv.vm
    keys: dict[str, str] = {}
    if path == ADVANCED:
        keys[VNUMA_KEY] = str(topology.vnuma_node_size(vm.vcpus, vm.vnuma_nodes))
    if vm.host_numa_nodes:
        keys["numa.nodeAffinity"] = topology.numa_node_affinity(list(vm.host_numa_nodes))
    keys["numa.autosize.once"] = "FALSE"
    # The user's keys win over the defaults above (applied verbatim), node keys over VM keys.
    keys.update(vm.advanced)
    keys.update(node.advanced)
    keys[OWNER_KEY] = inv.name  # never overridable: destroy relies on it
    return dict(sorted(keys.items()))
