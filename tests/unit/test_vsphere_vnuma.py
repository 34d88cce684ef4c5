"""The vNUMA path and its read-back as data: which path a session takes and why, pyVmomi's own
serializer dropping `virtualNuma` below 8.0.0.1, and the layout check over what vCenter reports."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from pyVmomi import SoapAdapter, vim
from test_vsphere_support import inventory, observed

from vcfslm.progress import RecordingReporter
from vcfslm.vsphere import changes as c
from vcfslm.vsphere import reconcile, snapshot
from vcfslm.vsphere import vnuma as V
from vcfslm.vsphere.desired import desired_vms, vnuma_reason
from vcfslm.vsphere.session import SessionOptions, pyvmomi_version


@pytest.mark.parametrize("api, element", [("6.7", False), ("7.0.3.0", False), ("8.0.3", True)])
def test_pyvmomis_serializer_sends_virtual_numa_only_from_8001(api, element):
    spec = vim.vm.ConfigSpec(numCPUs=96, virtualNuma=vim.vm.VirtualNuma(coresPerNumaNode=24))
    xml = SoapAdapter.Serialize(spec, version=pyvmomi_version(api)).decode()
    assert "<numCPUs>96</numCPUs>" in xml
    assert ("<virtualNuma><coresPerNumaNode>24</coresPerNumaNode></virtualNuma>" in xml) is element


# (server API, session API, pinned, inventory hardware, path, reason)
PATHS = [
    ("8.0.3.0", "8.0.3.0", False, "vmx-21", "virtualNuma",
     "session API 8.0.3.0 >= 8.0.0.1 and virtual hardware vmx-21 >= vmx-20"),
    ("8.0.3.0", "6.7", True, "vmx-21", "advanced",
     "session API 6.7 (pinned) is older than 8.0.0.1, though vCenter speaks 8.0.3.0: "
     "pyVmomi would drop ConfigSpec.virtualNuma from the request"),
    ("8.0.3.0", "7.0.3.0", False, "vmx-21", "advanced",
     "session API 7.0.3.0 is older than 8.0.0.1, though vCenter speaks 8.0.3.0: "
     "pyVmomi would drop ConfigSpec.virtualNuma from the request"),
    ("6.7", "6.7", False, "vmx-21", "advanced", "vCenter/host API 6.7 is older than 8.0.0.1"),
    ("8.0.3.0", "8.0.3.0", False, "vmx-19", "advanced", "virtual hardware vmx-19 is older than vmx-20"),
]


@pytest.mark.parametrize("server, session, pinned, hw, path, reason", PATHS)
def test_the_path_follows_the_older_of_vcenter_and_the_session(server, session, pinned, hw, path, reason):
    d = desired_vms(inventory({"hardware_version": hw}), server, session_api=session)[0]
    assert d.vnuma_path == path
    # The session does not cap the hardware; vCenter's release does (6.7 creates vmx-14).
    assert d.hardware_version == (hw if server.startswith("8") else "vmx-14")
    assert (d.cores_per_numa_node, d.extra_config.get(V.VNUMA_KEY)) == \
        ((24, None) if path == "virtualNuma" else (None, "24"))
    assert vnuma_reason(server, session, hw, pinned) == reason


def brief(api: str = "8.0.3.0"):
    return desired_vms(inventory(), api)[0]


# (case, desired API, what the VM reports (observed overrides), status, text fragment)
CHECKS = [
    ("numaInfo matches", "8.0.3.0", {}, V.CONFIRMED, "config.numaInfo.coresPerNumaNode=24"),
    ("numaInfo differs: silently dropped", "8.0.3.0", {"cores_per_numa_node": 48}, V.MISMATCH,
     "asked 24 cores per vNUMA node, the VM reports config.numaInfo.coresPerNumaNode=48"),
    ("numaInfo sized by vSphere", "8.0.3.0",
     {"cores_per_numa_node": None, "auto_cores_per_numa_node": True}, V.MISMATCH,
     "coresPerNumaNode=none (autoCoresPerNumaNode)"),
    ("no numaInfo (vcsim): unverified", "8.0.3.0", {"numa_info_reported": False, "cores_per_numa_node": None},
     V.UNVERIFIED, "vCenter reports no config.numaInfo; `vcfslm verify` settles it"),
    ("advanced path, stored", "6.7", {}, V.UNVERIFIED, "numa.vcpu.maxPerVirtualNode=24 stored"),
    ("advanced path, setting lost", "6.7", {"extra_config": {"numa.autosize.once": "FALSE"}}, V.MISMATCH,
     "numa.vcpu.maxPerVirtualNode missing"),
    ("numa.autosize reverts it", "8.0.3.0",
     {"extra_config": {"numa.autosize": "TRUE", "numa.autosize.once": "FALSE"}}, V.MISMATCH,
     "numa.autosize=TRUE"),
    ("autosize.once not FALSE", "8.0.3.0", {"extra_config": {"numa.autosize.once": "TRUE"}}, V.MISMATCH,
     "numa.autosize.once=TRUE"),
]


@pytest.mark.parametrize("api, seen, status, text", [x[1:] for x in CHECKS], ids=[x[0] for x in CHECKS])
def test_the_layout_check(api, seen, status, text):
    d = brief(api)
    state = observed(d, **seen)
    if "extra_config" not in seen:
        state = replace(state, extra_config=dict(d.extra_config))
    result = V.check_vnuma(d, state)
    assert result.status == status and text in result.text, result
    assert result.ok is (status != V.MISMATCH)


def test_a_read_back_numa_info_differing_from_the_request_fails_the_vm(mocker):
    """The driver's read-back parses what the property collector returns; 48 != 24 is an error."""
    from test_vsphere_driver import FakeWaiter, one_vm_plan
    from test_vsphere_support import fake_vm, lab_refs

    from vcfslm.vsphere import driver
    from vcfslm.vsphere.credentials import Secret

    mocker.patch.object(driver, "Waiter", FakeWaiter)
    vc = driver.PyVmomiVCenter(inventory().vcenter, Secret("pw"), RecordingReporter(),
                                options=SessionOptions(backoff=0))
    vc.session.si = mocker.MagicMock()
    vc.session.si.RetrieveContent.return_value = vc.session.si.content
    vc.session.si.content.about.apiVersion = "8.0.3.0"
    vc.refs = lab_refs()
    d = brief()
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    asked = []
    real = vim.VirtualMachine("vm-slm-01")
    props = {"name": "slm-01", "config.numaInfo": vim.vm.VirtualNumaInfo(coresPerNumaNode=48),
             "config.extraConfig": [vim.option.OptionValue(key=k, value=v) for k, v in d.extra_config.items()]}
    reported = [SimpleNamespace(obj=real, propSet=[SimpleNamespace(name=k, val=v) for k, v in props.items()])]
    vc.session.si.content.propertyCollector.RetrieveContents.side_effect = \
        lambda specs: asked.append(specs[0]) or reported
    vc.read_vm = lambda obj: driver.PyVmomiVCenter.read_vm(vc, real)

    change = c.Reconfigure("slm-01", fields=(c.FieldChange("cores_per_numa_node", "virtualNuma.coresPerNumaNode",
                                                           48, 24, True),), desired=d)
    plan = one_vm_plan(c.VmPlan("slm-01", "update", d, observed(d), (change,)))
    [out] = reconcile.apply_plan(vc, plan, vc.reporter)
    assert (out.status, out.step) == ("failed", "read-back")
    assert "asked 24 cores per vNUMA node, the VM reports config.numaInfo.coresPerNumaNode=48" in out.message
    assert "config.numaInfo" in asked[0].propSet[0].pathSet
    assert vm.ReconfigVM_Task.call_args.kwargs["spec"].virtualNuma.coresPerNumaNode == 24


