"""Waiting on vCenter: task results and guest IPs through a private property collector.

Each pool worker owns one `Waiter` (its own collector, so workers never see each
other's updates) and blocks in WaitForUpdatesEx: no sleep-polling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pyVmomi import vim, vmodl

from ..errors import VCenterError
from .session import Session
from .snapshot import ethernet_cards, usable_ipv4
from .throttle import throttle_reason

log = logging.getLogger(__name__)


class TaskFailed(VCenterError):
    """A vCenter task ended in error."""


class Waiter:
    """Waits for tasks and guest IPs through a private property collector (WaitForUpdatesEx).

    timeout: how long (s) a task may run before waiting for it gives up.
    """

    def __init__(self, session: Session, timeout: float = 3600.0):
        self.session = session
        self.timeout = timeout
        self.pc = session.call(session.content.propertyCollector.CreatePropertyCollector)

    def close(self) -> None:
        try:
            self.pc.DestroyPropertyCollector()
        except Exception:  # best effort: the session may be gone
            pass

    def _wait(self, obj, paths: list[str], done: Callable[[dict[str, Any]], Any], timeout: float,
              what: str):
        PC = vmodl.query.PropertyCollector
        spec = PC.FilterSpec(objectSet=[PC.ObjectSpec(obj=obj, skip=False)],
                             propSet=[PC.PropertySpec(type=type(obj), pathSet=paths)])
        flt = self.session.call(self.pc.CreateFilter, spec, partialUpdates=True)
        try:
            values: dict[str, Any] = {}
            version = ""
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise VCenterError(f"timed out after {timeout:.0f} s waiting for {what}")
                options = PC.WaitOptions(maxWaitSeconds=max(1, min(int(remaining), 60)))
                update = self.session.call(self.pc.WaitForUpdatesEx, version, options)
                if update is None:
                    continue
                version = update.version
                for fs in update.filterSet or []:
                    for oc in fs.objectSet or []:
                        for change in oc.changeSet or []:
                            values[change.name] = None if change.op == "remove" else change.val
                result = done(values)
                if result is not None:
                    return result
        finally:
            try:
                flt.Destroy()
            except Exception:  # already gone with the collector
                pass

    def run(self, what: str, method: Callable, *args, idempotent: bool = False, **kwargs):
        """Start a task with method(*args, **kwargs) and return its result (see `task`).

        what: names the task in the debug log ("clone slm-01"); idempotent: the start
        may be retried after a connection reset (power operations are). A task that
        fails because vCenter had too many at once (TooManyConcurrentNativeClones) did
        nothing: it is started again after the session's throttling backoff.
        """
        refusals = 0
        waited = 0.0
        while True:
            try:
                return self.task(self.session.call(method, *args, idempotent=idempotent, **kwargs), what)
            except TaskFailed as exc:
                reason = throttle_reason(exc.__cause__)
                if reason is None:
                    raise
                refusals += 1
                waited += self.session.throttle_wait(what, reason, refusals, waited)

    def task(self, task, what: str = "a task", timeout: float | None = None):
        """The task's result once it succeeds; TaskFailed (cause: the fault) when it fails."""
        task_id = getattr(task, "_moId", task)
        started = time.monotonic()
        log.debug("task %s started: %s", task_id, what)

        def done(v: dict[str, Any]):
            state = v.get("info.state")
            if state == vim.TaskInfo.State.success:
                log.debug("task %s succeeded after %.1f s: %s", task_id, time.monotonic() - started, what)
                return (v.get("info.result"),)
            if state == vim.TaskInfo.State.error:
                fault = v.get("info.error")
                text = self.session.text(fault) if fault is not None else "task failed"
                log.debug("task %s failed after %.1f s: %s: %s", task_id, time.monotonic() - started,
                          what, text)
                raise TaskFailed(text) from fault
            return None

        return self._wait(task, ["info.state", "info.error", "info.result"], done,
                          timeout or self.timeout, "a task")[0]

    def ipv4(self, vm, portgroup: str, timeout: float) -> str:
        """The first usable IPv4 address the guest reports on the `portgroup` adapter."""
        devices = self.session.call(lambda: vm.config.hardware.device) or []
        nic_keys = [d.key for d in ethernet_cards(devices)]
        first_key = nic_keys[0] if nic_keys else None

        def done(v: dict[str, Any]):
            for g in v.get("guest.net") or []:
                if g.network == portgroup or g.deviceConfigId == first_key:
                    for a in g.ipAddress or []:
                        if usable_ipv4(a):
                            return a
            return None

        log.debug("waiting up to %.0f s for an IPv4 address on %s", timeout, portgroup)
        return self._wait(vm, ["guest.net"], done, timeout, f"an IPv4 address on {portgroup}")
