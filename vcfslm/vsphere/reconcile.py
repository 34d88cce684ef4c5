"""Orchestration: observe -> preflight -> desired -> diff -> apply -> tag (and destroy).

The drivers are passed in (a `PyVmomiVCenter`-like object and an optional factory
of Automation API clients), so this module stays free of pyVmomi and the SDK.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..errors import VCenterError
from ..progress import NullReporter, Reporter
from . import changes, preflight
from .desired import desired_vms
from .state import Snapshot

TAG_CATEGORY = "vcfslm"  # the same as tags.CATEGORY (not imported: that pulls in the SDK)


class VCenter(Protocol):
    """What reconcile needs from a vCenter driver."""

    library_deploy: Callable[..., str] | None

    def observe(self, inv) -> Snapshot: ...

    def apply(self, plan: changes.Plan, reporter: Reporter | None = None) -> list: ...

    def destroy(self, dplan: changes.DestroyPlan, reporter: Reporter | None = None) -> list: ...


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
    outcomes: list[Any]
    warnings: list[str] = field(default_factory=list)
    tagged: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Any]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def pending(self) -> list[Any]:
        return [o for o in self.outcomes if o.ok and o.pending]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.pending else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code, "changes": self.plan.change_count,
            "vms": [{"name": o.name, "status": o.status, "message": o.message, "step": o.step,
                     "ip": o.ip, "moref": o.moref, "pending": o.pending} for o in self.outcomes],
            "warnings": self.warnings, "tagged": self.tagged,
        }


@dataclass
class DestroyResult:
    """What destroy did: removed VMs, refusals, absent names, warnings."""

    plan: changes.DestroyPlan
    outcomes: list[Any]
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
    desired = desired_vms(inv, checked.api_version, checked.host_cpu_mhz)
    plan = changes.plan(desired, snapshot, allow_restart, checked.node_problems,
                        checked.warnings, checked.vnuma_path)
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
        vc.library_deploy = library.deploy if library is not None else None
    try:
        outcomes = vc.apply(plan, reporter)
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
    outcomes = vc.destroy(dplan, reporter)
    return DestroyResult(dplan, outcomes, warnings)
