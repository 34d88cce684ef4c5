"""Property-collector results -> `Snapshot` (pure: no pyVmomi import, no network calls).

The driver hands over what RetrieveContents returned as `Found` records: each
managed object's moref id, its vSphere type names (base types included, so a
cluster is also a ComputeResource) and its properties by path, with references
to other managed objects given as moref ids. Nested data objects (devices, guest
NICs, NUMA info) are read by attribute and typed by their vSphere type names.
Besides the Snapshot (plain names), parsing yields `Refs`: the driver's handles
of the objects a plan will use, by name or path.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import vm_settings
from .desired import parse_version
from .state import HostFacts, Snapshot, VmState

# What observe asks of every VM besides the settings of vm_settings.py's table.
VM_PROPERTIES = (
    "name", "parent", "config.template", "config.version", "config.hardware.device",
    "config.extraConfig", "runtime.powerState", "runtime.host", "guest.net",
)
# vSphere type name -> the property paths observe asks of it (in the order they are asked).
PROPERTIES: dict[str, tuple[str, ...]] = {
    "Datacenter": ("name", "parent", "vmFolder"),
    "Folder": ("name", "parent"),
    "ComputeResource": ("name", "parent", "resourcePool"),
    "HostSystem": ("name", "parent", "hardware.numaInfo", "hardware.memorySize", "summary.hardware.cpuMhz",
                   "config.product.apiVersion", "runtime.connectionState"),
    "Datastore": ("name", "parent"),
    "Network": ("name", "parent"),
    "DistributedVirtualPortgroup": ("key", "config.distributedVirtualSwitch"),
    "DistributedVirtualSwitch": ("uuid",),
    "ResourcePool": ("name", "parent"),
    "VirtualMachine": VM_PROPERTIES,
}
DV_PORT_BACKING = "VirtualEthernetCardDistributedVirtualPortBackingInfo"
NETWORK_BACKING = "VirtualEthernetCardNetworkBackingInfo"


def properties(api_version: str) -> dict[str, list[str]]:
    """PROPERTIES for this API release, VMs' with what the settings table reads (a row's
    `since_api` property, such as `config.numaInfo` from vSphere 8.0.0.1, only where it exists)."""
    out = {kind: list(paths) for kind, paths in PROPERTIES.items()}
    api = parse_version(api_version)
    vm = out["VirtualMachine"]
    for s in vm_settings.rows():
        if s.observe not in vm and (s.since_api is None or api >= s.since_api):
            vm.append(s.observe)
    return out


def type_names(obj) -> frozenset[str]:
    """The vSphere type names of a pyVmomi object and of its base types ('Folder', 'ManagedEntity', ...)."""
    return frozenset(getattr(c, "_wsdlName", c.__name__) for c in type(obj).__mro__)


@dataclass(frozen=True)
class Found:
    """One managed object as the property collector returned it.

    types: vSphere type names, base types included; props: property path -> value,
    managed-object references as moref ids; obj: the driver's handle (what Refs hold).
    """

    moref: str
    types: frozenset[str]
    props: dict[str, Any]
    obj: Any = None


def _plain(value):
    """A managed-object reference as its moref id; anything else as it is."""
    return value._moId if "ManagedObject" in type_names(value) else value


def found(contents) -> list[Found]:
    """RetrieveContents' ObjectContent list as Found records, in the order returned."""
    return [Found(oc.obj._moId, type_names(oc.obj), {p.name: _plain(p.val) for p in oc.propSet or []},
                  oc.obj)
            for oc in contents or []]


@dataclass
class Refs:
    """Handles of the objects found by the last observe, by name or path."""

    datacenter: Any = None
    vm_root: Any = None
    cluster: Any = None
    folders: dict[str, Any] = field(default_factory=dict)
    hosts: dict[str, Any] = field(default_factory=dict)
    datastores: dict[str, Any] = field(default_factory=dict)
    networks: dict[str, Any] = field(default_factory=dict)
    dvportgroups: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (key, switch uuid)
    pools: dict[str, Any] = field(default_factory=dict)  # "" = the cluster's root pool
    vms: dict[str, Any] = field(default_factory=dict)

    def network_names(self) -> dict[str, str]:
        """Network name by port group key or network moref id (what adapter backings name)."""
        names = {getattr(obj, "_moId", None): name for name, obj in self.networks.items()}
        names.update({key: name for name, (key, _) in self.dvportgroups.items()})
        return names


