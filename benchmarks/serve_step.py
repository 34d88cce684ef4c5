"""What a free slot costs: one SlotEngine step at several occupancies against DecodeEngine's
static decode step at batch 1 and at batch `--slots`, side by side in one run.

    .venv/bin/python benchmarks/serve_step.py                      # 16 slots, context 640, 2 layers
    .venv/bin/python benchmarks/serve_step.py --layers 8 --repeats 7

Model: synthetic:phi-3-mini with `--layers` of its 32 layers (every matrix shape kept).
The slot step has one static shape, [slots, 1], whatever the occupancy: a lone request
pays for the free rows (their share of every matrix product and a one-key attention). The
ratios say how much: slots at occupancy 1 against a batch-1 decode step, and slots at full
occupancy against a batch-`slots` decode step (the price of per-row masks and cache writes).

Every configuration holds its own compiled graph (two DecodeEngines, one SlotEngine), so
rounds alternate configuration by configuration and drift hits all alike. A round
prefills `--prompt` tokens per stream (untimed), then times `--steps` steps one by one;
the median step of all rounds is printed. Both engines start at the same position and
attend over the same static context. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vcfslm.bench import linear  # noqa: E402
from vcfslm.bench.engine import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.bench.model import load_model  # noqa: E402
from vcfslm.bench.placement import parse_cpu_flags  # noqa: E402
from vcfslm.bench.slots import SlotEngine  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_line() -> str:
    """The CPU, its bf16-relevant flags and the linear kernel plan the engine takes on it."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.startswith("Model name")), "unknown CPU")
    except (OSError, subprocess.CalledProcessError):
        model = "unknown CPU (no lscpu)"
    flags = parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    have = [f for f in FLAGS if f in flags]
    return f"CPU: {model}; flags {have}; {linear.choose_plan(linear.onednn_bf16())}"


def time_decode(engine: DecodeEngine, prompt: torch.Tensor, context: int,
                steps: int) -> list[float]:
    """Prefill (untimed), then `steps` decode steps, each timed."""
    batch, length = prompt.shape
    cache = engine.cache_for(batch, context)  # same shape every round: reset, no compile
    token = engine.prefill(prompt, cache).argmax(dim=-1, keepdim=True)
    times = []
    for i in range(steps):
        position = torch.full((batch, 1), length + i, dtype=torch.long)
        started = time.perf_counter()
        token, _ = engine.decode_step(token, position, cache)
        times.append(time.perf_counter() - started)
    return times


def time_slots(slots: SlotEngine, prompt: torch.Tensor, steps: int) -> list[float]:
    """Admit one stream per prompt row into slots 0.. (untimed), then `steps` timed steps."""
    slots.reset()
    slots.admit([(i, row) for i, row in enumerate(prompt)])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        slots.step()
        times.append(time.perf_counter() - started)
    return times


