"""Orchestration: observe -> preflight -> desired -> diff -> apply -> tag (and destroy).

The drivers are passed in (a `PyVmomiVCenter`-like object and an optional factory
of Automation API clients), so this module stays free of pyVmomi and the SDK.
Applying a plan runs every VM in its own worker of a bounded pool, so the tasks
of all VMs are fired together and waited on together; one VM's failure never
stops the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from .. import node_selection
from ..errors import VCenterError
from ..progress import NullReporter, Reporter
from . import changes, preflight, vnuma
from .desired import DesiredVm, desired_vms
from .state import Snapshot, VmState
from .throttle import Throttled

log = logging.getLogger(__name__)

TAG_CATEGORY = "vcfslm"  # the same as tags.CATEGORY (not imported: that pulls in the SDK)
# callable(library, item, name, folder, host, resource_pool, datastore ids) -> new VM's moref id
LibraryDeploy = Callable[..., str]
STEP_LABELS = {"clone": "cloning", "reconfigure": "reconfiguring", "relocate": "migrating",
               "upgrade-hardware": "upgrading hardware", "power-off": "powering off",
               "power-on": "powering on", "customize": "customizing guest",
               "wait-ip": "waiting for an IPv4 address"}
In = TypeVar("In")
Out = TypeVar("Out")


@dataclass
class VmOutcome:
    """How one VM ended: status ok | failed | blocked; `step` is the last step attempted;
    throttled: it failed because vCenter kept refusing calls for load."""

    name: str
    status: str
    message: str = ""
    step: str = ""
    moref: str | None = None
    ip: str | None = None
    pending: list[str] = field(default_factory=list)
    throttled: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class VmWorker(Protocol):
    """Changes one VM; entering it opens what it waits with (its own task waiter)."""

    @property
    def moref(self) -> str | None: ...

    def __enter__(self) -> VmWorker: ...

    def __exit__(self, *exc) -> None: ...

    def apply(self, change: changes.Change, desired: DesiredVm) -> str | None:
        """Make one change; the guest's IPv4 address for WaitForIp, else None."""

    def read_back(self) -> VmState | None:
        """The VM as vCenter reports it now (None: it could not be read)."""

    def power_off(self) -> None: ...

    def destroy(self) -> None: ...


class VCenter(Protocol):
    """What reconcile needs from a vCenter driver (max_workers None: every VM up to the cap)."""

    max_workers: int | None

    def observe(self, inv) -> Snapshot: ...

    def ensure_folder(self, path: str) -> object: ...

    def worker(self, name: str, library_deploy: LibraryDeploy | None = None) -> VmWorker: ...

    def error_text(self, exc: BaseException) -> str: ...


@dataclass
class PlanResult:
    """A plan with the facts it came from."""

    plan: changes.Plan
    preflight: preflight.PreflightResult
    snapshot: Snapshot


@dataclass
class ProvisionResult:
    """What provision did: the plan, each VM's outcome, and warnings (e.g. tags skipped)."""

    plan: changes.Plan
    outcomes: list[VmOutcome]
    warnings: list[str] = field(default_factory=list)
    tagged: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[VmOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def pending(self) -> list[VmOutcome]:
        return [o for o in self.outcomes if o.ok and o.pending]

    @property
    def throttled(self) -> list[VmOutcome]:
        return [o for o in self.outcomes if o.throttled]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.pending else 0

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "exit_code": self.exit_code, "changes": p.change_count, "api_version": p.api_version,
            "session_api_version": p.session_api_version, "vnuma_path": p.vnuma_path,
            "vnuma_reason": p.vnuma_reason,
            "vms": [{"name": o.name, "status": o.status, "message": o.message, "step": o.step,
                     "ip": o.ip, "moref": o.moref, "pending": o.pending, "throttled": o.throttled}
                    for o in self.outcomes],
            "warnings": self.warnings, "tagged": self.tagged,
        }


@dataclass
class DestroyResult:
    """What destroy did: removed VMs, refusals, absent names, warnings."""

    plan: changes.DestroyPlan
    outcomes: list[VmOutcome]
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.plan.refused or any(not o.ok for o in self.outcomes) else 0


def _automation(factory, warnings: list[str], why: str):
    """A connected Automation API client, or None with a warning saying what is skipped."""
    if factory is None:
        warnings.append(f"{why}: no Automation API client configured")
        return None
    client = factory()
    try:
        client.connect()
    except VCenterError as exc:
        warnings.append(f"{why}: {exc}")
        return None
    return client


