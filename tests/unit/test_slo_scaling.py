"""The brief's SLOs scaled to this machine (vcfslm/analysis/slo_scaling.py), and `lab up --slos-from`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from vcfslm import presets, roofline, steadiness
from vcfslm.analysis.slo_scaling import (
    REFERENCE_MODEL,
    Rates,
    busy_probe_lines,
    model_cost,
    probe_decode_gbs,
    probe_rates,
    run_rates,
    scale_slos,
    scaling_for,
)
from vcfslm.cli import main
from vcfslm.contract import DEFAULT_SLOS
from vcfslm.errors import PlatformError, RunFolderError
from vcfslm.lab import generate


def _node(read_gbs, tflops, node=0) -> dict:
    """One NUMA node of `vcfslm probe -o json`, with the keys the scaling reads and a few it does not."""
    return {"numa_node": node, "threads": 2, "read_gbs": read_gbs, "triad_gbs": read_gbs * 0.8,
            "gemm": {"tflops": tflops, "threads": 2, "rows": 1024}}


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- the factors


def test_the_testbed_rank_comes_from_the_shipped_platform():
    scaling = scaling_for(31.9, 1.44)
    assert scaling.reference == "vx650v4-6747p"
    assert scaling.reference_read_gbs == pytest.approx(92.4)
    assert scaling.reference_gemm_tflops == pytest.approx(0.72 * 24)


def test_factors_are_the_testbed_rank_over_this_machine():
    scaling = scaling_for(31.9, 1.44)
    assert scaling.tpot_factor == pytest.approx(92.4 / 31.9)
    assert scaling.ttft_factor == pytest.approx(12.0)
    assert scaling.scales


def test_a_machine_faster_than_the_testbed_keeps_the_brief_slos():
    scaling = scaling_for(200.0, 40.0)
    assert (scaling.tpot_factor, scaling.ttft_factor) == (1.0, 1.0)
    assert not scaling.scales
    assert scale_slos(DEFAULT_SLOS, scaling) == DEFAULT_SLOS


def test_each_factor_is_clamped_on_its_own():
    faster_memory = scaling_for(150.0, 1.44)
    assert faster_memory.tpot_factor == 1.0 and faster_memory.ttft_factor == pytest.approx(12.0)
    faster_gemm = scaling_for(31.9, 30.0)
    assert faster_gemm.tpot_factor > 1.0 and faster_gemm.ttft_factor == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, None, True, "8"])
@pytest.mark.parametrize("which", ["read_gbs", "gemm_tflops"])
def test_non_positive_figures_are_refused_by_name(which, bad):
    figures = {"read_gbs": 31.9, "gemm_tflops": 1.44, which: bad}
    with pytest.raises(ValueError, match=which):
        scaling_for(**figures)


def test_another_reference_platform_by_name():
    scaling = scaling_for(31.9, 1.44, reference="vx650v4-6737p")
    assert scaling.reference == "vx650v4-6737p"
    assert scaling.reference_read_gbs > 31.9


# ---------------------------------------------------------------- scaled SLOs


def test_scaled_slos_round_tpot_to_ms_and_ttft_to_a_tenth():
    scaled = scale_slos(DEFAULT_SLOS, scaling_for(31.9, 1.44))
    # 130 x 2.8966 = 376.6, 200 x 2.8966 = 579.3; 3 x 12 = 36, 5 x 12 = 60
    assert scaled == {"A": {"tpot_ms": 377, "ttft_s": 36.0}, "B": {"tpot_ms": 579, "ttft_s": 60.0}}
    assert all(isinstance(limits["tpot_ms"], int) for limits in scaled.values())
    odd = scale_slos({"C": {"tpot_ms": 100.0, "ttft_s": 1.0}}, scaling_for(92.4 / 1.234, 17.28 / 7.3689))
    assert odd == {"C": {"tpot_ms": 123, "ttft_s": 7.4}}


def test_a_missing_limit_stays_missing_and_names_are_kept():
    scaled = scale_slos({"strict": {"tpot_ms": None, "ttft_s": 2.0}, "loose": {"tpot_ms": 500.0, "ttft_s": None}},
                        scaling_for(46.2, 8.64))
    assert scaled == {"strict": {"tpot_ms": None, "ttft_s": 4.0}, "loose": {"tpot_ms": 1000, "ttft_s": None}}


def test_the_brief_slos_are_not_changed_in_place():
    before = json.dumps(DEFAULT_SLOS, sort_keys=True)
    scale_slos(DEFAULT_SLOS, scaling_for(8.7, 0.64))
    assert json.dumps(DEFAULT_SLOS, sort_keys=True) == before


def test_lines_show_both_ratios_and_each_scaled_slo():
    assert scaling_for(31.9, 1.44).lines(DEFAULT_SLOS) == [
        "SLOs scaled to this machine: read 31.9 GB/s vs the testbed rank's 92.4 (TPOT x2.90), "
        "bf16 GEMM 1.44 vs 17.28 TFLOP/s (TTFT x12.0); testbed vx650v4-6747p",
        "SLO-A: TPOT <= 377 ms, TTFT <= 36 s (the brief's 130 ms, 3 s)",
        "SLO-B: TPOT <= 579 ms, TTFT <= 60 s (the brief's 200 ms, 5 s)",
    ]


def test_lines_say_so_when_nothing_is_scaled():
    lines = scaling_for(200.0, 40.0).lines()
    assert len(lines) == 1 and lines[0].startswith("SLOs as the brief's (this machine is no slower")
    assert "(TPOT x1.00)" in lines[0] and "(TTFT x1.0)" in lines[0]


# ---------------------------------------------------------------- the model's floors

DEMO = "synthetic:phi-3-mini,layers=1"


def test_a_models_cost_is_its_decode_step_bytes_and_prompt_flops():
    cost = model_cost(DEMO, 16)
    counts = presets.counts_of_source(DEMO)
    assert cost.name == DEMO and cost.prompt_tokens == 16
    assert cost.decode_bytes == counts.step_weight_bytes + 16 * counts.kv_bytes_per_token
    assert cost.prefill_flops == roofline.prefill_flops(counts.dims(), 1, 16)
    assert model_cost("microsoft/Phi-3-mini-128k-instruct", 16).decode_bytes == \
        model_cost(REFERENCE_MODEL, 16).decode_bytes


@pytest.mark.parametrize("source", ["synthetic:tiny", "synthetic:tiny-64", "/models/mine", "org/unknown"])
def test_a_shape_not_known_without_loading_has_no_cost(source):
    assert model_cost(source) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_prompt_length_must_be_whole_tokens(bad):
    with pytest.raises(ValueError, match="prompt_tokens"):
        model_cost(DEMO, bad)


def test_phi3_mini_itself_reduces_to_the_machine_scaling():
    machine = scaling_for(31.9, 1.44)
    phi3 = scaling_for(31.9, 1.44, model=model_cost(REFERENCE_MODEL, 16))
    assert (phi3.model_tpot_factor, phi3.model_ttft_factor) == (1.0, 1.0)
    assert (phi3.tpot_factor, phi3.ttft_factor) == (machine.tpot_factor, machine.ttft_factor)
    assert scale_slos(DEFAULT_SLOS, phi3) == scale_slos(DEFAULT_SLOS, machine)


def test_the_limit_is_the_ratio_of_the_two_floors():
    """TPOT x (the model's decode floor here / Phi-3-mini's on the testbed rank), TTFT x the
    prefill floors' ratio, at the same prompt length; the lab's 2 ranks split the probed
    node's threads (its GEMM rate), each reading at the node's bandwidth."""
    demo, phi3 = model_cost(DEMO, 16), model_cost(REFERENCE_MODEL, 16)
    scaling = scaling_for(15.5, 0.137, model=demo, ranks=2)
    here_decode = roofline.roofline_tpot_ms(demo.decode_bytes, 15.5)
    there_decode = roofline.roofline_tpot_ms(phi3.decode_bytes, 92.4)
    assert scaling.tpot_factor == pytest.approx(here_decode / there_decode)
    here_prefill = roofline.roofline_ttft_s(demo.prefill_flops, 0.137 / 2)
    there_prefill = roofline.roofline_ttft_s(phi3.prefill_flops, 17.28)
    assert scaling.ttft_factor == pytest.approx(here_prefill / there_prefill)
    scaled = scale_slos(DEFAULT_SLOS, scaling)
    assert scaled["A"]["tpot_ms"] == round(130 * here_decode / there_decode)
    assert scaled["B"]["ttft_s"] == round(5 * here_prefill / there_prefill, 1)


def test_a_smaller_model_may_tighten_the_brief_limits():
    """Only the machine's ratio is clamped at 1: a model 18x lighter than Phi-3-mini on a
    machine 6x slower gets a TPOT limit under the brief's 130 ms."""
    scaling = scaling_for(15.5, 0.137, model=model_cost(DEMO, 16), ranks=2)
    assert scaling.machine_tpot_factor == pytest.approx(92.4 / 15.5)
    assert scaling.model_tpot_factor == pytest.approx(0.0569, abs=1e-4)
    assert scale_slos(DEFAULT_SLOS, scaling)["A"]["tpot_ms"] == 44
    fast = scaling_for(200.0, 40.0, model=model_cost(DEMO, 16))
    assert fast.machine_tpot_factor == 1.0 and fast.tpot_factor == pytest.approx(fast.model_tpot_factor)
    assert fast.scales


