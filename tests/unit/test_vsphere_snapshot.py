"""The pure snapshot parser, as data: property sets in -> VmState / Snapshot / Refs out.

Records are plain: a moref id, type names and a property dict whose references are
moref ids (the handles in Refs are those ids too). Nested data objects (devices,
guest NICs, allocations) are the pyVmomi data objects vCenter returns.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pyVmomi import vim
from test_vsphere_support import dv_nic, template_nic

from vcfslm.vsphere import snapshot as S
from vcfslm.vsphere.state import HostFacts, Snapshot, VmState

BASES = {"ClusterComputeResource": ("ComputeResource",), "DistributedVirtualPortgroup": ("Network",),
         "VmwareDistributedVirtualSwitch": ("DistributedVirtualSwitch",)}
NET_NAMES = {"network-1": "mgmt-pg", "dvportgroup-7": "bench-25g-pg"}


def rec(moref: str, kind: str, props: dict | None = None, **more) -> S.Found:
    """A record as the driver hands it over: `props`, then `more` (`a__b=` sets path 'a.b')."""
    return S.Found(moref, frozenset({kind, *BASES.get(kind, ())}),
                   {**(props or {}), **{k.replace("__", "."): v for k, v in more.items()}}, obj=moref)


def guest_nic(key: int, network: str, *ips: str):
    return vim.vm.GuestInfo.NicInfo(deviceConfigId=key, network=network, ipAddress=list(ips))


def opts(*pairs):
    return [vim.option.OptionValue(key=k, value=v) for k, v in pairs]


BRIEF_VM = {
    "name": "slm-01", "config.template": False, "config.version": "vmx-21",
    "config.hardware.numCPU": 96, "config.hardware.numCoresPerSocket": 48,
    "config.hardware.memoryMB": 393216, "config.hardware.device": [template_nic(), dv_nic()],
    "config.extraConfig": opts(("numa.nodeAffinity", "0,1,2,3"), ("vcfslm.owner", "phi3-vx650v4")),
    "config.memoryReservationLockedToMax": True,
    "config.memoryAllocation": vim.ResourceAllocationInfo(reservation=393216),
    "config.cpuAllocation": vim.ResourceAllocationInfo(reservation=259200),
    "config.cpuHotAddEnabled": False,
    "config.latencySensitivity": vim.LatencySensitivity(level="high"),
    "config.numaInfo": vim.vm.VirtualNumaInfo(coresPerNumaNode=24),
    "runtime.powerState": "poweredOn", "runtime.host": "host-1",
    "guest.net": [guest_nic(4000, "mgmt-pg", "192.168.10.21"), guest_nic(4001, "bench-25g-pg", "172.16.25.21")],
}
BRIEF_STATE = VmState(
    name="slm-01", moref="vm-2", power_state="poweredOn", template=False, host="esx01.example.local",
    folder="SLM/phi3", hardware_version="vmx-21", num_cpus=96, cores_per_socket=48, memory_mb=393216,
    memory_locked_to_max=True, memory_reservation_mb=393216, cpu_hot_add=False,
    latency_sensitivity="high", cpu_reservation_mhz=259200, cores_per_numa_node=24,
    numa_info_reported=True,
    extra_config={"numa.nodeAffinity": "0,1,2,3", "vcfslm.owner": "phi3-vx650v4"},
    nics=("mgmt-pg", "bench-25g-pg"), ip_addresses=("192.168.10.21",))


def with_props(**changes):
    return rec("vm-2", "VirtualMachine", BRIEF_VM, **changes).props


def with_state(**changes):
    return VmState(**{**BRIEF_STATE.__dict__, **changes})


# (case, VM properties, path under the VM folder, expected VmState)
VM_CASES = [
    ("the brief's VM, every property read", BRIEF_VM, "SLM/phi3/slm-01", BRIEF_STATE),
    ("nothing reported: the defaults", {}, None, VmState(name="vm-2", moref="vm-2")),
    ("a template in the VM folder's root", {"name": "ubuntu", "config.template": True}, "ubuntu",
     VmState(name="ubuntu", moref="vm-2", template=True, folder="")),
    ("later extraConfig entries win (vcsim appends)",
     with_props(config__extraConfig=opts(("numa.nodeAffinity", "0"), ("numa.nodeAffinity", "0,1"))),
     "SLM/phi3/slm-01", with_state(extra_config={"numa.nodeAffinity": "0,1"})),
    ("vNUMA not reported (API before 8.0.0.1)", {k: v for k, v in BRIEF_VM.items() if k != "config.numaInfo"},
     "SLM/phi3/slm-01", with_state(cores_per_numa_node=None, numa_info_reported=False)),
    ("vNUMA sized by vSphere itself (autoCoresPerNumaNode)",
     with_props(config__numaInfo=vim.vm.VirtualNumaInfo(coresPerNumaNode=48, autoCoresPerNumaNode=True)),
     "SLM/phi3/slm-01", with_state(cores_per_numa_node=48, auto_cores_per_numa_node=True)),
    ("IPs: management NIC only, usable IPv4 only, each once",
     with_props(guest__net=[guest_nic(4000, "mgmt-pg", "fe80::1", "169.254.3.4", "0.0.0.0", "10.1.1.1",
                                      "nonsense", "10.1.1.1"),
                            guest_nic(4001, "bench-25g-pg", "172.16.25.21")]),
     "SLM/phi3/slm-01", with_state(ip_addresses=("10.1.1.1",))),
    ("IPs matched by the first adapter's network when the key differs",
     with_props(guest__net=[guest_nic(-1, "mgmt-pg", "10.2.2.2")]), "SLM/phi3/slm-01",
     with_state(ip_addresses=("10.2.2.2",))),
    ("adapters in device-key order, whatever order they are listed in",
     with_props(config__hardware__device=[dv_nic(3999), template_nic(4000)], guest__net=[]),
     "SLM/phi3/slm-01", with_state(nics=("bench-25g-pg", "mgmt-pg"), ip_addresses=())),
    ("an unknown port group key is shown as the key; no deviceName: the network's observed name",
     with_props(config__hardware__device=[
         vim.vm.device.VirtualVmxnet3(key=4000, backing=vim.vm.device.VirtualEthernetCard.NetworkBackingInfo(
             network=vim.Network("network-1"))), dv_nic(4001, pg_key="dvportgroup-99")]),
     "SLM/phi3/slm-01", with_state(nics=("mgmt-pg", "dvportgroup-99"))),
    ("latency sensitivity without a level; a host outside the datacenter",
     with_props(config__latencySensitivity=vim.LatencySensitivity(), runtime__host="host-9"),
     "SLM/phi3/slm-01", with_state(latency_sensitivity=None, host=None)),
    ("not under the datacenter's VM folder", with_props(), None, with_state(folder=None)),
]


@pytest.mark.parametrize("props, path, expected", [c[1:] for c in VM_CASES], ids=[c[0] for c in VM_CASES])
def test_vm_properties_to_vm_state(props, path, expected):
    assert S.vm_state("vm-2", props, {"host-1": "esx01.example.local"}, NET_NAMES, path) == expected


def datacenter(name: str = "DC01", n: str = "1") -> list[S.Found]:
    """One datacenter: VM folder SLM/phi3, cluster with a nested pool, a host, a datastore,
    a standard and a distributed port group, a template and the brief's VM."""
    return [
        rec(f"dc-{n}", "Datacenter", name=name, parent="group-d1", vmFolder=f"group-v{n}"),
        rec(f"group-v{n}", "Folder", name="vm", parent=f"dc-{n}"),
        rec(f"group-v{n}2", "Folder", name="SLM", parent=f"group-v{n}"),
        rec(f"group-v{n}3", "Folder", name="phi3", parent=f"group-v{n}2"),
        rec(f"group-h{n}", "Folder", name="host", parent=f"dc-{n}"),
        rec(f"group-s{n}", "Folder", name="datastore", parent=f"dc-{n}"),
        rec(f"group-n{n}", "Folder", name="network", parent=f"dc-{n}"),
        rec(f"domain-c{n}", "ClusterComputeResource", name="WLD01-CL01", parent=f"group-h{n}",
            resourcePool=f"resgroup-{n}"),
        rec(f"resgroup-{n}", "ResourcePool", name="Resources", parent=f"domain-c{n}"),
        rec(f"resgroup-{n}2", "ResourcePool", name="slm", parent=f"resgroup-{n}"),
        rec(f"resgroup-{n}3", "ResourcePool", name="phi3", parent=f"resgroup-{n}2"),
        rec(f"host-{n}", "HostSystem", name=f"esx0{n}.example.local", parent=f"domain-c{n}",
            hardware__numaInfo=vim.host.NumaInfo(numNodes=4), hardware__memorySize=1536 * 1024**3,
            summary__hardware__cpuMhz=2700, config__product__apiVersion="8.0.3.0",
            runtime__connectionState="connected"),
        rec(f"datastore-{n}", "Datastore", name="vsanDatastore", parent=f"group-s{n}"),
        rec(f"network-{n}", "Network", name="mgmt-pg", parent=f"group-n{n}"),
        rec(f"dvportgroup-{n}", "DistributedVirtualPortgroup", name="bench-25g-pg", parent=f"group-n{n}",
            key=f"dvportgroup-{n}", config__distributedVirtualSwitch=f"dvs-{n}"),
        rec(f"dvs-{n}", "VmwareDistributedVirtualSwitch", uuid="50 1a uuid"),
        rec(f"vm-{n}1", "VirtualMachine", name="ubuntu-24.04-template", parent=f"group-v{n}",
            config__template=True),
        rec(f"vm-{n}2", "VirtualMachine", BRIEF_VM, parent=f"group-v{n}3", runtime__host=f"host-{n}",
            config__hardware__device=[template_nic(), dv_nic(pg_key=f"dvportgroup-{n}")]),
    ]


