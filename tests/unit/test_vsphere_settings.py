"""The VM settings table: every row names real vSphere paths, the inventory and the lab take
their keys from it, and a setting added as one row alone is planned, observed and applied."""

from __future__ import annotations

import pytest
import yaml
from pyVmomi import vim
from test_vsphere_driver import apply, one_vm_plan, vc  # noqa: F401 (vc is a fixture)
from test_vsphere_support import BRIEF, fake_vm, inventory, lab_refs, observed

from vcfslm import vm_settings as settings
from vcfslm.errors import InventoryError
from vcfslm.inventory import VMSpec
from vcfslm.inventory_load import parse_inventory
from vcfslm.lab import generate
from vcfslm.vsphere import changes as c
from vcfslm.vsphere import snapshot, specs
from vcfslm.vsphere.desired import desired_vms

# A setting vcsim stores and reports back, added through the table alone.
FAKE = settings.VmSetting("memory_hot_add", "memoryHotAddEnabled", "config.memoryHotAddEnabled",
                          unset=False, desired=lambda facts: True)


@pytest.fixture
def fake_row(monkeypatch):
    monkeypatch.setattr(settings, "VM_SETTINGS", (*settings.VM_SETTINGS, FAKE))
    return FAKE


def property_type(cls, path: str):
    """The type a dotted path of a vSphere data object type ends in (KeyError-free: asserts)."""
    for step in path.split("."):
        cls = cls._GetPropertyInfo(step).type
    return cls


@pytest.mark.parametrize("row", settings.VM_SETTINGS, ids=lambda s: s.name)
def test_each_row_names_real_vsphere_paths(row):
    assert property_type(vim.vm.ConfigSpec, row.spec)
    root, _, rest = row.observe.partition(".")
    assert root == "config"
    assert property_type(vim.vm.ConfigInfo, rest + (f".{row.member}" if row.member else ""))


def test_names_are_unique():
    names = [s.name for s in settings.VM_SETTINGS]
    assert len(names) == len(set(names))


def test_the_inventory_and_the_lab_take_their_keys_from_the_table():
    keyed = {s.name for s in settings.inventory_rows()}
    assert keyed == {"latency_sensitivity", "cpu_hot_add"}
    assert keyed <= set(VMSpec.model_fields)
    assert {k: generate.vm_section(generate.MachineShape(4, 1, 32))[k] for k in keyed} == \
        {"latency_sensitivity": "normal", "cpu_hot_add": False}
    for s in settings.inventory_rows():
        assert VMSpec.model_fields[s.name].description == s.inventory.description


def brief_with(**vm) -> str:
    data = yaml.safe_load(BRIEF.read_text())
    data["vm"].update(vm)
    return yaml.safe_dump(data, sort_keys=False)


def test_cpu_hot_add_false_is_the_only_accepted_value():
    assert parse_inventory(brief_with(cpu_hot_add=False), "c.yaml").vm.cpu_hot_add is False
    with pytest.raises(InventoryError) as info:
        parse_inventory(brief_with(cpu_hot_add=True), "c.yaml")
    [msg] = [str(p) for p in info.value.problems]
    assert msg.startswith("c.yaml:") and " vm.cpu_hot_add: " in msg and "False" in msg
    assert info.value.exit_code == 2


def test_cpu_hot_add_on_is_planned_off_with_a_restart():
    d = desired_vms(inventory({"cpu_hot_add": False}), "8.0.3.0")[0]
    assert d.cpu_hot_add is False
    p = c.plan_vm(d, observed(d, cpu_hot_add=True), allow_restart=True)
    [change] = [ch for ch in p.changes if isinstance(ch, c.Reconfigure)]
    assert [(f.label, f.old, f.new, f.needs_power_off) for f in change.fields] == \
        [("cpuHotAddEnabled", True, False, True)]
    assert [ch.kind for ch in p.changes][:2] == ["power-off", "reconfigure"]
    assert specs.config_spec(change.fields, d, lab_refs()).cpuHotAddEnabled is False


def test_a_row_alone_is_desired_observed_and_compared(fake_row):
    d = desired_vms(inventory(), "6.5")[0]
    assert d.memory_hot_add is True and d.settings["memory_hot_add"] is True
    assert "config.memoryHotAddEnabled" in snapshot.properties("6.5")["VirtualMachine"]
    props = {"name": "slm-01", "config.memoryHotAddEnabled": True}
    assert snapshot.vm_state("vm-1", props, {}, {}, None).memory_hot_add is True
    assert snapshot.vm_state("vm-1", {"name": "slm-01"}, {}, {}, None).memory_hot_add is None
    held = c.plan_vm(d, observed(d, power_state="poweredOn"), allow_restart=False)
    assert [(f.label, f.old, f.new) for f in held.pending] == [("memoryHotAddEnabled", False, True)]
    assert "    ! pending (needs --allow-restart): memoryHotAddEnabled: False -> True" in \
        c.Plan((held,)).lines()
    assert c.plan_vm(d, observed(d, memory_hot_add=True), allow_restart=False).action == "in-sync"


def test_a_row_alone_is_applied_by_the_driver(vc, fake_row):  # noqa: F811
    d = desired_vms(inventory(), "8.0.3.0")[0]
    vm = fake_vm("slm-01")
    vc.refs.vms["slm-01"] = vm
    [out] = apply(vc, one_vm_plan(c.plan_vm(d, observed(d, power_state="poweredOff"), False)))
    assert out.ok
    spec = vm.ReconfigVM_Task.call_args.kwargs["spec"]
    assert spec.memoryHotAddEnabled is True
    assert spec.numCPUs is None and spec.cpuHotAddEnabled is None  # only what differs


def test_set_path_makes_each_missing_step():
    spec = vim.vm.ConfigSpec()
    specs.set_path(spec, "cpuAllocation.reservation", 100)
    specs.set_path(spec, "cpuAllocation.limit", 200)
    assert (spec.cpuAllocation.reservation, spec.cpuAllocation.limit) == (100, 200)
    specs.set_path(spec, "nestedHVEnabled", True)
    assert spec.nestedHVEnabled is True


def test_settings_read_as_attributes_and_are_given_by_name():
    d = desired_vms(inventory(), "6.5")[0]
    assert d.num_cpus == d.settings["num_cpus"] == 96
    state = observed(d, num_cpus=8)
    assert state.num_cpus == 8 and state.settings["num_cpus"] == 8
    assert observed(d, cpu_reservation_mhz=None).cpu_reservation_mhz is None
    with pytest.raises(AttributeError):
        _ = d.no_such_setting
    with pytest.raises(TypeError):
        type(state)(name="x", moref="vm-1", no_such_setting=1)
