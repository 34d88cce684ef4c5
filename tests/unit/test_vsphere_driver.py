"""The pyVmomi driver's calls for each change kind (pytest-mock on pyVmomi objects), run
through reconcile's pool: its one-round-trip observe, failure isolation, folders, destroy."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from pyVmomi import vim
from test_vsphere_support import HOSTS, fake_vm, inventory, lab_refs, observed, template_nic

from vcfslm.progress import RecordingReporter
from vcfslm.vsphere import changes as c
from vcfslm.vsphere import driver, reconcile, tasks
from vcfslm.vsphere.credentials import Secret
from vcfslm.vsphere.desired import desired_vms
from vcfslm.vsphere.session import SessionOptions
from vcfslm.vsphere.state import VmState


class FakeWaiter(tasks.Waiter):
    """The real waiter's `run`, over a `task` that returns what the test maps the task to."""

    results: dict = {}
    waited: list = []

    def __init__(self, session, timeout=3600.0):
        self.session = session
        self.timeout = timeout

    def task(self, task, what="a task", timeout=None):
        FakeWaiter.waited.append(task)
        result = FakeWaiter.results.get(task)
        if isinstance(result, BaseException):
            raise result
        return result

    def ipv4(self, vm, portgroup, timeout):
        return "192.168.10.21"

    def close(self):
        pass


@pytest.fixture
def vc(mocker):
    FakeWaiter.results = {}
    FakeWaiter.waited = []
    mocker.patch.object(driver, "Waiter", FakeWaiter)
    v = driver.PyVmomiVCenter(inventory().vcenter, Secret("pw"), RecordingReporter(),
                               options=SessionOptions(backoff=0))
    v.session.si = MagicMock()
    v.session.si.RetrieveContent.return_value = v.session.si.content
    v.session.si.content.about.apiVersion = "8.0.3.0"
    v.refs = lab_refs()
    v.read_vm = lambda vm: None  # the read-back finds nothing: vNUMA unverified
    return v


def apply(vc, plan: c.Plan, **kw):
    return reconcile.apply_plan(vc, plan, vc.reporter, **kw)


def one_vm_plan(vm_plan: c.VmPlan) -> c.Plan:
    return c.Plan(vms=(vm_plan,))


def test_create_clones_reconfigures_customizes_and_powers_on(vc):
    d = desired_vms(inventory(), "6.5")[0]
    template = vc.refs.vms["ubuntu-24.04-template"]
    clone = fake_vm("slm-01")
    FakeWaiter.results["template:CloneVM_Task"] = clone
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, None, allow_restart=False)))
    assert out.ok and out.ip == "192.168.10.21" and out.moref == "vm-slm-01"

    kwargs = template.CloneVM_Task.call_args.kwargs
    assert kwargs["name"] == "slm-01" and kwargs["folder"] is vc.refs.folders["SLM/phi3"]
    spec = kwargs["spec"]
    assert spec.location.host is HOSTS["esx01.example.local"]
    assert spec.location.datastore._moId == "datastore-1" and spec.location.pool._moId == "resgroup-1"
    assert spec.powerOn is False and spec.template is False
    assert [(o.key, o.value) for o in spec.config.extraConfig] == [("vcfslm.owner", "phi3-vx650v4")]
    clone.RelocateVM_Task.assert_not_called()  # already on the right host

    first, mark = [call.kwargs["spec"] for call in clone.ReconfigVM_Task.call_args_list]
    assert (first.numCPUs, first.numCoresPerSocket, first.memoryMB) == (96, 48, 393216)
    assert first.memoryReservationLockedToMax is True
    assert first.memoryAllocation.reservation == 393216
    keys = {o.key: o.value for o in first.extraConfig}
    assert keys == {"numa.autosize.once": "FALSE", "numa.nodeAffinity": "0,1,2,3",
                    "numa.vcpu.maxPerVirtualNode": "24", "vcfslm.owner": "phi3-vx650v4"}
    assert first.virtualNuma is None
    [nic] = first.deviceChange
    assert nic.operation == "add"
    assert nic.device.backing.port.portgroupKey == "dvportgroup-7"
    assert nic.device.backing.port.switchUuid == "50 1a uuid"

    custom = clone.CustomizeVM_Task.call_args.kwargs["spec"]
    assert custom.identity.hostName.name == "slm-01"
    ips = [(a.adapter.ip.ipAddress, a.adapter.subnetMask, list(a.adapter.gateway)) for a in custom.nicSettingMap]
    assert ips == [("192.168.10.21", "255.255.255.0", ["192.168.10.1"]),
                   ("172.16.25.21", "255.255.255.0", [])]
    assert custom.globalIPSettings.dnsServerList == ["192.168.10.10"]
    assert [(o.key, o.value) for o in mark.extraConfig] == [
        ("vcfslm.customization", d.customization_fingerprint)]
    clone.PowerOnVM_Task.assert_called_once()
    assert FakeWaiter.waited == ["template:CloneVM_Task", "slm-01:ReconfigVM_Task",
                                 "slm-01:CustomizeVM_Task", "slm-01:ReconfigVM_Task",
                                 "slm-01:PowerOnVM_Task"]


