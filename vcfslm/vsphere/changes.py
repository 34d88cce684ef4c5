"""Desired vs observed -> the typed changes that converge each VM (pure; no I/O).

A VM's plan is an ordered list of changes the driver executes in order:
create = clone, reconfigure, customize, power on, wait for IP; an existing VM
gets only the fields that differ. Fields that take effect only at power-on
(vCPUs, memory, vNUMA, `numa.*` keys, ...) "need a restart": on a running VM
they are applied only with allow_restart (power off, change, power on), else
they are reported as pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from .. import vm_settings
from .desired import (
    CUSTOMIZATION_KEY,
    OWNER_KEY,
    VIRTUAL_NUMA,
    VNUMA_KEY,
    DesiredVm,
    hardware_number,
)
from .state import Snapshot, VmState
from .vnuma import VnumaCheck, check_vnuma

# extraConfig keys vcsim consumes as property setters ("SET.guest.ipAddress") and
# never stores: written when the VM is created, never compared afterwards.
WRITE_ONLY_PREFIXES = ("SET.",)
# extraConfig keys ESXi reads only at power-on.
RESTART_KEY_PREFIXES = ("numa.", "sched.", "cpuid.", "monitor.")


@dataclass(frozen=True)
class FieldChange:
    """One setting going from `old` to `new`; `field` is a settings-table row's name or
    'extra_config:<key>' / 'nics'; `label` is what users see (a row's ConfigSpec path)."""

    field: str
    label: str
    old: Any
    new: Any
    needs_power_off: bool

    def describe(self) -> str:
        return f"{self.label}: {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class Change:
    """Base of every change; `vm` names the VM ('' for cluster-level changes)."""

    kind: ClassVar[str] = "change"
    vm: str

    @property
    def needs_power_off(self) -> bool:
        return False

    def describe(self) -> str:
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "vm": self.vm, "summary": self.describe()}
        if self.needs_power_off:
            out["needs_power_off"] = True
        return out


@dataclass(frozen=True)
class CreateFolder(Change):
    kind: ClassVar[str] = "create-folder"
    path: str = ""

    def describe(self) -> str:
        return f"create folder {self.path}"


@dataclass(frozen=True)
class CloneVm(Change):
    kind: ClassVar[str] = "clone"
    template: str = ""
    host: str = ""
    datastore: str = ""
    folder: str = ""
    resource_pool: str | None = None
    owner: str = ""

    def describe(self) -> str:
        return f"clone {self.template} -> {self.vm} on {self.host} ({self.datastore}, folder {self.folder})"


@dataclass(frozen=True)
class Reconfigure(Change):
    kind: ClassVar[str] = "reconfigure"
    fields: tuple[FieldChange, ...] = ()
    desired: DesiredVm | None = None

    @property
    def needs_power_off(self) -> bool:
        return any(f.needs_power_off for f in self.fields)

    def describe(self) -> str:
        return "reconfigure " + "; ".join(f.describe() for f in self.fields)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["fields"] = [{"field": f.label, "old": f.old, "new": f.new,
                          "needs_power_off": f.needs_power_off} for f in self.fields]
        return out


@dataclass(frozen=True)
class Relocate(Change):
    kind: ClassVar[str] = "relocate"
    old_host: str | None = None
    host: str = ""

    def describe(self) -> str:
        return f"migrate host: {_show(self.old_host)} -> {self.host}"


@dataclass(frozen=True)
class UpgradeHardware(Change):
    kind: ClassVar[str] = "upgrade-hardware"
    old: str | None = None
    new: str = ""

    @property
    def needs_power_off(self) -> bool:
        return True

    def describe(self) -> str:
        return f"upgrade virtual hardware: {_show(self.old)} -> {self.new}"


@dataclass(frozen=True)
class Customize(Change):
    kind: ClassVar[str] = "customize"
    desired: DesiredVm | None = None

    @property
    def needs_power_off(self) -> bool:
        return True

    def describe(self) -> str:
        d = self.desired
        if d is None:
            return "customize guest"
        ips = ", ".join(f"{n.ip} on {n.portgroup}" for n in d.nics)
        return f"customize guest: hostname {d.hostname}, {ips}"


@dataclass(frozen=True)
class PowerOff(Change):
    kind: ClassVar[str] = "power-off"

    def describe(self) -> str:
        return "power off"


@dataclass(frozen=True)
class PowerOn(Change):
    kind: ClassVar[str] = "power-on"

    def describe(self) -> str:
        return "power on"