def test_ranks_split_the_probed_nodes_gemm_rate_not_its_bandwidth():
    shared = scaling_for(31.9, 1.44, ranks=2)
    assert (shared.rank_read_gbs, shared.rank_gemm_tflops) == (31.9, 0.72)
    assert shared.tpot_factor == pytest.approx(scaling_for(31.9, 1.44).tpot_factor)
    assert shared.ttft_factor == pytest.approx(2 * scaling_for(31.9, 1.44).ttft_factor)
    assert scale_slos(DEFAULT_SLOS, shared) == {"A": {"tpot_ms": 377, "ttft_s": 72.0},
                                                "B": {"tpot_ms": 579, "ttft_s": 120.0}}


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_ranks_must_be_a_whole_number(bad):
    with pytest.raises(ValueError, match="ranks"):
        scaling_for(31.9, 1.44, ranks=bad)


def test_limits_under_a_second_keep_two_figures():
    scaled = scale_slos({"fast": {"tpot_ms": 130.0, "ttft_s": 3.0}},
                        scaling_for(200.0, 40.0, model=model_cost(DEMO, 16)))
    assert scaled == {"fast": {"tpot_ms": 7, "ttft_s": 0.099}}


def test_lines_show_the_model_ratio():
    scaling = scaling_for(15.5, 0.137, model=model_cost(DEMO, 16), ranks=2)
    assert scaling.lines(DEFAULT_SLOS) == [
        "SLOs scaled to this machine and model: read 15.5 GB/s vs the testbed rank's 92.4 (TPOT x5.96), "
        "bf16 GEMM 0.137 over 2 ranks (0.0685 each) vs 17.28 TFLOP/s (TTFT x252.3); testbed vx650v4-6747p",
        "model synthetic:phi-3-mini,layers=1 vs phi-3-mini at 16-token prompts: decode step 0.424 vs 7.45 GB "
        "(TPOT x0.0569), prefill 3.82 vs 116 GFLOP (TTFT x0.0329); together TPOT x0.339, TTFT x8.3",
        "SLO-A: TPOT <= 44 ms, TTFT <= 24.9 s (the brief's 130 ms, 3 s)",
        "SLO-B: TPOT <= 68 ms, TTFT <= 41.5 s (the brief's 200 ms, 5 s)",
    ]
    faster = scaling_for(200.0, 40.0, model=model_cost(DEMO, 16)).lines()
    assert faster[0].startswith("SLOs scaled to the model (this machine is no slower than the testbed rank): ")