def test_clone_placed_elsewhere_is_migrated(vc):
    d = desired_vms(inventory(), "6.5")[1]  # esx02
    clone = fake_vm("slm-02", host="esx01.example.local")
    FakeWaiter.results["template:CloneVM_Task"] = clone
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, None, allow_restart=False)))
    assert out.ok
    spec = clone.RelocateVM_Task.call_args.kwargs["spec"]
    assert spec.host is HOSTS["esx02.example.local"]


def library_vm(d):
    return replace(d, template="library:slm-lib/ubuntu-24.04")


def test_library_template_is_deployed_by_the_given_callable_then_owner_marked(vc):
    d = library_vm(desired_vms(inventory(), "6.5")[0])
    deployed = []

    def deploy(library, item, **ids):
        deployed.append((library, item, ids))
        return "vm-77"

    stub = vc.session.si._stub  # what the deployed VM's calls and property reads go through
    props = {"runtime": SimpleNamespace(host=HOSTS["esx01.example.local"]),  # placed right
             "config": SimpleNamespace(hardware=SimpleNamespace(device=[template_nic()]))}
    stub.InvokeAccessor.side_effect = lambda mo, info: props[info.name]
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, None, allow_restart=False)), library_deploy=deploy)
    assert out.ok and out.moref == "vm-77"
    assert deployed == [("slm-lib", "ubuntu-24.04", {
        "name": "slm-01", "folder": "group-v3", "host": "host-1", "resource_pool": "resgroup-1",
        "datastore": "datastore-1"})]
    vm, method, args = stub.InvokeMethod.call_args_list[0].args
    assert (vm._moId, method.wsdlName) == ("vm-77", "ReconfigVM_Task")
    assert [(o.key, o.value) for o in args[0].extraConfig] == [("vcfslm.owner", "phi3-vx650v4")]
    assert vc.refs.vms["slm-01"]._moId == "vm-77"


def test_library_template_without_the_automation_api_fails_that_vm(vc):
    d = library_vm(desired_vms(inventory(), "6.5")[0])
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, None, allow_restart=False)))
    assert out.status == "failed" and out.step == "clone"
    assert out.message == ("clone: content-library templates need the Automation API, "
                           "which is not available")


def test_vsphere8_reconfigure_uses_virtual_numa_and_latency_sensitivity(vc):
    inv = inventory({"latency_sensitivity": "high"})
    d = desired_vms(inv, "8.0.3.0", {"esx01.example.local": 2700})[0]
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    now = observed(d, power_state="poweredOff", cores_per_numa_node=None, latency_sensitivity="normal",
                   cpu_reservation_mhz=0)
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, now, allow_restart=False)))
    assert out.ok
    spec = vm.ReconfigVM_Task.call_args.kwargs["spec"]
    assert spec.virtualNuma.coresPerNumaNode == 24
    assert spec.latencySensitivity.level == "high"
    assert spec.cpuAllocation.reservation == 96 * 2700
    assert spec.numCPUs is None  # only what differs
    vm.PowerOffVM_Task.assert_not_called()
    vm.PowerOnVM_Task.assert_called_once()


def test_restart_needing_drift_power_cycles_only_when_allowed(vc):
    d = desired_vms(inventory(), "8.0.3.0")[0]
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    now = observed(d, num_cpus=8)
    [held] = apply(vc, one_vm_plan(c.plan_vm(d, now, allow_restart=False)))
    assert held.ok and held.pending == ["numCPUs: 8 -> 96"]
    vm.ReconfigVM_Task.assert_not_called()
    vm.PowerOffVM_Task.assert_not_called()

    [done] = apply(vc, one_vm_plan(c.plan_vm(d, now, allow_restart=True)))
    assert done.ok and done.pending == []
    assert vm.ReconfigVM_Task.call_args.kwargs["spec"].numCPUs == 96
    assert FakeWaiter.waited == ["slm-01:PowerOffVM_Task", "slm-01:ReconfigVM_Task",
                                 "slm-01:PowerOnVM_Task"]


def test_relocate_and_hardware_upgrade_calls(vc):
    d = desired_vms(inventory(), "8.0.3.0")[0]
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    now = observed(d, host="esx04.example.local", hardware_version="vmx-19")
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, now, allow_restart=True)))
    assert out.ok
    assert vm.RelocateVM_Task.call_args.kwargs["spec"].host is HOSTS["esx01.example.local"]
    vm.UpgradeVM_Task.assert_called_once_with(version="vmx-21")


