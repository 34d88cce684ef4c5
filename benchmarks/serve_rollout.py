"""Changes without downtime, measured on this machine's lab: vLLM CPU on a small model, one
server per lab node behind vLLM's router and the front door (`vcfslm serve up`), loaded
through that endpoint (`vcfslm bench --serve --deployment`) at a steady rate while a server
setting changes and then while the key rotates. Per change: the requests that failed in
the window that took it, the window's attainment per SLO, and how long the roll took.

    .venv/bin/python benchmarks/serve_rollout.py --rate 4            # tiny-64, 2 lab nodes
    .venv/bin/python benchmarks/serve_rollout.py --lab-dir /tmp/lab  # an existing lab

The bench reads its key once, when it starts: across a key rotation it keeps the old key,
which the door refuses once the second roll begins (by design), so the rotation's window
is sized to end before that (0.8 of the setting change's roll, which restarts the same
servers): its requests cross the first roll, where the door and the servers change under
them.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)
from serve_scaleout import VCFSLM, run, serve_inventory, served_lab  # noqa: E402

from vcfslm.analysis.report import known_slos, load_inputs  # noqa: E402
from vcfslm.serving import judging  # noqa: E402


def window_figures(folder: Path) -> dict:
    """The window's offered, completed, failed requests and attainment per SLO."""
    analysis, _ = load_inputs([str(folder)])
    slos, _ = known_slos([r.meta for r in analysis.runs])
    records = [r for run in analysis.runs for r in (run.serve_records or ())]
    out = {"offered": 0, "completed": 0, "failed": 0, "errors": [], "attainment": {}}
    for r in records:
        out["offered"] += r.offered
        out["completed"] += r.completed
        out["failed"] += int(getattr(r, "failed", 0) or 0) + int(r.unfinished or 0)
        out["errors"] += list(getattr(r, "errors", None) or [])[:3]
        for slo in slos:
            a = judging.attainment(list(r.ttft_s), list(r.tpot_ms), r.unfinished, slo.tpot_ms, slo.ttft_s,
                                   input_tokens=list(r.request_input_tokens),
                                   ttft_per_token_ms=getattr(slo, "ttft_per_token_ms", None))
            out["attainment"][slo.name] = round(a.share, 3)
    return out


def loaded_change(inventory: Path, key: Path, runs: Path, run_id: str, args, env, change: list[str],
                  before_change_s: float, duration_s: float) -> tuple[dict, float]:
    """One bench window of `duration_s` at args.rate with `serve up CHANGE` started
    `before_change_s` into it."""
    bench = subprocess.Popen(
        [*VCFSLM, "bench", "--serve", "--deployment", str(inventory), "--key-file", str(key),
         "--rates", str(args.rate), "--input-tokens", str(args.input_tokens),
         "--output-tokens", str(args.output_tokens), "--duration", f"{duration_s:.0f}", "--warmup-s", "2",
         "--cooldown-s", "2", "--run-id", run_id, "--runs-dir", str(runs)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    took = {}

    def roll() -> None:
        time.sleep(before_change_s)
        started = time.monotonic()
        run("serve", "up", str(inventory), "--key-file", str(key), "--no-install", *change, env=env, timeout=3600)
        took["s"] = time.monotonic() - started

    roller = threading.Thread(target=roll)
    roller.start()
    out, err = bench.communicate(timeout=7200)
    roller.join()
    if bench.returncode not in (0, 1):
        raise SystemExit(f"bench failed ({bench.returncode}):\n{err[-3000:]}")
    return window_figures(runs / run_id), took.get("s", float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:tiny-64", help="Written with `vcfslm model write`.")
    p.add_argument("--rate", type=float, default=4.0, help="Requests/s (about half the threshold).")
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=480.0,
                   help="Seconds of arrivals in the setting change's window (longer than its roll).")
    p.add_argument("--slots", type=int, default=8, help="max_num_seqs per server.")
    p.add_argument("--lab-dir", default=None, help="Lab folder (default: a new one, taken down at the end).")
    args = p.parse_args()
    # A timeout's SIGTERM still takes the service and the lab down (served_lab's way out).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(cpu_line())
    with served_lab(args.lab_dir, 2, "vcfslm-rollout-") as (work, lab, env):
        key, runs = work / "slm.key", work / "runs"
        model = work / "model"
        run("model", "write", args.model, str(model), env=env)
        inventory = serve_inventory(lab, model, 2, "auto", args.slots)
        run("serve", "up", str(inventory), "--key-file", str(key), env=env, timeout=3600)
        doc = yaml.safe_load(inventory.read_text())
        doc["serve"]["max_num_seqs"] = args.slots - 1
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        setting, setting_s = loaded_change(inventory, key, runs, "setting", args, env, [], 10.0, args.duration)
        # The rotation's first roll takes about as long as the setting's (the same servers
        # restart): the window covers it and ends before the second roll refuses the old key.
        rotation, rotation_s = loaded_change(inventory, key, runs, "rotation", args, env, ["--rotate-key"], 10.0,
                                             min(args.duration, 0.8 * setting_s))
        print(f"\n{args.model}, {args.input_tokens}/{args.output_tokens} tokens, {args.rate:g} req/s Poisson, "
              f"2 servers behind the router, {args.duration:g} s windows")
        for name, fig, took in (("server setting (max_num_seqs)", setting, setting_s),
                                ("key rotation", rotation, rotation_s)):
            print(f"{name:<32} serve up {took:.0f} s; requests {fig['offered']} offered, {fig['completed']} "
                  f"completed, {fig['failed']} failed; attainment "
                  + ", ".join(f"{k} {v:.0%}" for k, v in fig["attainment"].items())
                  + (f"; errors {fig['errors']}" if fig["errors"] else ""))
    print(f"\nruns in {runs}")


if __name__ == "__main__":
    main()
