"""`vcfslm predict` through click: runs made from known efficiencies are validated and
predicted, the answer is whole lines or JSON, and bad input exits 2 naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_analysis_support import brief_shaped_csv, make_run
from test_perfmodel import CURVE_GBS, CURVE_ROWS, PHI3_2L, TRUE

from vcfslm.analysis import perfmodel as P
from vcfslm.cli import main
from vcfslm.results import read_meta, write_meta

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def model_run(path: Path, run_id: str, threads: int = 1, scale: float = 1.0, batches=(1, 4, 8, 16),
              inputs=(128, 512), probes: bool = True, dims: P.ModelDims = PHI3_2L,
              model: str = "synthetic:tiny", source: str = "synthetic:phi-3-mini,layers=2") -> Path:
    """A run dir whose cells are the model's own values for `dims` on a rank with rates x `scale`."""
    rates = P.RankRates(20.0 * scale, 0.22 * scale, CURVE_ROWS, tuple(g * scale for g in CURVE_GBS))
    table = {}
    for b in batches:
        for i in inputs:
            x = P.terms(dims, rates, P.Scenario(b, i, 16))
            step = x.linears_s / TRUE["eta_w"] + x.kv_s / TRUE["eta_kv"] + TRUE["overhead"]
            ttft = (x.prefill_s / TRUE["eta_p"] + x.prefill_attention_s / TRUE["eta_pa"]
                    + x.weights_s / TRUE["eta_w"] + TRUE["overhead_p"])
            table[(b, i)] = (ttft, step * 1000, b * 16 / (ttft + 15 * step))
    make_run(path, run_id, ["local"], table, repeats=2, ranks=1, out=16, model=model)
    meta = read_meta(path)
    meta.threads_per_rank = threads
    facts = {"node": "local", "local_rank": 0, "model": {**dims.to_facts(), "source": source}}
    if probes:
        facts |= {"probe": {"read_gbs": rates.read_gbs}, "gemm": {"tflops": rates.gemm_tflops, "threads": threads},
                  "decode_linears": {"rows": list(rates.decode_rows), "gbs": list(rates.decode_gbs),
                                     "threads": threads}}
    meta.ranks = {"0": facts}
    write_meta(path, meta)
    return path