def test_power_off_of_an_already_off_vm_is_fine(vc):
    d = desired_vms(inventory(), "8.0.3.0")[0]
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    vm.PowerOffVM_Task.side_effect = vim.fault.InvalidPowerState()
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, observed(d, num_cpus=8), allow_restart=True)))
    assert out.ok


def test_one_failure_does_not_stop_the_others(vc):
    ds = desired_vms(inventory(), "6.5")
    template = vc.refs.vms["ubuntu-24.04-template"]

    def clone(folder, name, spec):
        if name == "slm-02":
            raise vim.fault.InsufficientResourcesFault(msg="not enough memory on esx02")
        FakeWaiter.results[f"{name}:clone"] = fake_vm(name, host=ds[int(name[-1]) - 1].host)
        return f"{name}:clone"

    template.CloneVM_Task.side_effect = clone
    plan = c.Plan(vms=tuple(c.plan_vm(d, None, allow_restart=False) for d in ds))
    outs = apply(vc, plan)
    assert [o.status for o in outs] == ["ok", "failed", "ok", "ok"]
    assert outs[1].step == "clone" and "not enough memory on esx02" in outs[1].message
    assert vc.reporter.last("slm-02").startswith("failed at clone")


def test_failed_task_reports_the_fault(vc):
    d = desired_vms(inventory(), "8.0.3.0")[0]
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    FakeWaiter.results["slm-01:ReconfigVM_Task"] = tasks.TaskFailed("InvalidArgument: numCPUs")
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, observed(d, memory_locked_to_max=False), False)))
    assert out.status == "failed" and out.step == "reconfigure"
    assert "InvalidArgument: numCPUs" in out.message


def test_blocked_and_in_sync_vms_are_not_touched(vc):
    first, second = desired_vms(inventory(), "8.0.3.0")[:2]
    vm = fake_vm("slm-02", host="esx02.example.local")
    vc.refs.vms["slm-02"] = vm
    blocked = c.plan_vm(first, None, False, problems=("ESXi host gone",))
    same = c.plan_vm(second, observed(second), False)
    outs = apply(vc, c.Plan(vms=(blocked, same)))
    assert [o.status for o in outs] == ["blocked", "ok"]
    assert outs[0].message == "ESXi host gone"
    assert [call[0] for call in vm.method_calls] == []
    vc.refs.vms["ubuntu-24.04-template"].CloneVM_Task.assert_not_called()


def test_folder_is_created_level_by_level(vc):
    vc.refs.folders = {"": vc.refs.vm_root}
    root = MagicMock()
    slm = MagicMock()
    root.CreateFolder.return_value = slm
    slm.CreateFolder.return_value = vim.Folder("group-v9")
    vc.refs.vm_root = root
    assert vc.ensure_folder("SLM/phi3")._moId == "group-v9"
    root.CreateFolder.assert_called_once_with(name="SLM")
    slm.CreateFolder.assert_called_once_with(name="phi3")
    assert vc.ensure_folder("/SLM/phi3/")._moId == "group-v9"  # cached, no second create


def test_destroy_powers_off_then_destroys(vc):
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    plan = c.DestroyPlan(destroy=(VmState("slm-01", "vm-slm-01", power_state="poweredOn"),))
    [out] = reconcile.destroy_vms(vc, plan, vc.reporter)
    assert out.ok
    assert FakeWaiter.waited == ["slm-01:PowerOffVM_Task", "slm-01:Destroy_Task"]
    assert "slm-01" not in vc.refs.vms


# ------------------------------------------------------------------ observe


def content(obj, **props):
    """An ObjectContent as RetrieveContents returns it (plain objects: only .obj/.propSet are read)."""
    return SimpleNamespace(obj=obj, propSet=[SimpleNamespace(name=k.replace("__", "."), val=v)
                                             for k, v in props.items()])


