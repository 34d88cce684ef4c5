"""`vcfslm predict --serve` through click: a run made from known efficiencies is simulated
under serving, on the measured machine and on a platform file; the answer is whole lines or
JSON, and what cannot be simulated exits 2 naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_predict_cli import model_run, run

from vcfslm.results import read_meta, write_meta

ROOT = Path(__file__).resolve().parents[2]
SERVE = ("--serve", "--rates", "0.25,0.5,1,2", "--slo", "B:tpot<=400ms,ttft<=5s", "--input-tokens", "128",
         "--output-tokens", "16", "--duration", "200")


def test_predict_serve_gives_per_load_attainment_thresholds_nodes_and_scale_out(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--results", r, *SERVE, "--peak-rps", "100", "--scale-nodes", "2", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert [row["load"] for row in doc["loads"]] == [0.25, 0.5, 1.0, 2.0]
    low, high = doc["loads"][0], doc["loads"][-1]
    # Light load: every request meets SLO-B, the TPOT near one decode step; overload: few do.
    assert low["attainment"]["B"] == 1.0 and low["meets"]["B"] is True
    assert high["meets"]["B"] is False and high["ttft_s"]["p50"] > low["ttft_s"]["p50"]
    (th,) = doc["thresholds"]
    assert th["threshold"] in (0.25, 0.5, 1.0) and th["first_failing"] is not None
    assert th["interval"]["replicates"] > 0
    # The fit is exact (cells made from the model), so its interval's ends agree with the middle.
    assert th["fit_interval"] == [th["threshold"], th["threshold"]]
    # So does each load's p50 interval: the loads simulated again at the fit's ends.
    for row in doc["loads"]:
        for which in ("ttft_s", "tpot_ms"):
            low_end, high_end = row[which]["p50_fit_interval"]
            assert low_end == pytest.approx(row[which]["p50"], rel=1e-6) == high_end
    (nodes,) = doc["nodes"]
    assert nodes["nodes"] == -(-100 // th["threshold"]) if th["threshold"] >= 1 else nodes["nodes"] >= 100
    rows = doc["scale_out"]["B"]
    assert [row["nodes"] for row in rows] == [1, 2] and rows[0]["efficiency"] == 1.0
    assert doc["policy"]["scheduler"] == "vcfslm" and doc["policy"]["capped"] is True
    text = run("predict", "--results", r, *SERVE)
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert "Predicted serving per server (fixed 128/16, poisson, 16 slots, 1 × 200 s window(s) per load)" in lines
    assert any(line.startswith("SLO-B  ") for line in lines)


def test_predict_serve_on_a_platform_file_and_for_vllm(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    platform = ROOT / "platforms" / "vx650v4-6747p.yaml"
    out = run("predict", "--results", r, *SERVE, "--platform", platform, "--model", "phi-3-mini", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["servers_per_vm"] == 4 and "6747p" in doc["target"]
    assert any("extrapolation" in n for n in doc["notes"])
    # vLLM is fitted on vLLM's own runs only.
    wrong = run("predict", "--results", r, *SERVE, "--server", "vllm")
    assert wrong.exit_code == 2
    assert "needs a fit on vllm's own runs" in wrong.output
    v = model_run(tmp_path / "v1", "v1")
    meta = read_meta(v)
    meta.spec = {"server": {"name": "vllm"}}
    write_meta(v, meta)
    out = run("predict", "--results", v, *SERVE, "--server", "vllm", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["server"] == "vllm" and doc["policy"] == {
        "scheduler": "vllm", "slots": 16, "batched_tokens": 2048, "chunks": {}, "lane_buckets": [], "capped": False}
    assert [row["load"] for row in doc["loads"]] == [0.25, 0.5, 1.0, 2.0]


def test_serving_flags_need_serve(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--results", r, "--rates", "1,2")
    assert out.exit_code == 2
    assert "--rates only apply to predict --serve" in out.output


def test_a_closed_loop_has_no_fleet(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    args = ("predict", "--results", r, "--serve", "--users", "2,4", "--input-tokens", "128", "--output-tokens", "16",
            "--duration", "60")
    out = run(*args, "--scale-nodes", "2")
    assert out.exit_code == 2
    assert "simulated on one server only" in out.output
    one = run(*args, "-o", "json")
    assert one.exit_code == 0, one.output
    assert [row["load"] for row in json.loads(one.stdout)["loads"]] == [2.0, 4.0]


def test_the_sweep_goes_below_a_grid_that_fails_and_bisects(tmp_path):
    r = model_run(tmp_path / "r1", "r1")
    out = run("predict", "--results", r, "--serve", "--rates", "4,8", "--slo", "B:tpot<=400ms,ttft<=5s",
              "--input-tokens", "128", "--output-tokens", "16", "--duration", "200", "--sweep", "-o", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    loads = [row["load"] for row in doc["loads"]]
    assert min(loads) < 4 and len(loads) > 3
    (th,) = doc["thresholds"]
    assert th["threshold"] is not None and th["threshold"] < 4 and th["first_failing"] <= 4
