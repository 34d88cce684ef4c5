"""Two tiny models of different families (Phi-3 and Qwen2's structure: GQA, q/k/v biases,
tied embedding), each benchmarked by `vcfslm bench --local` on the real engine, then one
report and one sizing over both: a row per model, never pooled."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vcfslm import presets
from vcfslm.cli import main

pytestmark = pytest.mark.integration

MATRIX = ["--ranks", "1", "--threads", "1", "--batch-sizes", "2", "--input-tokens", "8", "--output-tokens", "4",
          "--warmup", "0", "--repeats", "2", "--no-probe", "--slo", "loose:tpot<=60s,ttft<=60s",
          # Eager: each family's compiled step is checked against HF in test_model_families.py;
          # here its C++ kernels were most of the time wherever Inductor's cache was cold.
          "--compile", "eager"]


def bench(model: str, runs, run_id: str):
    result = CliRunner().invoke(main, ["bench", "--local", "--model", model, *MATRIX, "--runs-dir", str(runs),
                                       "--run-id", run_id, "-o", "json"])
    assert result.exit_code == 0, result.output
    return runs / run_id


def test_two_families_benchmark_and_answer_side_by_side(tmp_path):
    config = tmp_path / "qwen-tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(presets.tiny_values("qwen2.5-3b")))
    qwen = f"synthetic:config={config}"
    runs = tmp_path / "runs"
    phi_run, qwen_run = bench("synthetic:tiny", runs, "phi"), bench(qwen, runs, "qwen")

    facts = json.loads((qwen_run / "meta.json").read_text())["ranks"]["0"]["model"]
    assert (facts["architecture"], facts["kv_heads"], facts["source"]) == ("Qwen2ForCausalLM", 1, qwen)

    sized = CliRunner().invoke(main, ["size", "--peak-streams", "8", "--slo", "loose", "--results", str(phi_run),
                                      "--results", str(qwen_run), "-o", "json"])
    assert sized.exit_code == 0, sized.output
    rows = json.loads(sized.stdout)["sizings"]
    assert sorted({r["model"] for r in rows}) == sorted(["synthetic:tiny", qwen])

    out = tmp_path / "report"
    report = CliRunner().invoke(main, ["report", str(phi_run), str(qwen_run), "--slo", "loose", "--out", str(out)])
    assert report.exit_code == 0, report.output
    lines = (out / "report.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| model | SLO |"))
    answer = lines[lines.index(header) + 2:]
    answer = answer[:next(i for i, line in enumerate(answer) if not line.startswith("|"))]
    assert [row.split("|")[1].strip() for row in answer] == ["synthetic:tiny", qwen]
