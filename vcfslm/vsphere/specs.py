"""Changes -> vSphere specs (pure: builds pyVmomi data objects, calls nothing on the server).

vNUMA reaches the ConfigSpec by one of two paths, chosen per VM in `desired`:
on vSphere 8.0.0.1+ with hardware vmx-20+ the field `cores_per_numa_node`
becomes `ConfigSpec.virtualNuma.coresPerNumaNode`; on older releases the same
size travels as the advanced setting `numa.vcpu.maxPerVirtualNode` among the
other `extra_config:<key>` fields, as `ConfigSpec.extraConfig`.
Each setting of the table in settings.py is written at its row's ConfigSpec path.
Managed objects (hosts, pools, networks) come from the observe's `Refs`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pyVmomi import vim

from .. import vm_settings
from ..errors import VCenterError
from .changes import FieldChange
from .desired import (
    ADVANCED,
    CUSTOMIZATION_KEY,
    OWNER_KEY,
    VIRTUAL_NUMA,
    VNUMA_API,
    VNUMA_HARDWARE,
    VNUMA_KEY,
    DesiredVm,
)
from .snapshot import Refs, backing_name, ethernet_cards

log = logging.getLogger(__name__)

_API = ".".join(map(str, VNUMA_API))
WHY_VNUMA_PATH = {
    VIRTUAL_NUMA: f"vSphere API {_API}+ with virtual hardware vmx-{VNUMA_HARDWARE}+",
    ADVANCED: f"vSphere API older than {_API} or virtual hardware older than vmx-{VNUMA_HARDWARE}",
}


def needs_devices(fields: Iterable[FieldChange]) -> bool:
    """True when config_spec needs the VM's current devices (the adapters change)."""
    return any(f.field == "nics" for f in fields)


def config_spec(fields: Iterable[FieldChange], desired: DesiredVm, refs: Refs, devices=None):
    """A ConfigSpec setting exactly `fields` to their new values.

    devices: the VM's current devices, needed when the adapters change (see needs_devices).
    """
    spec = vim.vm.ConfigSpec()
    extra = []
    for f in fields:
        setting = vm_settings.row(f.field)
        if setting is not None:
            set_path(spec, setting.spec, f.new)
        elif f.field.startswith("extra_config:"):
            extra.append(vim.option.OptionValue(key=f.field.split(":", 1)[1], value=f.new))
        elif f.field == "nics":
            spec.deviceChange = nic_changes(devices, desired, refs)
        else:
            raise VCenterError(f"unknown field {f.field}")
    if extra:
        spec.extraConfig = extra
    _log_vnuma(desired, spec)
    return spec


def set_path(obj, path: str, value) -> None:
    """Sets a dotted data-object path ("latencySensitivity.level"), making each missing
    step an object of the type the vSphere API gives that property."""
    *steps, last = path.split(".")
    for step in steps:
        inner = getattr(obj, step)
        if inner is None:
            inner = type(obj)._GetPropertyInfo(step).type()
            setattr(obj, step, inner)
        obj = inner
    setattr(obj, last, value)


def _log_vnuma(desired: DesiredVm, spec) -> None:
    why = WHY_VNUMA_PATH.get(desired.vnuma_path, "unknown path")
    if spec.virtualNuma is not None:
        log.debug("%s: vNUMA via ConfigSpec.virtualNuma.coresPerNumaNode=%s (%s path: %s; hardware %s)",
                  desired.name, spec.virtualNuma.coresPerNumaNode, desired.vnuma_path, why,
                  desired.hardware_version)
    for opt in spec.extraConfig or []:
        if opt.key == VNUMA_KEY:
            log.debug("%s: vNUMA via extraConfig %s=%s (%s path: %s; hardware %s)", desired.name,
                      opt.key, opt.value, desired.vnuma_path, why, desired.hardware_version)


def _one_key(key: str, value: str):
    return vim.vm.ConfigSpec(extraConfig=[vim.option.OptionValue(key=key, value=value)])


def owner_mark(owner: str):
    """A ConfigSpec setting the owner marker (destroy only removes VMs that carry it)."""
    return _one_key(OWNER_KEY, owner)


