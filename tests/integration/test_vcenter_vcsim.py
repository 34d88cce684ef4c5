"""plan / provision / destroy against the lab's real vCenter simulator (vcsim, API 6.5).

The brief's inventory (4 x 96 vCPUs in four vNUMA nodes, 384 GiB, NUMA affinity
0-3) with the simulator's object names; vcsim's hosts are VX650 V4-shaped, so it
passes preflight. One provisioned cluster is shared by the tests of this module,
in order: read back, re-run, drift, destroy.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.cli import main

pytestmark = pytest.mark.integration

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"
PASSWORD_ENV = "VCFSLM_IT_VCENTER_PASSWORD"
FOLDER = "SLM/it-vcenter"


def brief_inventory(server, name: str, nodes: list[tuple[str, str]], **placement) -> dict:
    """The brief's inventory with vcsim's object names; nodes = [(vm name, host)]."""
    data = yaml.safe_load(BRIEF.read_text())
    data["name"] = name
    data["vcenter"].update(host=server.host, port=server.port, user=server.user,
                           password_env=PASSWORD_ENV, ca_bundle=server.ca_file, insecure=False)
    data["placement"].update(datacenter=server.datacenter, cluster=server.cluster,
                             datastore=server.datastore, folder=FOLDER, template=server.template)
    data["placement"]["networks"]["management"]["portgroup"] = server.management_portgroup
    data["placement"]["networks"]["bench"]["portgroup"] = server.bench_portgroup
    data["placement"].update(placement)
    data["nodes"] = [
        {"name": vm, "host": host, "management_ip": f"192.168.10.{21 + i}",
         "bench_ip": f"172.16.25.{21 + i}",
         # vcsim reports the guest IP from this key (a real guest gets it from customization).
         "advanced": {"SET.guest.ipAddress": f"192.168.10.{21 + i}"}}
        for i, (vm, host) in enumerate(nodes)]
    return data


def write(tmp: Path, data: dict) -> str:
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def env(vcsim_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("state") / "state.json"
    return {PASSWORD_ENV: vcsim_server.password, "VCFSLM_STATE": str(state),
            "VCFSLM_INVENTORY": ""}


@pytest.fixture(scope="module")
def run(env):
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, list(args), env=env, catch_exceptions=False)

    return invoke


@pytest.fixture(scope="module")
def si(vcsim_server):
    """A direct pyVmomi session: the test's own eyes (read back, drift)."""
    from pyVim.connect import Disconnect, SmartConnect

    ctx = ssl.create_default_context(cafile=vcsim_server.ca_file)
    conn = SmartConnect(host=vcsim_server.host, port=vcsim_server.port, user=vcsim_server.user,
                        pwd=vcsim_server.password, sslContext=ctx)
    yield conn
    Disconnect(conn)


def find_vm(si, name: str):
    from pyVmomi import vim

    view = si.content.viewManager.CreateContainerView(si.content.rootFolder, [vim.VirtualMachine], True)
    try:
        return next((vm for vm in view.view if vm.name == name), None)
    finally:
        view.Destroy()


def wait(task):
    from pyVim.task import WaitForTask

    WaitForTask(task)


def extra(vm) -> dict[str, str]:
    out = {}
    for opt in vm.config.extraConfig:
        out[opt.key] = opt.value  # later entries win (vcsim appends)
    return out


def vm_names(si) -> set[str]:
    """Names of the VMs vCenter lists, read by one property-collector call."""
    from pyVmomi import vim, vmodl

    PC = vmodl.query.PropertyCollector
    view = si.content.viewManager.CreateContainerView(si.content.rootFolder, [vim.VirtualMachine], True)
    try:
        spec = PC.FilterSpec(
            objectSet=[PC.ObjectSpec(obj=view, skip=True, selectSet=[PC.TraversalSpec(
                name="view", type=vim.view.ContainerView, path="view", skip=False)])],
            propSet=[PC.PropertySpec(type=vim.VirtualMachine, pathSet=["name"])])
        return {p.val for oc in si.content.propertyCollector.RetrieveContents([spec])
                for p in oc.propSet}
    finally:
        view.Destroy()


def folder_exists(si, path: str) -> bool:
    folder = si.content.rootFolder.childEntity[0].vmFolder
    for part in path.split("/"):
        folder = next((f for f in folder.childEntity if f.name == part), None)
        if folder is None:
            return False
    return True


BRIEF_NODES = [(f"itvc-0{i + 1}", f"DC0_C0_H{i}") for i in range(4)]