def test_validate_by_batch_recovers_the_held_out_cells(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--validate", r, "--fit-batches", "1,4", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["fit_observations"] == 8
    assert sorted((c["batch_per_rank"], c["input_tokens"]) for c in doc["cells"]) == [
        (8, 128), (8, 512), (16, 128), (16, 512)]
    # Batches 1 and 4 stream at the same rate, so the fit cannot tell the per-step overhead
    # from the weights' efficiency: a small TPOT error at 8 and 16 is the price, said as such.
    assert doc["median_abs_error"]["tpot"] < 0.03 and doc["median_abs_error"]["ttft"] < 1e-6
    assert all(c["extrapolation"] for c in doc["cells"])       # beyond the fitted batches: said
    text = run("predict", "--validate", r, "--fit-batches", "1,4")
    assert text.exit_code == 0
    lines = text.stdout.splitlines()
    assert lines[0] == "fitted on 8 repeats: read 20.0 GB/s, GEMM 0.220 TFLOP/s per rank, decode-batch curve probed"
    assert "Held-out cells: measured p50 vs predicted" in lines
    assert "  median |error|: TPOT 1.0%, TTFT 0.0% over 4 held-out cells" in lines


def test_validate_by_threads_uses_each_runs_own_rates(tmp_path):
    one = model_run(tmp_path / "t1", "t1", threads=1)
    two = model_run(tmp_path / "t2", "t2", threads=2, scale=1.8)
    out = run("predict", "--validate", one, "--validate", two, "--fit-threads", "1", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert {c["run"] for c in doc["cells"]} == {"t2"} and len(doc["cells"]) == 8
    assert doc["median_abs_error"]["tpot"] < 1e-6


def test_predict_on_the_production_bom(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--results", r, "--platform", ROOT / "platforms" / "vx650v4-6737p.yaml",
              "--peak-streams", 256, "--slo", "B", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["target_basis"] == "spec" and "6737p" in doc["target"]
    assert doc["rank_rates"]["read_gbs"] == pytest.approx(92.4)
    assert len(doc["predictions"]) == 8
    for p in doc["predictions"]:
        lo, hi = p["tpot_ms_interval"]
        assert lo <= p["tpot_ms"] <= hi
    assert {c["slo"]["name"] for c in doc["crossovers"]} == {"B"}
    assert all(s["peak_streams"] == 256 for s in doc["sizings"])
    assert any("spec" in n for n in doc["notes"])
    text = run("predict", "--results", r, "--platform", "vx650v4-6737p", "--peak-streams", 256, "--slo", "B")
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert ("target: vx650v4-6737p: 4 vNUMA nodes x 24 vCPUs, 92.4 GB/s per node, 0.48 TFLOP/s per vCPU (spec); "
            "4 ranks x 24 threads; per rank: read 92.4 GB/s, GEMM 11.520 TFLOP/s") in lines
    assert "Predicted crossover (streams per VM still meeting the SLO at p50)" in lines
    assert "Predicted nodes (ceil(peak streams / threshold))" in lines


def test_predict_with_flags_and_a_layout_change(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--results", r, "--bandwidth-gbs", 40, "--gemm-tflops", 0.44, "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["rank_rates"]["read_gbs"] == 40 and doc["rank_rates"]["gemm_tflops"] == pytest.approx(0.44)
    # four ranks on the flags' one NUMA node share its bandwidth; --gemm-tflops is per rank
    four = run("predict", "--results", r, "--bandwidth-gbs", 40, "--gemm-tflops", 0.44, "--threads-per-rank", 4,
               "--ranks-per-node", 4, "-o", "json")
    assert four.exit_code == 0, four.output
    rates = json.loads(four.stdout)["rank_rates"]
    assert rates["read_gbs"] == pytest.approx(10.0) and rates["gemm_tflops"] == pytest.approx(0.44)
    # the run's own platform has one vCPU: two ranks cannot share it
    out = run("predict", "--results", r, "--ranks-per-node", 2)
    assert out.exit_code == 2
    assert ("error: --ranks-per-node/--threads-per-rank/--vnuma-nodes: threads_per_rank 1 x 2 rank(s) per vNUMA "
            "node needs 2 vCPUs; a node has 1") in out.stderr.splitlines()


def test_predict_from_a_csv_measured_on_a_platform(tmp_path):
    csv = tmp_path / "brief.csv"
    csv.write_text(brief_shaped_csv())
    out = run("predict", "--results", csv, "--measured-on", "vx650v4-6747p", "--platform", "vx650v4-6737p",
              "-o", "json")
    assert out.exit_code == 0, out.output
    bom = json.loads(out.stdout)
    assert bom["model"]["observations"] == 12
    same = run("predict", "--results", csv, "--measured-on", "vx650v4-6747p", "-o", "json")
    testbed = json.loads(same.stdout)
    assert "6747p" in testbed["target"] and "6737p" in bom["target"]
    cells = {(p["batch_per_rank"], p["input_tokens"]): p for p in testbed["predictions"]}
    # fewer cores, the same memory: prefill slows by up to the core ratio (1.5), decode at
    # batch 1 (bandwidth-bound) does not move
    for p in bom["predictions"]:
        t = cells[(p["batch_per_rank"], p["input_tokens"])]
        assert 1.0 <= p["ttft_s"] / t["ttft_s"] <= 1.5
        if p["batch_per_rank"] == 1:
            assert p["tpot_ms"] == pytest.approx(t["tpot_ms"], rel=0.02)
    big = max(bom["predictions"], key=lambda p: (p["input_tokens"], p["batch_per_rank"]))
    assert big["ttft_s"] / cells[(big["batch_per_rank"], big["input_tokens"])]["ttft_s"] > 1.3


@pytest.mark.parametrize("args, line", [
    (["--bandwidth-gbs", "40"], "error: give --bandwidth-gbs and --gemm-tflops together (or a --platform file)"),
    (["--validate", "RUN", "--platform", "vx650v4-6737p"],
     "error: --validate checks the model on its runs' own cells; drop --platform"),
    (["--validate", "RUN", "--fit-batches", "1,4,8,16"],
     "error: RUN: nothing is held out to predict: every cell is in the fit set"),
    (["--platform", "missing.yaml"], "error: missing.yaml: file not found"),
])
def test_bad_input_exits_2_with_a_whole_line(tmp_path, args, line):
    r = model_run(tmp_path / "r1", "r1")
    args = [str(r) if a == "RUN" else a for a in args]
    line = line.replace("RUN", str(r))
    if "--validate" not in args:
        args = ["--results", str(r), *args]
    out = run("predict", *args)
    assert out.exit_code == 2, out.output
    assert line in out.stderr.splitlines()


def test_a_run_without_probes_or_a_bare_csv_cannot_be_calibrated(tmp_path):
    r = model_run(tmp_path / "bare", "bare", probes=False)
    out = run("predict", "--results", r)
    assert out.exit_code == 2
    assert (f"error: {r}: cannot calibrate on this run: it lacks the bandwidth probe "
            "(the run was made with --no-probe?)") in out.stderr.splitlines()
    csv = tmp_path / "x.csv"
    csv.write_text(brief_shaped_csv())
    out = run("predict", "--results", csv)
    assert out.exit_code == 2
    assert any("give --measured-on PLATFORM" in line for line in out.stderr.splitlines())


def test_a_bad_platform_file_names_its_line(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnuma_nodes: 4\ncpus_per_numa_node: 24\nbandwidth_gbs: 0\n")
    out = run("predict", "--results", r, "--platform", bad)
    assert out.exit_code == 2
    lines = out.stderr.splitlines()
    assert f"error: {bad}:4:1: bandwidth_gbs: Input should be greater than 0 (got 0)" in lines
    assert f"{bad}:1:1: gemm_tflops_per_cpu: required key is missing" in lines


def test_report_states_the_fitted_model_and_draws_it(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("report", r)
    assert out.exit_code == 0, out.output
    md = (r / "report.md").read_text().splitlines()
    assert "## Performance model" in md
    assert any(line.startswith("- fitted on 16 repeats from 1 run(s), batch ≤ 16, input ≤ 512: eta_w = 0.800")
               for line in md)
    assert ("- Check: fitted on batches 1, 4 only, the other cells are predicted with median |error| TPOT 1.0%, "
            "TTFT 0.0% (4 cells; `vcfslm predict --validate` for more splits).") in md
    assert "### Performance model vs measured (fitted on every valid cell)" in md
    assert (r / "fig-6-model.png").stat().st_size > 0
    assert 'id="fig-6-model"' in (r / "report.html").read_text()


def test_predicting_another_model_shape_is_flagged(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--results", r, "--model", "phi-3-mini", "--platform", "vx650v4-6737p", "-o", "json")
    assert out.exit_code == 0, out.output
    preds = json.loads(out.stdout)["predictions"]
    assert all("another model shape than the fitted one" in p["extrapolation"] for p in preds)
    same = json.loads(run("predict", "--results", r, "--platform", "vx650v4-6737p", "-o", "json").stdout)
    # 32 layers read 5.7x the weights of the fitted 2: TPOT at batch 1 grows about as much
    ratio = preds[0]["tpot_ms"] / same["predictions"][0]["tpot_ms"]
    assert 5 < ratio < 12


def test_predict_model_takes_every_preset_and_a_bigger_one_reads_more_per_step(tmp_path):
    r = model_run(tmp_path / "r1", "r1")

    def predicted(name):
        out = run("predict", "--results", r, "--model", name, "--platform", "vx650v4-6737p", "-o", "json")
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)

    phi, qwen = predicted("phi-3-mini"), predicted("qwen2.5-7b")
    assert (phi["models"], qwen["models"]) == (["phi-3-mini"], ["qwen2.5-7b"])
    assert all(p["model"] == "qwen2.5-7b" and "another model shape than the fitted one" in p["extrapolation"]
               for p in qwen["predictions"])
    assert any("qwen2.5-7b is predicted from a fit on synthetic:tiny: another model shape" in n
               for n in qwen["notes"])
    # The same fit, another shape: Qwen2.5-7B reads 14.1 GB of linears per step, Phi-3-mini 7.4 GB
    # (and less KV: 4 KV heads), so its batch-1 TPOT is about 1.8x Phi-3-mini's.
    by_cell = {(p["batch_per_rank"], p["input_tokens"]): p["tpot_ms"] for p in phi["predictions"]}
    ratio = qwen["predictions"][0]["tpot_ms"] / by_cell[(1, 128)]
    assert (qwen["predictions"][0]["batch_per_rank"], qwen["predictions"][0]["input_tokens"]) == (1, 128)
    assert 1.6 < ratio < 2.0
    text = run("predict", "--results", r, "--model", "qwen2.5-7b", "--platform", "vx650v4-6737p")
    assert text.exit_code == 0, text.output
    assert "Predicted crossover for qwen2.5-7b (streams per VM still meeting the SLO at p50)" in text.stdout.splitlines()
    bad = run("predict", "--results", r, "--model", "gpt-5")
    assert bad.exit_code == 2 and "'gpt-5' is not one of 'phi-3-mini'" in bad.stderr


def test_runs_of_two_models_give_one_prediction_per_model_each_from_its_own_shape(tmp_path):
    from vcfslm.presets import preset_counts

    llama_2l = preset_counts("llama-3.2-3b", layers=2).dims()
    phi = model_run(tmp_path / "phi", "phi", model="synthetic:phi-3-mini,layers=2")
    llama = model_run(tmp_path / "llama", "llama", dims=llama_2l, model="synthetic:llama-3.2-3b,layers=2",
                      source="synthetic:llama-3.2-3b,layers=2")
    out = run("predict", "--results", phi, "--results", llama, "--platform", "vx650v4-6737p", "--slo", "B",
              "--peak-streams", 256, "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    names = ["synthetic:phi-3-mini,layers=2", "synthetic:llama-3.2-3b,layers=2"]
    assert doc["models"] == names
    assert [p["model"] for p in doc["predictions"]] == [names[0]] * 8 + [names[1]] * 8
    per_context = [names[0]] * 2 + [names[1]] * 2            # 128 and 512 input tokens each
    assert [c["model"] for c in doc["crossovers"]] == per_context == [s["model"] for s in doc["sizings"]]
    # Each model is predicted with its own facts, so neither is another shape than a fitted one.
    assert not any("another model shape" in f for p in doc["predictions"] for f in p["extrapolation"])
    tpot = {(p["model"], p["batch_per_rank"], p["input_tokens"]): p["tpot_ms"] for p in doc["predictions"]}
    # Llama's tied 128k-token embedding is read as its lm_head every step: more bytes than Phi's 2 layers.
    assert tpot[(names[1], 1, 128)] > 1.3 * tpot[(names[0], 1, 128)]
    text = run("predict", "--results", phi, "--results", llama, "--platform", "vx650v4-6737p", "--slo", "B")
    lines = text.stdout.splitlines()
    assert [line for line in lines if line.startswith("Predicted crossover")] == [
        f"Predicted crossover for {n} (streams per VM still meeting the SLO at p50)" for n in names]


def test_a_csv_names_its_preset_in_a_model_column(tmp_path):
    header, *rows = brief_shaped_csv().splitlines()
    csv = tmp_path / "qwen.csv"
    csv.write_text("\n".join([header + ",model"] + [row + ",synthetic:qwen2.5-7b" for row in rows]) + "\n")
    out = run("predict", "--results", csv, "--measured-on", "vx650v4-6747p", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["models"] == ["synthetic:qwen2.5-7b"]
    assert not any("another model shape" in f for p in doc["predictions"] for f in p["extrapolation"])
    odd = tmp_path / "odd.csv"
    odd.write_text("\n".join([header + ",model"] + [row + ",my-own-model" for row in rows]) + "\n")
    bad = run("predict", "--results", odd, "--measured-on", "vx650v4-6747p")
    assert bad.exit_code == 2
    assert any(line.startswith(f"error: {odd}: model: 'my-own-model' is not a shape known without a run's facts")
               for line in bad.stderr.splitlines())