def test_observe_is_one_round_trip_and_reads_everything(vc):
    root = vim.Folder("group-d1")
    dc, vmf, hostf, dsf, netf = (vim.Datacenter("dc-1"), vim.Folder("group-v1"), vim.Folder("group-h1"),
                                 vim.Folder("group-s1"), vim.Folder("group-n1"))
    slm, phi3 = vim.Folder("group-v2"), vim.Folder("group-v3")
    cl, rp = vim.ClusterComputeResource("domain-c1"), vim.ResourcePool("resgroup-1")
    h1, ds1 = vim.HostSystem("host-1"), vim.Datastore("datastore-1")
    net, pg, dvs = (vim.Network("network-1"), vim.dvs.DistributedVirtualPortgroup("dvportgroup-7"),
                    vim.dvs.VmwareDistributedVirtualSwitch("dvs-1"))
    tpl, vm = vim.VirtualMachine("vm-1"), vim.VirtualMachine("vm-2")
    numa = vim.host.NumaInfo(type="NUMA", numNodes=4)
    nics = [template_nic(), vim.vm.device.VirtualVmxnet3(
        key=4001, backing=vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo(
            port=vim.dvs.PortConnection(portgroupKey="dvportgroup-7", switchUuid="u")))]
    guest_net = [vim.vm.GuestInfo.NicInfo(deviceConfigId=4000, network="mgmt-pg",
                                          ipAddress=["fe80::1", "169.254.3.4", "192.168.10.21"]),
                 vim.vm.GuestInfo.NicInfo(deviceConfigId=4001, network="bench-25g-pg",
                                          ipAddress=["172.16.25.21"])]
    objects = [
        content(root, name="Datacenters"),
        content(dc, name="DC01", parent=root, vmFolder=vmf),
        content(vmf, name="vm", parent=dc), content(slm, name="SLM", parent=vmf),
        content(phi3, name="phi3", parent=slm),
        content(hostf, name="host", parent=dc), content(dsf, name="datastore", parent=dc),
        content(netf, name="network", parent=dc),
        content(cl, name="WLD01-CL01", parent=hostf, resourcePool=rp),
        content(rp, name="Resources", parent=cl),
        content(h1, name="esx01.example.local", parent=cl, hardware__numaInfo=numa,
                hardware__memorySize=1536 * 1024**3, summary__hardware__cpuMhz=2700,
                config__product__apiVersion="8.0.3.0", runtime__connectionState="connected"),
        content(ds1, name="vsanDatastore", parent=dsf),
        content(net, name="mgmt-pg", parent=netf),
        content(pg, name="bench-25g-pg", parent=netf, key="dvportgroup-7",
                config__distributedVirtualSwitch=dvs),
        content(dvs, uuid="50 1a uuid"),
        content(tpl, name="ubuntu-24.04-template", parent=vmf, config__template=True),
        content(vm, name="slm-01", parent=phi3, config__template=False, config__version="vmx-21",
                config__hardware__numCPU=96, config__hardware__numCoresPerSocket=48,
                config__hardware__memoryMB=393216, config__hardware__device=nics,
                config__extraConfig=[vim.option.OptionValue(key="numa.nodeAffinity", value="0"),
                                     vim.option.OptionValue(key="numa.nodeAffinity", value="0,1,2,3")],
                config__memoryReservationLockedToMax=True,
                config__memoryAllocation=vim.ResourceAllocationInfo(reservation=393216),
                config__cpuAllocation=vim.ResourceAllocationInfo(reservation=0),
                config__latencySensitivity=vim.LatencySensitivity(level="normal"),
                config__numaInfo=vim.vm.VirtualNumaInfo(coresPerNumaNode=24),
                runtime__powerState="poweredOn", runtime__host=h1, guest__net=guest_net),
    ]
    vc.session.si.content.rootFolder = root
    vc.session.si.content.about.apiVersion = "8.0.3.0"
    retrieve = vc.session.si.content.propertyCollector.RetrieveContents
    retrieve.return_value = objects
    snap = vc.observe(inventory())
    retrieve.assert_called_once()
    [spec] = retrieve.call_args.args[0]
    vm_paths = next(p.pathSet for p in spec.propSet if p.type is vim.VirtualMachine)
    assert "config.numaInfo" in vm_paths  # asked only of vSphere 8.0.0.1+

    assert (snap.datacenter, snap.cluster) == ("DC01", "WLD01-CL01")
    assert snap.folders == {"SLM", "SLM/phi3"}
    assert snap.datastores == {"vsanDatastore"} and snap.networks == {"mgmt-pg", "bench-25g-pg"}
    assert snap.hosts["esx01.example.local"].numa_nodes == 4
    assert snap.hosts["esx01.example.local"].cluster == "WLD01-CL01"
    assert vc.refs.dvportgroups == {"bench-25g-pg": ("dvportgroup-7", "50 1a uuid")}
    assert (vc.refs.vms["slm-01"], vc.refs.folders["SLM/phi3"], vc.refs.pools[""]) == (vm, phi3, rp)
    s = snap.vms["slm-01"]
    assert (s.num_cpus, s.cores_per_socket, s.memory_mb, s.cores_per_numa_node) == (96, 48, 393216, 24)
    assert s.extra_config["numa.nodeAffinity"] == "0,1,2,3"  # the last entry wins
    assert s.nics == ("mgmt-pg", "bench-25g-pg")
    assert s.ip_addresses == ("192.168.10.21",)  # management NIC only, no link-local
    assert (s.host, s.folder, s.power_state) == ("esx01.example.local", "SLM/phi3", "poweredOn")
    assert snap.vms["ubuntu-24.04-template"].template is True