@pytest.fixture(scope="module")
def cluster(vcsim_server, tmp_path_factory, run):
    """The brief's 4-VM cluster, provisioned once for this module."""
    tmp = tmp_path_factory.mktemp("inv")
    path = write(tmp, brief_inventory(vcsim_server, "itvc", BRIEF_NODES))
    first = run("provision", path, "--stage", "vms", "--output", "json")
    return {"path": path, "tmp": tmp, "first": first}


def test_provision_builds_the_brief_shape(cluster, si):
    first = cluster["first"]
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert [v["status"] for v in report["vms"]] == ["ok"] * 4
    assert report["changes"] > 0
    for i, (name, host) in enumerate(BRIEF_NODES):
        vm = find_vm(si, name)
        assert vm is not None, name
        hw = vm.config.hardware
        assert (hw.numCPU, hw.numCoresPerSocket, hw.memoryMB) == (96, 48, 384 * 1024)
        assert vm.config.memoryReservationLockedToMax is True
        assert vm.config.memoryAllocation.reservation == 384 * 1024
        assert not vm.config.cpuHotAddEnabled
        keys = extra(vm)
        # API 6.5: the advanced-setting vNUMA path.
        assert keys["numa.vcpu.maxPerVirtualNode"] == "24"
        assert keys["numa.nodeAffinity"] == "0,1,2,3"
        assert keys["numa.autosize.once"] == "FALSE"
        assert keys["vcfslm.owner"] == "itvc"
        assert "vcfslm.customization" in keys
        assert vm.runtime.host.name == host
        assert vm.runtime.powerState == "poweredOn"
        assert vm.parent.name == "it-vcenter" and vm.parent.parent.name == "SLM"
        nets = [d.backing for d in hw.device if hasattr(d, "macAddress")]
        assert len(nets) == 2
        assert report["vms"][i]["ip"] == f"192.168.10.{21 + i}"
        assert vm.guest.hostName == name  # guest customization ran


def test_second_run_changes_nothing(cluster, run):
    plan = run("plan", cluster["path"], "--output", "json")
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.stdout)["changes"] == 0
    again = run("provision", cluster["path"], "--stage", "vms")
    assert again.exit_code == 0, again.output
    assert "0 change(s) planned" in again.stdout


def test_drift_is_shown_then_fixed(cluster, run, si):
    from pyVmomi import vim

    vm = find_vm(si, "itvc-02")
    spec = vim.vm.ConfigSpec(memoryReservationLockedToMax=False,
                             extraConfig=[vim.option.OptionValue(key="numa.nodeAffinity", value="0")])
    wait(vm.ReconfigVM_Task(spec=spec))

    plan = run("plan", cluster["path"])
    assert plan.exit_code == 0, plan.output
    assert "memoryReservationLockedToMax: False -> True" in plan.stdout
    assert "extraConfig[numa.nodeAffinity]: 0 -> 0,1,2,3" in plan.stdout
    assert "pending" in plan.stdout  # affinity needs a restart, the VM is running

    held = run("provision", cluster["path"], "--stage", "vms")
    assert held.exit_code == 1, held.output
    assert "pending" in held.output and "itvc-02" in held.output
    assert vm.config.memoryReservationLockedToMax is True  # the live field is fixed already
    assert extra(vm)["numa.nodeAffinity"] == "0"  # the restart-needing one waits

    fixed = run("provision", cluster["path"], "--stage", "vms", "--allow-restart", "--yes")
    assert fixed.exit_code == 0, fixed.output
    assert extra(vm)["numa.nodeAffinity"] == "0,1,2,3"
    assert vm.runtime.powerState == "poweredOn"
    assert json.loads(run("plan", cluster["path"], "--output", "json").stdout)["changes"] == 0


def test_missing_host_fails_alone(vcsim_server, tmp_path_factory, run, si):
    tmp = tmp_path_factory.mktemp("lonely")
    nodes = [("itmh-01", "DC0_C0_H0"), ("itmh-02", "esx-does-not-exist"), ("itmh-03", "DC0_C0_H1")]
    path = write(tmp, brief_inventory(vcsim_server, "itmh", nodes))
    res = run("provision", path, "--stage", "vms")
    assert res.exit_code == 1, res.output
    assert "esx-does-not-exist" in res.output
    assert {"itmh-01", "itmh-03"} <= vm_names(si)
    assert "itmh-02" not in vm_names(si)
    gone = run("destroy", path, "--yes")
    assert gone.exit_code == 0, gone.output
    assert not {"itmh-01", "itmh-03"} & vm_names(si)