@dataclass(frozen=True)
class WaitForIp(Change):
    """Not a change to vCenter: wait until the management NIC reports an IPv4 address."""

    kind: ClassVar[str] = "wait-ip"
    portgroup: str = ""

    def describe(self) -> str:
        return f"wait for an IPv4 address on {self.portgroup}"


@dataclass(frozen=True)
class VmPlan:
    """What provision will do to one VM.

    action: create | update | in-sync | blocked; pending: restart-needing fields held
    back (no allow_restart); problems: why a blocked VM is left alone; vnuma: the
    existing VM's vNUMA layout as vCenter reports it, against the one asked for.
    """

    name: str
    action: str
    desired: DesiredVm
    observed: VmState | None = None
    changes: tuple[Change, ...] = ()
    pending: tuple[FieldChange, ...] = ()
    problems: tuple[str, ...] = ()
    vnuma: VnumaCheck | None = None

    @property
    def change_count(self) -> int:
        """Changes made to vCenter (field changes count one each; waiting counts none)."""
        n = 0
        for c in self.changes:
            if isinstance(c, Reconfigure):
                n += len(c.fields)
            elif not isinstance(c, WaitForIp):
                n += 1
        return n

    @property
    def restarts(self) -> bool:
        """True when the VM is running and this plan powers it off."""
        return any(isinstance(c, PowerOff) for c in self.changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "action": self.action, "host": self.desired.host,
            "change_count": self.change_count, "restarts": self.restarts,
            "changes": [c.to_dict() for c in self.changes],
            "pending": [{"field": f.label, "old": f.old, "new": f.new} for f in self.pending],
            "problems": list(self.problems),
            "vnuma": {"status": self.vnuma.status, "text": self.vnuma.text} if self.vnuma else None,
        }


@dataclass(frozen=True)
class Plan:
    """The whole provision: cluster-level changes, then one VmPlan per node."""

    vms: tuple[VmPlan, ...]
    cluster_changes: tuple[Change, ...] = ()
    warnings: tuple[str, ...] = ()
    vnuma_path: str = ""
    api_version: str = ""
    session_api_version: str = ""
    session_api_pinned: bool = False
    vnuma_reason: str = ""

    @property
    def change_count(self) -> int:
        return len(self.cluster_changes) + sum(v.change_count for v in self.vms)

    @property
    def pending_count(self) -> int:
        return sum(len(v.pending) for v in self.vms)

    @property
    def blocked(self) -> list[VmPlan]:
        return [v for v in self.vms if v.action == "blocked"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": self.change_count, "pending": self.pending_count,
            "api_version": self.api_version, "session_api_version": self.session_api_version,
            "session_api_pinned": self.session_api_pinned, "vnuma_path": self.vnuma_path,
            "vnuma_reason": self.vnuma_reason,
            "cluster_changes": [c.to_dict() for c in self.cluster_changes],
            "vms": [v.to_dict() for v in self.vms], "warnings": list(self.warnings),
        }

    def path_lines(self) -> list[str]:
        """The API releases in play and the vNUMA path taken, with why (plan's and provision's head)."""
        how = "pinned" if self.session_api_pinned else "negotiated by pyVmomi"
        out = [f"vCenter API {self.api_version}, session API "
               f"{self.session_api_version or self.api_version} ({how})"]
        if self.vnuma_path == VIRTUAL_NUMA:
            out.append(f"vNUMA path: ConfigSpec.virtualNuma.coresPerNumaNode ({self.vnuma_reason})")
        elif self.vnuma_path:
            out.append(f"vNUMA path: fallback, extraConfig {VNUMA_KEY} ({self.vnuma_reason})")
        return out

    def lines(self) -> list[str]:
        """Human-readable plan, one line per VM plus one per change (the text form of plan)."""
        out = [f"  {c.describe()}" for c in self.cluster_changes]
        for v in self.vms:
            head = f"{v.name} ({v.desired.host}): {v.action}"
            if v.action == "blocked":
                out.append(head + ": " + "; ".join(v.problems))
                continue
            out.append(head)
            for c in v.changes:
                if isinstance(c, Reconfigure):
                    out.extend(f"    ~ {f.describe()}" + (" [restart]" if f.needs_power_off else "")
                               for f in c.fields)
                else:
                    out.append(f"    + {c.describe()}")
            out.extend(f"    ! pending (needs --allow-restart): {f.describe()}" for f in v.pending)
            if v.vnuma is not None and v.vnuma.status:
                out.append(f"    {'! ' if not v.vnuma.ok else ''}{v.vnuma.text}")
        n = self.change_count
        out.append(f"{n} change{'s' if n != 1 else ''}"
                   + (f", {self.pending_count} pending restart" if self.pending_count else "")
                   + (f", {len(self.blocked)} VM(s) blocked" if self.blocked else ""))
        return out


