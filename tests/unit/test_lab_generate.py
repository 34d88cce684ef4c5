"""The lab's generated inventory and env file (pure functions), and the shipped inventories/lab.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vcfslm.inventory_load import load_inventory, parse_inventory
from vcfslm.lab import generate
from vcfslm.resources import resource_dir


def _document(shape: generate.MachineShape, nodes: int = 4) -> dict:
    ports = {f"slm-{i + 1:02d}": 40000 + i for i in range(nodes)}
    return generate.lab_inventory(
        vcenter=generate.LabVcenter(host="127.0.0.1", port=8989, user="administrator@vsphere.local",
                                    ca_bundle="/lab/vcsim/tls/ca.pem", template="vcfslm-template"),
        nodes=generate.lab_nodes(nodes, ports),
        guest=generate.LabGuestLogin(user="root", ssh_key="/lab/ssh/id_ed25519",
                                     known_hosts="/lab/ssh/known_hosts", workdir="/lab/work"),
        bench_port=29500, shape=shape)


# a vcsim as the SLO and vLLM tests name it
VCSIM = generate.LabVcenter(host="127.0.0.1", port=8989, user="u", ca_bundle="/ca.pem", template="t")

SHAPES = [
    generate.MachineShape(cpus=2, numa_nodes=1, memory_gib=10),
    generate.MachineShape(cpus=1, numa_nodes=1, memory_gib=3),      # tiny runner: memory clamped
    generate.MachineShape(cpus=4, numa_nodes=2, memory_gib=32),
    generate.MachineShape(cpus=3, numa_nodes=2, memory_gib=16),     # uneven: one vNUMA node
    generate.MachineShape(cpus=64, numa_nodes=8, memory_gib=512),   # more nodes than the sim host
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.cpus}cpu-{s.numa_nodes}node")
def test_generated_inventory_passes_the_schema(shape):
    inventory = parse_inventory(yaml.safe_dump(_document(shape)), "lab.yaml")
    assert inventory.vm.vcpus == shape.cpus
    assert inventory.vm.vcpus % inventory.vm.vnuma_nodes == 0
    assert len(inventory.vm.host_numa_nodes) == inventory.vm.vnuma_nodes <= 4
    assert inventory.bench.ranks_per_node * inventory.bench.threads_per_rank <= shape.cpus


def test_generated_inventory_names_the_simulator_and_the_guests():
    inventory = parse_inventory(yaml.safe_dump(_document(SHAPES[0])), "lab.yaml")
    assert inventory.name == "lab"
    assert (inventory.vcenter.host, inventory.vcenter.port) == ("127.0.0.1", 8989)
    assert inventory.vcenter.password_env == "VCFSLM_VCENTER_PASSWORD"
    assert inventory.vcenter.ca_bundle == "/lab/vcsim/tls/ca.pem"
    assert inventory.vcenter.insecure is False
    p = inventory.placement
    assert (p.datacenter, p.cluster, p.datastore, p.template) == ("DC0", "DC0_C0", "LocalDS_0",
                                                                 "vcfslm-template")
    assert (p.networks.management.portgroup, p.networks.bench.portgroup) == ("VM Network", "DC0_DVPG0")
    assert p.networks.bench.mtu == 65536
    assert [(n.name, n.host, str(n.management_ip), str(n.bench_ip), n.ssh_port)
            for n in inventory.nodes] == [
        ("slm-01", "DC0_C0_H0", "127.0.0.11", "127.0.1.11", 40000),
        ("slm-02", "DC0_C0_H1", "127.0.0.12", "127.0.1.12", 40001),
        ("slm-03", "DC0_C0_H2", "127.0.0.13", "127.0.1.13", 40002),
        ("slm-04", "DC0_C0_H3", "127.0.0.14", "127.0.1.14", 40003),
    ]
    assert all(n.advanced == {"SET.guest.ipAddress": str(n.management_ip)} for n in inventory.nodes)
    g = inventory.guest
    assert (g.user, g.ssh_key, g.known_hosts, g.workdir) == ("root", "/lab/ssh/id_ed25519",
                                                             "/lab/ssh/known_hosts", "/lab/work")
    assert (g.torch, g.torch_index_url, g.model) == ("2.13.0", None, "synthetic:tiny")
    assert (inventory.bench.ranks_per_node, inventory.bench.threads_per_rank) == (2, 1)


def test_memory_is_clamped_only_below_the_schema_floor():
    # fixed, whatever the machine reports today (its memory moves with ballooning)
    assert generate.vm_section(generate.MachineShape(2, 1, 3))["memory_gb"] == generate.LAB_MEMORY_GB
    assert generate.vm_section(generate.MachineShape(2, 1, 23))["memory_gb"] == generate.LAB_MEMORY_GB


def test_machine_shape_reads_numa_nodes(tmp_path: Path):
    for node, kib in (("node0", 8 * 1024 * 1024), ("node1", 4 * 1024 * 1024)):
        (tmp_path / node).mkdir()
        (tmp_path / node / "meminfo").write_text(f"Node {node[-1]} MemTotal:  {kib} kB\n"
                                                 f"Node {node[-1]} MemFree:   1 kB\n")
    shape = generate.machine_shape(sys_nodes=tmp_path)
    assert (shape.numa_nodes, shape.memory_gib) == (2, 12)
    assert shape.cpus >= 1


def test_machine_shape_without_sysfs_falls_back_to_meminfo(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\n")
    shape = generate.machine_shape(sys_nodes=tmp_path / "missing", meminfo=meminfo)
    assert (shape.numa_nodes, shape.memory_gib) == (1, 16)


def test_env_file_round_trips_awkward_values():
    text = generate.env_file_text("pa ss'$word", "/lab dir/inventory.yaml")
    assert "export VCFSLM_VCENTER_PASSWORD=" in text
    assert generate.parse_env_file(text) == {"VCFSLM_VCENTER_PASSWORD": "pa ss'$word",
                                             "VCFSLM_INVENTORY": "/lab dir/inventory.yaml"}


def test_parse_env_file_accepts_plain_lines_and_comments():
    assert generate.parse_env_file("# c\n\nA=1\nexport B='x y'\nnot a pair\n") == {"A": "1", "B": "x y"}


def test_shipped_lab_inventory_validates_and_matches_the_generator():
    path = resource_dir("inventories") / "lab.yaml"
    shipped = load_inventory(path)
    generated = parse_inventory(yaml.safe_dump(_document(SHAPES[0])), "generated")
    assert shipped.vm == generated.vm
    assert shipped.bench.model_dump(exclude={"port"}) == generated.bench.model_dump(exclude={"port"})
    assert shipped.placement == generated.placement
    assert [(n.name, n.host, n.management_ip, n.bench_ip, n.advanced) for n in shipped.nodes] == \
        [(n.name, n.host, n.management_ip, n.bench_ip, n.advanced) for n in generated.nodes]
    assert shipped.slos == generated.slos


def test_guests_inventory_takes_a_port_and_ranks_per_node():
    from types import SimpleNamespace

    started = [SimpleNamespace(name=f"slm-{140 + i}", address=f"127.0.0.{150 + i}",
                               bench_address=f"127.0.1.{150 + i}", port=40000 + i, user="me",
                               key="/lab/ssh/id_ed25519", known_hosts="/lab/ssh/known_hosts")
               for i in range(3)]
    doc = generate.guests_inventory(started, "/lab/work", bench_port=31234, ranks_per_node=1)
    inventory = parse_inventory(yaml.safe_dump(doc), "guests.yaml")
    assert inventory.bench.port == 31234 and inventory.bench.ranks_per_node == 1
    assert [str(n.bench_ip) for n in inventory.nodes] == ["127.0.1.150", "127.0.1.151", "127.0.1.152"]
    default = generate.guests_inventory(started, "/lab/work")
    assert default["bench"]["port"] == 29500
    assert default["bench"]["ranks_per_node"] == generate.bench_section(generate.machine_shape(), 1)["ranks_per_node"]


def test_without_scaled_slos_the_lab_keeps_the_brief_ones():
    from vcfslm.contract import DEFAULT_SLOS

    doc = _document(SHAPES[0])
    assert doc["slos"] == DEFAULT_SLOS
    assert doc["slos"]["A"] is not DEFAULT_SLOS["A"]   # a copy: dumping or editing it leaves the brief's alone
    inventory = parse_inventory(yaml.safe_dump(doc), "lab.yaml")
    assert {n: (s.tpot_ms, s.ttft_s) for n, s in inventory.slos.items()} == {"A": (130, 3), "B": (200, 5)}


def test_scaled_slos_go_into_the_lab_inventory():
    from vcfslm.analysis.slo_scaling import scale_slos, scaling_for
    from vcfslm.contract import DEFAULT_SLOS

    scaled = scale_slos(DEFAULT_SLOS, scaling_for(31.9, 1.44))
    ports = {"slm-01": 40000}
    doc = generate.lab_inventory(
        vcenter=VCSIM, nodes=generate.lab_nodes(1, ports),
        guest=generate.LabGuestLogin(user="root", ssh_key="/k", known_hosts="/kh", workdir="/w"),
        bench_port=29500, shape=SHAPES[0], slos=scaled)
    inventory = parse_inventory(yaml.safe_dump(doc), "lab.yaml")
    assert {n: (s.tpot_ms, s.ttft_s) for n, s in inventory.slos.items()} == {"A": (377, 36.0), "B": (579, 60.0)}
    fresh = generate.fresh_guest_document(doc, wheelhouse="/wh", workdir="/root/work", management_mtu=1500,
                                          bench_mtu=9000, bench_netmask="255.255.255.0")
    assert fresh["slos"] == scaled


def test_inventory_header_carries_notes_as_comments():
    header = generate.inventory_header("/lab/lab.env", ["slos: scaled by probe.json", "SLO-A: TPOT <= 377 ms"])
    assert header.startswith(generate.INVENTORY_HEADER.format(env_file="/lab/lab.env"))
    assert header.endswith("# slos: scaled by probe.json\n# SLO-A: TPOT <= 377 ms\n")
    assert generate.inventory_header("/lab/lab.env") == generate.INVENTORY_HEADER.format(env_file="/lab/lab.env")
    assert yaml.safe_load(header + "name: lab\n") == {"name": "lab"}


def test_lab_vllm_settings_with_and_without_an_installed_venv():
    without = parse_inventory(yaml.safe_dump(_document(SHAPES[0])), "lab.yaml").bench.serve.vllm
    assert (without.venv, without.reserved_cores, without.listen) == (None, 0, "bench")
    assert without.venv_path("/lab/work") == "/lab/work/vllm-venv"
    ports = {f"slm-{i + 1:02d}": 40000 + i for i in range(2)}
    doc = generate.lab_inventory(
        vcenter=VCSIM, nodes=generate.lab_nodes(2, ports),
        guest=generate.LabGuestLogin(user="root", ssh_key="/k", known_hosts="/kh", workdir="/lab/work"),
        bench_port=29500, shape=SHAPES[0], vllm_venv="/src/vcfslm/.venv-vllm")
    inventory = parse_inventory(yaml.safe_dump(doc), "lab.yaml")
    assert inventory.bench.serve.vllm.venv == "/src/vcfslm/.venv-vllm"
    assert inventory.bench.serve.server == "vcfslm"       # the lab serves with vcfslm unless told
    from vcfslm.guest_layout import guest_paths

    assert guest_paths(inventory).vllm_python == "/src/vcfslm/.venv-vllm/bin/python"
    # fresh guests see none of this machine's folders, and each has a loopback of its own
    fresh = generate.fresh_guest_document(doc, wheelhouse="/wh", workdir="/root/work", management_mtu=1500,
                                          bench_mtu=9000, bench_netmask="255.255.255.0")
    vllm = parse_inventory(yaml.safe_dump(fresh), "fresh.yaml").bench.serve.vllm
    assert (vllm.venv, vllm.reserved_cores, vllm.listen) == (None, 0, "loopback")
    assert doc["bench"]["serve"]["vllm"]["venv"] == "/src/vcfslm/.venv-vllm"   # the original is left alone


def test_guests_inventory_passes_the_vllm_venv_on():
    from types import SimpleNamespace

    started = [SimpleNamespace(name="slm-01", address="127.0.0.11", bench_address="127.0.1.11", port=40000,
                               user="me", key="/k", known_hosts="/kh")]
    doc = generate.guests_inventory(started, "/lab/work", vllm_venv="/v")
    assert parse_inventory(yaml.safe_dump(doc), "g.yaml").bench.serve.vllm.venv == "/v"


# ---------------------------------------------------------------- the lab's model and matrix

DEMO = "synthetic:phi-3-mini,layers=1"


def test_the_tiny_model_keeps_the_quick_matrix():
    shape = SHAPES[0]
    assert generate.bench_section(shape, 1) == generate.bench_section(shape, 1, "synthetic:tiny")
    quick = generate.bench_section(shape, 1)
    assert (quick["ranks_per_node"], quick["threads_per_rank"], quick["batch_sizes"]) == (2, 1, [1, 2])
    assert generate.bench_section(shape, 1, "synthetic:tiny-64")["batch_sizes"] == [1, 2]


def test_another_model_gets_the_briefs_batches_and_passes_the_schema():
    doc = generate.lab_inventory(
        vcenter=VCSIM, nodes=generate.lab_nodes(2, {"slm-01": 40000, "slm-02": 40001}),
        guest=generate.LabGuestLogin(user="root", ssh_key="/k", known_hosts="/kh", workdir="/w"),
        bench_port=29500, shape=SHAPES[0], model=DEMO)
    inventory = parse_inventory(yaml.safe_dump(doc), "lab.yaml")
    assert inventory.guest.model == DEMO
    assert inventory.bench.batch_sizes == [1, 4, 8, 16]
    assert (inventory.bench.ranks_per_node, inventory.bench.threads_per_rank) == (2, 1)
    assert inventory.bench.input_tokens == [16, 32] and inventory.bench.output_tokens == 8


@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[2:3], ids=lambda s: f"{s.cpus}cpu-{s.numa_nodes}node")
def test_a_model_two_replicas_of_which_do_not_fit_gets_one_rank_of_a_whole_node(shape):
    ranks, threads = generate.lab_ranks(shape, "synthetic:phi-3-mini")
    vnuma = generate.lab_vnuma_nodes(shape)
    assert (ranks, threads) == (1, shape.cpus // vnuma)
    section = generate.bench_section(shape, 1, "synthetic:phi-3-mini")
    assert (section["ranks_per_node"], section["threads_per_rank"]) == (1, shape.cpus // vnuma)


def test_ranks_per_numa_node_is_what_shares_a_probed_node():
    assert generate.ranks_per_numa_node(SHAPES[0], DEMO) == 2          # 2 ranks, one node
    assert generate.ranks_per_numa_node(SHAPES[1], DEMO) == 1          # one CPU, one rank
    assert generate.ranks_per_numa_node(SHAPES[2], DEMO) == 1          # 2 ranks over 2 nodes
    assert generate.ranks_per_numa_node(SHAPES[0], "synthetic:phi-3-mini") == 1