def test_preflight_failure_changes_nothing(vcsim_server, tmp_path_factory, run, si):
    tmp = tmp_path_factory.mktemp("preflight")
    data = brief_inventory(vcsim_server, "itpf", [("itpf-01", "DC0_C0_H0")], datastore="NoSuchDS",
                           folder="SLM/never-created")
    data["placement"]["networks"]["bench"]["portgroup"] = "no-such-pg"
    path = write(tmp, data)
    before = vm_names(si)
    res = run("provision", path, "--stage", "vms")
    assert res.exit_code == 1
    assert "preflight failed" in res.output
    assert "NoSuchDS" in res.output and "no-such-pg" in res.output  # all problems together
    assert vm_names(si) == before
    assert not folder_exists(si, "SLM/never-created")


def test_bad_input_is_exit_2(vcsim_server, tmp_path_factory, run):
    tmp = tmp_path_factory.mktemp("bad")
    data = brief_inventory(vcsim_server, "itbad", [("itbad-01", "DC0_C0_H0")])
    data["vm"]["vnuma_nodes"] = 5  # 96 vCPUs do not split into 5 nodes
    path = write(tmp, data)
    for cmd in ("plan", "provision", "destroy"):
        res = run(cmd, path)
        assert res.exit_code == 2, (cmd, res.output)
        assert "vm.vnuma_nodes" in res.output


def test_tls_is_verified(vcsim_server, tmp_path_factory, run):
    tmp = tmp_path_factory.mktemp("tls")
    data = brief_inventory(vcsim_server, "ittls", [("ittls-01", "DC0_C0_H0")])
    data["vcenter"]["ca_bundle"] = None  # the system store does not know the lab CA
    res = run("plan", write(tmp, data))
    assert res.exit_code == 1
    assert "TLS verification" in res.output
    assert vcsim_server.password not in res.output


def test_destroy_removes_only_owned_vms(cluster, vcsim_server, run, si):
    from pyVmomi import vim

    # A VM with a node's name but without the marker, made behind the tool's back.
    template = find_vm(si, vcsim_server.template)
    folder = si.content.rootFolder.childEntity[0].vmFolder
    pool = si.content.rootFolder.childEntity[0].hostFolder.childEntity[0].resourcePool
    wait(template.CloneVM_Task(folder=folder, name="itvc-05",
                               spec=vim.vm.CloneSpec(location=vim.vm.RelocateSpec(pool=pool))))
    # The same inventory, its last node swapped for the unowned VM's name.
    data = yaml.safe_load(Path(cluster["path"]).read_text())
    data["nodes"][3] = {**data["nodes"][3], "name": "itvc-05"}
    path = Path(cluster["tmp"]) / "itvc-with-unowned.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    res = run("destroy", str(path), "--yes")
    assert res.exit_code == 1, res.output
    assert "itvc-05" in res.output and "refus" in res.output.lower()
    names = vm_names(si)
    assert "itvc-05" in names and "itvc-04" in names
    assert not {"itvc-01", "itvc-02", "itvc-03"} & names

    rest = run("destroy", cluster["path"], "--yes")
    assert rest.exit_code == 0, rest.output
    assert "itvc-04" not in vm_names(si)
    wait(find_vm(si, "itvc-05").Destroy_Task())


def test_the_lab_inventory_provisions_and_reports_guest_ips(lab, run, si):
    env = {**lab.env, "VCFSLM_STATE": str(lab.dir / "state.json")}
    runner = CliRunner()
    res = runner.invoke(main, ["provision", str(lab.inventory), "--stage", "vms", "-o", "json"], env=env)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    inv = lab.load_inventory()
    assert [v["ip"] for v in report["vms"]] == [str(n.management_ip) for n in inv.nodes]
    gone = runner.invoke(main, ["destroy", str(lab.inventory), "--yes"], env=env)
    assert gone.exit_code == 0, gone.output
    assert not {n.name for n in inv.nodes} & vm_names(si)


# ------------------------------------------------------- the vSphere 8 path and its fallback
#
# Each API mode gets its own small simulator (2 hosts) advertising that release, so pyVmomi
# negotiates it; vcsim records every reconfigure / clone carrying vNUMA as it arrived.

API_NODES = [(f"itapi-0{i + 1}", f"DC0_C0_H{i}") for i in range(2)]
VIRTUAL_NUMA_24 = "<virtualNuma><coresPerNumaNode>24</coresPerNumaNode></virtualNuma>"


@pytest.fixture(scope="module")
def api_server(request, vcsim_binary, vcsim_server, tmp_path_factory):
    """A simulator advertising vSphere API 8.0.3 or 6.7 (the session's password)."""
    from tests.lab_fixtures import VcsimServer
    from vcfslm.lab import vcsim

    workdir = tmp_path_factory.mktemp(f"vcsim-{request.param}")
    opts = vcsim.VcsimOptions(port=0, hosts=2, api=request.param)
    running = vcsim.start(workdir, vcsim_server.password, opts, binary=vcsim_binary)
    try:
        yield VcsimServer(url=running.url, host=running.host, port=running.port, user=running.user,
                          password=vcsim_server.password, ca_file=running.ca_file, hosts=2,
                          template=running.template, pid=running.pid, vcsim=running)
    finally:
        vcsim.stop(running)


