"""Disjoint CPUs for the lab's loopback guests (`lab up --cores-per-node K`).

Guest i gets CPUs [i*K, (i+1)*K) of the CPUs this process may use, so a 2-node run
measures two nodes rather than two guests taking turns on the same cores. Its sshd, and so
every process one of its sessions starts (torchrun, the ranks, a vLLM server), is held to
them by one of two mechanisms:

- cpuset: a cgroup v1 cpuset of its own, `<cpuset>/vcfslm-lab-<id>/<node>`, where the
  cpuset controller is mounted and writable. The kernel holds every descendant to it,
  whatever affinity a process asks for later (numactl --cpunodebind is intersected with it).
- affinity: the sshd's CPU affinity (sched_setaffinity), where the cpuset controller is
  missing or not writable (cgroup v2 without a delegated cpuset, no root). Children inherit
  it, but a process may widen its own again: it confines what is launched as it is.

The decisions (which CPUs, which mechanism, where the cgroup goes) are pure functions;
`observe`, `confine` and `release` are the thin driver around them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError, VcfslmError
from ..topology import format_cpu_list, parse_cpu_list
from . import process

CPUSET = "cpuset"
AFFINITY = "affinity"
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_PREFIX = "vcfslm-lab-"
RELEASE_WAIT_S = 5.0   # rmdir fails with EBUSY until the cgroup's last task has exited


class ConfineFailed(VcfslmError):
    """A guest's sshd could not be held to its CPUs."""


# ------------------------------------------------------------------ decisions (pure)


def allocate(nodes: int, cores_per_node: int, usable: Sequence[int]) -> list[tuple[int, ...]]:
    """Node i's CPUs: [i*K, (i+1)*K) of the usable CPUs, sorted; UsageError when they run out."""
    if cores_per_node < 1:
        raise UsageError(f"--cores-per-node must be at least 1; got {cores_per_node}")
    cpus = sorted(set(usable))
    needed = nodes * cores_per_node
    if needed > len(cpus):
        raise UsageError(f"--cores-per-node {cores_per_node} for {nodes} node(s) needs {needed} CPUs; "
                         f"this process may use {len(cpus)} ({format_cpu_list(cpus) or 'none'})")
    return [tuple(cpus[i * cores_per_node:(i + 1) * cores_per_node]) for i in range(nodes)]


@dataclass(frozen=True)
class CpusetView:
    """What the machine offers for cpusets: the v1 controller's mount, whether it is there
    and writable by us, and this process's own cpuset in it (its lab parent goes below)."""

    root: Path
    mounted: bool
    writable: bool
    own: str = "/"

    @property
    def base(self) -> Path:
        return self.root / self.own.lstrip("/")


def choose_mechanism(view: CpusetView) -> tuple[str, str]:
    """(mechanism, why): the cpuset where its controller is mounted and writable, else affinity."""
    if not view.mounted:
        return AFFINITY, f"no cgroup v1 cpuset controller at {view.root}"
    if not view.writable:
        return AFFINITY, f"{view.base} is not writable by this user"
    return CPUSET, f"cgroup v1 cpuset under {view.base}"


def lab_cgroup_name(lab_dir: Path) -> str:
    """The lab's parent cpuset: one per lab folder, so two labs on one machine never share one."""
    return CGROUP_PREFIX + hashlib.sha256(str(lab_dir).encode()).hexdigest()[:12]


def parse_own_cpuset(text: str) -> str:
    """This process's cpuset path from /proc/self/cgroup text ("/" when none is listed)."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and CPUSET in parts[1].split(","):
            return parts[2].strip() or "/"
    return "/"


@dataclass(frozen=True)
class GuestCores:
    """A guest's own CPUs and how it is held to them (cgroup: its cpuset's folder, cpuset only)."""

    cpus: tuple[int, ...]
    mechanism: str
    cgroup: str | None = None

    def describe(self) -> str:
        """'CPU 1 (cpuset)', 'CPUs 2-3 (affinity)'."""
        noun = "CPU" if len(self.cpus) == 1 else "CPUs"
        return f"{noun} {format_cpu_list(self.cpus)} ({self.mechanism})"

    def to_json(self) -> dict:
        return {"cpus": format_cpu_list(self.cpus), "mechanism": self.mechanism, "cgroup": self.cgroup}

    @classmethod
    def from_json(cls, data: Mapping) -> GuestCores:
        return cls(tuple(parse_cpu_list(str(data["cpus"]))), str(data["mechanism"]), data.get("cgroup"))


def plan_guest(lab_dir: Path, node: str, cpus: Sequence[int], view: CpusetView) -> GuestCores:
    """How guest `node` is held to `cpus`: its own cpuset under the lab's parent, or affinity."""
    mechanism, _ = choose_mechanism(view)
    cgroup = str(view.base / lab_cgroup_name(lab_dir) / node) if mechanism == CPUSET else None
    return GuestCores(tuple(cpus), mechanism, cgroup)


