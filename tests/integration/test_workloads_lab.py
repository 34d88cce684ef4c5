"""Workloads on the lab (real sshd guests, real torchrun, synthetic:tiny on vcfslm's engine):
a run on the chat mix and a run replaying a Mooncake trace at two time scales, then one
report of both: each workload its own series, its TTFT and TPOT by prompt length, and its own
row in the answer; the engine's missing prefix cache said beside the conversations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vcfslm.results import read_run

pytestmark = pytest.mark.integration

VCFSLM = [sys.executable, "-m", "vcfslm.cli"]
# Prompt pieces of 256 tokens, not the SLO rule's: under this loose TPOT limit the rule takes
# 2048-token pieces, and the numerics gate's steps beside a piece of that width over the
# chat mix's 4k context were half of each rank's time (the sizing is not what this checks).
WINDOWS = ["--slots", "4", "--duration", "3", "--warmup-s", "0.5", "--cooldown-s", "0.5", "--repeats", "1",
           "--compile", "eager", "--no-probe", "--slo", "B:tpot<=500ms,ttft<=5s", "--chunk-tokens", "256",
           "--output", "json"]


def cli(lab, *args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, **lab.env, "VCFSLM_STATE": str(lab.dir / "state.json")}
    return subprocess.run([*VCFSLM, *args], capture_output=True, text=True, env=env, timeout=timeout)


def mooncake_trace(path: Path) -> Path:
    """60 requests, one every 0.5 s (2 req/s of its own), prompts from 100 to 1500 tokens in
    512-token blocks, every third sharing its first block with the one before."""
    rows = []
    for i in range(60):
        length = 100 + (i * 97) % 1400
        blocks = [1000 + i // 3 * 3] + [2000 + i * 10 + b for b in range(1, (length + 511) // 512)]
        rows.append({"timestamp": 500 * i, "input_length": length, "output_length": 8 + i % 9,
                     "hash_ids": blocks})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_chat_mix_and_a_replayed_trace_each_get_length_buckets_and_an_answer(provisioned_lab, tmp_path):
    runs = tmp_path / "runs"
    chat = cli(provisioned_lab, "bench", "--nodes", "1", "--serve", "--workload", "chat", "--rates", "2,6",
               "--run-id", "t-chat", "--runs-dir", str(runs), *WINDOWS)
    assert chat.returncode == 0, chat.stdout[-2000:] + chat.stderr[-3000:]
    trace = mooncake_trace(tmp_path / "trace.jsonl")
    replay = cli(provisioned_lab, "bench", "--nodes", "1", "--serve", "--workload", f"mooncake:{trace}",
                 "--time-scale", "1,4", "--run-id", "t-trace", "--runs-dir", str(runs), *WINDOWS)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-3000:]
    # Its summary names the files it left in vLLM's --save-result layout.
    assert json.loads(replay.stdout)["vllm_results"]

    chat_run, trace_run = read_run(runs / "t-chat"), read_run(runs / "t-trace")
    assert chat_run.meta.complete and trace_run.meta.complete
    assert {r.workload for r in chat_run.serve_records} == {"chat"}
    # Later turns carried their conversation's history; the engine has no prefix cache to say
    # what it held of it.
    assert any(p > 0 for r in chat_run.serve_records for p in r.request_prefix_tokens)
    assert all(r.request_cached_tokens == [] for r in chat_run.serve_records)
    # The trace's own rate is 60 requests over 30 s: the scales 1 and 4 are 2 and 8 req/s.
    assert sorted({r.load for r in trace_run.serve_records}) == [2.0, 8.0]
    assert sorted({round(r.time_scale, 3) for r in trace_run.serve_records}) == [1.0, 4.0]
    assert {r.workload for r in trace_run.serve_records} == {"mooncake:trace.jsonl"}
    lengths = {n for r in trace_run.serve_records for n in r.request_input_tokens}
    assert min(lengths) < 256 and max(lengths) >= 1024

    report = cli(provisioned_lab, "report", str(runs / "t-chat"), str(runs / "t-trace"), "--out",
                 str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr[-3000:]
    md = (tmp_path / "report" / "report.md").read_text().splitlines()
    buckets = [line for line in md if line.startswith("### TTFT and TPOT by prompt length")]
    assert any(line.endswith("workload chat (mix)") for line in buckets), buckets
    assert any("workload trace.jsonl (Mooncake trace, " in line for line in buckets), buckets
    # Each workload is a row of its own in the answer, never pooled with the other.
    answer = [line for line in md if line.startswith("| ") and "SLO-B" in line]
    assert any("chat (mix)" in line for line in answer), answer
    assert any("trace.jsonl (Mooncake trace, " in line for line in answer), answer
    assert any("no prefix cache" in line for line in md)
    assert (tmp_path / "report" / "serve-length-buckets.csv").exists()