def records_of(server, moref: str) -> list[dict]:
    from vcfslm.lab import vcsim

    return [r for r in vcsim.soap_records(server.vcsim) if r["moref"] == moref]


@pytest.mark.parametrize("api_server", ["8.0.3", "6.7"], indirect=True)
def test_each_api_mode_provisions_the_brief_shape_on_its_vnuma_path(api_server, tmp_path, run):
    eight = api_server.vcsim.api == "8.0.3"
    path = write(tmp_path, brief_inventory(api_server, "itapi", API_NODES))
    plan = run("plan", path)
    assert plan.exit_code == 0, plan.output
    if eight:
        assert "vCenter API 8.0.3.0, session API 8.0.3.0 (negotiated by pyVmomi)" in plan.stdout
        assert ("vNUMA path: ConfigSpec.virtualNuma.coresPerNumaNode (session API 8.0.3.0 >= 8.0.0.1 "
                "and virtual hardware vmx-21 >= vmx-20)") in plan.stdout
    else:
        assert "vCenter API 6.7, session API 6.7 (negotiated by pyVmomi)" in plan.stdout
        assert ("vNUMA path: fallback, extraConfig numa.vcpu.maxPerVirtualNode "
                "(vCenter/host API 6.7 is older than 8.0.0.1)") in plan.stdout

    res = run("provision", path, "--stage", "vms", "--output", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["vnuma_path"] == ("virtualNuma" if eight else "advanced")
    for vm in report["vms"]:
        assert vm["status"] == "ok", vm
        # vcsim fills no config.numaInfo: nothing vCenter returns confirms the layout.
        assert "vNUMA unverified" in vm["message"] and "vcfslm verify" in vm["message"]
        [reconfigure] = [r for r in records_of(api_server, vm["moref"]) if r["method"] == "ReconfigVM_Task"]
        assert reconfigure["soap_action"] == ("urn:vim25/8.0.3.0" if eight else "urn:vim25/6.7")
        if eight:
            assert reconfigure["virtual_numa"] == VIRTUAL_NUMA_24
            assert reconfigure["cores_per_numa_node"] == 24
            assert "numa.vcpu.maxPerVirtualNode" not in reconfigure["extra_config"]
        else:
            assert "virtual_numa" not in reconfigure
            assert reconfigure["extra_config"]["numa.vcpu.maxPerVirtualNode"] == "24"
        assert reconfigure["extra_config"]["numa.autosize.once"] == "FALSE"
        assert reconfigure["extra_config"]["numa.nodeAffinity"] == "0,1,2,3"

    again = run("plan", path, "--output", "json")
    assert json.loads(again.stdout)["changes"] == 0, again.stdout  # converged on either path
    assert run("destroy", path, "--yes").exit_code == 0


@pytest.mark.parametrize("api_server", ["8.0.3"], indirect=True)
def test_a_67_session_against_an_8_lab_takes_and_names_the_fallback(api_server, tmp_path, run):
    data = brief_inventory(api_server, "itpin", [("itpin-01", "DC0_C0_H0")])
    assert data["vm"]["hardware_version"] == "vmx-21"
    path = write(tmp_path, data)
    plan = run("plan", path, "--api-version", "6.7")
    assert plan.exit_code == 0, plan.output
    assert "vCenter API 8.0.3.0, session API 6.7 (pinned)" in plan.stdout
    assert ("vNUMA path: fallback, extraConfig numa.vcpu.maxPerVirtualNode (session API 6.7 (pinned) "
            "is older than 8.0.0.1, though vCenter speaks 8.0.3.0: pyVmomi would drop "
            "ConfigSpec.virtualNuma from the request)") in plan.stdout

    res = run("provision", path, "--stage", "vms", "--api-version", "6.7", "--output", "json")
    assert res.exit_code == 0, res.output
    [vm] = json.loads(res.stdout)["vms"]
    [reconfigure] = [r for r in records_of(api_server, vm["moref"]) if r["method"] == "ReconfigVM_Task"]
    assert reconfigure["soap_action"] == "urn:vim25/6.7"
    assert "virtual_numa" not in reconfigure
    assert reconfigure["extra_config"]["numa.vcpu.maxPerVirtualNode"] == "24"
    assert run("destroy", path, "--yes").exit_code == 0

    unknown = run("plan", path, "--api-version", "5.9")
    assert unknown.exit_code == 1 and "does not know vSphere API 5.9" in unknown.output
