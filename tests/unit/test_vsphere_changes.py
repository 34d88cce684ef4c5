"""The diff as tables: create, in sync, drift (live vs restart-needing), power, ownership, JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from vcfslm.inventory_load import parse_inventory
from vcfslm.vsphere import changes as c
from vcfslm.vsphere.desired import CUSTOMIZATION_KEY, desired_vms
from vcfslm.vsphere.state import Snapshot, VmState

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"


def inventory(node0_advanced: dict | None = None):
    data = yaml.safe_load(BRIEF.read_text())
    if node0_advanced:
        data["nodes"][0]["advanced"] = node0_advanced
    return parse_inventory(yaml.safe_dump(data), "brief.yaml")


def want(api: str = "8.0.3.0", **kw):
    return desired_vms(inventory(**kw), api)[0]


def in_sync(desired, **overrides) -> VmState:
    """The VM vCenter would report once `desired` is applied."""
    extra = {k: v for k, v in desired.extra_config.items() if not k.startswith("SET.")}
    extra[CUSTOMIZATION_KEY] = desired.customization_fingerprint
    state = VmState(
        name=desired.name, moref="vm-1", power_state="poweredOn", host=desired.host,
        folder=desired.folder, hardware_version=desired.hardware_version, num_cpus=desired.num_cpus,
        cores_per_socket=desired.cores_per_socket, memory_mb=desired.memory_mb,
        memory_locked_to_max=desired.memory_locked_to_max,
        memory_reservation_mb=desired.memory_reservation_mb, cpu_hot_add=False,
        latency_sensitivity="normal", cpu_reservation_mhz=0,
        cores_per_numa_node=desired.cores_per_numa_node,
        numa_info_reported=desired.cores_per_numa_node is not None, extra_config=extra,
        nics=tuple(n.portgroup for n in desired.nics), ip_addresses=("192.168.10.21",))
    return replace(state, **overrides)


def kinds(vm_plan) -> list[str]:
    return [ch.kind for ch in vm_plan.changes]


def labels(vm_plan) -> list[str]:
    return [f.label for ch in vm_plan.changes if isinstance(ch, c.Reconfigure) for f in ch.fields]


@pytest.mark.parametrize("api", ["6.5", "8.0.3.0"])
def test_missing_vm_is_created_in_order(api):
    d = want(api)
    template = VmState(name="tpl", moref="vm-9", template=True, num_cpus=2, cores_per_socket=2,
                       memory_mb=4096, nics=("mgmt-pg",))
    p = c.plan_vm(d, None, allow_restart=False, template=template)
    assert p.action == "create"
    assert kinds(p) == ["clone", "reconfigure", "customize", "power-on", "wait-ip"]
    fields = {f.label: (f.old, f.new) for f in p.changes[1].fields}
    assert fields["numCPUs"] == (2, 96)
    assert fields["numCoresPerSocket"] == (2, 48)
    assert fields["memoryMB"] == (4096, 393216)
    assert fields["memoryAllocation.reservation"] == (0, 393216)
    assert fields["network adapters"] == (("mgmt-pg",), ("mgmt-pg", "bench-25g-pg"))
    if api == "6.5":
        assert fields["extraConfig[numa.vcpu.maxPerVirtualNode]"] == (None, "24")
        assert "virtualNuma.coresPerNumaNode" not in fields
    else:
        assert fields["virtualNuma.coresPerNumaNode"] == (None, 24)
        assert "extraConfig[numa.vcpu.maxPerVirtualNode]" not in fields
    assert p.changes[0].owner == "phi3-vx650v4"


@pytest.mark.parametrize("api", ["6.5", "8.0.3.0"])
def test_converged_vm_is_in_sync(api):
    d = want(api)
    p = c.plan_vm(d, in_sync(d), allow_restart=False)
    assert (p.action, p.changes, p.pending, p.change_count) == ("in-sync", (), (), 0)


def test_write_only_keys_are_not_compared_after_creation():
    d = want("6.5", node0_advanced={"SET.guest.ipAddress": "127.0.0.11"})
    assert c.plan_vm(d, in_sync(d), allow_restart=False).action == "in-sync"
    created = c.plan_vm(d, None, allow_restart=False)
    assert "extraConfig[SET.guest.ipAddress]" in labels(created)


# (drifted field, value, needs a restart)
DRIFT = [
    ("memory_locked_to_max", False, False),
    ("memory_reservation_mb", 0, False),
    ("num_cpus", 48, True),
    ("cores_per_socket", 24, True),
    ("memory_mb", 1024, True),
    ("cores_per_numa_node", 12, True),
    ("cpu_hot_add", True, True),
    ("nics", ("mgmt-pg",), False),
]


@pytest.mark.parametrize("field, value, restart", DRIFT)
def test_drift_on_a_running_vm(field, value, restart):
    d = want("8.0.3.0")
    observed = in_sync(d, **{field: value})
    held = c.plan_vm(d, observed, allow_restart=False)
    allowed = c.plan_vm(d, observed, allow_restart=True)
    if restart:
        assert held.action == "in-sync" and len(held.pending) == 1
        assert held.pending[0].field == field
        assert kinds(allowed) == ["power-off", "reconfigure", "power-on", "wait-ip"]
        assert allowed.restarts
    else:
        assert held.pending == () and kinds(held) == ["reconfigure"]
        assert kinds(allowed) == ["reconfigure"] and not allowed.restarts
    reconf = next(ch for ch in allowed.changes if isinstance(ch, c.Reconfigure))
    assert [f.field for f in reconf.fields] == [field]
    expected = ("mgmt-pg", "bench-25g-pg") if field == "nics" else getattr(d, field)
    assert reconf.fields[0].new == expected


def test_extra_config_drift_restart_only_for_numa_keys():
    d = want("6.5")
    extra = dict(in_sync(d).extra_config, **{"numa.nodeAffinity": "0"})
    extra.pop("numa.autosize.once")
    p = c.plan_vm(d, in_sync(d, extra_config=extra), allow_restart=False)
    assert [f.label for f in p.pending] == ["extraConfig[numa.autosize.once]",
                                            "extraConfig[numa.nodeAffinity]"]
    assert p.pending[1].describe() == "extraConfig[numa.nodeAffinity]: 0 -> 0,1,2,3"
    d2 = replace(d, extra_config={**d.extra_config, "guestinfo.role": "slm"})
    live = c.plan_vm(d2, in_sync(d), allow_restart=False)
    assert labels(live) == ["extraConfig[guestinfo.role]"] and live.pending == ()


def test_a_fallback_node_size_left_from_an_older_vcenter_is_removed_on_the_virtual_numa_path():
    d = want("8.0.3.0")
    assert d.cores_per_numa_node == 24 and c.VNUMA_KEY not in d.extra_config
    left = in_sync(d, extra_config={**in_sync(d).extra_config, c.VNUMA_KEY: "24"})
    p = c.plan_vm(d, left, allow_restart=True)
    assert labels(p) == [f"extraConfig[{c.VNUMA_KEY}]"]
    [field] = [f for ch in p.changes if isinstance(ch, c.Reconfigure) for f in ch.fields]
    assert (field.old, field.new, field.needs_power_off) == ("24", "", True)
    # once deleted (vCenter may report the key with an empty value) the VM is in sync
    gone = in_sync(d, extra_config={**in_sync(d).extra_config, c.VNUMA_KEY: ""})
    assert c.plan_vm(d, gone, allow_restart=True).changes == ()


def test_mixed_drift_applies_live_fields_and_holds_the_rest():
    d = want("8.0.3.0")
    observed = in_sync(d, memory_locked_to_max=False, num_cpus=8)
    p = c.plan_vm(d, observed, allow_restart=False)
    assert labels(p) == ["memoryReservationLockedToMax"]
    assert [f.label for f in p.pending] == ["numCPUs"]
    assert p.change_count == 1


def test_powered_off_vm_is_changed_and_started_without_restart_permission():
    d = want("8.0.3.0")
    p = c.plan_vm(d, in_sync(d, power_state="poweredOff", num_cpus=8), allow_restart=False)
    assert kinds(p) == ["reconfigure", "power-on", "wait-ip"] and p.pending == ()
    assert not p.restarts


def test_wrong_host_is_migrated_live():
    d = want()
    p = c.plan_vm(d, in_sync(d, host="esx09"), allow_restart=False)
    assert kinds(p) == ["relocate"]
    assert p.changes[0].describe() == "migrate host: esx09 -> esx01.example.local"


def test_changed_ips_recustomize_with_a_restart():
    d = want()
    stale = dict(in_sync(d).extra_config, **{CUSTOMIZATION_KEY: "old"})
    held = c.plan_vm(d, in_sync(d, extra_config=stale), allow_restart=False)
    assert [f.field for f in held.pending] == ["customization"]
    allowed = c.plan_vm(d, in_sync(d, extra_config=stale), allow_restart=True)
    assert kinds(allowed) == ["power-off", "customize", "power-on", "wait-ip"]


def test_old_hardware_is_upgraded_with_a_restart():
    d = want("8.0.3.0")
    p = c.plan_vm(d, in_sync(d, hardware_version="vmx-19"), allow_restart=True)
    assert kinds(p) == ["power-off", "upgrade-hardware", "power-on", "wait-ip"]
    newer = c.plan_vm(d, in_sync(d, hardware_version="vmx-22"), allow_restart=True)
    assert newer.action == "in-sync"  # never downgraded


def test_running_vm_without_ip_is_waited_for_but_not_counted():
    d = want()
    p = c.plan_vm(d, in_sync(d, ip_addresses=()), allow_restart=False)
    assert kinds(p) == ["wait-ip"] and p.action == "in-sync" and p.change_count == 0


@pytest.mark.parametrize("owner, why", [(None, "no vcfslm ownership marker"),
                                        ("other", "owned by inventory 'other'")])
def test_same_named_vm_of_someone_else_is_blocked(owner, why):
    d = want()
    extra = {k: v for k, v in in_sync(d).extra_config.items() if k != "vcfslm.owner"}
    if owner:
        extra["vcfslm.owner"] = owner
    p = c.plan_vm(d, in_sync(d, extra_config=extra), allow_restart=True)
    assert p.action == "blocked" and p.changes == ()
    assert why in p.problems[0]


def test_whole_plan_folder_counts_json_and_lines():
    inv = inventory()
    ds = desired_vms(inv, "6.5")
    snap = Snapshot(api_version="6.5", datacenter="DC01", cluster="WLD01-CL01", folders=frozenset({"SLM"}),
                    vms={ds[1].name: in_sync(ds[1]), ds[2].name: in_sync(ds[2], num_cpus=8)})
    p = c.plan(ds, snap, allow_restart=False, node_problems={"slm-04": ["ESXi host 'x' not found"]})
    assert [v.action for v in p.vms] == ["create", "in-sync", "in-sync", "blocked"]
    assert p.cluster_changes == (c.CreateFolder("", path="SLM/phi3"),)
    assert p.pending_count == 1
    assert p.change_count == 1 + p.vms[0].change_count
    data = json.loads(json.dumps(p.to_dict()))
    assert data["vms"][3]["problems"] == ["ESXi host 'x' not found"]
    assert data["vms"][2]["pending"] == [{"field": "numCPUs", "old": 8, "new": 96}]
    text = "\n".join(p.lines())
    assert "create folder SLM/phi3" in text
    assert "slm-02 (esx02.example.local): in-sync" in text
    assert "pending (needs --allow-restart): numCPUs: 8 -> 96" in text
    assert text.endswith("1 pending restart, 1 VM(s) blocked")


def test_in_sync_plan_says_zero_changes():
    ds = desired_vms(inventory(), "6.5")
    snap = Snapshot(api_version="6.5", datacenter="DC01", folders=frozenset({"SLM", "SLM/phi3"}),
                    vms={d.name: in_sync(d) for d in ds})
    p = c.plan(ds, snap)
    assert p.change_count == 0 and p.lines()[-1] == "0 changes"


def test_destroy_plan_only_owned():
    ds = desired_vms(inventory(), "6.5")
    mine = in_sync(ds[0])
    unmarked = in_sync(ds[1], extra_config={})
    theirs = in_sync(ds[2], extra_config={"vcfslm.owner": "other"})
    snap = Snapshot(api_version="6.5", vms={v.name: v for v in (mine, unmarked, theirs)})
    dp = c.plan_destroy("phi3-vx650v4", [d.name for d in ds], snap)
    assert [v.name for v in dp.destroy] == ["slm-01"]
    assert dp.absent == ("slm-04",)
    assert len(dp.refused) == 2
    assert "no vcfslm.owner marker" in dp.refused[0] and "owner: 'other'" in dp.refused[1]
