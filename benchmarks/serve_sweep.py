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

Side by side at fixed rates (no sweep, one window per rate and server, the SLO given):
the table per rate and server (TTFT and TPOT p50/p90, the share that met both limits),
each server's threshold among the rates, vcfslm's static batch-1 TPOT, its serving chunk
and the rule that chose it, and the targets checked:

    .venv/bin/python benchmarks/serve_sweep.py --servers vcfslm,vllm --slots 16 --rates 0.075,0.15,0.3 \
        --static-batches 1 --no-sweep --slo 'B:tpot<=580ms,ttft<=33s' --span 120 --warm 10
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def write_checkpoint(model: str, seed: int = 0) -> None:
    """The synthetic model as the checkpoint vLLM loads, by `vcfslm model write`, into the
    folder `vcfslm bench --server vllm` looks in (so the bench reuses it)."""
    import os
    import re

    cache = Path(os.environ.get("VCFSLM_MODEL_CACHE") or "~/.cache/vcfslm/models").expanduser()
    folder = cache / f"{re.sub(r'[^A-Za-z0-9.=-]+', '-', model)}-seed{seed}"
    if not (folder / "config.json").exists():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        run([*VCFSLM, "model", "write", model, str(partial), "--seed", str(seed)], f"model write {folder}")
        partial.rename(folder)


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


def given_slo(text: str) -> tuple[str, dict]:
    """'B:tpot<=580ms,ttft<=33s' -> (the text, {tpot_ms, ttft_s})."""
    limits: dict = {"tpot_ms": None, "ttft_s": None}
    for part in text.split(":", 1)[1].split(","):
        key, value = part.split("<=")
        if key.strip() == "tpot":
            limits["tpot_ms"] = float(value.strip().removesuffix("ms"))
        else:
            limits["ttft_s"] = float(value.strip().removesuffix("s"))
    return text, limits


def serve_rows(serve_dir: Path, limits: dict) -> dict[float, dict]:
    """Per rate: every counted request of the run's valid windows, its p50/p90 TTFT and
    TPOT (an unfinished request counts as infinite) and the share that met both limits."""
    from vcfslm.results import read_serve_records
    from vcfslm.serving import decisions as serving

    pooled: dict[float, dict] = {}
    for r in read_serve_records(serve_dir / "serving.jsonl"):
        if not r.valid:
            continue
        p = pooled.setdefault(float(r.load), {"ttft": [], "tpot": [], "unfinished": 0, "chunk": r.chunk_tokens,
                                              "rule": r.chunk_rule, "by_lanes": r.chunk_by_lanes})
        p["ttft"] += r.ttft_s
        p["tpot"] += r.tpot_ms
        p["unfinished"] += r.unfinished
    for p in pooled.values():
        n = len(p["ttft"]) + p["unfinished"]
        met = sum(1 for a, b in zip(p["ttft"], p["tpot"], strict=True)
                  if a <= (limits["ttft_s"] or float("inf")) and b <= (limits["tpot_ms"] or float("inf")))
        p.update(requests=n, met=met, share=met / n if n else 0.0,
                 **{f"{k}_p{q}": serving.tail(p[k], p["unfinished"], q) for k in ("ttft", "tpot") for q in (50, 90)})
    return pooled


def threshold(rows: dict[float, dict], attainment: float = 0.9) -> float | None:
    """The largest measured rate at which, and at every lower one, the share met both limits."""
    best = None
    for rate in sorted(rows):
        if rows[rate]["share"] < attainment:
            break
        best = rate
    return best


