"""Orchestration with a fake driver: preflight gates, pending -> exit 1, tags as warnings,
and the per-VM pool: plan order, failure isolation, folders first, destroy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vcfslm.errors import PreflightError, VCenterError
from vcfslm.inventory_load import parse_inventory
from vcfslm.progress import RecordingReporter
from vcfslm.vsphere import changes, reconcile
from vcfslm.vsphere.desired import desired_vms
from vcfslm.vsphere.state import HostFacts, Snapshot, VmState
from vcfslm.vsphere.tags import AutomationUnavailable

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"


def inventory(**placement):
    data = yaml.safe_load(BRIEF.read_text())
    data["placement"].update(placement)
    return parse_inventory(yaml.safe_dump(data), "brief.yaml")


def snapshot(**kw) -> Snapshot:
    base = dict(
        api_version="8.0.3.0", datacenter="DC01", cluster="WLD01-CL01",
        hosts={f"esx0{i}.example.local": HostFacts(f"esx0{i}.example.local", "WLD01-CL01", 4,
                                                   1536 * 1024**3, 2700, "8.0.3.0")
               for i in range(1, 5)},
        datastores=frozenset({"vsanDatastore"}), networks=frozenset({"mgmt-pg", "bench-25g-pg"}),
        folders=frozenset({"SLM", "SLM/phi3"}),
        vms={"ubuntu-24.04-template": VmState("ubuntu-24.04-template", "vm-1", template=True)})
    base.update(kw)
    return Snapshot(**base)


class FakeWorker:
    """Records each change; clones of the VCenter's `fail` names raise."""

    def __init__(self, vc: FakeVCenter, name: str):
        self.vc = vc
        self.name = name
        self.moref = vc.existing.get(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.vc.closed.append(self.name)

    def apply(self, change, desired):
        self.vc.worked.append((self.name, change.kind))
        if self.name in self.vc.fail:
            raise VCenterError(f"InsufficientResourcesFault: no room for {self.name}")
        if change.kind == "clone":
            self.moref = f"vm-{self.name}"
        return "10.0.0.1" if change.kind == "wait-ip" else None

    def read_back(self):
        return self.vc.read_back.get(self.name)

    def power_off(self):
        self.vc.worked.append((self.name, "power-off"))

    def destroy(self):
        if self.name in self.vc.fail:
            raise VCenterError("TaskInProgress")
        self.vc.destroyed.append(self.name)


class FakeVCenter:
    """Records what reconcile asks of the driver; changes nothing."""

    max_workers = 3

    def __init__(self, snap: Snapshot, fail: set[str] = frozenset(), folder_error: str | None = None):
        self.snap = snap
        self.fail = fail
        self.folder_error = folder_error
        self.existing = {name: vm.moref for name, vm in snap.vms.items()}
        self.folders: list[str] = []
        self.workers: list[tuple[str, object]] = []  # (name, library_deploy)
        self.worked: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self.destroyed: list[str] = []
        self.read_back: dict[str, VmState] = {}  # what each VM reports after its changes

    def observe(self, inv):
        return self.snap

    def ensure_folder(self, path):
        if self.folder_error:
            raise VCenterError(self.folder_error)
        self.folders.append(path)

    def worker(self, name, library_deploy=None):
        self.workers.append((name, library_deploy))
        return FakeWorker(self, name)

    def error_text(self, exc):
        return str(exc)


class FakeAutomation:
    def __init__(self, fail_connect=False):
        self.fail_connect = fail_connect
        self.attached = []
        self.detached = []
        self.closed = False

    def connect(self):
        if self.fail_connect:
            raise AutomationUnavailable("Automation API at https://vcsim/api is not available (404)")

    def library_items(self, library):
        return ["ubuntu-24.04"]

    def deploy(self, library, item, **ids):
        return "vm-77"

    def attach(self, name, ids):
        self.attached.append((name, ids))
        return ids

    def detach(self, name, ids):
        self.detached.append((name, ids))

    def close(self):
        self.closed = True


def test_preflight_failure_applies_nothing():
    vc = FakeVCenter(snapshot(datastores=frozenset(), networks=frozenset()))
    with pytest.raises(PreflightError) as err:
        reconcile.provision(inventory(), vc)
    assert len(err.value.problems) == 3
    assert vc.workers == [] and vc.folders == []


def test_provision_creates_and_tags():
    auto = FakeAutomation()
    vc = FakeVCenter(snapshot())
    result = reconcile.provision(inventory(), vc, automation_factory=lambda: auto)
    assert [v.action for v in result.plan.vms] == ["create"] * 4
    assert result.exit_code == 0 and result.warnings == []
    assert [o.ip for o in result.outcomes] == ["10.0.0.1"] * 4
    assert sorted(vc.closed) == ["slm-01", "slm-02", "slm-03", "slm-04"]  # every waiter closed
    assert auto.attached == [("phi3-vx650v4", ["vm-slm-01", "vm-slm-02", "vm-slm-03", "vm-slm-04"])]
    assert auto.closed


def test_tagging_unavailable_is_a_warning_not_a_failure():
    vc = FakeVCenter(snapshot(api_version="6.5"))
    result = reconcile.provision(inventory(), vc,
                                 automation_factory=lambda: FakeAutomation(fail_connect=True))
    assert result.exit_code == 0
    assert any("tag vcfslm/phi3-vx650v4 not applied" in w for w in result.warnings)


def test_missing_host_blocks_its_node_and_fails_the_run():
    snap = snapshot()
    snap.hosts.pop("esx03.example.local")
    vc = FakeVCenter(snap)
    result = reconcile.provision(inventory(), vc)
    actions = [v.action for v in result.plan.vms]
    assert actions == ["create", "create", "blocked", "create"]
    assert "slm-03" not in [name for name, _ in vc.workers]
    assert result.exit_code == 1 and [o.name for o in result.failed] == ["slm-03"]


def test_pending_restart_is_exit_1():
    inv = inventory()
    vms = dict(snapshot().vms)
    for d in desired_vms(inv, "8.0.3.0"):
        extra = dict(d.extra_config, **{"vcfslm.customization": d.customization_fingerprint})
        vms[d.name] = VmState(d.name, f"vm-{d.name}", "poweredOn", host=d.host, hardware_version="vmx-21",
                              num_cpus=8, cores_per_socket=48, memory_mb=d.memory_mb,
                              memory_locked_to_max=True, memory_reservation_mb=d.memory_mb,
                              cores_per_numa_node=24, extra_config=extra,
                              nics=("mgmt-pg", "bench-25g-pg"), ip_addresses=("10.0.0.1",))
    vc = FakeVCenter(snapshot(vms=vms))
    result = reconcile.provision(inv, vc)
    assert result.exit_code == 1 and len(result.pending) == 4

    asked = []
    with pytest.raises(VCenterError, match="aborted"):
        reconcile.provision(inv, vc, allow_restart=True, confirm=lambda plan: asked.append(plan) or False)
    assert len(asked) == 1 and vc.workers == []  # nothing applied after the refusal


def test_destroy_detaches_tags_and_refuses_unowned():
    vms = dict(snapshot().vms)
    vms["slm-01"] = VmState("slm-01", "vm-11", extra_config={"vcfslm.owner": "phi3-vx650v4"})
    vms["slm-02"] = VmState("slm-02", "vm-12", extra_config={})
    vc = FakeVCenter(snapshot(vms=vms))
    auto = FakeAutomation()
    result = reconcile.destroy(inventory(), vc, automation_factory=lambda: auto)
    assert vc.destroyed == ["slm-01"] and vc.worked == []  # already powered off
    assert auto.detached == [("phi3-vx650v4", ["vm-11"])]
    assert result.exit_code == 1 and "slm-02" in result.plan.refused[0]


def vm_plan(name: str, action: str = "create", kinds=("clone", "reconfigure", "wait-ip"), **kw):
    """A VmPlan of the brief's first node renamed, with changes of the given kinds."""
    d = desired_vms(inventory(), "8.0.3.0")[0]
    made = {"clone": changes.CloneVm(name), "reconfigure": changes.Reconfigure(name),
            "wait-ip": changes.WaitForIp(name, portgroup="mgmt-pg"), "power-on": changes.PowerOn(name)}
    return changes.VmPlan(name, action, d, changes=tuple(made[k] for k in kinds), **kw)


def test_the_pool_keeps_plan_order_and_isolates_failures():
    vc = FakeVCenter(snapshot(), fail={"b"})
    reporter = RecordingReporter()
    plan = changes.Plan(vms=tuple(vm_plan(n) for n in "abcde"))
    outs = reconcile.apply_plan(vc, plan, reporter)
    assert [(o.name, o.status) for o in outs] == [("a", "ok"), ("b", "failed"), ("c", "ok"), ("d", "ok"),
                                                  ("e", "ok")]
    assert all(isinstance(o, reconcile.VmOutcome) for o in outs)
    failed = outs[1]
    assert (failed.step, failed.message, failed.moref) == (
        "clone", "clone: InsufficientResourcesFault: no room for b", None)
    assert reporter.last("b") == "failed at clone: InsufficientResourcesFault: no room for b"
    assert reporter.last("a") == "created, 10.0.0.1, vNUMA unverified" and outs[0].moref == "vm-a"
    assert [k for n, k in vc.worked if n == "c"] == ["clone", "reconfigure", "wait-ip"]
    assert sorted(vc.closed) == list("abcde")


def test_blocked_and_in_sync_vms_get_no_worker():
    vc = FakeVCenter(snapshot())
    same = vm_plan("s", "in-sync", kinds=(), observed=VmState("s", "vm-7", ip_addresses=("10.9.9.9",)))
    plan = changes.Plan(vms=(vm_plan("x", "blocked", kinds=(), problems=("ESXi host gone",)), same))
    outs = reconcile.apply_plan(vc, plan)
    assert [(o.status, o.message, o.moref, o.ip) for o in outs] == [
        ("blocked", "ESXi host gone", None, None), ("ok", "in sync", "vm-7", "10.9.9.9")]
    assert vc.workers == []


def test_a_folder_that_cannot_be_created_fails_every_vm_to_change():
    vc = FakeVCenter(snapshot(), folder_error="NoPermission")
    plan = changes.Plan(vms=(vm_plan("a"), vm_plan("b")),
                        cluster_changes=(changes.CreateFolder("", path="SLM/new"),))
    outs = reconcile.apply_plan(vc, plan)
    assert {(o.status, o.step, o.message) for o in outs} == {
        ("failed", "create folder", "cannot create folder SLM/new: NoPermission")}
    assert vc.workers == []


def test_library_deploy_is_handed_to_each_worker():
    auto = FakeAutomation()
    inv = inventory(template="library:slm-lib/ubuntu-24.04")
    vc = FakeVCenter(snapshot())
    result = reconcile.provision(inv, vc, automation_factory=lambda: auto)
    assert result.exit_code == 0
    assert [deploy for _, deploy in vc.workers] == [auto.deploy] * 4


def test_destroy_vms_powers_off_running_ones_and_isolates_failures():
    vc = FakeVCenter(snapshot(), fail={"b"})
    reporter = RecordingReporter()
    dplan = changes.DestroyPlan(destroy=(VmState("a", "vm-1", power_state="poweredOn"),
                                         VmState("b", "vm-2"), VmState("c", "vm-3", power_state="suspended")))
    outs = reconcile.destroy_vms(vc, dplan, reporter)
    assert [(o.name, o.status, o.message, o.moref) for o in outs] == [
        ("a", "ok", "destroyed", "vm-1"), ("b", "failed", "destroy: TaskInProgress", "vm-2"),
        ("c", "ok", "destroyed", "vm-3")]
    assert sorted(vc.worked) == [("a", "power-off"), ("c", "power-off")]
    assert sorted(vc.destroyed) == ["a", "c"] and reporter.last("b") == "failed at destroy: TaskInProgress"
    assert reconcile.destroy_vms(vc, changes.DestroyPlan()) == []
