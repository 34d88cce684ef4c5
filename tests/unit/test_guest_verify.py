"""In-guest verification: facts vs inventory -> expected-vs-seen problems (pure tables),
and the verify step over a scripted transport."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vcfslm.errors import PlaybookError
from vcfslm.guest import host_facts as H
from vcfslm.guest.context import HostContext
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.playbook import host_variables
from vcfslm.guest.steps import VerifyStep
from vcfslm.guest.verify import (
    describe_numa,
    memory_problems,
    network_problems,
    numa_problems,
    verify_guest,
)
from vcfslm.inventory_load import load_inventory

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"


def numa(*nodes: tuple[str, int]) -> H.NumaHardware:
    """numa(("0-23", 96000), ...) -> NumaHardware."""
    from vcfslm.topology import parse_cpu_list

    return H.NumaHardware(tuple(H.NumaNode(i, parse_cpu_list(c), mb) for i, (c, mb) in enumerate(nodes)))


GOOD = numa(("0-23", 96000), ("24-47", 96000), ("48-71", 96000), ("72-95", 96000))


@pytest.mark.parametrize("seen,vcpus,nodes,expected", [
    (GOOD, 96, 4, []),
    (numa(("0-1", 10458)), 2, 1, []),
    (numa(("0-1", 10458)), 96, 4,
     ["expected 4 vNUMA nodes of 24 CPUs, seen 1 node of 2 CPUs"]),
    (numa(("0-47", 1), ("48-95", 1)), 96, 4,
     ["expected 4 vNUMA nodes of 24 CPUs, seen 2 nodes of 48 CPUs"]),
    (numa(("0-23", 1), ("24-47", 1), ("48-71", 1), ("72-94", 1)), 96, 4,
     ["expected 4 vNUMA nodes of 24 CPUs, seen 4 nodes of 24, 24, 24, 23 CPUs"]),
    (numa(("0-11,48-59", 96000), ("12-23,60-71", 96000), ("24-35,72-83", 96000), ("36-47,84-95", 96000)),
     96, 4, ["CPUs are not numbered contiguously per vNUMA node as rank placement assumes: "
             "node 0 has 0-11,48-59 (expected 0-23); node 1 has 12-23,60-71 (expected 24-47)"]),
    (numa(("0-23", 96000), ("24-47", 96000), ("48-71", 96000), ("72-95", 60000)), 96, 4,
     ["memory per vNUMA node is uneven: node 0 96000 MB, node 1 96000 MB, node 2 96000 MB, "
      "node 3 60000 MB"]),
])
def test_numa_problems(seen, vcpus, nodes, expected):
    got = numa_problems(seen, vcpus, nodes)
    assert len(got) == len(expected), got
    for message, start in zip(got, expected, strict=True):
        assert message.startswith(start), message


def test_memory_within_ten_percent_passes():
    assert memory_problems(numa(("0-1", 100), ("2-3", 91))) == []
    assert memory_problems(numa(("0-1", 100), ("2-3", 80)))


def test_numactl_missing_is_a_problem():
    assert numa_problems(H.NumaHardware((), False, "numactl is not installed"), 96, 4) == \
        ["cannot read the NUMA topology: numactl is not installed"]


def test_describe_numa():
    assert describe_numa(numa(("0-1", 1))) == "1 node of 2 CPUs"
    assert describe_numa(GOOD) == "4 nodes of 24 CPUs"


IFACES = H.parse_ip_addr_json(json.dumps([
    {"ifname": "lo", "mtu": 65536, "flags": ["UP"], "addr_info": [{"local": "127.0.0.1", "prefixlen": 8}]},
    {"ifname": "ens224", "mtu": 1500, "flags": ["UP"], "addr_info": [{"local": "172.16.25.21", "prefixlen": 24}]},
]))


@pytest.mark.parametrize("ip,mtu,name,expected", [
    ("172.16.25.21", 1500, None, []),
    ("172.16.25.21", 9000, None, ["bench interface ens224 has MTU 1500, expected 9000"]),
    ("172.16.25.21", 1500, "ens256", ["bench IP 172.16.25.21 is on ens224, but bench.interface is ens256"]),
    ("127.0.1.11", 65536, None, []),  # the lab
    ("10.1.1.1", 9000, None, ["bench IP 10.1.1.1 is on no interface (seen: lo 127.0.0.1/8; "
                              "ens224 172.16.25.21/24)"]),
])
def test_network_problems(ip, mtu, name, expected):
    got = network_problems(IFACES, ip, mtu, name)
    assert [g.split(" (placement")[0] for g in got] == expected


@pytest.fixture(scope="module")
def brief():
    return load_inventory(BRIEF)


def test_verify_guest_everything(brief):
    ifaces = H.parse_ip_addr_json(json.dumps([{"ifname": "ens224", "mtu": 9000, "flags": ["UP"],
                                               "addr_info": [{"local": "172.16.25.21", "prefixlen": 24}]}]))
    peers = H.peer_targets(brief, "slm-01")
    assert peers == {"172.16.25.22:22": "slm-02", "172.16.25.23:22": "slm-03", "172.16.25.24:22": "slm-04"}
    reach = {t: H.Reach(True, "ok") for t in peers}
    facts = H.GuestFacts(GOOD, None, ifaces, reach, peers)
    assert verify_guest(brief, "slm-01", facts) == []
    reach["172.16.25.23:22"] = H.Reach(False, "timed out")
    bad = H.GuestFacts(numa(("0-95", 384000)), None, ifaces, reach, peers)
    assert verify_guest(brief, "slm-01", bad) == [
        "expected 4 vNUMA nodes of 24 CPUs, seen 1 node of 96 CPUs (the VM's vNUMA settings did not "
        "take, or the inventory's vm.vcpus/vnuma_nodes do not describe this guest)",
        "bench IP 172.16.25.23 of slm-03 is unreachable (timed out)"]


def test_lscpu_cpu_count_checked_when_numa_agrees(brief):
    cpu = H.CpuInfo(cpus=94, online=tuple(range(94)), sockets=2, cores_per_socket=47, threads_per_core=1)
    assert verify_guest(brief, "slm-01", H.GuestFacts(numa=GOOD, cpu=cpu)) == \
        ["expected 96 vCPUs, lscpu shows 94"]


def scripted_guest(brief, numactl: str) -> FakeTransport:
    """A fake slm-01 answering the verify step's fact commands."""
    peers = list(H.peer_targets(brief, "slm-01"))
    ip = json.dumps([{"ifname": "ens224", "mtu": 9000, "flags": ["UP"],
                      "addr_info": [{"local": "172.16.25.21", "prefixlen": 24}]}])
    return FakeTransport("slm-01", {
        "numactl --hardware": numactl,
        H.ALLOWED.command: "Cpus_allowed_list:\t0-95\nMems_allowed_list:\t0-3\n",
        "lscpu -J": (1, "", "lscpu: not found"),
        "ip -j addr": ip,
        H.reach_probe(peers).command: "".join(f"{t} ok\n" for t in peers),
    })


