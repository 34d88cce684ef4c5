"""What the driver observed in vCenter, as plain data (names, not managed objects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..vm_settings import carries_settings


@carries_settings
@dataclass(frozen=True)
class VmState:
    """One existing VM as observed; `None` fields were not reported by vCenter.

    The settings of vm_settings.py's table (num_cpus, latency_sensitivity, ...) are
    in `settings` and read as attributes; a setting vCenter did not report reads None.
    """

    name: str
    moref: str
    power_state: str = "poweredOff"  # poweredOn | poweredOff | suspended
    template: bool = False
    host: str | None = None
    folder: str | None = None  # path under the datacenter's VM folder ("" = the root)
    hardware_version: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    numa_info_reported: bool = False  # config.numaInfo came back (vSphere 8.0.0.1+ fills it)
    auto_cores_per_numa_node: bool | None = None
    extra_config: dict[str, str] = field(default_factory=dict)
    nics: tuple[str, ...] = ()  # port group name per network adapter, in device order
    ip_addresses: tuple[str, ...] = ()  # IPv4 addresses the guest reports on the management NIC

    @property
    def owner(self) -> str | None:
        from .desired import OWNER_KEY

        return self.extra_config.get(OWNER_KEY)


@dataclass(frozen=True)
class HostFacts:
    """One ESXi host: where it is and what it has."""

    name: str
    cluster: str | None
    numa_nodes: int
    memory_bytes: int
    cpu_mhz: int
    api_version: str = ""
    connection_state: str = "connected"


@dataclass(frozen=True)
class Snapshot:
    """Everything preflight and the diff need, from one property-collector round trip.

    `api_version` is vCenter's; the session may speak an older release (pinned, or an
    older pyVmomi), and pyVmomi sends nothing newer than the session's release.
    Names are those of the inventory's datacenter (other datacenters are not looked at);
    `datacenter`/`cluster` are None when not found. Folders and resource pools are
    paths ("SLM/phi3"); VMs are keyed by name (`duplicate_vms` lists names seen twice).
    """

    api_version: str
    session_api_version: str = ""  # what pyVmomi negotiated ("" = the same as api_version)
    session_api_pinned: bool = False
    datacenter: str | None = None
    cluster: str | None = None
    hosts: dict[str, HostFacts] = field(default_factory=dict)
    datastores: frozenset[str] = frozenset()
    networks: frozenset[str] = frozenset()
    folders: frozenset[str] = frozenset()
    resource_pools: frozenset[str] = frozenset()
    vms: dict[str, VmState] = field(default_factory=dict)
    duplicate_vms: frozenset[str] = frozenset()
    library_items: frozenset[str] | None = None  # "lib/item"; None = not looked up
