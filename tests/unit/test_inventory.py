"""Inventory schema: every validation rule has its own case, errors carry file:line:col key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vcfslm.errors import InventoryError
from vcfslm.inventory_load import load_inventory, parse_inventory

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"


def brief_data() -> dict:
    return yaml.safe_load(BRIEF.read_text())


def problems_of(data: dict | str) -> list[str]:
    text = data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False)
    with pytest.raises(InventoryError) as info:
        parse_inventory(text, "cluster.yaml")
    return [str(p) for p in info.value.problems]


def test_shipped_brief_inventory_is_valid():
    inv = load_inventory(BRIEF)
    assert inv.vm.vcpus == 96 and inv.vm.vnuma_nodes == 4 and inv.vm.vnuma_node_size == 24
    assert [s.cpu_list for s in inv.rank_slots()] == ["0-23", "24-47", "48-71", "72-95"]
    assert all(s.bind == "node" for s in inv.rank_slots())
    assert inv.source == str(BRIEF)
    assert len(inv.nodes) == 4 and inv.slos["B"].tpot_ms == 200


def test_error_names_file_line_column_and_key():
    text = BRIEF.read_text().replace("vnuma_nodes: 4 ", "vnuma_nodes: 5 ")
    msgs = problems_of(text)
    line = next(i for i, text_line in enumerate(text.splitlines(), 1) if "vnuma_nodes: 5" in text_line)
    assert msgs[0] == f"cluster.yaml:{line}:3: vm.vnuma_nodes: 96 vCPUs cannot split into 5 vNUMA nodes"


@pytest.mark.parametrize(("mutate", "key", "pattern"), [
    (lambda d: d["vm"].update(vcpus=90, cores_per_socket=45), "vm.vnuma_nodes", "cannot split"),
    (lambda d: d["vm"].update(cores_per_socket=40), "vm.cores_per_socket", "does not divide"),
    (lambda d: d["vm"].update(cores_per_socket=32), "vm.cores_per_socket", "neither a multiple"),
    (lambda d: d["vm"].update(vcpus=96, cores_per_socket=16), "vm.cores_per_socket",
     "neither a multiple nor a divisor"),
    (lambda d: d["bench"].update(threads_per_rank=32), "bench.threads_per_rank", "span two vNUMA"),
    (lambda d: d["bench"].update(ranks_per_node=5), "bench.threads_per_rank", "exceeds 96 vCPUs"),
    (lambda d: d["bench"].update(ranks_per_node=6, threads_per_rank=16), "bench.threads_per_rank",
     "do not fit one vNUMA node"),
    (lambda d: d["nodes"][1].update(name="slm-01"), "nodes[1].name", r"already used by nodes\[0\]"),
    (lambda d: d["nodes"][2].update(host="esx01.example.local"), "nodes[2].host", "already used"),
    (lambda d: d["nodes"][3].update(management_ip="192.168.10.21"), "nodes[3].management_ip",
     "already used"),
    (lambda d: d["nodes"][3].update(bench_ip="172.16.25.21"), "nodes[3].bench_ip", "already used"),
    (lambda d: d["nodes"][2].update(bench_ip="172.16.26.23"), "nodes[2].bench_ip",
     "outside the bench network 172.16.25.0/24"),
    (lambda d: d["nodes"][2].update(management_ip="10.0.0.5"), "nodes[2].management_ip",
     "outside the management network"),
    (lambda d: d["nodes"][0].update(bench_ip="172.16.25.300"), "nodes[0].bench_ip", "IPv4"),
    (lambda d: d["bench"].update(batch_sizes=[1, 0]), "bench.batch_sizes[1]", "greater than 0"),
    (lambda d: d["bench"].update(input_tokens=[-1]), "bench.input_tokens[0]", "greater than 0"),
    (lambda d: d["bench"].update(output_tokens=0), "bench.output_tokens", "greater than or equal"),
    (lambda d: d["bench"].update(batch_sizes=[]), "bench.batch_sizes", "at least 1"),
    (lambda d: d["bench"].update(batch_sizes=[4, 4]), "bench.batch_sizes", "unique"),
    (lambda d: d["vm"].update(memory_gb=48), "vm.memory_gb", r"too small: 4 replicas x \(7\.1 GiB"),
    (lambda d: d["vcenter"].update(password="hunter2"), "vcenter.password", "secrets are not written"),
    (lambda d: d["guest"].update(api_token="abc"), "guest.api_token", "secrets are not written"),
    (lambda d: d["vm"].update(memry_gb=3), "vm.memry_gb", "unknown key \\(did you mean 'memory_gb'\\?\\)"),
    (lambda d: d.update(benchh={}), "benchh", "unknown key \\(did you mean 'bench'\\?\\)"),
    (lambda d: d["vm"].update(latency_sensitivity="extreme"), "vm.latency_sensitivity", "normal"),
    (lambda d: d["vm"].update(hardware_version="21"), "vm.hardware_version", "pattern"),
    (lambda d: d["placement"].update(template="library:only-lib"), "placement.template", "library:<library>/<item>"),
    (lambda d: d["placement"]["networks"]["bench"].update(netmask="255.0.255.0"),
     "placement.networks.bench.netmask", "netmask"),
    (lambda d: d["vm"].update(host_numa_nodes=[0, 1]), "vm.host_numa_nodes", "cannot back 4 vNUMA"),
    (lambda d: d["vm"].update(host_numa_nodes=[0, 1, 1, 2]), "vm.host_numa_nodes", "unique"),
    (lambda d: d.pop("vm"), "vm", "required key is missing"),
    (lambda d: d.update(name="Phi3 Cluster"), "name", "pattern"),
    (lambda d: d.update(nodes=[]), "nodes", "at least 1"),
    (lambda d: d["guest"].update(model="synthetic:qwen9-7b"), "guest.model", "unknown synthetic model 'qwen9-7b'"),
    (lambda d: d["guest"].update(model="synthetic:llama-3.2-3b,layers=0"), "guest.model", "expected layers=N"),
    (lambda d: d["guest"].update(model="synthetic:config=/no/such/config.json"), "guest.model",
     "/no/such/config.json: cannot read the config"),
    # 16.2 GiB per Qwen2.5-7B replica: the VM holds two (40.3 GiB of 48), but each replica is
    # bound to one vNUMA node, and a node has 10 GiB.
    (lambda d: (d["guest"].update(model="synthetic:qwen2.5-7b"), d["vm"].update(memory_gb=48),
                d["bench"].update(ranks_per_node=2)),
     "guest.model", r"does not fit a vNUMA node: 1 replica\(s\) x .* a node holds 10\.0 GiB"),
])
def test_each_rule(mutate, key, pattern):
    data = brief_data()
    mutate(data)
    msgs = problems_of(data)
    hits = [m for m in msgs if re.search(rf" {re.escape(key)}: .*{pattern}", m)]
    assert hits, msgs
    assert all(re.match(r"cluster\.yaml:\d+:\d+: ", m) for m in msgs), msgs


def test_all_problems_at_once_sorted_by_line():
    data = brief_data()
    data["vm"]["memry"] = 1
    data["bench"]["batch_sizes"] = [0]
    data["nodes"][0]["bench_ip"] = "nope"
    msgs = problems_of(data)
    assert len(msgs) == 3
    lines = [int(m.split(":")[1]) for m in msgs]
    assert lines == sorted(lines)


def test_a_preset_is_sized_from_its_config():
    """Qwen2.5-7B: 15.2 GB of weights (untied), KV of 4 heads x 128 (not hidden), so four
    replicas need a bigger VM than four Phi-3-minis; a 1-layer config file shrinks it."""
    data = brief_data()
    data["guest"]["model"] = "synthetic:qwen2.5-7b"
    data["vm"]["memory_gb"] = 64
    [msg] = problems_of(data)
    assert "vm.memory_gb: 64 GiB is too small: 4 replicas x (14.2 GiB weights + 1.0 GiB KV cache" in msg


def test_a_synthetic_config_file_is_read(tmp_path):
    import json

    from vcfslm import presets

    values = presets.config_values(presets.SyntheticSpec(preset="qwen2.5-7b", layers=1))
    (tmp_path / "config.json").write_text(json.dumps(values))
    data = brief_data()
    data["guest"]["model"] = f"synthetic:config={tmp_path / 'config.json'}"
    data["vm"]["memory_gb"] = 64
    inv = parse_inventory(yaml.safe_dump(data, sort_keys=False), "cluster.yaml")
    assert inv.guest.model.endswith("config.json")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2",\n "hidden_size": }')
    [msg] = problems_of(data)
    assert f"{tmp_path / 'config.json'}:2: not JSON" in msg


def test_memory_message_gives_the_numbers():
    data = brief_data()
    data["vm"]["memory_gb"] = 48
    [msg] = problems_of(data)
    assert "batch 16 x 1152 tokens" in msg and "8 GiB guest overhead" in msg and "67.5 GiB" in msg
    assert "+ 1.0 GiB runtime)" in msg  # the engine holds one copy of the weights, plus its runtime


def test_unknown_model_skips_memory_estimate():
    data = brief_data()
    data["vm"]["memory_gb"] = 16
    data["guest"]["model"] = "/models/something-local"
    assert parse_inventory(yaml.safe_dump(data), "c.yaml").vm.memory_gb == 16


def test_password_env_is_allowed_and_secret_value_never_echoed():
    data = brief_data()
    data["vcenter"]["password"] = "S3cr3t-value"
    msgs = problems_of(data)
    assert not any("S3cr3t-value" in m for m in msgs)


@pytest.mark.parametrize(("text", "expected"), [
    ("name: [unclosed\n", r"^cluster\.yaml:2:1: YAML syntax error"),
    ("a: b\n  c: d\n", r"^cluster\.yaml:2:4: YAML syntax error"),
    ("- just\n- a list\n", r"^cluster\.yaml:1:1: the inventory must be a mapping"),
    ("", r"^cluster\.yaml: the inventory must be a mapping"),
    ("name: a\nname: b\n", r"^cluster\.yaml:2:1: name: duplicate key"),
])
def test_yaml_level_errors(text, expected):
    msgs = problems_of(text)
    assert re.search(expected, msgs[0]), msgs


def test_missing_file():
    with pytest.raises(InventoryError, match="nope.yaml: file not found"):
        load_inventory("nope.yaml")


def test_sub_node_ranks_bind_cpus():
    data = brief_data()
    data["bench"].update(ranks_per_node=8, threads_per_rank=12)
    inv = parse_inventory(yaml.safe_dump(data), "c.yaml")
    slots = inv.rank_slots()
    assert [(s.numa_node, s.cpu_list, s.bind) for s in slots[:3]] == [
        (0, "0-11", "cpus"), (0, "12-23", "cpus"), (1, "24-35", "cpus")]


def test_older_compile_mode_names_read_as_compile_and_unknown_ones_are_refused():
    data = brief_data()
    data["bench"]["compile"] = "freezing"
    assert parse_inventory(yaml.safe_dump(data), "c.yaml").bench.compile == "compile"
    data["bench"]["compile"] = "fast"
    with pytest.raises(InventoryError) as err:
        parse_inventory(yaml.safe_dump(data), "c.yaml")
    assert "bench.compile" in str(err.value)


def test_a_validators_own_words_without_pydantics_prefix():
    data = yaml.safe_load(BRIEF.read_text())
    data["bench"]["batch_sizes"] = [1, 1]
    with pytest.raises(InventoryError) as err:
        parse_inventory(yaml.safe_dump(data), "x.yaml")
    assert str(err.value).splitlines() == ["x.yaml:2:3: bench.batch_sizes: values must be unique"]


def test_the_judging_rule_defaults_and_its_bad_values_name_the_key():
    inv = load_inventory(BRIEF)
    assert (inv.slo.percentile, inv.slo.attainment) == ("p90", 0.9)
    data = brief_data()
    data["slo"] = {"percentile": "p95", "attainment": 1.5}
    msgs = problems_of(data)
    assert any(re.match(r"cluster\.yaml:\d+:\d+: slo\.percentile: ", m) for m in msgs), msgs
    assert any(re.match(r"cluster\.yaml:\d+:\d+: slo\.attainment: ", m) for m in msgs), msgs
    data["slo"] = {"percentile": "p50", "attainment": 0.95}
    ok = parse_inventory(yaml.safe_dump(data), "cluster.yaml")
    assert (ok.slo.percentile, ok.slo.attainment) == ("p50", 0.95)


def test_the_arrival_names_are_the_registrys_and_a_bad_one_names_the_key():
    from vcfslm.serving import arrivals

    data = brief_data()
    for name in arrivals.OPEN_LOOP:
        data["bench"].setdefault("serve", {})["arrival"] = name
        assert parse_inventory(yaml.safe_dump(data, sort_keys=False), "cluster.yaml").bench.serve.arrival == name
    data["bench"]["serve"]["arrival"] = "closed"   # the closed loop is chosen by users, not by name
    msgs = problems_of(data)
    assert len(msgs) == 1 and re.match(
        r"cluster\.yaml:\d+:\d+: bench\.serve\.arrival: Input should be 'poisson' or 'gamma' \(got 'closed'\)$",
        msgs[0]), msgs
