"""The run contract: one home for the facts every stage shares, checked from each side."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from vcfslm import contract, guest_layout, matrix, node_selection, run_meta
from vcfslm.errors import InventoryError
from vcfslm.inventory_load import parse_inventory
from vcfslm.results import RunMeta
from vcfslm.runspec import RunSpec

ROOT = Path(__file__).resolve().parents[2]
BRIEF = (ROOT / "inventories" / "vx650v4-4node.yaml").read_text()


@pytest.fixture
def inv():
    return parse_inventory(BRIEF, "brief.yaml")


def with_model(model: str):
    data = yaml.safe_load(BRIEF)
    data["guest"]["model"] = model
    return parse_inventory(yaml.safe_dump(data), "x.yaml")


# ------------------------------------------------------------------ node selection


def test_select_nodes_by_count_and_by_name(inv):
    assert [n.name for n in node_selection.select_nodes(inv, 1)] == ["slm-01"]
    assert [n.name for n in node_selection.select_nodes(inv)] == ["slm-01", "slm-02", "slm-03", "slm-04"]
    # names come back in inventory order, whatever order they were given in
    assert [n.name for n in node_selection.select_nodes(inv, None, ["slm-03", " slm-02 "])] == ["slm-02", "slm-03"]


@pytest.mark.parametrize(("count", "names", "message"), [
    (5, None, "brief.yaml: --nodes: 5 nodes asked, the inventory has 4"),
    (0, None, "brief.yaml: --nodes: 0 nodes asked, the inventory has 4"),
    (None, ["slm-09", "slm-01"],
     "brief.yaml: --hosts: unknown node(s) slm-09; the inventory has slm-01, slm-02, slm-03, slm-04"),
])
def test_select_nodes_names_the_flag_and_the_file(inv, count, names, message):
    with pytest.raises(InventoryError) as err:
        node_selection.select_nodes(inv, count, names)
    assert str(err.value) == message and err.value.exit_code == 2


def test_targets_slice_the_selected_nodes_for_the_bench(inv):
    from vcfslm import topology

    targets = node_selection.targets_of(inv, ["slm-03", "slm-01"])
    # inventory order, each node's addresses and ports, the one guest layout, the rank slots
    assert [t.name for t in targets] == ["slm-01", "slm-03"]
    first = targets[0]
    assert (first.address, first.ssh_port, first.bench_ip, first.rdzv_port) == (
        str(inv.nodes[0].management_ip), inv.nodes[0].ssh_port, str(inv.nodes[0].bench_ip), inv.bench.port)
    assert first.paths == guest_layout.guest_paths(inv)
    assert first.slots == tuple(inv.rank_slots())
    # the run's own ranks and threads, where they differ from the inventory's
    [t] = node_selection.targets_of(inv, ["slm-02"], ranks=2, threads=12)
    assert t.slots == tuple(topology.rank_slots(inv.vm.vcpus, inv.vm.vnuma_nodes, 2, 12))


def test_targets_refuse_unknown_nodes_and_ranks_the_vm_cannot_place(inv):
    with pytest.raises(InventoryError, match="--hosts: unknown node.s. slm-09"):
        node_selection.targets_of(inv, ["slm-09"])
    with pytest.raises(InventoryError, match=r"brief.yaml: vm: 3 rank\(s\) of 40 thread\(s\) per node"):
        node_selection.targets_of(inv, ["slm-01"], ranks=3, threads=40)


# ------------------------------------------------------------------ guest layout


def test_guest_layout(inv):
    p = guest_layout.guest_paths(inv)
    assert (p.venv, p.python, p.rank_script, p.env_file, p.runs_dir, p.models_dir) == (
        "/opt/vcfslm/venv", "/opt/vcfslm/venv/bin/python", "/opt/vcfslm/launch/rank.sh",
        "/opt/vcfslm/launch/env.sh", "/opt/vcfslm/runs", "/opt/vcfslm/models")
    # vLLM's server: a venv of its own; its entry file beside the launch scripts
    assert (p.vllm_venv, p.vllm_python, p.vllm_entry) == (
        "/opt/vcfslm/vllm-venv", "/opt/vcfslm/vllm-venv/bin/python", "/opt/vcfslm/launch/vllm-entry.py")
    moved = inv.model_copy(update={"bench": inv.bench.model_copy(update={"serve": inv.bench.serve.model_copy(
        update={"vllm": inv.bench.serve.vllm.model_copy(update={"venv": "/srv/vllm/"})})})})
    assert (guest_layout.guest_paths(moved).vllm_venv, guest_layout.guest_paths(moved).vllm_python) == ("/srv/vllm", "/srv/vllm/bin/python")


@pytest.mark.parametrize(("model", "kind", "ref"), [
    ("synthetic:tiny", "synthetic", "synthetic:tiny"),
    ("microsoft/Phi-3-mini-128k-instruct", "hub", "microsoft/Phi-3-mini-128k-instruct"),
    ("/models/phi3", "dir", "/opt/vcfslm/models/phi3"),
    ("./models/phi3", "dir", "/opt/vcfslm/models/phi3"),
    # a relative path upwards is a folder too, existing here or not (the bench once missed it)
    ("../elsewhere/phi3", "dir", "/opt/vcfslm/models/phi3"),
    ("~/phi3", "dir", "/opt/vcfslm/models/phi3"),
])
def test_model_kind_and_ref(model, kind, ref):
    assert guest_layout.model_kind(model) == kind
    assert guest_layout.model_ref(with_model(model)) == ref
    assert guest_layout.guest_model(model, "/opt/vcfslm/models/") == ref


def test_model_kind_of_an_existing_folder_and_of_nonsense(tmp_path, monkeypatch):
    (tmp_path / "phi3").mkdir()
    monkeypatch.chdir(tmp_path)
    assert guest_layout.model_kind("phi3") == "dir"
    assert guest_layout.model_kind("not a model") is None


def test_the_guest_stage_and_the_bench_stage_read_one_layout(inv):
    from vcfslm.bench.cluster import ClusterOptions, plan_launches
    from vcfslm.guest.playbook import host_variables

    variables = host_variables(inv, inv.nodes[0])
    [la] = plan_launches(node_selection.targets_of(inv, [inv.nodes[0].name]), RunSpec.of_inventory(inv, [inv.nodes[0].name], "r"),
                         ClusterOptions())
    argv = list(la.torchrun_argv)
    assert argv[0] == variables["python"]
    assert variables["rank_script"] in argv
    assert la.spec.model == variables["model_ref"]
    assert la.run_dir == f"{variables['runs_dir']}/r"


# ------------------------------------------------------------------ the matrix


def test_scenarios_in_run_order_and_filtered():
    m = matrix.Matrix((4, 1), (512, 128), 16)
    assert m.scenarios() == [(1, 128, 16), (1, 512, 16), (4, 128, 16), (4, 512, 16)]
    m = matrix.Matrix((1, 4, 16), (128, 512), 8)
    assert m.scenarios("1x*, 16x128") == [(1, 128, 8), (1, 512, 8), (16, 128, 8)]
    assert m.scenarios("2x*") == []
    assert m.scenarios("") == m.scenarios(None) == m.scenarios()


def test_recorded_matrix_round_trip():
    m = matrix.Matrix((1, 4), (128,), 32, warmup=0, repeats=2)
    record = matrix.matrix_record(m, compile_mode="compile", scenarios="4x*", seed=7)
    assert record == {"batch_sizes": [1, 4], "input_tokens": [128], "output_tokens": 32, "warmup": 0,
                      "repeats": 2, "compile": "compile", "scenarios": "4x*", "seed": 7}
    assert matrix.Matrix.of_record(record) == m
    assert matrix.recorded_scenarios(record) == [(4, 128, 32)]
    # an older meta.json with a scalar where a list belongs
    assert matrix.recorded_scenarios({"batch_sizes": 2, "input_tokens": [8], "output_tokens": 4}) == [(2, 8, 4)]


def test_inventory_matrix_with_overrides(inv):
    m = matrix.Matrix.of_inventory(inv.bench, output_tokens=16, repeats=1)
    assert (m.batch_sizes, m.input_tokens, m.output_tokens, m.warmup, m.repeats) == (
        (1, 4, 8, 16), (128, 512, 1024), 16, 1, 1)


# ------------------------------------------------------------------ run ids, progress


def test_run_ids_are_one_format():
    at = datetime(2026, 12, 1, 10, 15, 0, tzinfo=timezone.utc)
    assert run_meta.new_run_id("lab", 4, at) == "lab-4n-20261201-101500"
    assert run_meta.new_run_id("local", 1, at) == "local-1n-20261201-101500"


@pytest.mark.parametrize("prefix", ["", "[default3]:", "2026-12-01 10:00:00 INFO "])
def test_progress_line_round_trip(prefix):
    event = {"rank": 3, "phase": "measure", "scenario": 2, "scenarios": 4, "tpot_ms_p50": 80.5}
    line = contract.format_progress(event)
    assert "\n" not in line and line.startswith(contract.PROGRESS_PREFIX)
    assert contract.parse_progress(prefix + line + "\n") == event


@pytest.mark.parametrize("line", ["plain output", "VCFSLM-PROGRESS {broken", "VCFSLM-PROGRESS [1, 2]"])
def test_progress_parser_ignores_what_is_not_an_event(line):
    assert contract.parse_progress(line) is None


# ------------------------------------------------------------------ run metadata


def meta(grid=None, **kw) -> RunMeta:
    spec = RunSpec(run_id="r", mode="local", nodes=("local",), ranks=2, threads=1, model="synthetic:tiny",
                   matrix=matrix.Matrix((1,) if grid is None else tuple(grid["batch_sizes"]), (8,), 4),
                   command=("vcfslm", "bench"))
    return run_meta.build_run_meta(spec, **kw)


def test_run_meta_fresh():
    m = meta(label="x", guests={"local": {"numactl": True}})
    assert m.created and not m.complete and m.failure is None
    assert (m.label, m.guests, m.probe, m.ranks, m.inventory_sha256) == ("x", {"local": {"numactl": True}}, {}, {}, None)


def test_a_resume_keeps_creation_and_facts_it_does_not_gather_again():
    first = meta(guests={"local": {"numactl": True}}, probe={"local": {"0": 40.0}}, inventory_sha256="abc",
                 failure="torchrun exited 1", label="baseline", slos={"A": {"tpot_ms": 130, "ttft_s": 3}})
    first.created = "2026-01-01T00:00:00+00:00"
    again = meta(previous=first, grid={"batch_sizes": [1, 2]}, ranks={"0": {"engine": "compile"}})
    assert again.created == "2026-01-01T00:00:00+00:00" and again.failure is None
    assert again.guests == first.guests and again.probe == first.probe and again.inventory_sha256 == "abc"
    assert again.matrix["batch_sizes"] == [1, 2] and again.spec["matrix"]["batch_sizes"] == [1, 2]
    assert again.ranks == {"0": {"engine": "compile"}}
    assert again.label == "baseline" and again.slos == first.slos
    assert meta(previous=first, label="rerun").label == "rerun"


def test_run_meta_refuses_an_unknown_fact():
    with pytest.raises(TypeError, match="unknown run facts: probes"):
        meta(probes={})


def test_compile_modes():
    assert contract.normalize_compile_mode("autotune") == "compile" == contract.normalize_compile_mode("freezing")
    assert set(contract.ACCEPTED_COMPILE_MODES) == {"compile", "eager", "autotune", "freezing", "default"}
    with pytest.raises(ValueError, match="unknown compile mode 'fast'"):
        contract.normalize_compile_mode("fast")


@pytest.mark.parametrize("requested, items, cap, workers", [
    (None, 64, 32, 32),   # default: every host up to the cap
    (None, 3, 32, 3),     # never more workers than hosts
    (100, 3, 32, 3),
    (4, 64, 32, 4),       # an explicit setting wins over the cap, down ...
    (48, 64, 32, 48),     # ... and up
    (None, 0, 32, 1),
])
def test_parallelism(requested, items, cap, workers):
    assert node_selection.parallelism(requested, items, cap) == workers


def test_parallel_settings_in_the_inventory(inv):
    assert inv.vcenter.parallel is None and inv.guest.parallel is None
    data = yaml.safe_load(BRIEF)
    data["vcenter"]["parallel"] = 8
    data["guest"]["parallel"] = 0
    with pytest.raises(InventoryError) as err:
        parse_inventory(yaml.safe_dump(data), "x.yaml")
    assert "guest.parallel" in str(err.value)
    data["guest"]["parallel"] = 40
    parsed = parse_inventory(yaml.safe_dump(data), "x.yaml")
    assert (parsed.vcenter.parallel, parsed.guest.parallel) == (8, 40)


def test_the_matrix_crosses_to_the_worker_typed():
    m = matrix.Matrix((1, 4), (128, 512), 16, warmup=0, repeats=2)
    assert matrix.Matrix.from_json(m.to_json()) == m
    for bad, why in [("1,4", "not JSON"), ("[1]", "expected a JSON object"),
                     ('{"batch_sizes": [1], "input_tokens": [8], "output_tokens": 4, "warmup": 1}',
                      "repeats: expected an integer"),
                     ('{"batch_sizes": [1, true], "input_tokens": [8], "output_tokens": 4, "warmup": 1, '
                      '"repeats": 1}', "batch_sizes: expected a list of positive integers"),
                     ('{"batch_sizes": [], "input_tokens": [8], "output_tokens": 4, "warmup": 1, "repeats": 1}',
                      "batch_sizes: expected a list of positive integers"),
                     ('{"batch_sizes": [1], "input_tokens": [8], "output_tokens": "4", "warmup": 1, "repeats": 1}',
                      "output_tokens: expected an integer"),
                     ('{"batch_sizes": [1], "input_tokens": [8], "output_tokens": 4, "warmup": 1, "repeats": 1, '
                      '"seed": 3}', "unknown field(s) seed")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            matrix.Matrix.from_json(bad)