def customization_mark(desired: DesiredVm):
    """A ConfigSpec recording what the guest was customized with (a later diff re-customizes on change)."""
    return _one_key(CUSTOMIZATION_KEY, desired.customization_fingerprint)


def placement(desired: DesiredVm, refs: Refs) -> tuple[Any, Any, Any]:
    """(host, datastore, resource pool) of the desired VM; VCenterError naming what is missing."""
    host = refs.hosts.get(desired.host)
    if host is None:
        raise VCenterError(f"ESXi host {desired.host} not found")
    datastore = refs.datastores.get(desired.datastore)
    if datastore is None:
        raise VCenterError(f"datastore {desired.datastore} not found")
    pool = refs.pools.get((desired.resource_pool or "").strip("/"))
    if pool is None:
        raise VCenterError(f"resource pool {desired.resource_pool or '(cluster root)'} not found")
    return host, datastore, pool


def clone_spec(desired: DesiredVm, refs: Refs, owner: str):
    """A CloneSpec to the desired host, datastore and pool, powered off, owner-marked from birth."""
    host, datastore, pool = placement(desired, refs)
    return vim.vm.CloneSpec(
        location=vim.vm.RelocateSpec(host=host, datastore=datastore, pool=pool),
        powerOn=False, template=False,
        # The owner marker is on from birth, so an interrupted create can be resumed.
        config=owner_mark(owner))


def relocate_spec(desired: DesiredVm, refs: Refs):
    """A RelocateSpec to the desired host and resource pool."""
    host, _, pool = placement(desired, refs)
    return vim.vm.RelocateSpec(host=host, pool=pool)


def backing(portgroup: str, refs: Refs):
    """The adapter backing for a distributed or standard port group."""
    if portgroup in refs.dvportgroups:
        key, uuid = refs.dvportgroups[portgroup]
        return vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo(
            port=vim.dvs.PortConnection(portgroupKey=key, switchUuid=uuid))
    net = refs.networks.get(portgroup)
    if net is None:
        raise VCenterError(f"port group {portgroup} not found")
    return vim.vm.device.VirtualEthernetCard.NetworkBackingInfo(deviceName=portgroup, network=net)


def nic_changes(devices, desired: DesiredVm, refs: Refs) -> list:
    """Device changes giving the VM one adapter per desired port group, in order."""
    names = refs.network_names()
    nics = ethernet_cards(devices)
    Spec = vim.vm.device.VirtualDeviceSpec
    out = []
    for i, nic_want in enumerate(desired.nics):
        if i < len(nics):
            if backing_name(nics[i], names) != nic_want.portgroup:
                nics[i].backing = backing(nic_want.portgroup, refs)
                out.append(Spec(operation=Spec.Operation.edit, device=nics[i]))
        else:
            card = vim.vm.device.VirtualVmxnet3(
                key=-(100 + i), backing=backing(nic_want.portgroup, refs),
                connectable=vim.vm.device.VirtualDevice.ConnectInfo(
                    startConnected=True, allowGuestControl=True, connected=True))
            out.append(Spec(operation=Spec.Operation.add, device=card))
    for extra in nics[len(desired.nics):]:
        out.append(Spec(operation=Spec.Operation.remove, device=extra))
    return out


def customization_spec(desired: DesiredVm):
    """Linux guest customization: hostname, static IPv4 on each NIC, gateway and DNS."""
    C = vim.vm.customization
    adapters = []
    for nic in desired.nics:
        ip = C.IPSettings(ip=C.FixedIp(ipAddress=nic.ip), subnetMask=nic.netmask)
        if nic.gateway:
            ip.gateway = [nic.gateway]
        if nic.dns:
            ip.dnsServerList = list(nic.dns)
        adapters.append(C.AdapterMapping(adapter=ip))
    dns = list(dict.fromkeys(d for nic in desired.nics for d in nic.dns))
    return C.Specification(
        identity=C.LinuxPrep(hostName=C.FixedName(name=desired.hostname), domain="localdomain",
                             hwClockUTC=True),
        globalIPSettings=C.GlobalIPSettings(dnsServerList=dns),
        nicSettingMap=adapters)