# ------------------------------------------------------------------- diffing


def field_changes(desired: DesiredVm, observed: VmState | None, created: bool) -> list[FieldChange]:
    """Settings that differ. created=True compares against the template (or nothing) and
    includes write-only keys; every desired setting not already equal is listed."""
    out: list[FieldChange] = []
    for s in vm_settings.rows():
        want = getattr(desired, s.name)
        if want is None:
            continue  # not managed on this path / with these settings
        if s.name == "cores_per_numa_node" and not created and observed is not None \
                and not observed.numa_info_reported:
            continue  # vCenter reports no numaInfo to compare with: vnuma.check says "unverified"
        have = getattr(observed, s.name, None) if observed is not None else None
        if have is None:
            have = s.unset
        if have != want:
            out.append(FieldChange(s.name, s.spec, have, want, s.power_off))
    have_keys = observed.extra_config if observed is not None else {}
    for key, want in desired.extra_config.items():
        if not created and key.startswith(WRITE_ONLY_PREFIXES):
            continue
        have = have_keys.get(key)
        if have != want:
            out.append(FieldChange(f"extra_config:{key}", f"extraConfig[{key}]", have, want,
                                   key.startswith(RESTART_KEY_PREFIXES)))
    stray = have_keys.get(VNUMA_KEY)
    if desired.cores_per_numa_node and stray and VNUMA_KEY not in desired.extra_config:
        # A node size left by an earlier fallback provision (vCenter upgraded since) would
        # compete with virtualNuma; an empty value deletes an extraConfig key.
        out.append(FieldChange(f"extra_config:{VNUMA_KEY}", f"extraConfig[{VNUMA_KEY}]", stray, "", True))
    want_nics = tuple(n.portgroup for n in desired.nics)
    have_nics = observed.nics if observed is not None else ()
    if have_nics != want_nics:
        out.append(FieldChange("nics", "network adapters", have_nics, want_nics, False))
    return out


def plan_vm(desired: DesiredVm, observed: VmState | None, allow_restart: bool,
            template: VmState | None = None, problems: tuple[str, ...] = ()) -> VmPlan:
    """The changes converging one VM; `template` (observed) only improves the create diff."""
    if problems:
        return VmPlan(desired.name, "blocked", desired, observed, problems=tuple(problems))
    if observed is None:
        return _plan_create(desired, template)
    if observed.template:
        return VmPlan(desired.name, "blocked", desired, observed,
                      problems=(f"{desired.name} is a VM template, not a VM",))
    if observed.owner != desired.owner:
        why = ("carries no vcfslm ownership marker" if observed.owner is None
               else f"is owned by inventory '{observed.owner}'")
        return VmPlan(desired.name, "blocked", desired, observed,
                      problems=(f"a VM named {desired.name} already exists and {why}; "
                                "refusing to touch it (rename the node or remove that VM)",))
    return replace(_plan_update(desired, observed, allow_restart), vnuma=check_vnuma(desired, observed))


def _older_hardware(observed: VmState | None, desired: DesiredVm) -> bool:
    return (observed is not None and observed.hardware_version is not None
            and hardware_number(observed.hardware_version) < hardware_number(desired.hardware_version))


def _plan_create(desired: DesiredVm, template: VmState | None) -> VmPlan:
    fields = field_changes(desired, template, created=True)
    changes: list[Change] = [
        CloneVm(desired.name, template=desired.template, host=desired.host,
                datastore=desired.datastore, folder=desired.folder,
                resource_pool=desired.resource_pool, owner=desired.owner)]
    if _older_hardware(template, desired):
        # The clone has the template's hardware; virtualNuma needs vmx-20+ before it is sent.
        changes.append(UpgradeHardware(desired.name, old=template.hardware_version,
                                       new=desired.hardware_version))
    changes += [
        Reconfigure(desired.name, fields=tuple(fields), desired=desired),
        Customize(desired.name, desired=desired),
        PowerOn(desired.name),
        WaitForIp(desired.name, portgroup=desired.nics[0].portgroup),
    ]
    return VmPlan(desired.name, "create", desired, None, tuple(changes))


