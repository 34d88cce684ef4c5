"""Decode efficiency of the rank engine, side by side in one process (issue 6's targets).

    .venv/bin/python benchmarks/decode_efficiency.py                 # quick: 8 of Phi-3-mini's 32 layers
    .venv/bin/python benchmarks/decode_efficiency.py --layers 32     # the full shape (~10 GB RSS, minutes)

Model: synthetic:phi-3-mini (exact Phi-3-mini-128k-instruct layer shapes, random bf16
weights); the quick mode keeps every matrix shape and drops layers, so bytes per step
shrink with the layer count but each GEMV is the real one.

Measured, alternating the batch-1 modes window by window so drift hits both alike:
  1. HF `generate()` eager (dynamic cache, greedy, EOS ignored) at batch 1;
  2. the engine (static cache, compiled decode step; `--compile` picks the mode) at batch 1;
  3. the engine at batch `--big-batch` (16).
TPOT = (last token - first token) / (tokens - 1) per window, from a streamer's timestamps
for generate(); the compile window is discarded. Roofline TPOT = bytes one decode step
reads (weights but the input embedding, plus the KV cache at the mean context) / the
probe's read bandwidth with the same threads.

Printed last, with the issue's targets:
  roofline / engine TPOT at batch 1        (target >= 0.90)
  generate() TPOT / engine TPOT at batch 1 (target >= 1.6)
  engine decode tok/s batch 16 / batch 1   (target >= 8)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vcfslm.bench import probe  # noqa: E402
from vcfslm.bench.engine import (  # noqa: E402
    CompileOptions,
    DecodeEngine,
    current_rss_bytes,
    peak_rss_bytes,
    synthetic_prompt,
)
from vcfslm.bench.model import load_model  # noqa: E402

MODES = {"autotune": CompileOptions(), "freezing": CompileOptions(max_autotune=False),
         "default": CompileOptions(freezing=False, max_autotune=False)}


class StampStreamer:
    """A generate() streamer that notes when each generated token arrives."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def hf_generate_tpot_ms(model, prompt, tokens: int) -> float:
    streamer = StampStreamer()
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False, streamer=streamer,
                             pad_token_id=model.config.pad_token_id)
    assert out.shape[1] == prompt.shape[1] + tokens and len(streamer.stamps) == tokens
    return (streamer.stamps[-1] - streamer.stamps[0]) / (tokens - 1) * 1000