class _Tree:
    """The found objects by moref id, with the walks up their `parent` chains."""

    def __init__(self, records: Iterable[Found]):
        self.by_id = {r.moref: r for r in records}

    def props(self, key: str | None) -> dict[str, Any]:
        return self.by_id[key].props if key in self.by_id else {}

    def is_a(self, key: str | None, kind: str) -> bool:
        return key in self.by_id and kind in self.by_id[key].types

    def obj(self, key: str):
        return self.by_id[key].obj

    def ancestors(self, key: str) -> Iterator[str]:
        seen = set()
        parent = self.props(key).get("parent")
        while parent and parent not in seen and parent in self.by_id:
            seen.add(parent)
            yield parent
            parent = self.props(parent).get("parent")

    def path_under(self, key: str, root: str | None) -> str | None:
        """'a/b/<name of key>' below `root`; None when `key` is not below it."""
        names = [self.props(key).get("name", "")]
        for a in self.ancestors(key):
            if a == root:
                return "/".join(reversed(names))
            names.append(self.props(a).get("name", ""))
        return None

    def paths(self, keys: Iterable[str], kind: str, root: str | None) -> dict[str, str]:
        """path -> key of each `kind` object below `root` ("" = root itself)."""
        out = {"": root} if root is not None else {}
        for k in keys:
            if self.is_a(k, kind) and k != root:
                p = self.path_under(k, root)
                if p is not None:
                    out[p] = k
        return out


def parse(records: Iterable[Found], datacenter: str, cluster: str,
          api_version: str, session_api: str = "", pinned: bool = False) -> tuple[Snapshot, Refs]:
    """The named datacenter's placement objects and VMs, and the handles a plan uses.

    datacenter, cluster: the inventory's names (other datacenters are not looked at);
    api_version: vCenter's; session_api: the release the session negotiated (pinned:
    asked for by the caller); all three recorded in the Snapshot.
    """
    tree = _Tree(records)
    refs = Refs()
    apis = {"api_version": api_version, "session_api_version": session_api, "session_api_pinned": pinned}
    dc_key = next((k for k, r in tree.by_id.items() if "Datacenter" in r.types
                   and r.props.get("name") == datacenter), None)
    if dc_key is None:
        return Snapshot(**apis), refs
    refs.datacenter = tree.obj(dc_key)
    vm_root = tree.props(dc_key).get("vmFolder")
    refs.vm_root = tree.obj(vm_root) if vm_root in tree.by_id else None
    inside = [k for k in tree.by_id if dc_key in set(tree.ancestors(k))]

    folders = tree.paths(inside, "Folder", vm_root)
    refs.folders = {p: tree.obj(k) for p, k in folders.items() if k in tree.by_id}

    cluster_key = next((k for k in inside if tree.is_a(k, "ClusterComputeResource")
                        and tree.props(k).get("name") == cluster), None)
    pools: dict[str, str] = {}
    if cluster_key is not None:
        refs.cluster = tree.obj(cluster_key)
        root_pool = tree.props(cluster_key).get("resourcePool")
        if root_pool in tree.by_id:
            pools = tree.paths(inside, "ResourcePool", root_pool)
    refs.pools = {p: tree.obj(k) for p, k in pools.items()}

    hosts, host_names = _hosts(tree, inside, refs)
    _networks(tree, inside, refs)
    network_names = refs.network_names()
    vms: dict[str, VmState] = {}
    duplicates: set[str] = set()
    for k in inside:
        if not tree.is_a(k, "VirtualMachine"):
            continue
        state = vm_state(k, tree.props(k), host_names, network_names,
                         tree.path_under(k, vm_root) if vm_root else None)
        if state.name in vms:
            duplicates.add(state.name)
        vms[state.name] = state
        refs.vms[state.name] = tree.obj(k)
    snapshot = Snapshot(
        **apis, datacenter=datacenter,
        cluster=cluster if cluster_key else None, hosts=hosts,
        datastores=frozenset(refs.datastores), networks=frozenset(refs.networks),
        folders=frozenset(p for p in folders if p), resource_pools=frozenset(p for p in pools if p),
        vms=vms, duplicate_vms=frozenset(duplicates))
    return snapshot, refs


