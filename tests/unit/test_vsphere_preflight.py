"""Preflight over snapshots: everything reported at once, per-node scope, API facts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vcfslm.errors import PreflightError
from vcfslm.inventory_load import parse_inventory
from vcfslm.vsphere import preflight
from vcfslm.vsphere.state import HostFacts, Snapshot, VmState

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"
TB = 1024**4


def inventory(**placement):
    data = yaml.safe_load(BRIEF.read_text())
    data["placement"].update(placement)
    return parse_inventory(yaml.safe_dump(data), "brief.yaml")


def host(name: str, numa: int = 4, memory: int = int(1.5 * TB), cluster: str = "WLD01-CL01",
         api: str = "8.0.3.0", state: str = "connected") -> HostFacts:
    return HostFacts(name, cluster, numa, memory, 2700, api, state)


def good_snapshot(**kw) -> Snapshot:
    base = dict(
        api_version="8.0.3.0", datacenter="DC01", cluster="WLD01-CL01",
        hosts={f"esx0{i}.example.local": host(f"esx0{i}.example.local") for i in range(1, 5)},
        datastores=frozenset({"vsanDatastore"}), networks=frozenset({"mgmt-pg", "bench-25g-pg"}),
        folders=frozenset({"SLM", "SLM/phi3"}),
        vms={"ubuntu-24.04-template": VmState("ubuntu-24.04-template", "vm-1", template=True)})
    base.update(kw)
    return Snapshot(**base)


def test_a_good_vcenter_passes_with_vsphere8_facts():
    r = preflight.check(inventory(), good_snapshot())
    assert r.ok and r.node_problems == {} and r.warnings == ()
    assert (r.api_version, r.vnuma_path, r.hardware_version) == ("8.0.3.0", "virtualNuma", "vmx-21")
    assert r.host_cpu_mhz["esx01.example.local"] == 2700
    r.raise_for_problems()  # no error


def test_every_cluster_wide_problem_at_once():
    snap = good_snapshot(cluster=None, datastores=frozenset({"other-ds"}), networks=frozenset({"mgmt-pg"}),
                         vms={})
    r = preflight.check(inventory(resource_pool="gone"), snap)
    text = "\n".join(r.problems)
    assert "cluster 'WLD01-CL01' not found" in text
    assert "datastore 'vsanDatastore' not found (found: other-ds)" in text
    assert "bench port group 'bench-25g-pg' not found" in text
    assert "template 'ubuntu-24.04-template' not found" in text
    with pytest.raises(PreflightError) as err:
        r.raise_for_problems()
    assert len(err.value.problems) == 4


def test_missing_datacenter_is_the_only_problem_reported():
    r = preflight.check(inventory(), Snapshot(api_version="8.0.3.0"))
    assert r.problems == ("datacenter 'DC01' not found",)


def test_missing_folder_is_a_planned_create_not_a_problem():
    r = preflight.check(inventory(), good_snapshot(folders=frozenset()))
    assert r.ok and "folder 'SLM/phi3' does not exist yet" in r.warnings[0]


def test_per_node_problems_block_only_their_node():
    hosts = good_snapshot().hosts | {
        "esx02.example.local": host("esx02.example.local", numa=2),
        "esx03.example.local": host("esx03.example.local", memory=256 * 1024**3),
        "esx04.example.local": host("esx04.example.local", cluster="other", state="disconnected"),
    }
    hosts.pop("esx01.example.local")
    r = preflight.check(inventory(), good_snapshot(hosts=hosts))
    assert r.ok  # nothing cluster-wide
    assert "ESXi host 'esx01.example.local' not found" in r.node_problems["slm-01"][0]
    assert "has 2 NUMA node(s); 4 vNUMA nodes need at least 4" in r.node_problems["slm-02"][0]
    assert "NUMA nodes 0-1" in r.node_problems["slm-02"][1]
    assert "fully reserved 384 GiB VM does not fit" in r.node_problems["slm-03"][0]
    assert len(r.node_problems["slm-04"]) == 2


def test_api_6_5_takes_the_advanced_path_and_warns_about_hardware():
    r = preflight.check(inventory(), good_snapshot(api_version="6.5"))
    assert (r.vnuma_path, r.hardware_version) == ("advanced", "vmx-13")
    assert "vmx-21 is newer than API 6.5" in r.warnings[0]


def test_the_oldest_host_decides():
    hosts = dict(good_snapshot().hosts)
    hosts["esx02.example.local"] = host("esx02.example.local", api="7.0.3.0")
    r = preflight.check(inventory(), good_snapshot(hosts=hosts))
    assert r.api_version == "7.0.3.0" and r.vnuma_path == "advanced"


def test_library_item_checked_when_the_automation_api_answered():
    inv = inventory(template="library:golden/ubuntu-24.04")
    assert preflight.check(inv, good_snapshot(library_items=frozenset({"golden/ubuntu-24.04"}))).ok
    missing = preflight.check(inv, good_snapshot(library_items=frozenset()))
    assert "item 'ubuntu-24.04' not found in library 'golden'" in missing.problems[0]
    unknown = preflight.check(inv, good_snapshot(library_items=None))
    assert "Automation API" in unknown.problems[0]