# ---------------------------------------------------------------- this machine's figures


def test_probe_rates_take_the_slowest_node_of_each_figure(tmp_path):
    path = _write(tmp_path / "probe.json", [_node(40.0, 1.2, 0), _node(35.0, 1.5, 1)])
    assert probe_rates(path) == Rates(35.0, 1.2)
    assert probe_rates(str(path)) == Rates(35.0, 1.2)


def test_probe_rates_read_a_real_probe_shape(tmp_path):
    doc = [{"buffer_bytes": 67108864, "cpu_affinity": "0-1", "numa_node": 0, "read_gbs": 8.714,
            "read_kernels": {"sum": 8.71}, "threads": 2, "triad_gbs": 6.65,
            "gemm": {"k": 3072, "n": 8192, "rows": 1024, "tflops": 0.6445, "threads": 2,
                     "rates": {"engine onednn-packed M=1024": 0.6445}},
            "decode_linears": {"rows": [1, 2], "gbs": [6.2, 6.4], "threads": 2}}]
    path = _write(tmp_path / "p.json", doc)
    assert probe_rates(path) == Rates(8.714, 0.6445)
    assert probe_decode_gbs(path) == 6.2        # the decode linears at one row


def test_the_decode_rate_is_the_slowest_nodes_and_only_when_every_node_has_one(tmp_path):
    def node(read, tflops, gbs):
        return {**_node(read, tflops), "decode_linears": {"rows": [1, 4], "gbs": gbs}}

    assert probe_decode_gbs(_write(tmp_path / "a.json", [node(30.0, 1.0, [21.0, 20.0]),
                                                         node(28.0, 1.1, [22.5, 9.0])])) == 21.0
    assert probe_decode_gbs(_write(tmp_path / "b.json", [node(30.0, 1.0, [21.0, 20.0]), _node(28.0, 1.1)])) is None
    odd = [{**_node(30.0, 1.0), "decode_linears": {"rows": [2], "gbs": [9]}}]
    assert probe_decode_gbs(_write(tmp_path / "c.json", odd)) is None


