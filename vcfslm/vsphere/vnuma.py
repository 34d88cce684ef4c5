"""Did the VM get the vNUMA layout asked for? (pure: a DesiredVm against a VmState).

What vCenter can confirm: `config.numaInfo.coresPerNumaNode` (vSphere 8.0.0.1+,
read only when the session speaks that release) and the advanced settings ESXi
sizes vNUMA from. A request dropped on the way (pyVmomi serializes nothing newer
than the session's release) or undone at power-on (`numa.autosize`) shows there
as a layout different from the one asked for: a mismatch. When vCenter reports
nothing that confirms the layout (no numaInfo: older API, or vcsim), the result
is "unverified" and the in-guest check settles it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .desired import VNUMA_KEY, DesiredVm
from .state import VmState

GUEST_CHECK = "vcfslm verify"  # numactl --hardware inside each guest
CONFIRMED = "confirmed"
UNVERIFIED = "unverified"
MISMATCH = "mismatch"


@dataclass(frozen=True)
class VnumaCheck:
    """status: confirmed | unverified | mismatch ("" = nothing to check); text says what was seen."""

    status: str
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status != MISMATCH


def is_vnuma_field(name: str) -> bool:
    """True for a FieldChange.field that changes the vNUMA layout check's inputs."""
    return name in ("cores_per_numa_node", f"extra_config:{VNUMA_KEY}") \
        or name.startswith("extra_config:numa.autosize")


def expected_node_size(desired: DesiredVm) -> int | None:
    """Cores per vNUMA node asked for, on either path (None: the VM does not set one)."""
    if desired.cores_per_numa_node:
        return desired.cores_per_numa_node
    value = desired.extra_config.get(VNUMA_KEY, "")
    return int(value) if value.isdigit() else None


def check_vnuma(desired: DesiredVm, seen: VmState | None) -> VnumaCheck:
    """The vNUMA layout `seen` reports against the one `desired` asks for."""
    want = expected_node_size(desired)
    if want is None:
        return VnumaCheck("")
    if seen is None:
        return VnumaCheck(UNVERIFIED, f"vNUMA unverified: the VM could not be read back; "
                                      f"`{GUEST_CHECK}` settles it")
    asked = f"asked {want} cores per vNUMA node"
    problems = []
    if seen.numa_info_reported and seen.cores_per_numa_node != want:
        got = (f"{seen.cores_per_numa_node}" if seen.cores_per_numa_node else "none")
        auto = " (autoCoresPerNumaNode)" if seen.auto_cores_per_numa_node else ""
        problems.append(f"config.numaInfo.coresPerNumaNode={got}{auto}")
    keys = seen.extra_config
    stored = keys.get(VNUMA_KEY) or None  # an empty value is a deleted key
    if stored is not None and stored != str(want):
        problems.append(f"{VNUMA_KEY}={stored}")
    elif stored is None and VNUMA_KEY in desired.extra_config:
        problems.append(f"{VNUMA_KEY} missing")
    if keys.get("numa.autosize", "").upper() == "TRUE":
        problems.append("numa.autosize=TRUE (ESXi resizes vNUMA at power-on)")
    once = keys.get("numa.autosize.once")
    if desired.extra_config.get("numa.autosize.once") == "FALSE" and (once or "").upper() != "FALSE":
        problems.append(f"numa.autosize.once={once or 'missing'} (ESXi may keep the first layout it saw)")
    if problems:
        return VnumaCheck(MISMATCH, f"vNUMA layout differs: {asked}, the VM reports " + ", ".join(problems))
    if seen.numa_info_reported:
        return VnumaCheck(CONFIRMED, f"vNUMA confirmed: config.numaInfo.coresPerNumaNode={want}")
    where = (f"{VNUMA_KEY}={stored} stored, but vCenter reports no layout (no config.numaInfo)"
             if stored is not None else "vCenter reports no config.numaInfo")
    return VnumaCheck(UNVERIFIED, f"vNUMA unverified: {where}; `{GUEST_CHECK}` settles it")
