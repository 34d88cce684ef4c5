"""The desired VM as a table: both vNUMA paths, affinity, reservations, advanced keys, owner."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vcfslm.inventory_load import parse_inventory
from vcfslm.vsphere import desired as d

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"


def brief(vm: dict | None = None, node0: dict | None = None):
    data = yaml.safe_load(BRIEF.read_text())
    data["vm"].update(vm or {})
    data["nodes"][0].update(node0 or {})
    return parse_inventory(yaml.safe_dump(data), "brief.yaml")


@pytest.mark.parametrize("api, hw, path", [
    ("6.5", "vmx-13", d.ADVANCED),
    ("7.0.3.0", "vmx-19", d.ADVANCED),
    ("8.0.0.0", "vmx-20", d.ADVANCED),       # API below 8.0.0.1
    ("8.0.0.1", "vmx-19", d.ADVANCED),       # hardware below vmx-20
    ("8.0.0.1", "vmx-20", d.VIRTUAL_NUMA),
    ("8.0.3.0", "vmx-21", d.VIRTUAL_NUMA),
    ("9.0.0.0", "vmx-22", d.VIRTUAL_NUMA),
])
def test_vnuma_path(api, hw, path):
    assert d.vnuma_path(api, hw) == path


@pytest.mark.parametrize("api, wanted, got", [
    ("6.5", "vmx-21", "vmx-13"), ("7.0.2.0", "vmx-21", "vmx-19"), ("8.0.2.0", "vmx-21", "vmx-21"),
    ("9.0.0.0", "vmx-21", "vmx-21"), ("8.0.0.1", "vmx-21", "vmx-20"),
])
def test_hardware_is_capped_by_the_api(api, wanted, got):
    assert d.effective_hardware(wanted, api) == got


def test_brief_on_vsphere_8_uses_virtual_numa():
    vm = d.desired_vms(brief(), "8.0.3.0")[0]
    assert (vm.num_cpus, vm.cores_per_socket, vm.memory_mb) == (96, 48, 384 * 1024)
    assert vm.vnuma_path == d.VIRTUAL_NUMA and vm.cores_per_numa_node == 24
    assert vm.hardware_version == "vmx-21"
    assert vm.memory_locked_to_max is True and vm.memory_reservation_mb == 384 * 1024
    assert vm.cpu_hot_add is False
    assert vm.latency_sensitivity == "normal" and vm.cpu_reservation_mhz is None
    assert vm.extra_config == {"numa.autosize.once": "FALSE", "numa.nodeAffinity": "0,1,2,3",
                               "vcfslm.owner": "phi3-vx650v4"}
    assert [n.portgroup for n in vm.nics] == ["mgmt-pg", "bench-25g-pg"]
    assert vm.nics[0].gateway == "192.168.10.1" and vm.nics[0].dns == ("192.168.10.10",)
    assert (vm.host, vm.folder, vm.hostname) == ("esx01.example.local", "SLM/phi3", "slm-01")


def test_brief_on_api_6_5_uses_the_advanced_setting():
    vm = d.desired_vms(brief(), "6.5")[0]
    assert vm.vnuma_path == d.ADVANCED and vm.cores_per_numa_node is None
    assert vm.hardware_version == "vmx-13"
    assert vm.extra_config["numa.vcpu.maxPerVirtualNode"] == "24"
    assert vm.extra_config["numa.nodeAffinity"] == "0,1,2,3"
    assert vm.extra_config["numa.autosize.once"] == "FALSE"


def test_high_latency_sensitivity_reserves_all_cpu_and_memory():
    inv = brief({"latency_sensitivity": "high", "reserve_all_memory": False})
    vm = d.desired_vms(inv, "8.0.3.0", {"esx01.example.local": 2700})[0]
    assert vm.latency_sensitivity == "high"
    assert vm.cpu_reservation_mhz == 96 * 2700
    assert vm.memory_locked_to_max is True  # required by latency sensitivity high


def test_no_reservation_when_not_asked():
    vm = d.desired_vms(brief({"reserve_all_memory": False}), "8.0.3.0")[0]
    assert vm.memory_locked_to_max is False and vm.memory_reservation_mb is None


def test_advanced_keys_vm_then_node_and_the_owner_always_wins():
    inv = brief({"advanced": {"sched.mem.pin": "TRUE", "numa.autosize.once": "TRUE",
                              "vcfslm.owner": "someone-else"}},
                {"advanced": {"sched.mem.pin": "FALSE", "SET.guest.ipAddress": "127.0.0.11"}})
    first, second = d.desired_vms(inv, "6.5")[:2]
    assert first.extra_config["sched.mem.pin"] == "FALSE"  # node over VM
    assert second.extra_config["sched.mem.pin"] == "TRUE"
    assert first.extra_config["numa.autosize.once"] == "TRUE"  # the user's key is verbatim
    assert first.extra_config["SET.guest.ipAddress"] == "127.0.0.11"
    assert first.extra_config["vcfslm.owner"] == "phi3-vx650v4"


def test_no_affinity_key_without_host_numa_nodes():
    vm = d.desired_vms(brief({"host_numa_nodes": []}), "6.5")[0]
    assert "numa.nodeAffinity" not in vm.extra_config


def test_customization_fingerprint_follows_ips():
    a = d.desired_vms(brief(), "6.5")[0]
    b = d.desired_vms(brief(node0={"management_ip": "192.168.10.99"}), "6.5")[0]
    assert a.customization_fingerprint != b.customization_fingerprint
    assert a.customization_fingerprint == d.desired_vms(brief(), "6.5")[0].customization_fingerprint
