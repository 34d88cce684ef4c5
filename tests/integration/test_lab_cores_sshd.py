"""`lab up --cores-per-node 1` with the real lab: each guest's sessions run on its own CPU,
and `lab down` removes the cpusets it made."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vcfslm.lab import cores, guests
from vcfslm.lab import lab as lab_mod

pytestmark = pytest.mark.integration


def _allowed_cpus(guest: guests.Guest) -> str:
    """Cpus_allowed_list of a process a session of `guest` starts, over the lab's own ssh files."""
    done = subprocess.run(
        ["ssh", "-i", guest.key, "-o", f"UserKnownHostsFile={guest.known_hosts}",
         "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-p", str(guest.port),
         f"{guest.user}@{guest.address}", "grep Cpus_allowed_list /proc/self/status"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout.split(":", 1)[1].strip()


def test_each_guest_runs_on_its_own_cpu_and_down_removes_the_cpusets(tmp_path, vcsim_binary):
    usable = cores.usable_cpus()
    if len(usable) < 2:
        pytest.skip(f"two lab nodes of one CPU each need 2 usable CPUs; this machine has {len(usable)}")
    try:
        guests.tools()
    except guests.GuestsUnavailable as exc:
        pytest.skip(str(exc))
    directory = tmp_path / "lab"
    cgroups: list[Path] = []
    try:
        first = lab_mod.up(directory, nodes=2, cores_per_node=1)
        state = first.state
        assert state.cores_per_node == 1
        assert [g.cores.cpus for g in state.guests] == [(usable[0],), (usable[1],)]
        assert [_allowed_cpus(g) for g in state.guests] == [str(usable[0]), str(usable[1])]
        cgroups = [Path(g.cores.cgroup) for g in state.guests if g.cores.mechanism == cores.CPUSET]
        # The cpuset wherever its controller is mounted and writable (here, as root on cgroup v1).
        assert len(cgroups) == (2 if cores.choose_mechanism(cores.observe())[0] == cores.CPUSET else 0)
        for g, cgroup in zip(state.guests, cgroups, strict=False):
            assert str(g.pid) in (cgroup / "tasks").read_text().split()
        # The same option again: the running guests stay.
        again = lab_mod.up(directory, nodes=2, cores_per_node=1)
        assert {"slm-01", "slm-02"} <= set(again.reused) and not again.stopped
        assert [row.cpus for row in lab_mod.status(directory) if row.kind == "sshd"] == \
            [g.cores.describe() for g in state.guests]
    finally:
        stopped = lab_mod.down(directory)
    assert {"slm-01", "slm-02", "vcsim"} <= set(stopped)
    for cgroup in cgroups:
        assert not cgroup.exists()
    if cgroups:
        assert not cgroups[0].parent.exists()
    assert not os.path.exists(directory / "state.json")