def test_read_back_asks_numa_info_only_where_the_session_has_it():
    assert "config.numaInfo" in snapshot.properties("8.0.3.0")["VirtualMachine"]
    assert "config.numaInfo" not in snapshot.properties("6.7")["VirtualMachine"]


def test_plan_names_the_path_and_the_unverified_layout():
    d = brief()
    vm = c.plan_vm(d, replace(observed(d), numa_info_reported=False, cores_per_numa_node=None), False)
    assert vm.action == "in-sync"  # nothing to compare coresPerNumaNode with: no endless change
    plan = c.Plan((vm,), vnuma_path="virtualNuma", api_version="8.0.3.0", session_api_version="8.0.3.0",
                  vnuma_reason="why")
    assert plan.path_lines() == ["vCenter API 8.0.3.0, session API 8.0.3.0 (negotiated by pyVmomi)",
                                 "vNUMA path: ConfigSpec.virtualNuma.coresPerNumaNode (why)"]
    assert "    vNUMA unverified: vCenter reports no config.numaInfo; `vcfslm verify` settles it" in plan.lines()


def test_in_sync_vm_with_a_differing_layout_is_an_error():
    d = brief()
    vm = c.plan_vm(d, observed(d, extra_config={**d.extra_config, "numa.autosize": "TRUE",
                                                "vcfslm.customization": d.customization_fingerprint}), False)
    assert vm.action == "in-sync" and not vm.vnuma.ok
    assert "    ! vNUMA layout differs" in "\n".join(c.Plan((vm,)).lines())
    [out] = reconcile.apply_plan(SimpleNamespace(max_workers=1), c.Plan((vm,)))
    assert out.status == "failed" and "numa.autosize=TRUE" in out.message


def test_create_upgrades_older_template_hardware_before_reconfiguring():
    from vcfslm.vsphere.state import VmState

    d = brief()
    plan = c.plan_vm(d, None, False, template=VmState("t", "vm-1", template=True, hardware_version="vmx-19"))
    assert [x.kind for x in plan.changes][:3] == ["clone", "upgrade-hardware", "reconfigure"]


@pytest.mark.parametrize("api, name", [("6.7", "vim.version.version12"), ("8.0.3", "vim.version.v8_0_3_0"),
                                       ("8.0.3.0", "vim.version.v8_0_3_0"), ("9.0", "vim.version.v9_0_0_0")])
def test_pinned_versions_by_pyvmomis_names(api, name):
    assert pyvmomi_version(api) == name
