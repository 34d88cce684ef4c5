"""Does batching pay? The engine's linear kernel plans side by side, in one run: decode at
batch 1 against the read floor, and what a batch of 2, 4 and 8 streams costs over one.

    .venv/bin/python benchmarks/plan_batching.py                       # the demo's model, 1 layer
    .venv/bin/python benchmarks/plan_batching.py --layers 32 --rounds 1  # the full Phi-3-mini shape

Each round runs one child process per plan, alternating (dense-bf16, onednn-fp32, and
onednn-packed where oneDNN has bf16), so the machine's drift hits every plan alike; each
child is forced onto its plan with VCFSLM_LINEAR_KERNEL, the way a rank's environment would
force it. A child loads synthetic:phi-3-mini with `--layers` of its 32 layers (every matrix
shape kept: one layer and the full lm_head is the demo's model), builds the compiled engine,
then per batch runs one warm-up window and `--windows` measured ones (`--prompt` tokens in,
`--tokens` out), each beside a sustained read of as many bytes as the window's steps read
(half before, half after: this host's bandwidth drifts within seconds).

Per plan and batch it prints the median TPOT, and
  - floor/TPOT: the read floor of the bytes the plan holds and reads per step (fp32: twice
    the model's bf16 bytes) at the sustained read rate, over the TPOT. Target at batch 1:
    >= 0.6;
  - bf16 floor/TPOT: the same against the model's own bf16 bytes (what a plan that read bf16
    at the bandwidth would reach);
  - step / batch-1 step: what more streams cost. Target at batch 4: <= 1.3.
Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

sys.path.insert(0, str(ROOT))
from vcfslm.bench.pages import HUGE_PAGES_ENV  # noqa: E402
from vcfslm.engine import linear  # noqa: E402

CHILD = r"""
import json, statistics, sys
import torch
from vcfslm.bench import probe
from vcfslm.engine.decode import DecodeEngine, synthetic_prompt
from vcfslm.engine.model import load_model
layers, prompt_len, tokens, windows = map(int, sys.argv[1:5])
batches = [int(b) for b in sys.argv[5].split(",")]
spec = "synthetic:phi-3-mini" + ("" if layers == 32 else f",layers={layers}")
loaded = load_model(spec, seed=0, max_context=prompt_len + tokens)
engine = DecodeEngine(loaded.model, "compile")
held_step = loaded.step_weight_bytes * engine.plan.held_bytes_per_weight // 2
read = probe.SustainedRead()
out = {"engine": engine.label, "plan": engine.plan.kernel, "step_weight_bytes": loaded.step_weight_bytes,
       "held_step_bytes": held_step, "held_weight_bytes": loaded.held_weight_bytes, "batches": {}}
for batch in batches:
    prompt = synthetic_prompt(batch, prompt_len, loaded.config.vocab_size, seed=batch)
    engine.generate(prompt, tokens)                      # warm-up: compiles this shape
    rows = []
    for _ in range(windows):
        half = held_step * (tokens - 1) // 2
        before = read.gbs(half)
        gen = engine.generate(prompt, tokens)
        after = read.gbs(half)
        rows.append((gen.decode_s / (tokens - 1), (before + after) / 2, gen.compiles))
    out["batches"][str(batch)] = {"tpot_s": statistics.median(r[0] for r in rows),
                                  "read_gbs": statistics.median(r[1] for r in rows),
                                  "compiles": sum(r[2] for r in rows)}
print("RESULT " + json.dumps(out))
"""


def plans() -> list[str]:
    """The plans this CPU can run: oneDNN's bf16 one only where oneDNN has bf16."""
    names = [linear.DENSE_BF16]
    if linear.onednn_available():
        names.append(linear.ONEDNN_FP32)
    if linear.onednn_bf16():
        names.append(linear.ONEDNN_PACKED)
    return names


def child(plan: str, args) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(args.layers), str(args.prompt), str(args.tokens), str(args.windows),
           args.batches]
    env = {**os.environ, **HUGE_PAGES_ENV, "PYTHONPATH": str(ROOT), linear.FORCE_ENV: plan}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        sys.exit(f"child on {plan} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def verdict(value: float, target: float, at_most: bool = False) -> str:
    met = value <= target if at_most else value >= target
    return f"{'met' if met else 'NOT met'} ({'<=' if at_most else '>='} {target:g})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="Phi-3-mini layers (1: the demo's model; 32: full)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--windows", type=int, default=3, help="measured windows per batch and child")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--plans", default=None, help="comma-separated plans (default: every plan this CPU runs)")
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    names = args.plans.split(",") if args.plans else plans()
    if linear.onednn_bf16() and linear.ONEDNN_FP32 in names:
        print("this CPU has bf16 in oneDNN: onednn-fp32 and dense-bf16 run here because they are forced "
              f"({linear.FORCE_ENV}); the engine would pick onednn-packed", flush=True)
    print(f"synthetic:phi-3-mini, {args.layers} layer(s); prompt {args.prompt}, {args.tokens} tokens; "
          f"plans {', '.join(names)}; {args.rounds} round(s) alternating", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            runs[name].append(child(name, args))
            b = runs[name][-1]["batches"]
            print(f"  round {r + 1} {name}: " + ", ".join(f"b{k} {v['tpot_s'] * 1e3:.1f} ms" for k, v in b.items()),
                  flush=True)
    batches = [str(b) for b in args.batches.split(",")]
    print(f"\n{'plan':<14} {'batch':>5} {'TPOT ms':>9} {'read GB/s':>9} {'floor/TPOT':>10} "
          f"{'bf16 floor/TPOT':>15} {'step/b1':>8}")
    summary = {}
    for name in names:
        first = runs[name][0]
        tpot = {b: statistics.median(x["batches"][b]["tpot_s"] for x in runs[name]) for b in batches}
        gbs = {b: statistics.median(x["batches"][b]["read_gbs"] for x in runs[name]) for b in batches}
        for b in batches:
            floor = first["held_step_bytes"] / (gbs[b] * 1e9)
            floor16 = first["step_weight_bytes"] / (gbs[b] * 1e9)
            print(f"{name:<14} {b:>5} {tpot[b] * 1e3:>9.1f} {gbs[b]:>9.1f} {floor / tpot[b]:>10.2f} "
                  f"{floor16 / tpot[b]:>15.2f} {tpot[b] / tpot[batches[0]]:>8.2f}")
        late = sum(x["batches"][b]["compiles"] for x in runs[name] for b in batches)
        summary[name] = (first, tpot, gbs, late)
    print()
    for name, (first, tpot, gbs, late) in summary.items():
        eff = first["held_step_bytes"] / (gbs["1"] * 1e9) / tpot["1"] if "1" in tpot else None
        ratio = tpot["4"] / tpot["1"] if "1" in tpot and "4" in tpot else None
        print(f"{name}: {first['engine']}; holds {first['held_weight_bytes'] / 1e9:.2f} GB of weights "
              f"({first['step_weight_bytes'] / 1e9:.2f} GB per step in bf16)"
              + (f"; batch 1 at {eff:.2f} of the read floor, {verdict(eff, 0.6)}" if eff else "")
              + (f"; batch-4 step {ratio:.2f}x batch 1, {verdict(ratio, 1.3, at_most=True)}" if ratio else "")
              + ("" if not late else f"; {late} compiles inside measured windows"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
