"""Builders shared by the vSphere driver, spec and snapshot tests: the brief's inventory,
pyVmomi stand-ins (managed-object stubs, mocked VMs), observe-shaped Refs and VmStates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from unittest.mock import MagicMock

import yaml
from pyVmomi import vim

from vcfslm.inventory_load import parse_inventory
from vcfslm.vsphere.snapshot import Refs
from vcfslm.vsphere.state import VmState

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"
HOSTS = {f"esx0{i}.example.local": vim.HostSystem(f"host-{i}") for i in range(1, 5)}
VM_METHODS = ("CloneVM_Task", "ReconfigVM_Task", "PowerOnVM_Task", "PowerOffVM_Task",
              "CustomizeVM_Task", "RelocateVM_Task", "UpgradeVM_Task", "Destroy_Task")


def inventory(vm: dict | None = None):
    """The brief's inventory, with `vm` merged into its vm section."""
    data = yaml.safe_load(BRIEF.read_text())
    data["vm"].update(vm or {})
    return parse_inventory(yaml.safe_dump(data), "brief.yaml")


def template_nic(key: int = 4000, portgroup: str = "mgmt-pg"):
    backing = vim.vm.device.VirtualEthernetCard.NetworkBackingInfo(deviceName=portgroup)
    return vim.vm.device.VirtualVmxnet3(key=key, backing=backing)


def dv_nic(key: int = 4001, pg_key: str = "dvportgroup-7", switch: str = "u"):
    return vim.vm.device.VirtualVmxnet3(
        key=key, backing=vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo(
            port=vim.dvs.PortConnection(portgroupKey=pg_key, switchUuid=switch)))


def fake_vm(name: str, host: str = "esx01.example.local"):
    """A mocked VM whose task methods return '<name>:<method>' (the 'task' the waiter sees)."""
    vm = MagicMock(name=name)
    vm._moId = f"vm-{name}"
    vm.runtime.host = HOSTS[host]
    vm.config.hardware.device = [template_nic()]
    for method in VM_METHODS:
        getattr(vm, method).return_value = f"{name}:{method}"
    return vm


def lab_refs() -> Refs:
    """What observe leaves for the brief's placement: folders, hosts, datastore, pool, networks."""
    root = vim.Folder("group-v1")
    return Refs(
        vm_root=root,
        folders={"": root, "SLM": vim.Folder("group-v2"), "SLM/phi3": vim.Folder("group-v3")},
        hosts=dict(HOSTS), datastores={"vsanDatastore": vim.Datastore("datastore-1")},
        pools={"": vim.ResourcePool("resgroup-1")},
        networks={"mgmt-pg": vim.Network("network-1"),
                  "bench-25g-pg": vim.dvs.DistributedVirtualPortgroup("dvportgroup-7")},
        dvportgroups={"bench-25g-pg": ("dvportgroup-7", "50 1a uuid")},
        vms={"ubuntu-24.04-template": fake_vm("template")})


def observed(d, **overrides) -> VmState:
    """The VM vCenter would report once `d` is applied, with `overrides` drifted."""
    extra = dict(d.extra_config, **{"vcfslm.customization": d.customization_fingerprint})
    state = VmState(
        name=d.name, moref=f"vm-{d.name}", power_state="poweredOn", host=d.host, folder=d.folder,
        hardware_version=d.hardware_version, num_cpus=d.num_cpus, cores_per_socket=d.cores_per_socket,
        memory_mb=d.memory_mb, memory_locked_to_max=d.memory_locked_to_max,
        memory_reservation_mb=d.memory_reservation_mb, cpu_hot_add=False, latency_sensitivity="normal",
        cpu_reservation_mhz=d.cpu_reservation_mhz or 0, cores_per_numa_node=d.cores_per_numa_node,
        numa_info_reported=d.cores_per_numa_node is not None,
        extra_config=extra, nics=tuple(n.portgroup for n in d.nics), ip_addresses=("192.168.10.21",))
    return replace(state, **overrides)