def _plan_update(desired: DesiredVm, observed: VmState, allow_restart: bool) -> VmPlan:
    running = observed.power_state == "poweredOn"
    fields = field_changes(desired, observed, created=False)
    customize = observed.extra_config.get(CUSTOMIZATION_KEY) != desired.customization_fingerprint
    upgrade = _older_hardware(observed, desired)
    restart_fields = [f for f in fields if f.needs_power_off]
    live_fields = [f for f in fields if not f.needs_power_off]
    needs_off = bool(restart_fields) or customize or upgrade
    pending: list[FieldChange] = []
    if running and needs_off and not allow_restart:
        # Apply what a running VM accepts; hold the rest back.
        pending = list(restart_fields)
        if upgrade:
            pending.append(FieldChange("hardware_version", "virtual hardware", observed.hardware_version,
                                       desired.hardware_version, True))
        if customize:
            pending.append(FieldChange("customization", "guest customization",
                                       observed.extra_config.get(CUSTOMIZATION_KEY),
                                       desired.customization_fingerprint, True))
        fields, restart_fields, customize, upgrade = live_fields, [], False, False
        needs_off = False

    changes: list[Change] = []
    if observed.host != desired.host:
        changes.append(Relocate(desired.name, old_host=observed.host, host=desired.host))
    power_cycle = running and needs_off
    if power_cycle:
        changes.append(PowerOff(desired.name))
    if upgrade:
        changes.append(UpgradeHardware(desired.name, old=observed.hardware_version,
                                       new=desired.hardware_version))
    if fields:
        changes.append(Reconfigure(desired.name, fields=tuple(fields), desired=desired))
    if customize:
        changes.append(Customize(desired.name, desired=desired))
    if power_cycle or not running:
        changes.append(PowerOn(desired.name))
        changes.append(WaitForIp(desired.name, portgroup=desired.nics[0].portgroup))
    elif not observed.ip_addresses:
        changes.append(WaitForIp(desired.name, portgroup=desired.nics[0].portgroup))
    counted = [c for c in changes if not isinstance(c, WaitForIp)]
    action = "update" if counted else "in-sync"
    return VmPlan(desired.name, action, desired, observed, tuple(changes), tuple(pending))


def plan(desired: list[DesiredVm], snapshot: Snapshot, allow_restart: bool = False,
         node_problems: dict[str, list[str]] | None = None, warnings: tuple[str, ...] = (),
         vnuma_path: str = "", vnuma_reason: str = "") -> Plan:
    """The whole plan: the folder if missing, then each VM's plan in node order."""
    node_problems = node_problems or {}
    cluster: list[Change] = []
    folders = {d.folder for d in desired}
    for path in sorted(folders):
        if path and path not in snapshot.folders:
            cluster.append(CreateFolder("", path=path))
    vms = []
    for d in desired:
        template = snapshot.vms.get(d.template)
        vms.append(plan_vm(d, snapshot.vms.get(d.name), allow_restart, template,
                           tuple(node_problems.get(d.name, ()))))
    return Plan(tuple(vms), tuple(cluster), tuple(warnings), vnuma_path, snapshot.api_version,
                snapshot.session_api_version or snapshot.api_version, snapshot.session_api_pinned,
                vnuma_reason)


@dataclass(frozen=True)
class DestroyPlan:
    """VMs destroy removes (owned), refuses (same name, not owned) and finds absent."""

    destroy: tuple[VmState, ...] = ()
    refused: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    owner: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"destroy": [v.name for v in self.destroy], "refused": list(self.refused),
                "absent": list(self.absent)}


def plan_destroy(owner: str, names: list[str], snapshot: Snapshot) -> DestroyPlan:
    """Destroy only the inventory's VMs that carry its ownership marker; refuse the others."""
    destroy, refused, absent = [], [], []
    for name in names:
        vm = snapshot.vms.get(name)
        if vm is None:
            absent.append(name)
        elif vm.template:
            refused.append(f"{name} is a VM template; not destroying it")
        elif vm.extra_config.get(OWNER_KEY) != owner:
            who = vm.extra_config.get(OWNER_KEY)
            refused.append(f"{name} exists but is not owned by '{owner}' "
                           + ("(no vcfslm.owner marker)" if who is None else f"(owner: '{who}')")
                           + "; refusing to destroy it")
        elif name in snapshot.duplicate_vms:
            refused.append(f"more than one VM is named {name}; refusing to guess which to destroy")
        else:
            destroy.append(vm)
    return DestroyPlan(tuple(destroy), tuple(refused), tuple(absent), owner)
