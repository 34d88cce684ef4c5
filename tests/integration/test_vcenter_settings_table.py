"""A VM setting added as one row of vm_settings.py's table, and vm.cpu_hot_add, on vcsim.

The fake row (memoryHotAddEnabled, a flag vcsim stores and reports back) touches no other
file: plan shows it, provision applies it, the next observe reads it back in sync, and a
drift of it is shown and fixed like any other power-off setting.
"""

from __future__ import annotations

import json

import pytest
from test_vcenter_vcsim import brief_inventory, env, find_vm, run, si, vm_names, wait, write  # noqa: F401

from vcfslm import vm_settings as settings

pytestmark = pytest.mark.integration

FAKE = settings.VmSetting("memory_hot_add", "memoryHotAddEnabled", "config.memoryHotAddEnabled",
                          unset=False, desired=lambda facts: True)
NODES = [("itst-01", "DC0_C0_H0")]


def test_a_row_alone_is_planned_and_provisioned(monkeypatch, vcsim_server, tmp_path, run, si):  # noqa: F811
    from pyVmomi import vim

    monkeypatch.setattr(settings, "VM_SETTINGS", (*settings.VM_SETTINGS, FAKE))
    path = write(tmp_path, brief_inventory(vcsim_server, "itst", NODES))

    plan = run("plan", path)
    assert plan.exit_code == 0, plan.output
    # Whole lines: plan never wraps (soft_wrap), so a line is the unit to compare.
    assert "~ memoryHotAddEnabled: False -> True [restart]" in [line.strip() for line in plan.stdout.splitlines()]

    first = run("provision", path, "--stage", "vms", "--output", "json")
    assert first.exit_code == 0, first.output
    vm = find_vm(si, "itst-01")
    assert vm.config.memoryHotAddEnabled is True
    assert not vm.config.cpuHotAddEnabled
    assert json.loads(run("plan", path, "--output", "json").stdout)["changes"] == 0

    # Drift behind the tool's back: the fake row's flag off, CPU hot-add on.
    wait(vm.ReconfigVM_Task(spec=vim.vm.ConfigSpec(memoryHotAddEnabled=False, cpuHotAddEnabled=True)))
    drift = run("plan", path)
    assert drift.exit_code == 0, drift.output
    assert "memoryHotAddEnabled: False -> True" in drift.stdout
    assert "cpuHotAddEnabled: True -> False" in drift.stdout
    assert "pending" in drift.stdout  # both need a power-off; the VM is running

    fixed = run("provision", path, "--stage", "vms", "--allow-restart", "--yes")
    assert fixed.exit_code == 0, fixed.output
    assert vm.config.memoryHotAddEnabled is True and vm.config.cpuHotAddEnabled is False
    assert vm.runtime.powerState == "poweredOn"
    assert json.loads(run("plan", path, "--output", "json").stdout)["changes"] == 0

    gone = run("destroy", path, "--yes")
    assert gone.exit_code == 0, gone.output
    assert "itst-01" not in vm_names(si)