def comparison(static_dir: Path, serve_dirs: dict[str, Path], slo_text: str, limits: dict, command: str) -> None:
    """The side-by-side table, and the targets: vcfslm's threshold at least vLLM's and holding
    the middle rate; light-load p50 TTFT within 1.3x vLLM's; p90 TPOT within 1.15x static b1."""
    b1 = static_median(static_dir, 1, "tpot_ms") if (static_dir / "results.jsonl").exists() else None
    rows = {name: serve_rows(d, limits) for name, d in serve_dirs.items() if (d / "serving.jsonl").exists()}
    fmt = lambda v, d: "inf" if v == float("inf") else f"{v:.{d}f}"   # noqa: E731
    print(f"\n{cpu_line()}\n{command}\nSLO {slo_text}, 90 % of requests meeting both")
    if b1 is not None:
        print(f"static batch 1 (vcfslm): TPOT {b1:.0f} ms (median window)")
    print("| server | req/s | p50 / p90 TTFT (s) | p50 / p90 TPOT (ms) | met both | threshold |")
    print("|---|---|---|---|---|---|")
    for name, per in rows.items():
        th = threshold(per)
        for k, rate in enumerate(sorted(per)):
            p = per[rate]
            last = (f"**{th:g} req/s**" if th is not None else f"**< {min(per):g} req/s**") if k == 0 else ""
            print(f"| {name if k == 0 else ''} | {rate:g} | {fmt(p['ttft_p50'], 2)} / {fmt(p['ttft_p90'], 2)} | "
                  f"{fmt(p['tpot_p50'], 0)} / {fmt(p['tpot_p90'], 0)} | {p['met']}/{p['requests']} "
                  f"({100 * p['share']:.0f} %) | {last} |")
    mine, theirs = rows.get("vcfslm"), rows.get("vllm")
    if mine:
        p = next(iter(mine.values()))
        print(f"vcfslm chunk: {p['chunk']} tokens per step, rule {p['rule'] or '-'}, by lane count {p['by_lanes']}")
    if not (mine and theirs):
        return
    rates = sorted(set(mine) & set(theirs))
    ours, vllm = threshold(mine), threshold(theirs)
    middle = rates[len(rates) // 2]
    light = mine[rates[0]]["ttft_p50"] / theirs[rates[0]]["ttft_p50"]
    print(f"target: vcfslm's threshold >= vLLM's: {ours} vs {vllm}: "
          f"{'met' if (ours or 0) >= (vllm or 0) else 'missed'}")
    print(f"target: vcfslm holds the middle rate {middle:g} req/s: {100 * mine[middle]['share']:.0f} % met both: "
          f"{'met' if mine[middle]['share'] >= 0.9 else 'missed'}")
    print(f"target: light-load ({rates[0]:g} req/s) p50 TTFT within 1.3x vLLM's: {light:.2f}x: "
          f"{'met' if light <= 1.3 else 'missed'}")
    if b1:
        for rate in rates:
            ratio = mine[rate]["tpot_p90"] / b1
            print(f"target: p90 TPOT within 1.15x static batch 1 at {rate:g} req/s: {ratio:.2f}x: "
                  f"{'met' if ratio <= 1.15 else 'missed'}")


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
    p.add_argument("--static-batches", default="1,4,8,16", help="the static run's batches")
    p.add_argument("--slo", default=None, help="the SLO, e.g. 'B:tpot<=580ms,ttft<=33s' (default: SLO-B scaled)")
    p.add_argument("--no-sweep", action="store_true", help="only the rates given, one window each: no bisection")
    p.add_argument("--span", type=float, default=None, help="a window's measured span, s (default: from the capacity)")
    p.add_argument("--warm", type=float, default=None, help="its warm-up and cool-down, s each")
    args = p.parse_args(argv)
    command = "benchmarks/serve_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
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
        run([*VCFSLM, "bench", *common, "--run-id", "static", "--batch-sizes", args.static_batches, "--warmup", "1",
             "--repeats", str(args.repeats)], "static run")
    slo_text, limits = given_slo(args.slo) if args.slo else scaled_slo(static_dir)
    if "vllm" in servers and model.startswith("synthetic:"):
        write_checkpoint(model)
    if not args.reuse:
        # Slots: the static crossover batch (a larger batch cap makes every step cost what
        # a batch that fails the SLO costs). Rates around that batch's static capacity (its
        # streams, each done after its E2E), from 1/16 to twice it; a measured span in which
        # half the capacity brings --span-requests requests; warm-up and cool-down of two
        # single-stream requests.
        slots = args.slots or static_crossover_batch(static_dir, slo_text, args.input_tokens)
        capacity = (slots / static_median(static_dir, slots, "e2e_s")) if not (args.rates and args.span) else None
        rates = ([float(r) for r in args.rates.split(",")] if args.rates else
                 [round(capacity * f, 4) for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2)])
        span = args.span or max(60.0, args.span_requests / (capacity / 2))
        warm = args.warm if args.warm is not None else max(10.0, 2 * static_median(static_dir, 1, "e2e_s"))
        sweep = [] if args.no_sweep else ["--sweep", "--sweep-steps", str(args.sweep_steps), "--sweep-precision",
                                          f"{args.sweep_precision:g}", "--sweep-budget", f"{args.sweep_budget:g}"]
        print(f"  serving: {slots} slots, rates {rates} req/s, span {span:.0f} s (+{warm:.0f} s warm-up and "
              "cool-down)", flush=True)
        for name, serve_dir in serve_dirs.items():
            if (serve_dir / "meta.json").exists():
                serve_dir.rename(runs / f"{serve_dir.name}-{time.strftime('%H%M%S')}")   # an earlier attempt, kept
            run([*VCFSLM, "bench", *common, "--run-id", serve_dir.name, "--serve", "--server", name,
                 "--slots", str(slots), "--rates", ",".join(f"{r:g}" for r in rates), *sweep,
                 "--duration", f"{span + 2 * warm:.0f}",
                 "--warmup-s", f"{warm:.0f}", "--cooldown-s", f"{warm:.0f}", "--repeats", "1",
                 "--slo", slo_text], f"serving run ({name})")
    if args.no_sweep:
        comparison(static_dir, serve_dirs, slo_text, limits, command)
        return 0
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