def test_rates_unpack_into_scaling_for_as_before(tmp_path):
    """benchmarks/serve_sweep.py calls scaling_for(*run_rates(folder)): two fields, in order."""
    assert len(Rates(1.0, 2.0)) == 2
    assert scaling_for(*Rates(31.9, 1.44)) == scaling_for(31.9, 1.44)


@pytest.mark.parametrize("doc, key", [
    ([_node(40.0, 1.2), {"read_gbs": 30.0, "gemm": None}], "[1].gemm.tflops"),
    ([{"gemm": {"tflops": 1.0}}], "[0].read_gbs"),
    ([_node(0, 1.2)], "[0].read_gbs"),
    ([_node(40.0, "fast")], "[0].gemm.tflops"),
])
def test_a_probe_file_without_a_figure_names_the_file_and_key(tmp_path, doc, key):
    path = _write(tmp_path / "bad.json", doc)
    with pytest.raises(PlatformError) as err:
        probe_rates(path)
    assert str(path) in str(err.value) and key in str(err.value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize("text", ["{}", "[]", '{"read_gbs": 8}', "[1, 2]", "not json", ""])
def test_a_file_that_is_no_probe_output_names_the_file(tmp_path, text):
    path = tmp_path / "probe.json"
    path.write_text(text)
    with pytest.raises(PlatformError, match=str(path)):
        probe_rates(path)


def test_a_missing_probe_file_is_named(tmp_path):
    with pytest.raises(PlatformError, match=f"{tmp_path / 'nope.json'}: file not found"):
        probe_rates(tmp_path / "nope.json")


def _meta(ranks: dict) -> dict:
    return {"run_id": "r", "ranks": ranks}


def test_run_rates_read_meta_json_from_the_folder_or_the_file(tmp_path):
    meta = _write(tmp_path / "meta.json", _meta({"0": {"probe": {"read_gbs": 31.9}, "gemm": {"tflops": 1.44}}}))
    assert run_rates(tmp_path) == Rates(31.9, 1.44)
    assert run_rates(meta) == Rates(31.9, 1.44)


def test_run_rates_take_the_slowest_rank(tmp_path):
    _write(tmp_path / "meta.json", _meta({
        "0": {"probe": {"read_gbs": 30.0}, "gemm": {"tflops": 2.0}},
        "1": {"probe": {"read_gbs": 40.0}, "gemm": {"tflops": 1.0}},
    }))
    assert run_rates(tmp_path) == Rates(30.0, 1.0)


@pytest.mark.parametrize("meta, key", [
    (_meta({"0": {"probe": None, "gemm": {"tflops": 1.0}}}), "ranks.0.probe.read_gbs"),
    (_meta({"0": {"probe": {"read_gbs": 30.0}, "gemm": {"tflops": 1.0}},
            "1": {"probe": {"read_gbs": 30.0}}}), "ranks.1.gemm.tflops"),
    (_meta({}), "ranks"),
    ({"run_id": "r"}, "ranks"),
    ([], "ranks"),
])
def test_a_meta_json_without_a_figure_names_the_file_and_key(tmp_path, meta, key):
    path = _write(tmp_path / "meta.json", meta)
    with pytest.raises(RunFolderError) as err:
        run_rates(tmp_path)
    assert f"{path}: {key}:" in str(err.value)


def test_a_folder_without_meta_json_is_named(tmp_path):
    with pytest.raises(RunFolderError, match=f"{tmp_path / 'meta.json'}: file not found"):
        run_rates(tmp_path)


# ---------------------------------------------------------------- vcfslm lab up --slos-from


@pytest.fixture
def fake_up(monkeypatch):
    """`lab up` without starting anything: what the CLI would pass to lab.up, recorded."""
    from vcfslm.lab import lab as lab_mod

    calls = []

    def up(folder, nodes, reporter, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(started=["vcsim"], state=SimpleNamespace(vcsim=None, env_file=folder / "lab.env"))

    monkeypatch.setattr(lab_mod, "up", up)
    monkeypatch.setattr(lab_mod, "status", lambda folder: [])
    # One CPU: the lab runs one rank, which has the probed node to itself.
    monkeypatch.setattr(generate, "machine_shape", lambda: generate.MachineShape(cpus=1, numa_nodes=1, memory_gib=16))
    return calls


def test_lab_up_with_a_bad_probe_file_is_a_usage_error_naming_it(tmp_path, fake_up):
    bad = _write(tmp_path / "bad.json", [{"read_gbs": 8.7}])
    lab_dir = tmp_path / "lab"
    result = CliRunner().invoke(main, ["lab", "up", "--slos-from", str(bad), "--dir", str(lab_dir)])
    assert result.exit_code == 2, result.output
    assert f"error: --slos-from: {bad}: [0].gemm.tflops: missing or not a positive number" in \
        result.stderr.splitlines()
    assert fake_up == [] and not lab_dir.exists()


def test_lab_up_with_a_missing_probe_file_starts_nothing(tmp_path, fake_up):
    missing = tmp_path / "missing.json"
    result = CliRunner().invoke(main, ["lab", "up", "--slos-from", str(missing), "--dir", str(tmp_path / "lab")])
    assert result.exit_code == 2 and str(missing) in result.stderr
    assert fake_up == []


def test_lab_up_scales_the_slos_and_prints_how(tmp_path, fake_up):
    probe = _write(tmp_path / "probe.json", [_node(31.9, 1.44)])
    result = CliRunner().invoke(main, ["lab", "up", "--slos-from", str(probe), "--dir", str(tmp_path / "lab")],
                                env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    # synthetic:tiny has no published shape: the machine's scaling alone, and a line says so.
    expected = scaling_for(31.9, 1.44).lines(DEFAULT_SLOS)
    expected.insert(1, "model synthetic:tiny: no published shape, so the limits are scaled by the machine alone")
    lines = result.stdout.splitlines()
    assert all(line in lines for line in expected), lines
    (kwargs,) = fake_up
    # lab.up takes the model, SLOs and notes as one LabBench now (the model sets the matrix).
    bench = kwargs["bench"]
    assert bench.slos == {"A": {"tpot_ms": 377, "ttft_s": 36.0}, "B": {"tpot_ms": 579, "ttft_s": 60.0}}
    assert bench.slo_notes == [f"slos: the brief's A and B scaled by {probe}", *expected]


def test_lab_up_without_slos_from_keeps_the_brief_slos(tmp_path, fake_up):
    result = CliRunner().invoke(main, ["lab", "up", "--dir", str(tmp_path / "lab")])
    assert result.exit_code == 0, result.output
    assert "SLO" not in result.stdout
    (kwargs,) = fake_up
    assert kwargs["bench"].slos is None and list(kwargs["bench"].slo_notes) == []



def test_lab_up_scales_by_the_model_and_the_ranks_splitting_a_node(tmp_path, fake_up, monkeypatch):
    monkeypatch.setattr(generate, "machine_shape", lambda: generate.MachineShape(cpus=2, numa_nodes=1, memory_gib=16))
    probe = _write(tmp_path / "probe.json", [_node(15.5, 0.137)])
    result = CliRunner().invoke(main, ["lab", "up", "--model", DEMO, "--slos-from", str(probe),
                                       "--dir", str(tmp_path / "lab")], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    scaling = scaling_for(15.5, 0.137, model=model_cost(DEMO, 16), ranks=2)
    lines = result.stdout.splitlines()
    assert all(line in lines for line in scaling.lines(DEFAULT_SLOS)), lines
    (kwargs,) = fake_up
    bench = kwargs["bench"]
    assert bench.model == DEMO
    assert bench.slos == {"A": {"tpot_ms": 44, "ttft_s": 24.9}, "B": {"tpot_ms": 68, "ttft_s": 41.5}}


def test_lab_up_with_phi3_mini_keeps_the_machine_ratio(tmp_path, fake_up, monkeypatch):
    """The full Phi-3-mini: one rank per node (two would not fit the lab VM), the model ratio 1."""
    monkeypatch.setattr(generate, "machine_shape", lambda: generate.MachineShape(cpus=2, numa_nodes=1, memory_gib=16))
    probe = _write(tmp_path / "probe.json", [_node(31.9, 1.44)])
    result = CliRunner().invoke(main, ["lab", "up", "--model", "synthetic:phi-3-mini", "--slos-from", str(probe),
                                       "--dir", str(tmp_path / "lab")])
    assert result.exit_code == 0, result.output
    (kwargs,) = fake_up
    assert kwargs["bench"].slos == {"A": {"tpot_ms": 377, "ttft_s": 36.0}, "B": {"tpot_ms": 579, "ttft_s": 60.0}}


def test_lab_up_refuses_an_unknown_synthetic_model(tmp_path, fake_up):
    result = CliRunner().invoke(main, ["lab", "up", "--model", "synthetic:nope", "--dir", str(tmp_path / "lab")])
    assert result.exit_code == 2 and "--model" in result.stderr and "nope" in result.stderr
    assert fake_up == []


def test_lab_up_takes_the_decode_linears_rate_and_shows_the_plain_one(tmp_path, fake_up):
    doc = [{**_node(30.1, 0.432), "decode_linears": {"rows": [1, 2], "gbs": [21.4, 21.9], "threads": 2}}]
    probe = _write(tmp_path / "probe.json", doc)
    result = CliRunner().invoke(main, ["lab", "up", "--model", DEMO, "--slos-from", str(probe),
                                       "--dir", str(tmp_path / "lab")], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    scaling = scaling_for(21.4, 0.432, model=model_cost(DEMO, 16), plain_read_gbs=30.1)
    lines = result.stdout.splitlines()
    assert all(line in lines for line in scaling.lines(DEFAULT_SLOS)), lines
    assert lines[lines.index(scaling.lines()[0])].startswith(
        "SLOs scaled to this machine and model: read 21.4 GB/s as decode's linears read it (plain read probe 30.1) "
        "vs the testbed rank's 92.4")
    (kwargs,) = fake_up
    assert kwargs["bench"].slos == scale_slos(DEFAULT_SLOS, scaling)


# ---------------------------------------------------------------- a probe taken on a busy machine


def _steadiness(share: float) -> dict:
    """A probe's recorded verdict, as the probe writes it, with others taking `share` of 2 CPUs."""
    others = steadiness.OthersCpu(cpus=2, wall_s=9.0, own_s=9.0, others_s=share * 18, share=share,
                                  steal_share=0.0)
    return steadiness.judge({"read": steadiness.Spread(5, 1.0, 1.01)}, others).to_dict()


def test_lab_up_with_a_busy_probe_says_so_under_the_scaling(tmp_path, fake_up):
    doc = [{**_node(31.9, 1.44, 0), "steadiness": _steadiness(0.49)},
           {**_node(33.0, 1.50, 1), "steadiness": _steadiness(0.0)}]
    probe = _write(tmp_path / "probe.json", doc)
    result = CliRunner().invoke(main, ["lab", "up", "--slos-from", str(probe), "--dir", str(tmp_path / "lab")])
    assert result.exit_code == 0, result.output
    warning = [f"warning: the probe in {probe} was taken on a busy machine: its figures are likely low, so the "
               "limits scaled by them are too loose; rerun `vcfslm probe` on a quiet machine, then `lab up "
               "--slos-from` with it",
               "  NUMA node 0: busy: other processes took 49% of the 2 CPUs the probe ran on (limit 10%)"]
    lines = result.stdout.splitlines()
    assert warning[0] in lines, lines
    at = lines.index(warning[0])
    assert lines[at - 2:at + 2] == [*scaling_for(31.9, 1.44).lines(DEFAULT_SLOS)[-2:], *warning]  # under SLO-A, B
    (kwargs,) = fake_up
    notes = list(kwargs["bench"].slo_notes)
    assert notes[-2:] == warning                 # the lab inventory's comments say it too
    # The limits are scaled all the same: the warning does not change them.
    assert kwargs["bench"].slos == {"A": {"tpot_ms": 377, "ttft_s": 36.0}, "B": {"tpot_ms": 579, "ttft_s": 60.0}}


@pytest.mark.parametrize("doc", [
    [{**_node(31.9, 1.44), "steadiness": _steadiness(0.01)}],      # steady
    [_node(31.9, 1.44)],                                           # a probe older than the check
])
def test_lab_up_with_a_steady_or_older_probe_warns_of_nothing(tmp_path, fake_up, doc):
    probe = _write(tmp_path / "probe.json", doc)
    assert busy_probe_lines(probe) == []
    result = CliRunner().invoke(main, ["lab", "up", "--slos-from", str(probe), "--dir", str(tmp_path / "lab")])
    assert result.exit_code == 0, result.output
    assert not any("busy" in line for line in result.stdout.splitlines())
    (kwargs,) = fake_up
    assert not any("busy" in note for note in kwargs["bench"].slo_notes)