ROOT = [rec("group-d1", "Folder", name="Datacenters")]
HOST = HostFacts("esx01.example.local", "WLD01-CL01", 4, 1536 * 1024**3, 2700, "8.0.3.0", "connected")


def parsed(records, dc="DC01", cluster="WLD01-CL01"):
    return S.parse(records, dc, cluster, "8.0.3.0")


def test_a_datacenter_to_snapshot_and_refs():
    snap, refs = parsed(ROOT + datacenter())
    assert snap == Snapshot(
        api_version="8.0.3.0", datacenter="DC01", cluster="WLD01-CL01",
        hosts={"esx01.example.local": HOST}, datastores=frozenset({"vsanDatastore"}),
        networks=frozenset({"mgmt-pg", "bench-25g-pg"}), folders=frozenset({"SLM", "SLM/phi3"}),
        resource_pools=frozenset({"slm", "slm/phi3"}),
        vms={"ubuntu-24.04-template": VmState("ubuntu-24.04-template", "vm-11", template=True, folder=""),
             "slm-01": with_state(moref="vm-12")})
    assert refs == S.Refs(
        datacenter="dc-1", vm_root="group-v1", cluster="domain-c1",
        folders={"": "group-v1", "SLM": "group-v12", "SLM/phi3": "group-v13"},
        hosts={"esx01.example.local": "host-1"}, datastores={"vsanDatastore": "datastore-1"},
        networks={"mgmt-pg": "network-1", "bench-25g-pg": "dvportgroup-1"},
        dvportgroups={"bench-25g-pg": ("dvportgroup-1", "50 1a uuid")},
        pools={"": "resgroup-1", "slm": "resgroup-12", "slm/phi3": "resgroup-13"},
        vms={"ubuntu-24.04-template": "vm-11", "slm-01": "vm-12"})


