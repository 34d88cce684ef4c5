"""Facts: parsers on recorded outputs, and each fact's command run for real on this machine
(through a local shell, the same way a guest's shell would run it)."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
import time

import pytest

from vcfslm.guest import facts as F
from vcfslm.guest import host_facts as H
from vcfslm.guest.transport import Result


def local(fact: F.Fact):
    """Run a fact's command in a local shell and parse it."""
    started = time.monotonic()
    proc = subprocess.run(["sh", "-c", fact.command], input=(fact.input or "").encode(),
                          capture_output=True, timeout=60)
    return fact.parse(Result(fact.command, proc.returncode, proc.stdout.decode(),
                             proc.stderr.decode(), time.monotonic() - started))


def numactl_text(nodes: int, per_node: int, sizes: list[int] | None = None) -> str:
    sizes = sizes or [96000] * nodes
    lines = [f"available: {nodes} nodes (0-{nodes - 1})"]
    for n in range(nodes):
        cpus = " ".join(str(c) for c in range(n * per_node, (n + 1) * per_node))
        lines += [f"node {n} cpus: {cpus}", f"node {n} size: {sizes[n]} MB", f"node {n} free: 1000 MB"]
    lines += ["node distances:", "node   " + "   ".join(str(n) for n in range(nodes))]
    return "\n".join(lines) + "\n"


def test_numactl_four_vnuma_nodes():
    hw = H.parse_numactl_hardware(numactl_text(4, 24))
    assert [n.id for n in hw.nodes] == [0, 1, 2, 3]
    assert hw.nodes[1].cpus == tuple(range(24, 48))
    assert hw.nodes[3].size_mb == 96000 and hw.nodes[3].free_mb == 1000
    assert hw.cpus == tuple(range(96))


def test_numactl_memoryless_and_cpuless_nodes():
    text = ("available: 2 nodes (0-1)\nnode 0 cpus: 0 1\nnode 0 size: 4000 MB\nnode 0 free: 10 MB\n"
            "node 1 cpus:\nnode 1 size: 0 MB\nnode 1 free: 0 MB\n")
    hw = H.parse_numactl_hardware(text)
    assert hw.nodes[1].cpus == () and hw.nodes[1].size_mb == 0


def test_numactl_missing_is_reported_not_raised():
    hw = H.NUMA_HARDWARE.parse(Result("numactl --hardware", 127, "", "sh: numactl: not found", 0))
    assert not hw.available and "not installed" in hw.error


def test_lscpu_flat_and_nested():
    flat = {"lscpu": [{"field": "CPU(s):", "data": "2"}, {"field": "On-line CPU(s) list:", "data": "0,1"},
                      {"field": "Socket(s):", "data": "1"}, {"field": "NUMA node0 CPU(s):", "data": "0,1"}]}
    info = H.parse_lscpu_json(json.dumps(flat))
    assert info.cpus == 2 and info.online == (0, 1) and info.numa_nodes == {0: (0, 1)}
    nested = {"lscpu": [
        {"field": "CPU(s):", "data": "96", "children": [{"field": "On-line CPU(s) list:", "data": "0-95"}]},
        {"field": "Vendor ID:", "data": "GenuineIntel", "children": [
            {"field": "Model name:", "data": "Intel(R) Xeon(R) 6747P", "children": [
                {"field": "Thread(s) per core:", "data": "1"}, {"field": "Core(s) per socket:", "data": "48"},
                {"field": "Socket(s):", "data": "2"}]}]},
        {"field": "NUMA:", "data": None, "children": [
            {"field": "NUMA node(s):", "data": "4"},
            *[{"field": f"NUMA node{k} CPU(s):", "data": f"{24 * k}-{24 * k + 23}"} for k in range(4)]]}]}
    info = H.parse_lscpu_json(json.dumps(nested))
    assert (info.cpus, info.sockets, info.cores_per_socket, info.threads_per_core) == (96, 2, 48, 1)
    assert info.numa_nodes[2] == tuple(range(48, 72)) and info.model.startswith("Intel")