def test_verify_step_passes_and_records_facts(brief):
    from test_guest_facts import numactl_text

    t = scripted_guest(brief, numactl_text(4, 24))
    ctx = HostContext(brief, brief.nodes[0], host_variables(brief, brief.nodes[0]), t)
    assert VerifyStep().plan(ctx, False) == []
    assert ctx.records["facts"].numa.nodes[3].cpus == tuple(range(72, 96))
    assert ctx.records["facts"].to_json()["reach"]["172.16.25.22:22"] == {"ok": True, "detail": "ok",
                                                                          "node": "slm-02"}


def test_verify_step_fails_with_expected_vs_seen(brief):
    from test_guest_facts import numactl_text

    t = scripted_guest(brief, numactl_text(1, 2, [10458]))
    ctx = HostContext(brief, brief.nodes[0], host_variables(brief, brief.nodes[0]), t)
    with pytest.raises(PlaybookError, match="expected 4 vNUMA nodes of 24 CPUs, seen 1 node of 2 CPUs"):
        VerifyStep().plan(ctx, False)


def test_guest_check_reads_the_guest_once_and_checks_what_it_read(brief):
    from test_guest_facts import numactl_text

    from vcfslm.guest.provision import guest_check, preflight_problems

    t = scripted_guest(brief, numactl_text(1, 2, [10458]))
    facts, problems = guest_check(brief, t)
    assert len(t.batches) == 1  # one round trip for every fact
    assert facts.numa.nodes[0].cpus == (0, 1)
    assert problems == verify_guest(brief, "slm-01", facts)
    assert problems[0].startswith("expected 4 vNUMA nodes of 24 CPUs, seen 1 node of 2 CPUs")
    assert preflight_problems(brief, scripted_guest(brief, numactl_text(1, 2, [10458]))) == problems