def standalone_host(records):
    """The host moved out of the cluster into its own (non-cluster) compute resource."""
    host = next(r for r in records if r.moref == "host-1")
    return [r for r in records if r is not host] + [
        rec("domain-s1", "ComputeResource", name="esx01", parent="group-h1"),
        rec("host-1", "HostSystem", host.props, parent="domain-s1")]


def duplicate_vm(records):
    return records + [rec("vm-99", "VirtualMachine", name="slm-01", parent="group-v12")]


# (case, records, datacenter, cluster, what the Snapshot says)
PARSE_CASES = [
    ("datacenter not found: nothing else is looked at", ROOT + datacenter(), "DC09", "WLD01-CL01",
     {"datacenter": None, "hosts": {}, "vms": {}}),
    ("another datacenter's objects stay out", ROOT + datacenter() + datacenter("DC02", "2"), "DC02",
     "WLD01-CL01",
     {"datacenter": "DC02", "hosts": {"esx02.example.local": HostFacts(
         "esx02.example.local", "WLD01-CL01", 4, 1536 * 1024**3, 2700, "8.0.3.0")}}),
    ("cluster not found: no cluster, no pools", ROOT + datacenter(), "DC01", "CL09",
     {"cluster": None, "resource_pools": frozenset()}),
    ("a host outside any cluster", standalone_host(ROOT + datacenter()), "DC01", "WLD01-CL01",
     {"hosts": {"esx01.example.local": HostFacts("esx01.example.local", None, 4, 1536 * 1024**3, 2700,
                                                 "8.0.3.0")}}),
    ("a VM name seen twice", duplicate_vm(ROOT + datacenter()), "DC01", "WLD01-CL01",
     {"duplicate_vms": frozenset({"slm-01"})}),
    ("nothing returned", [], "DC01", "WLD01-CL01", {"datacenter": None, "api_version": "8.0.3.0"}),
]