def _hosts(tree: _Tree, inside: list[str], refs: Refs) -> tuple[dict[str, HostFacts], dict[str, str]]:
    """HostFacts by host name, and host names by moref id (fills refs.hosts)."""
    hosts: dict[str, HostFacts] = {}
    host_names: dict[str, str] = {}
    for k in inside:
        if not tree.is_a(k, "HostSystem"):
            continue
        p = tree.props(k)
        parent = p.get("parent")
        cluster = tree.props(parent).get("name") if tree.is_a(parent, "ClusterComputeResource") else None
        numa = p.get("hardware.numaInfo")
        name = p.get("name", k)
        host_names[k] = name
        refs.hosts[name] = tree.obj(k)
        hosts[name] = HostFacts(
            name=name, cluster=cluster, numa_nodes=int(getattr(numa, "numNodes", 0) or 0),
            memory_bytes=int(p.get("hardware.memorySize") or 0),
            cpu_mhz=int(p.get("summary.hardware.cpuMhz") or 0),
            api_version=str(p.get("config.product.apiVersion") or ""),
            connection_state=str(p.get("runtime.connectionState") or "connected"))
    return hosts, host_names


def _networks(tree: _Tree, inside: list[str], refs: Refs) -> None:
    """Fills refs.datastores, refs.networks and refs.dvportgroups."""
    switch_uuid = {k: r.props.get("uuid") for k, r in tree.by_id.items()
                   if "DistributedVirtualSwitch" in r.types}
    for k in inside:
        p = tree.props(k)
        if tree.is_a(k, "Datastore"):
            refs.datastores[p["name"]] = tree.obj(k)
        elif tree.is_a(k, "Network"):
            name = p.get("name", k)
            refs.networks[name] = tree.obj(k)
            if tree.is_a(k, "DistributedVirtualPortgroup"):
                pg_key = p.get("key") or k
                dvs = p.get("config.distributedVirtualSwitch")
                refs.dvportgroups[name] = (pg_key, switch_uuid.get(dvs) or "")


def vm_state(key: str, p: dict[str, Any], host_names: dict[str, str],
             network_names: dict[str, str], path: str | None) -> VmState:
    """One VM's properties as a VmState.

    key: its moref id; host_names: host moref id -> name; network_names: see
    Refs.network_names; path: the VM's path under the datacenter's VM folder (None: not under it).
    """
    extra: dict[str, str] = {}
    for opt in p.get("config.extraConfig") or []:
        extra[opt.key] = str(opt.value)  # later entries win (vcsim appends on reconfigure)
    nics = ethernet_cards(p.get("config.hardware.device"))
    nic_names = tuple(backing_name(d, network_names) for d in nics)
    ips: list[str] = []
    first_key = nics[0].key if nics else None
    first_net = nic_names[0] if nic_names else None
    for g in p.get("guest.net") or []:
        if g.deviceConfigId == first_key or (first_net and g.network == first_net):
            ips.extend(a for a in (g.ipAddress or []) if usable_ipv4(a))
    numa = p.get("config.numaInfo")
    host = p.get("runtime.host")
    folder = path.rsplit("/", 1)[0] if path and "/" in path else ("" if path else None)
    return VmState(
        name=p.get("name", key), moref=key, power_state=str(p.get("runtime.powerState") or "poweredOff"),
        template=bool(p.get("config.template")), host=host_names.get(host) if host else None,
        folder=folder, hardware_version=p.get("config.version"),
        settings={s.name: s.read(p) for s in vm_settings.rows()},
        numa_info_reported="config.numaInfo" in p and numa is not None,
        auto_cores_per_numa_node=getattr(numa, "autoCoresPerNumaNode", None),
        extra_config=extra, nics=nic_names, ip_addresses=tuple(dict.fromkeys(ips)))


def ethernet_cards(devices) -> list:
    """The network adapters among a VM's devices, in device-key order."""
    return sorted((d for d in devices or [] if "VirtualEthernetCard" in type_names(d)), key=lambda d: d.key)


def backing_name(device, network_names: dict[str, str]) -> str:
    """The port group (or network) name an adapter is connected to (see Refs.network_names)."""
    backing = device.backing
    kinds = type_names(backing)
    if DV_PORT_BACKING in kinds:
        key = backing.port.portgroupKey if backing.port else None
        return network_names.get(key, key or "?")
    if NETWORK_BACKING in kinds:
        # The name observed with the network, not read from the reference (a round trip).
        return backing.deviceName or network_names.get(getattr(backing.network, "_moId", None), "?")
    return type(backing).__name__


def usable_ipv4(text: str) -> bool:
    """True for an IPv4 address a guest can be reached on (not link-local, not 0.0.0.0)."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return ip.version == 4 and not ip.is_link_local and not ip.is_unspecified