IP_JSON = json.dumps([
    {"ifname": "lo", "mtu": 65536, "flags": ["LOOPBACK", "UP"],
     "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8},
                   {"family": "inet6", "local": "::1", "prefixlen": 128}]},
    {"ifname": "ens192", "mtu": 1500, "flags": ["UP"], "addr_info": [{"local": "192.168.10.21", "prefixlen": 24}]},
    {"ifname": "ens224", "mtu": 9000, "flags": ["UP"], "addr_info": [{"local": "172.16.25.21", "prefixlen": 24}]},
    {"ifname": "ens256", "mtu": 1500, "flags": [], "addr_info": [{"local": "172.16.0.9", "prefixlen": 16}]},
])


@pytest.mark.parametrize("ip,name", [
    ("172.16.25.21", "ens224"),   # exact address
    ("172.16.25.99", "ens224"),   # the most specific prefix wins over ens256's /16
    ("172.16.1.1", "ens256"),
    ("127.0.1.12", "lo"),         # the lab: loopback addresses live inside lo's 127.0.0.1/8
    ("10.0.0.1", None),
])
def test_interface_of(ip, name):
    ifaces = H.parse_ip_addr_json(IP_JSON)
    found = H.interface_of(ip, ifaces)
    assert (found.name if found else None) == name


def test_ip_addr_parse_fields():
    lo, _, ens224, ens256 = H.parse_ip_addr_json(IP_JSON)
    assert lo.mtu == 65536 and ipaddress.ip_interface("::1/128") in lo.addresses
    assert ens224.up and not ens256.up


def test_probe_parse():
    got = H.parse_probe("127.0.1.12:22 ok\n127.0.1.13:22 refused\n10.9.9.9:22 fail timed_out\n")
    assert got["127.0.1.12:22"].ok and got["127.0.1.13:22"].ok  # refused: the address answered
    assert not got["10.9.9.9:22"].ok and got["10.9.9.9:22"].detail == "timed out"


# ---------------------------------------------------------------- the commands, run for real


def test_this_machine_numa_lscpu_ip():
    hw = local(H.NUMA_HARDWARE)
    assert hw.available and hw.nodes and sum(len(n.cpus) for n in hw.nodes) >= 1
    cpu = local(H.LSCPU)
    assert cpu is not None and cpu.cpus == len(hw.cpus)
    ifaces = local(H.INTERFACES)
    assert H.interface_of("127.0.0.1", ifaces).name == "lo"


def test_reach_probe_for_real():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        closed = _closed_port()
        targets = [f"127.0.0.1:{port}", f"127.0.0.1:{closed}"]
        got = local(H.reach_probe(targets, timeout=2))
        by_python = subprocess.run([sys.executable, "-c", H.probe_python(2), *targets],
                                   capture_output=True, text=True).stdout
    assert got[targets[0]] == H.Reach(True, "ok")
    assert got[targets[1]] == H.Reach(True, "refused")
    assert H.parse_probe(by_python) == got


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_file_state_content_exists(tmp_path):
    f = tmp_path / "a b.txt"
    f.write_text("hello\n")
    f.chmod(0o640)
    st = local(F.file_state(str(f)))
    assert st.kind == "file" and st.mode == "0640"
    assert st.sha256 == "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
    assert local(F.file_state(str(tmp_path))).kind == "directory"
    assert not local(F.file_state(str(tmp_path / "nope"))).exists
    assert local(F.file_content(str(f))) == "hello\n"
    assert local(F.file_content(str(tmp_path / "nope"))) is None
    assert local(F.path_exists(str(f))) and not local(F.path_exists(str(tmp_path / "nope")))
    assert local(F.command_succeeds("test -d /")) and not local(F.command_succeeds("false"))
    (tmp_path / "w.whl").write_bytes(b"12345")
    assert local(F.dir_listing(str(tmp_path)))["w.whl"] == 5
    assert local(F.dir_listing(str(tmp_path / "nope"))) == {}


def test_packages_on_this_machine():
    state = local(F.packages(["numactl", "surely-not-installed-pkg"], ["numactl"]))
    assert state.manager == "apt"
    assert "numactl" in state.installed and "surely-not-installed-pkg" not in state.installed


