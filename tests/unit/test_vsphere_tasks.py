"""The task waiter over a scripted property collector: results, faults, timeouts, guest IPs,
and each task's start and end in the DEBUG log."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from pyVmomi import vim
from test_vsphere_support import dv_nic, inventory, template_nic

from vcfslm.errors import VCenterError
from vcfslm.vsphere import tasks
from vcfslm.vsphere.credentials import Secret
from vcfslm.vsphere.session import Session, SessionOptions

RUNNING, SUCCESS, ERROR = vim.TaskInfo.State.running, vim.TaskInfo.State.success, vim.TaskInfo.State.error


def update(**values):
    """One WaitForUpdatesEx result setting property paths ('info__state' -> 'info.state')."""
    changes = [SimpleNamespace(name=k.replace("__", "."), op="assign", val=v) for k, v in values.items()]
    return SimpleNamespace(version="v", filterSet=[SimpleNamespace(objectSet=[SimpleNamespace(
        changeSet=changes)])])


def waiter(updates, password: str = "pw") -> tasks.Waiter:
    session = Session(inventory().vcenter, Secret(password), options=SessionOptions(backoff=0))
    session.si = MagicMock()
    session.si.RetrieveContent.return_value = session.si.content
    pc = session.si.content.propertyCollector.CreatePropertyCollector.return_value
    pc.WaitForUpdatesEx.side_effect = list(updates)
    return tasks.Waiter(session, timeout=30)


@pytest.mark.parametrize("updates, result", [
    ([update(info__state=SUCCESS, info__result="vm-9")], "vm-9"),
    ([update(info__state=RUNNING), None, update(info__state=SUCCESS, info__result=None)], None),
    ([update(info__state=RUNNING), update(info__result="r"), update(info__state=SUCCESS)], "r"),
])
def test_task_result_once_it_succeeds(updates, result, caplog):
    caplog.set_level(logging.DEBUG, logger=tasks.__name__)
    task = vim.Task("task-7")
    assert waiter(updates).task(task, "clone t -> slm-01") == result
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0] == "task task-7 started: clone t -> slm-01"
    assert logged[-1].startswith("task task-7 succeeded after ") and logged[-1].endswith(": clone t -> slm-01")


@pytest.mark.parametrize("fault, message", [
    (vim.fault.InvalidPowerState(msg="already on"), "InvalidPowerState: already on"),
    (vim.fault.InsufficientResourcesFault(msg="no memory for pw123"), "InsufficientResourcesFault: "
                                                                      "no memory for ********"),
    (None, "task failed"),
])
def test_failed_task_raises_with_the_fault_as_cause(fault, message, caplog):
    caplog.set_level(logging.DEBUG, logger=tasks.__name__)
    w = waiter([update(info__state=ERROR, info__error=fault)], password="pw123")
    with pytest.raises(tasks.TaskFailed) as err:
        w.task(vim.Task("task-8"), "reconfigure slm-01")
    assert str(err.value) == message and err.value.__cause__ is fault
    assert "pw123" not in caplog.text
    assert caplog.records[-1].getMessage().startswith("task task-8 failed after ")


def test_waiting_gives_up_after_the_timeout():
    w = waiter([update(info__state=RUNNING)] * 3)
    w.timeout = 0
    with pytest.raises(VCenterError, match="timed out after 0 s waiting for a task"):
        w.task(vim.Task("task-9"))


def test_run_starts_the_task_once_and_waits_for_it():
    w = waiter([update(info__state=SUCCESS, info__result="done")])
    start = MagicMock(side_effect=[ConnectionResetError(), ConnectionResetError(), vim.Task("task-1")])
    with pytest.raises(ConnectionResetError):  # a task start is not repeated unless it is safe
        w.run("reconfigure slm-01", start, spec="s")
    assert w.run("power on slm-01", start, idempotent=True) == "done"
    assert start.call_count == 3


@pytest.mark.parametrize("guest_net, ip", [
    ([SimpleNamespace(network="mgmt-pg", deviceConfigId=4000, ipAddress=["fe80::1", "192.168.10.21"])],
     "192.168.10.21"),
    ([SimpleNamespace(network="other", deviceConfigId=4000, ipAddress=["169.254.1.1", "10.0.0.5"])],
     "10.0.0.5"),  # matched by the first adapter's key
    ([SimpleNamespace(network="bench-25g-pg", deviceConfigId=4001, ipAddress=["172.16.25.21"]),
      SimpleNamespace(network="mgmt-pg", deviceConfigId=4000, ipAddress=["0.0.0.0", "192.168.10.22"])],
     "192.168.10.22"),
])
def test_ipv4_is_the_first_usable_address_on_the_management_nic(guest_net, ip):
    stub = MagicMock()  # vm.config is read through the stub
    stub.InvokeAccessor.return_value = SimpleNamespace(hardware=SimpleNamespace(
        device=[dv_nic(4001), template_nic(4000)]))
    vm = vim.VirtualMachine("vm-1", stub)
    w = waiter([update(guest__net=[]), update(guest__net=guest_net)])
    assert w.ipv4(vm, "mgmt-pg", timeout=30) == ip
