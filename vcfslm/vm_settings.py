"""The per-VM vCenter settings, one row each: the only place a new scalar setting is declared.

A row says where the setting comes from (an inventory key under `vm:`, or a rule over
the inventory's VM shape), where vCenter reports it (the property collector's path,
and the member of that data object), where a ConfigSpec takes it (a dotted path, also
the label users see), whether it takes effect only at power-on, what vCenter's silence
means, and what the lab inventory writes. `desired`, `snapshot`, `changes`, `specs`,
the inventory schema and the lab read `VM_SETTINGS`; adding a setting is one row plus
its tests (docs/ARCHITECTURE.md, "a new vCenter setting").

Pure: no pyVmomi here (specs.py turns a row's `spec` path into data objects).

Not rows, because they are not one scalar each: extraConfig keys (a mapping, compared
key by key), network adapters (devices, edited in place), placement (host, folder,
pool: relocation, not reconfiguration) and the virtual hardware version (an upgrade
task of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

from . import topology

# vSphere 8.0.0.1 is the first release with ConfigSpec.virtualNuma and VM config.numaInfo.
VNUMA_API = (8, 0, 0, 1)


@dataclass(frozen=True)
class VmFacts:
    """What a desired value may depend on: the inventory's `vm:` section, the host's CPU
    speed (MHz, None when unknown) and whether vNUMA goes through ConfigSpec.virtualNuma."""

    vm: Any
    cpu_mhz: int | None = None
    virtual_numa: bool = False


@dataclass(frozen=True)
class InventoryKey:
    """The setting as a key of the inventory's `vm:` section (vcfslm schema documents it)."""

    type: Any
    default: Any
    description: str


@dataclass(frozen=True)
class VmSetting:
    """One VM setting.

    name: the DesiredVm / VmState attribute (and `vm.<name>` when `inventory` is set);
    spec: the ConfigSpec path it is written to ("latencySensitivity.level"), shown as its label;
    observe: the VirtualMachine property the collector asks for; member: the attribute of
    that data object holding the value ("" = the property itself); power_off: applied only
    to a powered-off VM; unset: what a VM reporting nothing is compared as; desired: the
    wanted value from VmFacts (None = not managed), by default the inventory key's value;
    since_api: asked only from this vSphere API release on; lab: what the lab inventory
    writes for `vm.<name>`.
    """

    name: str
    spec: str
    observe: str
    member: str = ""
    power_off: bool = True
    unset: Any = None
    desired: Callable[[VmFacts], Any] | None = None
    inventory: InventoryKey | None = None
    since_api: tuple[int, ...] | None = None
    lab: Any = None

    def want(self, facts: VmFacts) -> Any:
        """The desired value for this VM (None = leave it as it is)."""
        if self.desired is not None:
            return self.desired(facts)
        return getattr(facts.vm, self.name)

    def read(self, props: dict[str, Any]) -> Any:
        """The value vCenter reported among a VM's collected properties (None = not reported)."""
        value = props.get(self.observe)
        if self.member:
            value = getattr(value, self.member, None) if value is not None else None
        if isinstance(value, str):
            value = str(value) or None  # pyVmomi enums are str subclasses; "" reports nothing
        return value


def _high(vm) -> bool:
    return vm.latency_sensitivity == "high"


def _memory_mb(facts: VmFacts) -> int:
    return facts.vm.memory_gb * 1024


def _memory_locked(facts: VmFacts) -> bool:
    # Latency sensitivity high requires all memory (and all CPU) reserved.
    return facts.vm.reserve_all_memory or _high(facts.vm)


def _cpu_reservation(facts: VmFacts) -> int | None:
    vm = facts.vm
    return vm.vcpus * facts.cpu_mhz if _high(vm) and facts.cpu_mhz else None


def _vnuma_node_size(facts: VmFacts) -> int | None:
    # On the advanced-setting path the same size travels as an extraConfig key instead.
    if not facts.virtual_numa:
        return None
    return topology.vnuma_node_size(facts.vm.vcpus, facts.vm.vnuma_nodes)


# In the order plan lists them.
VM_SETTINGS: tuple[VmSetting, ...] = (
    VmSetting("num_cpus", "numCPUs", "config.hardware.numCPU", desired=lambda f: f.vm.vcpus),
    VmSetting("cores_per_socket", "numCoresPerSocket", "config.hardware.numCoresPerSocket",
              desired=lambda f: f.vm.cores_per_socket),
    VmSetting("memory_mb", "memoryMB", "config.hardware.memoryMB", desired=_memory_mb),
    # changes.py compares it only where vCenter reports numaInfo (vnuma.py says "unverified").
    VmSetting("cores_per_numa_node", "virtualNuma.coresPerNumaNode", "config.numaInfo",
              member="coresPerNumaNode", desired=_vnuma_node_size, since_api=VNUMA_API),
    VmSetting("cpu_hot_add", "cpuHotAddEnabled", "config.cpuHotAddEnabled", unset=False,
              inventory=InventoryKey(Literal[False], False,
                                     "CPU hot-add; must stay off: ESXi disables vNUMA for a VM with it on."),
              lab=False),
    VmSetting("latency_sensitivity", "latencySensitivity.level", "config.latencySensitivity",
              member="level", unset="normal",
              inventory=InventoryKey(Literal["normal", "high"], "normal",
                                     "'high' also reserves all CPU, as vSphere requires."),
              lab="normal"),
    VmSetting("memory_locked_to_max", "memoryReservationLockedToMax", "config.memoryReservationLockedToMax",
              power_off=False, unset=False, desired=_memory_locked),
    VmSetting("memory_reservation_mb", "memoryAllocation.reservation", "config.memoryAllocation",
              member="reservation", power_off=False, unset=0,
              desired=lambda f: _memory_mb(f) if _memory_locked(f) else None),
    VmSetting("cpu_reservation_mhz", "cpuAllocation.reservation", "config.cpuAllocation",
              member="reservation", power_off=False, unset=0, desired=_cpu_reservation),
)


def rows() -> tuple[VmSetting, ...]:
    """The table as it stands now (read at call time, so a test can add a row)."""
    return VM_SETTINGS


def row(name: str) -> VmSetting | None:
    return next((s for s in rows() if s.name == name), None)


def inventory_rows() -> tuple[VmSetting, ...]:
    """The rows that are keys of the inventory's `vm:` section."""
    return tuple(s for s in rows() if s.inventory is not None)


def lab_values() -> dict[str, Any]:
    """What the lab inventory writes for each inventory-keyed setting."""
    return {s.name: s.lab for s in inventory_rows()}


def carries_settings(cls):
    """Class decorator: the table's values ride in the dataclass's `settings` mapping.

    They are read as attributes (`vm.latency_sensitivity`) and may be given by name to the
    constructor and to dataclasses.replace; a value of None (not managed / not reported)
    is not stored, so two objects with the same settings compare equal however built.
    """
    init = cls.__init__
    own = {f.name for f in fields(cls)}

    def __init__(self, *args, settings=None, **kwargs):
        given = dict(settings or {})
        for name in [k for k in kwargs if k not in own and row(k) is not None]:
            given[name] = kwargs.pop(name)
        init(self, *args, settings={k: v for k, v in given.items() if v is not None}, **kwargs)

    def __getattr__(self, name):
        if name != "settings" and not name.startswith("__") and row(name) is not None:
            return self.__dict__.get("settings", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    cls.__getattr__ = __getattr__
    return cls