def plan_guests(lab_dir: Path, names: Sequence[str], cores_per_node: int | None, usable: Sequence[int],
                view: CpusetView) -> dict[str, GuestCores | None]:
    """Each named guest's cores ({name: None} without --cores-per-node); UsageError when the
    usable CPUs do not go round."""
    if cores_per_node is None:
        return dict.fromkeys(names)
    cpus = allocate(len(names), cores_per_node, usable)
    return {name: plan_guest(lab_dir, name, own, view) for name, own in zip(names, cpus, strict=True)}


# ------------------------------------------------------------------ the driver


def usable_cpus() -> list[int]:
    """The CPUs this process may use, sorted."""
    return sorted(os.sched_getaffinity(0))


def observe(root: Path = CPUSET_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> CpusetView:
    """The cpuset controller as this process finds it."""
    mounted = (root / "cpuset.cpus").is_file() and (root / "tasks").is_file()
    try:
        own = parse_own_cpuset(proc_cgroup.read_text())
    except OSError:
        own = "/"
    base = root / own.lstrip("/")
    return CpusetView(root, mounted, mounted and os.access(base, os.W_OK), own)


def confine(pid: int, cores: GuestCores, proc: Path = process.PROC) -> None:
    """Hold `pid` (an sshd just started) and any child it has already to `cores`."""
    pids = [pid, *process.descendants(pid, proc)]
    try:
        if cores.mechanism == CPUSET:
            tasks = _ensure_cpuset(Path(str(cores.cgroup)), cores.cpus) / "tasks"
            for one in pids:
                _write(tasks, str(one))
        else:
            for one in pids:
                os.sched_setaffinity(one, cores.cpus)
    except ProcessLookupError:
        pass   # the sshd died on its own; the banner wait reports why
    except OSError as exc:
        raise ConfineFailed(f"cannot hold pid {pid} to {cores.describe()}: {exc}") from None


def _ensure_cpuset(cgroup: Path, cpus: Sequence[int]) -> Path:
    """The guest's cpuset with its CPUs, below the lab's parent (made from the parent's parent:
    a v1 cpuset starts with no CPUs or memory nodes and takes no task until it has both)."""
    parent = cgroup.parent
    if not parent.is_dir():
        parent.mkdir()
        _write(parent / "cpuset.cpus", (parent.parent / "cpuset.cpus").read_text().strip())
        _write(parent / "cpuset.mems", (parent.parent / "cpuset.mems").read_text().strip())
    cgroup.mkdir(exist_ok=True)
    _write(cgroup / "cpuset.cpus", format_cpu_list(cpus))
    _write(cgroup / "cpuset.mems", (parent / "cpuset.mems").read_text().strip())
    return cgroup


def _write(path: Path, value: str) -> None:
    # One write() per value: a cgroup file takes each write as one command.
    with open(path, "w") as handle:
        handle.write(value)


def release(cores: GuestCores | None, wait_s: float = RELEASE_WAIT_S) -> None:
    """Remove a stopped guest's cpuset, and the lab's parent once it is empty. A cgroup already
    gone is not an error; affinity needs nothing undone (it went with the process)."""
    if cores is None or cores.mechanism != CPUSET or not cores.cgroup:
        return
    cgroup = Path(cores.cgroup)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            cgroup.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError as exc:
            # EBUSY: a task that was killed has not left yet.
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise ConfineFailed(f"cannot remove the cpuset {cgroup}: {exc}") from None
            time.sleep(0.05)
    try:
        cgroup.parent.rmdir()
    except OSError:
        pass   # another guest's cpuset is still there, or it is gone already