def engine_window(engine, prompt, tokens: int) -> tuple[float, float, int]:
    """(TPOT ms, decode tok/s, compiles) of one engine generation."""
    gen = engine.generate(prompt, tokens)
    assert tuple(gen.tokens.shape) == (prompt.shape[0], tokens)
    tpot_s = gen.decode_s / (tokens - 1)
    return tpot_s * 1000, prompt.shape[0] * (tokens - 1) / gen.decode_s, gen.compiles


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):8.1f}  min {min(xs):8.1f}  max {max(xs):8.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="Phi-3-mini layers to keep (32 = full model)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (a short prompt)")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per window")
    ap.add_argument("--repeats", type=int, default=3, help="measured windows per mode")
    ap.add_argument("--big-batch", type=int, default=16)
    ap.add_argument("--compile", choices=sorted(MODES), default="autotune")
    ap.add_argument("--probe-mib", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    started = time.perf_counter()

    spec = "synthetic:phi-3-mini" + ("" if args.layers == 32 else f",layers={args.layers}")
    loaded = load_model(spec, seed=0, max_context=args.prompt + args.tokens)
    rss_loaded = current_rss_bytes()
    print(f"model {spec}: {loaded.facts['params'] / 1e9:.3f}B params, {loaded.weight_bytes / 1e9:.3f} GB "
          f"bf16, built in {loaded.load_s:.1f} s; RSS {rss_loaded / 1e9:.2f} GB")
    bw = probe.measure_bandwidth(args.threads, args.probe_mib)
    print(f"probe ({args.threads} threads, {args.probe_mib} MiB): read {bw.read_gbs:.1f} GB/s, "
          f"triad {bw.triad_gbs:.1f} GB/s")
    context = probe.mean_decode_context(args.prompt, args.tokens)
    step_bytes = probe.decode_step_bytes(loaded.step_weight_bytes, loaded.kv_bytes_per_token, 1, context)
    roofline = probe.roofline_tpot_ms(step_bytes, bw.read_gbs)
    print(f"batch 1 decode step reads {step_bytes / 1e9:.3f} GB -> roofline TPOT {roofline:.1f} ms")

    engine = DecodeEngine(loaded.model, MODES[args.compile])
    p1 = synthetic_prompt(1, args.prompt, loaded.config.vocab_size, seed=1)
    t0 = time.perf_counter()
    _, _, compiles = engine_window(engine, p1, args.tokens)  # compile window, discarded
    compile_s = time.perf_counter() - t0
    rss_compiled = current_rss_bytes()
    print(f"engine {engine.options.label}: first window (compile) {compile_s:.1f} s, {compiles} graph(s); "
          f"RSS {rss_compiled / 1e9:.2f} GB (+{(rss_compiled - rss_loaded) / 1e9:.2f} GB frozen/packed weights)")
    hf_generate_tpot_ms(loaded.model, p1, 4)  # warm generate()'s code paths too

    hf, eng1, eng1_tps, bad = [], [], [], 0
    for _ in range(args.repeats):
        hf.append(hf_generate_tpot_ms(loaded.model, p1, args.tokens))
        tpot, tps, compiles = engine_window(engine, p1, args.tokens)
        bad += compiles
        eng1.append(tpot)
        eng1_tps.append(tps)

    pb = synthetic_prompt(args.big_batch, args.prompt, loaded.config.vocab_size, seed=2)
    t0 = time.perf_counter()
    engine_window(engine, pb, args.tokens)  # new shape: compile window, discarded
    compile_big_s = time.perf_counter() - t0
    engb, engb_tps = [], []
    for _ in range(args.repeats):
        tpot, tps, compiles = engine_window(engine, pb, args.tokens)
        bad += compiles
        engb.append(tpot)
        engb_tps.append(tps)
    rss_end = current_rss_bytes()
    load1 = os.getloadavg()[0]

    print()
    print(f"{'mode':<34} TPOT ms (per window, {args.repeats} windows)        decode tok/s")
    print(f"{'HF generate() eager, batch 1':<34} {spread(hf)}   {1000 / statistics.median(hf):8.2f}")
    print(f"{'engine ' + args.compile + ', batch 1':<34} {spread(eng1)}   {statistics.median(eng1_tps):8.2f}")
    print(f"{'engine ' + args.compile + f', batch {args.big_batch}':<34} {spread(engb)}   "
          f"{statistics.median(engb_tps):8.2f}")
    print(f"{'roofline, batch 1':<34} {roofline:8.1f}")
    print(f"compile: batch 1 {compile_s:.1f} s, batch {args.big_batch} {compile_big_s:.1f} s; "
          f"recompiles inside measured windows: {bad}")
    print(f"memory: loaded {rss_loaded / 1e9:.2f} GB, after batch-1 compile {rss_compiled / 1e9:.2f} GB, "
          f"end {rss_end / 1e9:.2f} GB, peak {peak_rss_bytes() / 1e9:.2f} GB")
    print(f"noise: load average {load0:.2f} before, {load1:.2f} after ({os.cpu_count()} CPUs, shared machine); "
          f"wall {time.perf_counter() - started:.0f} s")
    print()
    r_roof = roofline / statistics.median(eng1)
    r_hf = statistics.median(hf) / statistics.median(eng1)
    r_batch = statistics.median(engb_tps) / statistics.median(eng1_tps)
    print(f"RATIO roofline / engine TPOT (batch 1)          {r_roof:6.2f}   target >= 0.90  "
          f"{'met' if r_roof >= 0.90 else 'NOT met'}")
    print(f"RATIO generate() TPOT / engine TPOT (batch 1)   {r_hf:6.2f}   target >= 1.60  "
          f"{'met' if r_hf >= 1.6 else 'NOT met'}")
    print(f"RATIO engine decode tok/s batch {args.big_batch} / batch 1  {r_batch:6.2f}   target >= 8.00  "
          f"{'met' if r_batch >= 8 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
