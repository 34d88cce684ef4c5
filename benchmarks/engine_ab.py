"""The static figures of this tree's engine against another revision's, side by side in one run.

    .venv/bin/python benchmarks/engine_ab.py --base HEAD~1               # 8 layers, 3 rounds
    .venv/bin/python benchmarks/engine_ab.py --base 9c1c0b0 --layers 32 --rounds 2

Each round runs one child process per revision, alternating (base, this tree, base, ...), so
the machine's drift hits both alike. A child loads synthetic:phi-3-mini with `--layers` of
its 32 layers (every matrix shape kept), builds the revision's DecodeEngine, runs one
warm-up window per shape (compiles), then `--windows` windows at batch 1 and at
`--big-batch`, each `--prompt` tokens in and `--tokens` out, and prints its medians: batch-1
TPOT, batch-1 TTFT, big-batch TPOT and big-batch TTFT. The base revision is checked out
into a temporary git worktree (removed at the end). The table gives each figure's median
over rounds per revision and the ratio this tree / base (below 1: faster). Nothing here
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

sys.path.insert(0, str(ROOT))
from vcfslm.bench.pages import HUGE_PAGES_ENV  # noqa: E402

CHILD = r"""
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
import torch
from vcfslm.engine.decode import DecodeEngine, synthetic_prompt
from vcfslm.engine.model import load_model
layers, prompt_len, tokens, big, windows = map(int, sys.argv[2:7])
loaded = load_model(f"synthetic:phi-3-mini,layers={layers}", seed=0, max_context=prompt_len + tokens)
engine = DecodeEngine(loaded.model, "compile")
out = {"engine": engine.label}
for batch in (1, big):
    prompt = synthetic_prompt(batch, prompt_len, loaded.config.vocab_size, seed=batch)
    engine.generate(prompt, tokens)                      # warm-up: compiles this shape
    tpot, ttft = [], []
    for _ in range(windows):
        gen = engine.generate(prompt, tokens)
        tpot.append(gen.decode_s / (tokens - 1) * 1e3)
        ttft.append(gen.first_token - gen.request_start)
    out[f"b{batch} TPOT ms"] = statistics.median(tpot)
    out[f"b{batch} TTFT s"] = statistics.median(ttft)
    out[f"b{batch} compiles in windows"] = gen.compiles
print("RESULT " + json.dumps(out))
"""


def child(tree: Path, args) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(tree), str(args.layers), str(args.prompt), str(args.tokens),
           str(args.big_batch), str(args.windows)]
    env = {**os.environ, **HUGE_PAGES_ENV, "PYTHONPATH": str(tree)}   # a rank's environment (rank.sh)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode or line is None:
        sys.exit(f"child in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=3, help="measured windows per shape and child")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--big-batch", type=int, default=16)
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    here = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    print(f"synthetic:phi-3-mini, {args.layers} layers; prompt {args.prompt}, {args.tokens} tokens; "
          f"base {base} vs this tree {here}; {args.rounds} rounds", flush=True)
    runs: dict[str, list[dict]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="vcfslm-ab-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), base], cwd=ROOT, check=True)
        try:
            for r in range(args.rounds):
                runs["base"].append(child(tree, args))
                runs["this"].append(child(ROOT, args))
                print(f"  round {r + 1}: base {runs['base'][-1]['b1 TPOT ms']:.1f} ms, this "
                      f"{runs['this'][-1]['b1 TPOT ms']:.1f} ms batch-1 TPOT", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    print(f"engines: base {runs['base'][0]['engine']}; this {runs['this'][0]['engine']}")
    figures = [k for k in runs["this"][0] if k.endswith(("ms", " s"))]
    print(f"\n{'figure':<16} {'base':>10} {'this tree':>10} {'this/base':>10}")
    for k in figures:
        a = statistics.median(x[k] for x in runs["base"])
        b = statistics.median(x[k] for x in runs["this"])
        print(f"{k:<16} {a:>10.3f} {b:>10.3f} {b / a:>10.3f}")
    late = [k for k in runs["this"][0] if k.endswith("compiles in windows") and
            any(x[k] for side in runs.values() for x in side)]
    print("compiles inside measured windows: " + (", ".join(late) if late else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
