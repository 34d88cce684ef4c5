"""How well the calibrated performance model predicts cells it never saw, on this machine.

Makes two local runs of the same matrix with a Phi-3-mini-shaped model (real weights
layout, fewer layers so a run takes minutes): one rank of 1 thread and one of 2 threads.
Then asks `vcfslm predict --validate` three questions:

  batches   fit on batches 1 and 4 of each run, predict batches 8 and 16
  threads   fit on the 1-thread run, predict every cell of the 2-thread run
            (with the 2-thread run's own probes)

and prints the median absolute error of each against the targets (TPOT 15 %, TTFT 25 %).

    .venv/bin/python benchmarks/predict_validate.py [--layers 2] [--repeats 3] [--keep DIR]
    .venv/bin/python benchmarks/predict_validate.py --reuse DIR     # re-validate earlier runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VCFSLM = [sys.executable, "-m", "vcfslm.cli"]
TARGETS = {"tpot": 0.15, "ttft": 0.25}


def cpu_line() -> str:
    """The CPU and the engine's kernel path on it (every benchmark prints which it took)."""
    code = ("from vcfslm.engine import linear; from vcfslm.bench import placement;"
            "flags = placement.parse_cpu_flags(open('/proc/cpuinfo').read());"
            "print(sorted(f for f in flags if f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16')),"
            " linear.default_plan())")
    plan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return f"CPU: {model}; {plan}"


def bench(runs: Path, run_id: str, threads: int, args) -> Path:
    cmd = [*VCFSLM, "bench", "--local", "--model", f"synthetic:phi-3-mini,layers={args.layers}",
           "--ranks", "1", "--threads", str(threads), "--batch-sizes", "1,4,8,16", "--input-tokens", args.inputs,
           "--output-tokens", str(args.output_tokens), "--warmup", "1", "--repeats", str(args.repeats),
           "--runs-dir", str(runs), "--run-id", run_id, "--output", "json"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"bench failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    print(f"  {run_id}: {time.perf_counter() - started:.0f} s", flush=True)
    return runs / run_id


def validate(*args: str) -> dict:
    cmd = [*VCFSLM, "predict", *args, "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"predict failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def show(name: str, doc: dict) -> bool:
    err = doc["median_abs_error"]
    ok = all(err[k] is not None and err[k] <= TARGETS[k] for k in TARGETS)
    print(f"\n{name}: {doc['model']['statement'][2]}")
    print(f"  {'run':<6} {'input':>6} {'batch':>6} {'TTFT s':>8} {'model':>8} {'err':>7} "
          f"{'TPOT ms':>8} {'model':>8} {'err':>7}")
    for c in doc["cells"]:
        print(f"  {c['run']:<6} {c['input_tokens']:>6} {c['batch_per_rank']:>6} {c['ttft_s']:>8.3f} "
              f"{c['predicted_ttft_s']:>8.3f} {c['ttft_error']:>+7.1%} {c['tpot_ms']:>8.1f} "
              f"{c['predicted_tpot_ms']:>8.1f} {c['tpot_error']:>+7.1%}")
    print(f"  median |error|: TPOT {err['tpot']:.1%} (target <= {TARGETS['tpot']:.0%}), "
          f"TTFT {err['ttft']:.1%} (target <= {TARGETS['ttft']:.0%}): {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="Phi-3-mini layers (default 2: 0.65 GB per step)")
    p.add_argument("--inputs", default="128,512", help="prompt lengths (default 128,512)")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", type=Path, default=None, help="write the runs here (default: a temporary folder)")
    p.add_argument("--reuse", type=Path, default=None, help="validate the runs t1/ and t2/ already in this folder")
    args = p.parse_args(argv)
    print(cpu_line())
    with tempfile.TemporaryDirectory(prefix="vcfslm-predict-") as tmp:
        runs = args.reuse or args.keep or Path(tmp)
        if args.reuse:
            one, two = runs / "t1", runs / "t2"
        else:
            runs.mkdir(parents=True, exist_ok=True)
            print(f"two local runs, synthetic:phi-3-mini,layers={args.layers}, batches 1,4,8,16 x inputs "
                  f"{args.inputs}, {args.output_tokens} output tokens, {args.repeats} repeats, into {runs}:")
            one = bench(runs, "t1", 1, args)
            two = bench(runs, "t2", 2, args)
        results = [
            show("batches, 1 thread (fit 1,4; predict 8,16)", validate("--validate", str(one), "--fit-batches", "1,4")),
            show("batches, 2 threads (fit 1,4; predict 8,16)", validate("--validate", str(two), "--fit-batches", "1,4")),
            show("threads (fit the 1-thread run; predict the 2-thread run)",
                 validate("--validate", str(one), "--validate", str(two), "--fit-threads", "1")),
        ]
    print(f"\n{sum(results)}/{len(results)} checks within target")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
