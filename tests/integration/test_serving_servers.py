"""HTTP serving backends end to end under torchrun: a fake OpenAI server started from the
rendered launch script as if it were vLLM (the dead-server stop and the resume), and one
real vLLM CPU server on a tiny model (.venv-vllm, as `make vllm` installs it)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vcfslm import results
from vcfslm.bench.local import NODE_NAME, LocalLaunch, run_local
from vcfslm.errors import BenchError
from vcfslm.guest.templates import render_template
from vcfslm.matrix import serve_matrix
from vcfslm.runspec import ProbeSpec, RunSpec
from vcfslm.serving import decisions as serving
from vcfslm.serving.decisions import ServeSpec
from vcfslm.serving.servers import ServerSpec
from vcfslm.serving.workloads import parse_workload

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SLOS = {"B": {"tpot_ms": 2000.0, "ttft_s": 10.0}}


def fake_python(tmp: Path) -> Path:
    """An 'interpreter' for the launch script that runs the fake server instead of vLLM."""
    path = tmp / "fake-python"
    path.write_text(f"#!/usr/bin/env bash\nexec {sys.executable} -m tests.fake_openai \"$@\"\n")
    path.chmod(0o755)
    return path


def model_folder(tmp: Path) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "vocab_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128,
        "num_hidden_layers": 2, "max_position_embeddings": 4096}))
    return folder


def run(tmp: Path, spec: ServeSpec, *, resume: bool = False, python: Path, model: Path, port: int,
        run_id: str = "srv"):
    """A local serving run; vLLM eager (--enforce-eager): its compile of the model would be half
    of its start, and these tests check the serving path, not vLLM's compiled steps."""
    run_spec = RunSpec(run_id=run_id, mode="local", model=str(model), matrix=serve_matrix(spec), seed=0, ranks=1,
                       nodes=(NODE_NAME,), slos=SLOS, probe=ProbeSpec(enabled=False), serve=spec,
                       server=ServerSpec(name="vllm", port=port, health_timeout_s=600, enforce_eager=True),
                       timeout_s=900)
    return run_local(run_spec, LocalLaunch(runs_dir=tmp / "runs", resume=resume, server_python=str(python)),
                     render_template=render_template)


def server_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_a_dead_server_stops_the_run_and_resume_completes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    spec = ServeSpec(loads=(4.0, 8.0), input_tokens=(16,), output_tokens=4, duration_s=3.0, warmup_s=0.5,
                     cooldown_s=0.5, warmup_windows=0)
    python, model = fake_python(tmp_path), model_folder(tmp_path)
    # The server exits three replies into the second load: the first load's window is kept.
    first = serving.open_loop_plan(spec, 4.0, 16, random.Random(serving.window_seed(0, 0, 4.0, 16, 0)))
    monkeypatch.setenv("FAKE_DIE_AFTER", str(len(first) + 3))
    with pytest.raises(BenchError, match="exited with code 3"):
        run(tmp_path, spec, python=python, model=model, port=18710)
    run_dir = tmp_path / "runs" / "srv"
    kept = results.read_serve_records(run_dir / "ranks" / "serve-0.jsonl")
    assert [r.load for r in kept] == [4.0]
    meta = results.read_meta(run_dir)
    assert meta.complete is False and "exited with code 3" in (meta.failure or "")
    assert server_processes(str(run_dir)) == []      # nothing left running

    monkeypatch.delenv("FAKE_DIE_AFTER")
    done = run(tmp_path, spec, python=python, model=model, port=18710, resume=True)
    assert sorted(r.load for r in done.serve_records) == [4.0, 8.0]
    assert done.meta.complete is True
    records = results.read_serve_records(run_dir / results.SERVE_RESULTS)
    assert all(r.server == "vllm" and r.valid for r in records)
    assert all(len(t) == 4 for r in records for t in r.token_s)
    assert records[0].server_metrics["kv_cache_usage_max"] == 0.25
    facts = json.loads((run_dir / "ranks.json").read_text())[0]["server"]
    assert facts["version"] == "fake-1.0" and facts["port"] == 18710
    assert any("Chunked prefill" in line for line in facts["log_facts"])
    assert done.meta.matrix["server"]["name"] == "vllm"
    # The key was never written: not in the scripts, the logs, the records or meta.json.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert "VLLM_API_KEY=" not in path.read_text(errors="replace")
    assert server_processes(str(run_dir)) == []


@pytest.mark.skipif(not VLLM_PYTHON.exists() and not os.environ.get("CI"),
                    reason="vLLM CPU is not installed here (make vllm); CI installs it and runs this")
def test_a_real_vllm_server_serves_a_tiny_model(tmp_path):
    from tests.vllm_model import write_tiny_vllm_model

    model = write_tiny_vllm_model(tmp_path / "tiny")
    # Three-turn conversations, each turn carrying the last prompt and reply as its prefix:
    # vLLM's prefix cache (blocks of 128 tokens on CPU) holds the earlier prompts' blocks.
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(json.dumps(row) + "\n" for c in range(20) for row in (
        {"conversation": c, "turn": 0, "input_tokens": 300, "output_tokens": 8},
        {"conversation": c, "turn": 1, "input_tokens": 400, "output_tokens": 8, "prefix_tokens": 308},
        {"conversation": c, "turn": 2, "input_tokens": 500, "output_tokens": 8, "prefix_tokens": 408})))
    spec = ServeSpec(loads=(2.0,), input_tokens=(500,), output_tokens=8, duration_s=8.0, warmup_s=1.0,
                     cooldown_s=1.0, warmup_windows=1, slots=4, workload=parse_workload(str(conversations)))
    done = run(tmp_path, spec, python=VLLM_PYTHON, model=model, port=18760, run_id="vllm")
    assert done.meta.complete is True
    [record] = done.serve_records
    assert record.server == "vllm" and record.valid, record.invalid_reasons
    assert record.completed == record.offered > 0 and record.failed == 0
    assert record.request_output_tokens == [8] * record.completed       # ignore_eos: every token came
    assert record.workload == "file:conversations.jsonl" and len(record.workload_digest) == 12
    pairs = list(zip(record.request_prefix_tokens, record.request_cached_tokens, strict=True))
    assert {p for p, _ in pairs} >= {0, 308}, pairs
    # A later turn finds its conversation's earlier prompt in the cache; a first turn shares nothing.
    assert all(cached >= 256 for prefix, cached in pairs if prefix >= 308), pairs
    assert all(cached == 0 for prefix, cached in pairs if prefix == 0), pairs
    assert record.server_metrics["generation_tokens"] >= 8 * record.completed
    facts = json.loads((done.run_dir / "ranks.json").read_text())[0]["server"]
    assert facts["version"].startswith("0.32")
    assert facts["chunked_prefill"] is True and max(facts["peak_rss_bytes"].values()) > 100e6
    assert facts["enforce_eager"] is True
    assert "enforce_eager=True" in Path(facts["log"]).read_text(errors="replace")   # vLLM took the flag
    assert server_processes(str(done.run_dir)) == []