def test_pip_state_and_versions_in_a_real_venv(tmp_path):
    # The running interpreter's environment stands in for a guest venv.
    venv = fake_venv(tmp_path / "venv")
    ok = local(F.pip_state(str(venv), ["pydantic>=2", "click"]))
    assert ok.satisfied, ok.missing
    bad = local(F.pip_state(str(venv), ["pydantic<2", "surely-not-a-dist", "vcfslm[nosuchextra]"]))
    assert bad.venv_exists and len(bad.missing) == 2
    assert any("have" in m for m in bad.missing) and any("not installed" in m for m in bad.missing)
    assert not local(F.pip_state(str(tmp_path / "none"), ["click"])).venv_exists
    v = local(F.versions(str(venv)))
    assert v.venv_exists and v.vcfslm and v.python.startswith("3.")
    assert not local(F.versions(str(tmp_path / "none"))).venv_exists


def test_pip_state_follows_extras_dependencies(tmp_path):
    venv = fake_venv(tmp_path / "venv")
    # vcfslm[dev] needs pytest, hypothesis, ... which this environment has.
    assert local(F.pip_state(str(venv), ["vcfslm[dev]"])).satisfied


def test_venv_state(tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert not local(F.venv_state(str(venv))).exists  # no pyvenv.cfg: not a venv
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = true\nversion = 3.11.2\n")
    st = local(F.venv_state(str(venv)))
    assert st.exists and st.system_site_packages and st.python_version == "3.11.2"


def fake_venv(path):
    """A folder whose bin/python runs the test interpreter's environment."""
    (path / "bin").mkdir(parents=True)
    py = path / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return path


def test_absent_values_describe_a_fresh_guest():
    assert not H.NUMA_HARDWARE.absent.available
    assert F.file_state("/x").absent == F.FileState(None)
    assert not F.pip_state("/v", ["torch"]).absent.satisfied
    assert F.packages(["numactl"], []).absent.installed == frozenset()


# ---------------------------------------------------------------- the CPUs a guest may use


def test_a_confined_guest_sees_only_its_allowed_cpus():
    # numactl --hardware in a cpuset of CPU 1 still lists node 0 as 0 1 (seen on a 2-CPU machine).
    allowed = H.parse_allowed("Cpus_allowed_list:\t1\nMems_allowed_list:\t0\n")
    assert allowed == H.Allowed(cpus=(1,), mems=(0,))
    two = H.parse_numactl_hardware(numactl_text(2, 2))
    narrowed = H.numa_within(H.parse_numactl_hardware(numactl_text(1, 2)), allowed)
    assert [(n.id, n.cpus) for n in narrowed.nodes] == [(0, (1,))]
    # a node none of whose CPUs or memory the guest may use is not the guest's
    assert [(n.id, n.cpus) for n in H.numa_within(two, allowed).nodes] == [(0, (1,))]
    cpu = H.CpuInfo(cpus=2, online=(0, 1), sockets=1, cores_per_socket=2, threads_per_core=1,
                    numa_nodes={0: (0, 1)})
    assert H.cpu_within(cpu, allowed) == H.CpuInfo(cpus=1, online=(1,), sockets=1, cores_per_socket=2,
                                                   threads_per_core=1, numa_nodes={0: (1,)})


def test_a_guest_allowed_every_cpu_sees_the_facts_unchanged():
    hw = H.parse_numactl_hardware(numactl_text(4, 24))
    every = H.parse_allowed("Cpus_allowed_list:\t0-95\nMems_allowed_list:\t0-3\n")
    assert H.numa_within(hw, every) == hw
    memory_only = H.parse_numactl_hardware("node 0 cpus: 0 1\nnode 0 size: 10 MB\nnode 1 cpus:\nnode 1 size: 5 MB\n")
    assert H.numa_within(memory_only, H.parse_allowed("Cpus_allowed_list:\t0-1\n")) == memory_only
    assert H.numa_within(hw, None) == hw and H.parse_allowed("") is None
    assert H.ALLOWED.parse(Result(H.ALLOWED.command, 2, "", "no /proc", 0)) is None


def test_gathered_facts_are_narrowed_to_the_allowed_cpus():
    answers = {H.NUMA_HARDWARE.key: H.parse_numactl_hardware(numactl_text(1, 2)),
               H.LSCPU.key: H.CpuInfo(cpus=2, online=(0, 1), sockets=1, cores_per_socket=2,
                                      threads_per_core=1),
               H.ALLOWED.key: H.Allowed(cpus=(1,))}
    facts = H.gather_guest_facts(lambda fact: answers[fact.key], None, "slm-02", network=False,
                                 reachability=False, server=False)
    assert facts.numa.cpus == (1,) and facts.cpu.cpus == 1 and facts.cpu.online == (1,)
