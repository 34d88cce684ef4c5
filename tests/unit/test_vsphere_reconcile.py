"""Orchestration with a fake driver: preflight gates, pending -> exit 1, tags as warnings."""

from __future__ import annotations

from pathlib import Path

import pytest

from vcfslm.errors import PreflightError, VCenterError
from vcfslm.inventory import parse_inventory
from vcfslm.vsphere import reconcile
from vcfslm.vsphere.driver import VmOutcome
from vcfslm.vsphere.state import HostFacts, Snapshot, VmState
from vcfslm.vsphere.tags import AutomationUnavailable

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"


def inventory():
    return parse_inventory(BRIEF.read_text(), "brief.yaml")


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


class FakeVCenter:
    """Records what reconcile asks; applies nothing."""

    library_deploy = None

    def __init__(self, snap: Snapshot, fail: set[str] = frozenset()):
        self.snap = snap
        self.fail = fail
        self.applied = []
        self.destroyed = []

    def observe(self, inv):
        return self.snap

    def apply(self, plan, reporter=None):
        self.applied.append(plan)
        return [VmOutcome(v.name, "blocked" if v.action == "blocked" else
                          "failed" if v.name in self.fail else "ok", moref=f"vm-{v.name}",
                          pending=[f.describe() for f in v.pending]) for v in plan.vms]

    def destroy(self, dplan, reporter=None):
        self.destroyed.append(dplan)
        return [VmOutcome(v.name, "ok", moref=v.moref) for v in dplan.destroy]


class FakeAutomation:
    def __init__(self, fail_connect=False):
        self.fail_connect = fail_connect
        self.attached = []
        self.detached = []
        self.closed = False

    def connect(self):
        if self.fail_connect:
            raise AutomationUnavailable("Automation API at https://vcsim/api is not available (404)")

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
    assert vc.applied == []


def test_provision_creates_and_tags():
    auto = FakeAutomation()
    vc = FakeVCenter(snapshot())
    result = reconcile.provision(inventory(), vc, automation_factory=lambda: auto)
    assert [v.action for v in vc.applied[0].vms] == ["create"] * 4
    assert result.exit_code == 0 and result.warnings == []
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
    actions = [v.action for v in vc.applied[0].vms]
    assert actions == ["create", "create", "blocked", "create"]
    assert result.exit_code == 1 and [o.name for o in result.failed] == ["slm-03"]


def test_pending_restart_is_exit_1():
    inv = inventory()
    from vcfslm.vsphere.desired import desired_vms

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
    assert len(asked) == 1 and len(vc.applied) == 1  # nothing applied after the refusal


def test_destroy_detaches_tags_and_refuses_unowned():
    vms = dict(snapshot().vms)
    vms["slm-01"] = VmState("slm-01", "vm-11", extra_config={"vcfslm.owner": "phi3-vx650v4"})
    vms["slm-02"] = VmState("slm-02", "vm-12", extra_config={})
    vc = FakeVCenter(snapshot(vms=vms))
    auto = FakeAutomation()
    result = reconcile.destroy(inventory(), vc, automation_factory=lambda: auto)
    assert [v.name for v in vc.destroyed[0].destroy] == ["slm-01"]
    assert auto.detached == [("phi3-vx650v4", ["vm-11"])]
    assert result.exit_code == 1 and "slm-02" in result.plan.refused[0]
