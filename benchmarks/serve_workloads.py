"""The serving threshold of one vLLM server per workload, side by side, and the nodes each
implies for the same peak: how far a node count sized on fixed 128/16-token requests is from
one sized on a chat or a RAG mix (vcfslm/workloads.py says where each mix's lengths come from).

For each workload, one local run (`vcfslm bench --local --serve --server vllm --workload W
--sweep`) on a real-shape model written by `vcfslm model write` (default Llama-3.2-1B's
shape cut to 4 layers, so a sweep fits in minutes on a small machine), at the same SLO, then
`vcfslm size --peak-rps` on each:

    .venv/bin/python benchmarks/serve_workloads.py
    .venv/bin/python benchmarks/serve_workloads.py --workloads fixed:128/16,chat,rag --rates 0.25,1,4 \
        --slo 'B:tpot<=200ms,ttft<=5s' --duration 90 --peak-rps 100
    .venv/bin/python benchmarks/serve_workloads.py --reuse DIR      # the table again from earlier runs

The table: per workload its mean prompt and output tokens as served, the threshold (req/s at
90 % of requests meeting every limit) with its 95 % interval, the concurrent streams it
holds (Little's law), and the nodes for the peak. One rank per VM here: on the brief's
VMs (four vNUMA nodes) the per-VM figures are four times these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)
from serve_sweep import VCFSLM, run, write_checkpoint  # noqa: E402

from vcfslm.results import read_serve_records  # noqa: E402

DEFAULT_MODEL = "synthetic:llama-3.2-1b,layers=4"


def bench(model: str, workload: str, args, runs: Path, run_id: str) -> Path:
    cmd = [*VCFSLM, "bench", "--local", "--serve", "--server", "vllm", "--model", model, "--workload", workload,
           "--rates", args.rates, "--slots", str(args.slots), "--duration", str(args.duration), "--warmup-s",
           str(args.warm), "--cooldown-s", str(args.warm), "--slo", args.slo, "--runs-dir", str(runs),
           "--run-id", run_id, "--repeats", "1", "--no-probe", "--output", "json"]
    if args.sweep:
        cmd += ["--sweep", "--sweep-steps", str(args.sweep_steps), "--sweep-budget", str(args.sweep_budget)]
    run(cmd, f"bench {workload}")
    return runs / run_id


def sizing(run_dir: Path, slo: str, peak_rps: float) -> dict:
    doc = json.loads(run([*VCFSLM, "size", "--results", str(run_dir), "--threshold", "serving", "--slo", slo,
                          "--peak-rps", str(peak_rps), "-o", "json"], f"size {run_dir.name}").stdout)
    (answer,) = doc["sizings"]
    return answer


def served_lengths(run_dir: Path) -> tuple[float, float, float]:
    """Mean prompt and output tokens of the requests the run served, and the share of prompt
    tokens the server's prefix cache held."""
    records = [r for r in read_serve_records(run_dir / "serving.jsonl") if r.valid]
    ins = [n for r in records for n in r.request_input_tokens]
    outs = [n for r in records for n in r.request_output_tokens]
    cached = sum(n for r in records for n in r.request_cached_tokens)
    return statistics.mean(ins), statistics.mean(outs), cached / sum(ins) if ins else 0.0


def table(runs: dict[str, Path], slo: str, peak_rps: float, command: str) -> None:
    print(f"\n{cpu_line()}\n{command}\nSLO {slo}, 90 % of requests meeting every limit; peak {peak_rps:g} req/s")
    print("| workload | mean prompt / output tokens | prefix-cache share | threshold req/s [95 % interval] "
          "| streams at it | nodes for the peak [interval] |")
    print("|---|---|---|---|---|---|")
    for name, run_dir in runs.items():
        answer = sizing(run_dir, slo, peak_rps)
        ins, outs, share = served_lengths(run_dir)
        print(f"| {name} | {ins:.0f} / {outs:.0f} | {share:.0%} | {_threshold(answer)} | "
              f"{_number(answer.get('threshold_streams_per_vm'))} | {_nodes(answer)} |")


def _number(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _threshold(answer: dict) -> str:
    """The threshold and its interval as `size` states them (≥ when every load passed)."""
    value = answer.get("threshold_load_per_vm")
    if value is None:
        return "below every load tried"
    interval = answer.get("threshold_interval_per_vm") or {}
    bound = "≥ " if answer.get("threshold_is_lower_bound") else ""
    low, high = interval.get("low"), interval.get("high")
    span = ""
    if low is not None and high is not None and not answer.get("threshold_is_lower_bound"):
        span = f" [{low:.3g}–{'<' if interval.get('high_is_exclusive') else ''}{high:.3g}]"
    return f"{bound}{value:.3g}{span}"


def _nodes(answer: dict) -> str:
    nodes = answer.get("nodes_by_rate") or answer.get("nodes")
    interval = answer.get("nodes_by_rate_interval") or {}
    low, high = interval.get("low"), interval.get("high")
    span = f" [{low}–{high}]" if low is not None and high is not None and (low, high) != (nodes, nodes) else ""
    return f"{nodes}{span}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--workloads", default="fixed:128/16,chat,rag")
    ap.add_argument("--rates", default="0.25,1,4")
    ap.add_argument("--slo", default="B:tpot<=200ms,ttft<=5s")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--warm", type=float, default=5.0)
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--sweep-steps", type=int, default=2)
    ap.add_argument("--sweep-budget", type=float, default=0.0)
    ap.add_argument("--peak-rps", type=float, default=100.0)
    ap.add_argument("--reuse", type=Path, default=None, help="a folder of earlier runs (one per workload)")
    args = ap.parse_args()
    command = "benchmarks/serve_workloads.py " + " ".join(sys.argv[1:])
    workloads = [w for w in args.workloads.split(",") if w]
    runs_dir = args.reuse or Path(tempfile.mkdtemp(prefix="vcfslm-workloads-"))
    print(f"{cpu_line()}\nruns in {runs_dir}", flush=True)
    runs: dict[str, Path] = {}
    if args.reuse is None:
        write_checkpoint(args.model)
    for i, workload in enumerate(workloads):
        run_id = f"w{i}-" + "".join(c if c.isalnum() else "-" for c in workload)
        runs[workload] = runs_dir / run_id if args.reuse else bench(args.model, workload, args, runs_dir, run_id)
    table(runs, args.slo, args.peak_rps, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