def make_plan(inv, vc: VCenter, allow_restart: bool = False,
              automation_factory: Callable[[], Any] | None = None) -> PlanResult:
    """Observe and check; PreflightError (nothing changed) on any cluster-wide problem."""
    snapshot = vc.observe(inv)
    lib = inv.placement.library_item
    if lib is not None:
        found: frozenset[str] | None = None
        client = _automation(automation_factory, [], "content library")
        if client is not None:
            try:
                found = frozenset(f"{lib[0]}/{n}" for n in client.library_items(lib[0]))
            finally:
                client.close()
        snapshot = replace(snapshot, library_items=found)
    checked = preflight.check(inv, snapshot)
    checked.raise_for_problems()
    desired = desired_vms(inv, checked.api_version, checked.host_cpu_mhz, checked.session_api_version)
    plan = changes.plan(desired, snapshot, allow_restart, checked.node_problems,
                        checked.warnings, checked.vnuma_path, checked.vnuma_reason)
    return PlanResult(plan, checked, snapshot)


def provision(inv, vc: VCenter, reporter: Reporter | None = None, allow_restart: bool = False,
              automation_factory: Callable[[], Any] | None = None,
              confirm: Callable[[changes.Plan], bool] | None = None) -> ProvisionResult:
    """Converge the inventory's VMs; `confirm(plan)` is asked before powering off running VMs."""
    reporter = reporter or NullReporter()
    planned = make_plan(inv, vc, allow_restart, automation_factory)
    plan = planned.plan
    warnings = list(plan.warnings)
    restarting = [v.name for v in plan.vms if v.restarts]
    if restarting and confirm is not None and not confirm(plan):
        raise VCenterError("aborted: nothing changed (restarts not confirmed)")
    library = None
    if inv.placement.library_item is not None and any(v.action == "create" for v in plan.vms):
        library = _automation(automation_factory, warnings, "content library deploy")
    try:
        outcomes = apply_plan(vc, plan, reporter, library.deploy if library is not None else None)
    finally:
        if library is not None:
            library.close()
    result = ProvisionResult(plan, outcomes, warnings)
    ids = [o.moref for o in outcomes if o.ok and o.moref]
    if ids:
        _tag(inv.name, ids, automation_factory, result)
    return result


def _tag(name: str, vm_ids: list[str], factory, result: ProvisionResult) -> None:
    client = _automation(factory, result.warnings, f"tag {TAG_CATEGORY}/{name} not applied")
    if client is None:
        return
    try:
        result.tagged = client.attach(name, vm_ids)
    except Exception as exc:  # tags are for discoverability; the VMs are fine without them
        result.warnings.append(f"tag {TAG_CATEGORY}/{name} not applied: {type(exc).__name__}: {exc}")
    finally:
        client.close()


def destroy(inv, vc: VCenter, reporter: Reporter | None = None,
            automation_factory: Callable[[], Any] | None = None,
            confirm: Callable[[changes.DestroyPlan], bool] | None = None) -> DestroyResult:
    """Destroy the inventory's owned VMs; same-named VMs without its marker are refused."""
    reporter = reporter or NullReporter()
    snapshot = vc.observe(inv)
    if snapshot.datacenter is None:
        raise VCenterError(f"datacenter '{inv.placement.datacenter}' not found")
    dplan = changes.plan_destroy(inv.name, [n.name for n in inv.nodes], snapshot)
    warnings: list[str] = []
    if dplan.destroy and confirm is not None and not confirm(dplan):
        raise VCenterError("aborted: nothing destroyed")
    ids = [v.moref for v in dplan.destroy]
    if ids:
        client = _automation(automation_factory, warnings, "tags not removed")
        if client is not None:
            try:
                client.detach(inv.name, ids)
            except Exception as exc:  # a stale tag is harmless; say so and go on
                warnings.append(f"tags not removed: {type(exc).__name__}: {exc}")
            finally:
                client.close()
    outcomes = destroy_vms(vc, dplan, reporter)
    return DestroyResult(dplan, outcomes, warnings)


def apply_plan(vc: VCenter, plan: changes.Plan, reporter: Reporter | None = None,
               library_deploy: LibraryDeploy | None = None) -> list[VmOutcome]:
    """Execute a plan, all VMs at once; one outcome per VM in plan order.

    library_deploy: deploys `template: library:<lib>/<item>` (vsphere.tags'
    AutomationClient.deploy); None when the Automation API is not available.
    """
    reporter = reporter or NullReporter()
    folder_error = None
    for change in plan.cluster_changes:
        if isinstance(change, changes.CreateFolder):
            try:
                reporter.log(f"creating folder {change.path}")
                vc.ensure_folder(change.path)
            except Exception as exc:  # every VM in that folder fails below, with this reason
                folder_error = f"cannot create folder {change.path}: {vc.error_text(exc)}"
    todo = [v for v in plan.vms if v.action in ("create", "update") or v.changes]
    results: dict[str, VmOutcome] = {}
    for v in plan.vms:
        if v.action == "blocked":
            results[v.name] = VmOutcome(v.name, "blocked", "; ".join(v.problems))
            reporter.update(v.name, "blocked: " + "; ".join(v.problems))
        elif v not in todo:
            results[v.name] = _in_sync(v)
            reporter.update(v.name, results[v.name].message)
    if folder_error:
        for v in todo:
            results[v.name] = VmOutcome(v.name, "failed", folder_error, "create folder")
        todo = []
    for outcome in _pooled(lambda vp: _apply_vm(vc, vp, reporter, library_deploy), todo,
                           vc.max_workers, "vcfslm-vm"):
        results[outcome.name] = outcome
    return [results[v.name] for v in plan.vms]