@pytest.mark.parametrize("records, dc, cluster, expected", [c[1:] for c in PARSE_CASES],
                         ids=[c[0] for c in PARSE_CASES])
def test_placement_records_to_snapshot(records, dc, cluster, expected):
    snap, refs = parsed(records, dc, cluster)
    assert {k: getattr(snap, k) for k in expected} == expected
    if snap.datacenter is None:
        assert snap == Snapshot(api_version="8.0.3.0") and refs == S.Refs()


def test_found_turns_references_into_moref_ids():
    dc, vmf, h1 = vim.Datacenter("dc-1"), vim.Folder("group-v1"), vim.HostSystem("host-1")
    numa = vim.host.NumaInfo(numNodes=2)
    contents = [SimpleNamespace(obj=dc, propSet=[SimpleNamespace(name="vmFolder", val=vmf),
                                                 SimpleNamespace(name="parent", val=None)]),
                SimpleNamespace(obj=vim.ClusterComputeResource("domain-c1"), propSet=None),
                SimpleNamespace(obj=h1, propSet=[SimpleNamespace(name="hardware.numaInfo", val=numa)])]
    first, cluster, host = S.found(contents)
    assert (first.moref, first.props, first.obj) == ("dc-1", {"vmFolder": "group-v1", "parent": None}, dc)
    assert {"ClusterComputeResource", "ComputeResource", "ManagedEntity"} <= cluster.types
    assert cluster.props == {} and host.props["hardware.numaInfo"] is numa


@pytest.mark.parametrize("api, numa_info", [("6.5", False), ("8.0", False), ("8.0.0.1", True),
                                            ("8.0.3.0", True), ("9.0", True)])
def test_vm_numa_info_is_asked_only_where_it_exists(api, numa_info):
    props = S.properties(api)
    assert ("config.numaInfo" in props["VirtualMachine"]) is numa_info
    assert props["VirtualMachine"][:len(S.VM_PROPERTIES)] == list(S.VM_PROPERTIES)
    assert list(props) == list(S.PROPERTIES)
