"""Serving threshold vs static crossover on this machine, with the full Phi-3-mini shape.

Local runs of one rank (the serving one once per server: vcfslm's own engine, and vLLM's
CPU server when .venv-vllm exists, `make vllm`):

  static   batches 1, 4, 8, 16 at one context: the brief's method (every stream of a
           window starts and stops together)
  serving  the same context under Poisson arrivals with continuous batching, as many
           slots as the static crossover's batch, from 1/16 to twice that batch's static
           capacity, then a sweep that bisects towards the largest rate meeting the SLO

and then the report of both: the static crossover, the serving threshold beside it, their
ratio, the sizing law from each, and the figures (latency and goodput vs load).

The SLO is SLO-B (TPOT <= 200 ms, TTFT <= 5 s), scaled to this machine when it cannot
meet SLO-B at all: a 2-core VM streams the weights ~10x slower and multiplies ~50x slower
than a 24-vCPU rank of the brief's testbed. The TPOT limit is scaled by the ratio of the
testbed's read bandwidth per rank to this rank's (measured by the static run's probe),
the TTFT limit by the ratio of the GEMM rates, each only when it is above 1; the scaled
SLO is printed and recorded in both runs. The scaling is vcfslm.analysis.slo_scaling's, the one
`vcfslm lab up --slos-from` scales the lab's SLOs with.

    .venv/bin/python benchmarks/serve_sweep.py [--layers 32] [--input-tokens 128] [--output-tokens 16]
    .venv/bin/python benchmarks/serve_sweep.py --reuse DIR     # re-analyse earlier runs
    .venv/bin/python benchmarks/serve_sweep.py --servers vcfslm,vllm --slots 16 --rates 0.25,0.5,1
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

from vcfslm.analysis.slo_scaling import run_rates, scale_slos, scaling_for  # noqa: E402
from vcfslm.contract import DEFAULT_SLOS  # noqa: E402
from vcfslm.errors import InputError  # noqa: E402

VCFSLM = [sys.executable, "-m", "vcfslm.cli"]
SLO_B = {"B": DEFAULT_SLOS["B"]}


def run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 3):
        sys.exit(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    print(f"  {what}: {time.perf_counter() - started:.0f} s", flush=True)
    return done


def scaled_slo(static_dir: Path) -> tuple[str, dict]:
    """SLO-B scaled by this rank's probed bandwidth and GEMM rate against the testbed's."""
    try:
        scaling = scaling_for(*run_rates(static_dir))
    except InputError as exc:
        sys.exit(f"cannot scale SLO-B: {exc}")
    for line in scaling.lines(SLO_B):
        print(f"  {line}")
    limits = scale_slos(SLO_B, scaling)["B"]
    return f"B-scaled:tpot<={limits['tpot_ms']:g}ms,ttft<={limits['ttft_s']:g}s", limits


def static_rows(static_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (static_dir / "results.jsonl").read_text().splitlines() if line.strip()]


def static_median(static_dir: Path, batch: int, key: str) -> float:
    """The static run's median window value of `key` (e2e_s, tpot_ms, ttft_s) at `batch`."""
    values = sorted(r[key][0] for r in static_rows(static_dir) if r["batch_per_rank"] == batch)
    return values[len(values) // 2]


def static_crossover_batch(static_dir: Path, slo_text: str, input_tokens: int) -> int:
    """The static crossover's batch per rank, judged by vcfslm's own rule (at least 1): the
    serving run's slots, as a server's batch cap would be set from a static sweep."""
    doc = json.loads(run([*VCFSLM, "size", "--results", str(static_dir), "--threshold", "static", "--slo",
                          slo_text, "--input-tokens", str(input_tokens), "--peak-streams", "1", "-o", "json"],
                         "static crossover").stdout)
    (answer,) = doc["sizings"]
    return max(1, answer["threshold_streams_per_vm"] or 1)      # one rank per VM here


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="Phi-3-mini layers (32: the full shape)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--span-requests", type=int, default=12,
                   help="requests a window's measured span should hold at half the static capacity")
    p.add_argument("--repeats", type=int, default=1, help="measured static windows per batch")
    p.add_argument("--slots", type=int, default=None, help="serving slots (default: the static crossover batch)")
    p.add_argument("--rates", default=None, help="serving rates, req/s (default: around the static capacity)")
    p.add_argument("--servers", default=None,
                   help="who serves, comma-separated (default: vcfslm, and vllm when .venv-vllm exists)")
    p.add_argument("--sweep-steps", type=int, default=2)
    p.add_argument("--sweep-precision", type=float, default=0.25,
                   help="add windows at the bracketing rates until the threshold's 95%% interval is this narrow")
    p.add_argument("--sweep-budget", type=float, default=900.0, help="... or until they took this many seconds")
    p.add_argument("--keep", type=Path, default=None, help="run folders go here (default: a temp dir)")
    p.add_argument("--reuse", type=Path, default=None, help="analyse the runs in this folder again")
    args = p.parse_args(argv)
    print(cpu_line(), flush=True)
    model = f"synthetic:phi-3-mini,layers={args.layers}" if args.layers != 32 else "synthetic:phi-3-mini"
    runs = args.reuse or args.keep or Path(tempfile.mkdtemp(prefix="vcfslm-serve-"))
    static_dir = runs / "static"
    servers = (args.servers.split(",") if args.servers else
               ["vcfslm"] + (["vllm"] if (ROOT / ".venv-vllm" / "bin" / "python").exists() else []))
    serve_dirs = {name: runs / ("serving" if name == "vcfslm" else f"serving-{name}") for name in servers}
    common = ["--local", "--model", model, "--ranks", "1", "--input-tokens", str(args.input_tokens),
              "--output-tokens", str(args.output_tokens), "--runs-dir", str(runs), "-o", "json"]
    if args.threads:
        common += ["--threads", str(args.threads)]
    print(f"model {model}, context {args.input_tokens}+{args.output_tokens}, runs in {runs}", flush=True)
    if not (static_dir / "results.jsonl").exists():
        run([*VCFSLM, "bench", *common, "--run-id", "static", "--batch-sizes", "1,4,8,16", "--warmup", "1",
             "--repeats", str(args.repeats)], "static run")
    slo_text, _ = scaled_slo(static_dir)
    if not args.reuse:
        # Slots: the static crossover batch (a larger batch cap makes every step cost what
        # a batch that fails the SLO costs). Rates around that batch's static capacity (its
        # streams, each done after its E2E), from 1/16 to twice it; a measured span in which
        # half the capacity brings --span-requests requests; warm-up and cool-down of two
        # single-stream requests.
        slots = args.slots or static_crossover_batch(static_dir, slo_text, args.input_tokens)
        capacity = slots / static_median(static_dir, slots, "e2e_s")
        rates = ([float(r) for r in args.rates.split(",")] if args.rates else
                 [round(capacity * f, 4) for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2)])
        span = max(60.0, args.span_requests / (capacity / 2))
        warm = max(10.0, 2 * static_median(static_dir, 1, "e2e_s"))
        print(f"  serving: {slots} slots, rates {rates} req/s, span {span:.0f} s (+{warm:.0f} s warm-up and "
              "cool-down)", flush=True)
        for name, serve_dir in serve_dirs.items():
            if (serve_dir / "meta.json").exists():
                serve_dir.rename(runs / f"{serve_dir.name}-{time.strftime('%H%M%S')}")   # an earlier attempt, kept
            run([*VCFSLM, "bench", *common, "--run-id", serve_dir.name, "--serve", "--server", name,
                 "--slots", str(slots), "--rates", ",".join(f"{r:g}" for r in rates), "--sweep",
                 "--sweep-steps", str(args.sweep_steps), "--sweep-precision", f"{args.sweep_precision:g}",
                 "--sweep-budget", f"{args.sweep_budget:g}", "--duration", f"{span + 2 * warm:.0f}",
                 "--warmup-s", f"{warm:.0f}", "--cooldown-s", f"{warm:.0f}", "--repeats", "1",
                 "--slo", slo_text], f"serving run ({name})")
    report_dir = runs / "report"
    served_dirs = [str(d) for d in serve_dirs.values() if (d / "meta.json").exists()]
    run([*VCFSLM, "report", str(static_dir), *served_dirs, "--slo", slo_text, "--out", str(report_dir)],
        "report")
    results_args = [a for d in [str(static_dir), *served_dirs] for a in ("--results", d)]
    sizes = {kind: json.loads(run([*VCFSLM, "size", *results_args, "--threshold", kind, "--slo", slo_text, "--input-tokens",
                                   str(args.input_tokens), "--peak-streams", "256", "-o", "json"],
                                  f"size --threshold {kind}").stdout)
             for kind in ("static", "serving")}
    print(f"\nSLO {slo_text}; context {args.input_tokens}+{args.output_tokens} tokens; one rank per VM here")
    for kind, doc in sizes.items():
        for answer in doc["sizings"]:
            who = answer.get("server") or ""
            print(f"  {kind:<8} {who:<7} {doc['rule']}: {answer['answer']}, binding {answer['binding'] or '-'}")
            if kind == "serving" and answer["static"].get("ratio") is not None:
                print(f"  {'':<8} serving / static streams at the threshold: {answer['static']['ratio_text']}")
    served = json.loads((report_dir / "serving.json").read_text()) if (report_dir / "serving.json").exists() else {}
    for point in served.get("points", []):
        print(f"  {point.get('server', 'vcfslm'):<7} rate {point['load_per_vm']:g}/s/VM: {point['requests']} requests, {point['windows']} window(s), "
              f"p90 TTFT {point['ttft_p90_s']} s, p90 TPOT {point['tpot_p90_ms']} ms, "
              f"streams/VM {point['streams_per_vm']:.2f}")
    print(f"figures and tables: {report_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