def destroy_vms(vc: VCenter, dplan: changes.DestroyPlan,
                reporter: Reporter | None = None) -> list[VmOutcome]:
    """Power off and destroy the plan's owned VMs, all at once."""
    reporter = reporter or NullReporter()
    return _pooled(lambda s: _destroy_vm(vc, s, reporter), dplan.destroy, vc.max_workers,
                   "vcfslm-destroy")


def _pooled(fn: Callable[[In], Out], items: Sequence[In], max_workers: int | None,
            prefix: str) -> list[Out]:
    """fn over items in a pool of max_workers threads (None: every item up to the vCenter
    cap), results in item order."""
    if not items:
        return []
    workers = node_selection.parallelism(max_workers, len(items), node_selection.VCENTER_PARALLEL_CAP)
    log.debug("%s: %d VM(s), %d at once", prefix, len(items), workers)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix) as pool:
        return list(pool.map(fn, items))


def _in_sync(v: changes.VmPlan) -> VmOutcome:
    obs = v.observed
    text = "in sync" + (f"; {v.vnuma.text}" if v.vnuma and v.vnuma.status else "")
    status = "failed" if v.vnuma and not v.vnuma.ok else "ok"
    return VmOutcome(v.name, status, text, moref=obs.moref if obs else None,
                     ip=obs.ip_addresses[0] if obs and obs.ip_addresses else None,
                     pending=[f.describe() for f in v.pending])


def _apply_vm(vc: VCenter, vp: changes.VmPlan, reporter: Reporter,
              library_deploy: LibraryDeploy | None) -> VmOutcome:
    name = vp.name
    outcome = VmOutcome(name, "ok", vp.action, pending=[f.describe() for f in vp.pending])
    worker = vc.worker(name, library_deploy)
    try:
        with worker:
            for change in vp.changes:
                outcome.step = change.kind
                reporter.update(name, STEP_LABELS.get(change.kind, change.kind))
                ip = worker.apply(change, vp.desired)
                if ip is not None:
                    outcome.ip = ip
            checked = _read_back(worker, vp, outcome, reporter)
        outcome.moref = worker.moref
        done = "created" if vp.action == "create" else ("updated" if vp.change_count else "in sync")
        if outcome.ip:
            done += f", {outcome.ip}"
        if vp.pending:
            done += f", {len(vp.pending)} change(s) pending a restart"
        if checked.status:
            outcome.message = f"{outcome.message}; {checked.text}"
            done += f", vNUMA {checked.status}"
        reporter.update(name, done)
    except Exception as exc:  # one VM's failure must not stop the others
        outcome.moref = worker.moref
        outcome.throttled = isinstance(exc, Throttled)
        _failed(outcome, vc.error_text(exc), reporter)
    return outcome


def _read_back(worker: VmWorker, vp: changes.VmPlan, outcome: VmOutcome,
               reporter: Reporter) -> vnuma.VnumaCheck:
    """What vCenter reports of the VM's vNUMA now; a layout differing from the request raises."""
    if not any(isinstance(c, changes.Reconfigure) for c in vp.changes):
        return vp.vnuma or vnuma.VnumaCheck("")
    outcome.step = "read-back"
    reporter.update(vp.name, "reading back the vNUMA layout")
    checked = vnuma.check_vnuma(vp.desired, worker.read_back())
    log.debug("%s: %s", vp.name, checked.text or "no vNUMA layout asked for")
    # A vNUMA change held back for a restart is reported as pending, not as a failure.
    held = any(vnuma.is_vnuma_field(f.field) for f in vp.pending)
    if not checked.ok and not held:
        raise VCenterError(checked.text)
    return checked


def _destroy_vm(vc: VCenter, state: VmState, reporter: Reporter) -> VmOutcome:
    outcome = VmOutcome(state.name, "ok", "destroyed", moref=state.moref)
    try:
        with vc.worker(state.name) as worker:
            if state.power_state != "poweredOff":
                outcome.step = "power-off"
                reporter.update(state.name, "powering off")
                worker.power_off()
            outcome.step = "destroy"
            reporter.update(state.name, "destroying")
            worker.destroy()
            reporter.update(state.name, "destroyed")
    except Exception as exc:  # the others go on
        outcome.throttled = isinstance(exc, Throttled)
        _failed(outcome, vc.error_text(exc), reporter)
    return outcome


def _failed(outcome: VmOutcome, text: str, reporter: Reporter) -> None:
    outcome.status = "failed"
    outcome.message = f"{outcome.step}: {text}"
    log.debug("%s failed at %s: %s", outcome.name, outcome.step, text)
    reporter.update(outcome.name, f"failed at {outcome.step}: {text}")