def agreement(slots: SlotEngine, engine: DecodeEngine, prompt: torch.Tensor, context: int,
              steps: int) -> float:
    """Share of greedy tokens equal between full slots and a decode batch on the same prompts."""
    slots.reset()
    mine = [slots.admit([(i, row) for i, row in enumerate(prompt)])]
    mine += [[out[i] for i in range(len(prompt))] for out in (slots.step() for _ in range(steps))]
    batch, length = prompt.shape
    cache = engine.cache_for(batch, context)
    token = engine.prefill(prompt, cache).argmax(dim=-1, keepdim=True)
    theirs = [token[:, 0].tolist()]
    for i in range(steps):
        position = torch.full((batch, 1), length + i, dtype=torch.long)
        token, _ = engine.decode_step(token, position, cache)
        theirs.append(token[:, 0].tolist())
    pairs = [(a, b) for row_a, row_b in zip(mine, theirs, strict=True)
             for a, b in zip(row_a, row_b, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over every configuration")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompt + 1 + args.steps > args.context:
        sys.exit("--prompt + --steps + 1 must fit --context")

    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    spec = f"synthetic:phi-3-mini,layers={args.layers}"
    loaded = load_model(spec, seed=0, max_context=args.context)
    vocab = loaded.config.vocab_size
    alone = DecodeEngine(loaded.model, "compile")
    # The model is already packed: the second engine shares its weights, with a graph of its own.
    batched = DecodeEngine(loaded.model, "compile", plan=alone.plan)
    slots = SlotEngine(alone, args.slots, args.context)
    print(f"model {spec}, {loaded.weight_bytes / 1e9:.2f} GB of weights; slots {args.slots}, "
          f"context {args.context}, prompt {args.prompt}; linears {alone.plan.label}")

    prompts = {k: synthetic_prompt(k, args.prompt, vocab, seed=k)
               for k in {1, args.slots // 2, args.slots}}
    configs = {
        f"slots, occupancy 1/{args.slots}": lambda: time_slots(slots, prompts[1], args.steps),
        f"slots, occupancy {args.slots // 2}/{args.slots}":
            lambda: time_slots(slots, prompts[args.slots // 2], args.steps),
        f"slots, occupancy {args.slots}/{args.slots}":
            lambda: time_slots(slots, prompts[args.slots], args.steps),
        "decode, batch 1": lambda: time_decode(alone, prompts[1], args.context, args.steps),
        f"decode, batch {args.slots}":
            lambda: time_decode(batched, prompts[args.slots], args.context, args.steps),
    }
    streams = dict(zip(configs, [1, args.slots // 2, args.slots, 1, args.slots], strict=True))

    started = time.perf_counter()
    with torch.inference_mode():
        for run in configs.values():  # warm-up: compiles each graph once
            run()
    graphs = (alone.compiles, batched.compiles)
    print(f"warm-up (compiles) {time.perf_counter() - started:.0f} s: graphs compiled "
          f"{graphs[0]} (batch 1 + slots), {graphs[1]} (batch {args.slots})")

    steps: dict[str, list[float]] = {name: [] for name in configs}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, run in configs.items():
                steps[name] += run()
        same = agreement(slots, batched, prompts[args.slots], args.context, args.steps)
    recompiled = (alone.compiles, batched.compiles) != graphs

    median = {name: statistics.median(t) * 1e3 for name, t in steps.items()}
    best = {name: min(t) * 1e3 for name, t in steps.items()}
    print(f"\n{'configuration':<28} {'median ms':>10} {'min ms':>8} {'tokens/s':>9}"
          f"   ({args.repeats} rounds x {args.steps} steps)")
    for name, t in steps.items():
        print(f"{name:<28} {median[name]:>10.1f} {min(t) * 1e3:>8.1f} "
              f"{streams[name] * 1e3 / median[name]:>9.1f}")
    n = args.slots
    one, half, full, alone_name, batch_name = configs
    ratios = [
        ("slots occupancy 1 / decode batch 1", one, alone_name,
         f"what a lone request pays for {n - 1} free slots"),
        (f"slots occupancy {n} / decode batch {n}", full, batch_name,
         "per-row masks and cache writes"),
        (f"slots occupancy 1 / occupancy {n}", one, full,
         "static shape: ~1 whatever the occupancy"),
        (f"slots occupancy {n // 2} / occupancy {n}", half, full, ""),
        (f"decode batch {n} / decode batch 1", batch_name, alone_name,
         "what a full batch costs over one stream"),
    ]
    print(f"\n{'ratios of step times':<40} median   best")
    for label, top, bottom, note in ratios:
        print(f"  {label:<38} {median[top] / median[bottom]:6.2f} {best[top] / best[bottom]:6.2f}"
              + (f"   ({note})" if note else ""))
    print(f"greedy tokens, slots at occupancy {n} vs decode batch {n} on the same prompts: "
          f"{same:.0%} equal ({args.steps + 1} per stream)")
    print("recompiles during the measured rounds: "
          + ("YES (figures invalid)" if recompiled else "none"))


if __name__ == "__main__":
    main()
