"""The pure spec builder, as data: change lists in -> ConfigSpec / CloneSpec out, on both
vNUMA paths (vSphere 8 `virtualNuma`, and `numa.*` extraConfig before it)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from pyVmomi import vim, vmodl
from test_vsphere_support import HOSTS, dv_nic, inventory, lab_refs, observed, template_nic

from vcfslm.errors import VCenterError
from vcfslm.vsphere import changes as c
from vcfslm.vsphere import specs
from vcfslm.vsphere.desired import desired_vms
from vcfslm.vsphere.snapshot import backing_name


def flat(obj, prefix: str = "") -> dict:
    """A spec's set properties by path; extraConfig as a dict, device changes as
    (operation, device key, port group) tuples."""
    out = {}
    for prop in obj._GetPropertyList():
        value = getattr(obj, prop.name)
        if value is None or (isinstance(value, list) and not value):
            continue
        if prop.name == "extraConfig":
            out[prefix + prop.name] = {o.key: o.value for o in value}
        elif prop.name == "deviceChange":
            names = lab_refs().network_names()
            out[prefix + prop.name] = [(d.operation, d.device.key, backing_name(d.device, names))
                                       for d in value]
        elif isinstance(value, vmodl.DynamicData):
            out.update(flat(value, f"{prefix}{prop.name}."))
        else:
            out[prefix + prop.name] = value
    return out


BRIEF_KEYS = {"numa.autosize.once": "FALSE", "numa.nodeAffinity": "0,1,2,3", "vcfslm.owner": "phi3-vx650v4"}
CREATED = {"numCPUs": 96, "numCoresPerSocket": 48, "memoryMB": 393216,
           "memoryReservationLockedToMax": True, "memoryAllocation.reservation": 393216,
           "deviceChange": [("add", -101, "bench-25g-pg")]}  # the template has the management NIC
ADVANCED_LOG = "slm-01: vNUMA via extraConfig numa.vcpu.maxPerVirtualNode=24 (advanced path"
VIRTUAL_LOG = "slm-01: vNUMA via ConfigSpec.virtualNuma.coresPerNumaNode=24 (virtualNuma path"


def adapters(portgroups) -> list:
    """The devices of a VM whose adapters are on `portgroups`, keys from 4000."""
    dv = lab_refs().dvportgroups
    return [dv_nic(4000 + i, dv[pg][0]) if pg in dv else template_nic(4000 + i, pg)
            for i, pg in enumerate(portgroups)]


def off(**drift):
    return lambda d: observed(d, power_state="poweredOff", **drift)


# (case, vCenter API, inventory vm section, what vCenter reports (None: to be created),
#  the reconfigure spec, its vNUMA log line)
CASES = [
    ("create before vSphere 8.0.0.1: vNUMA as an advanced setting", "6.5", {}, None,
     {**CREATED, "extraConfig": {**BRIEF_KEYS, "numa.vcpu.maxPerVirtualNode": "24"}}, ADVANCED_LOG),
    ("create on vSphere 8: vNUMA in ConfigSpec.virtualNuma", "8.0.3.0", {}, None,
     {**CREATED, "virtualNuma.coresPerNumaNode": 24, "extraConfig": BRIEF_KEYS}, VIRTUAL_LOG),
    ("vSphere 8, virtual hardware vmx-19: the advanced setting still", "8.0.3.0",
     {"hardware_version": "vmx-19"}, None,
     {**CREATED, "extraConfig": {**BRIEF_KEYS, "numa.vcpu.maxPerVirtualNode": "24"}}, ADVANCED_LOG),
    ("vNUMA drift, vSphere 8: only virtualNuma", "8.0.3.0", {}, off(cores_per_numa_node=None),
     {"virtualNuma.coresPerNumaNode": 24}, VIRTUAL_LOG),
    ("vNUMA drift, 6.5: only the numa.vcpu key", "6.5", {},
     lambda d: observed(d, power_state="poweredOff",
                        extra_config={**observed(d).extra_config, "numa.vcpu.maxPerVirtualNode": "12"}),
     {"extraConfig": {"numa.vcpu.maxPerVirtualNode": "24"}}, ADVANCED_LOG),
    ("latency sensitivity high: level and the full CPU reservation", "8.0.3.0",
     {"latency_sensitivity": "high"}, off(cpu_reservation_mhz=0),
     {"latencySensitivity.level": "high", "cpuAllocation.reservation": 96 * 2700}, None),
    ("shape drift, no vNUMA change", "8.0.3.0", {}, off(num_cpus=8, cores_per_socket=4, cpu_hot_add=True),
     {"numCPUs": 96, "numCoresPerSocket": 48, "cpuHotAddEnabled": False}, None),
    ("memory no longer locked", "6.5", {}, off(memory_locked_to_max=False, memory_reservation_mb=0),
     {"memoryReservationLockedToMax": True, "memoryAllocation.reservation": 393216}, None),
    ("adapters swapped: both edited in place", "6.5", {}, off(nics=("bench-25g-pg", "mgmt-pg")),
     {"deviceChange": [("edit", 4000, "mgmt-pg"), ("edit", 4001, "bench-25g-pg")]}, None),
]


@pytest.mark.parametrize("api, vm, now, expected, logged", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_reconfigure_spec(api, vm, now, expected, logged, caplog):
    caplog.set_level(logging.DEBUG, logger=specs.__name__)
    d = desired_vms(inventory(vm), api, {"esx01.example.local": 2700})[0]
    plan = c.plan_vm(d, now(d) if now else None, allow_restart=False)
    [change] = [ch for ch in plan.changes if isinstance(ch, c.Reconfigure)]
    devices = adapters(plan.observed.nics if now else ("mgmt-pg",)) \
        if specs.needs_devices(change.fields) else None
    assert flat(specs.config_spec(change.fields, d, lab_refs(), devices)) == expected
    vnuma = [r.getMessage() for r in caplog.records if "vNUMA" in r.getMessage()]
    assert [m[:len(logged)] for m in vnuma] == ([logged] if logged else [])


def test_clone_spec_places_the_vm_powered_off_and_owner_marked():
    d = desired_vms(inventory(), "6.5")[1]
    [clone] = [ch for ch in c.plan_vm(d, None, allow_restart=False).changes if isinstance(ch, c.CloneVm)]
    spec = specs.clone_spec(d, lab_refs(), clone.owner)
    assert spec.location.host is HOSTS["esx02.example.local"]
    assert (spec.location.datastore._moId, spec.location.pool._moId) == ("datastore-1", "resgroup-1")
    assert (spec.powerOn, spec.template) == (False, False)
    assert flat(spec.config) == {"extraConfig": {"vcfslm.owner": "phi3-vx650v4"}}
    assert specs.relocate_spec(d, lab_refs()).host is HOSTS["esx02.example.local"]


@pytest.mark.parametrize("change, message", [
    ({"host": "esx09.example.local"}, "ESXi host esx09.example.local not found"),
    ({"datastore": "nfs01"}, "datastore nfs01 not found"),
    ({"resource_pool": "/slm/"}, "resource pool /slm/ not found"),
])
def test_placement_names_what_is_missing(change, message):
    d = replace(desired_vms(inventory(), "6.5")[0], **change)
    with pytest.raises(VCenterError, match=f"^{message}$"):
        specs.clone_spec(d, lab_refs(), "x")


# (case, current adapters, desired port groups, device changes)
NIC_CASES = [
    ("in order already: nothing", [template_nic(4000), dv_nic(4001, "dvportgroup-7")],
     ("mgmt-pg", "bench-25g-pg"), []),
    ("one missing: added, connected", [template_nic(4000)], ("mgmt-pg", "bench-25g-pg"),
     [("add", -101, "bench-25g-pg")]),
    ("one too many: removed", [template_nic(4000), dv_nic(4001), template_nic(4002)],
     ("mgmt-pg", "bench-25g-pg"), [("remove", 4002, "mgmt-pg")]),
    ("wrong port group: re-backed", [template_nic(4000, "old-pg")], ("mgmt-pg",),
     [("edit", 4000, "mgmt-pg")]),
    ("none at all", [], ("mgmt-pg", "bench-25g-pg"),
     [("add", -100, "mgmt-pg"), ("add", -101, "bench-25g-pg")]),
]


@pytest.mark.parametrize("devices, portgroups, expected", [case[1:] for case in NIC_CASES],
                         ids=[case[0] for case in NIC_CASES])
def test_nic_changes(devices, portgroups, expected):
    d = desired_vms(inventory(), "6.5")[0]
    d = replace(d, nics=tuple(replace(d.nics[0], portgroup=pg) for pg in portgroups))
    out = specs.nic_changes(devices, d, lab_refs())
    assert flat(vim.vm.ConfigSpec(deviceChange=out)).get("deviceChange", []) == expected
    for change in out:
        if change.operation == "add":
            assert change.device.connectable.startConnected is True


def test_backing_kind_follows_the_port_group():
    refs = lab_refs()
    dv = specs.backing("bench-25g-pg", refs)
    assert (dv.port.portgroupKey, dv.port.switchUuid) == ("dvportgroup-7", "50 1a uuid")
    std = specs.backing("mgmt-pg", refs)
    assert (std.deviceName, std.network._moId) == ("mgmt-pg", "network-1")
    with pytest.raises(VCenterError, match="port group nope not found"):
        specs.backing("nope", refs)


def test_customization_and_its_marker():
    d = desired_vms(inventory(), "6.5")[0]
    custom = specs.customization_spec(d)
    assert custom.identity.hostName.name == "slm-01"
    ips = [(a.adapter.ip.ipAddress, a.adapter.subnetMask, list(a.adapter.gateway)) for a in custom.nicSettingMap]
    assert ips == [("192.168.10.21", "255.255.255.0", ["192.168.10.1"]),
                   ("172.16.25.21", "255.255.255.0", [])]
    assert custom.globalIPSettings.dnsServerList == ["192.168.10.10"]
    assert flat(specs.customization_mark(d)) == {"extraConfig": {
        "vcfslm.customization": d.customization_fingerprint}}


def test_unknown_field_is_an_error():
    d = desired_vms(inventory(), "6.5")[0]
    with pytest.raises(VCenterError, match="unknown field floppy"):
        specs.config_spec([c.FieldChange("floppy", "floppy", None, 1, False)], d, lab_refs())
