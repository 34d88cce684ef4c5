"""The sizing law under serving, measured on this machine's lab: vLLM CPU on a small model,
one server per lab node behind vLLM's router and the front door (`vcfslm serve up`), loaded
through that one endpoint (`vcfslm bench --serve --deployment`) at 1 and 2 nodes.

It prints, per SLO, the threshold (requests/s at the stated attainment) at each node count
with its interval, N x the single node's, and their ratio: the scale-out efficiency with
its interval. Then, at the top node count, the same sweep for each router policy asked
for (the default policy's justification), and a window with one server killed.

    .venv/bin/python benchmarks/serve_scaleout.py                          # tiny-64, 2 lab nodes
    .venv/bin/python benchmarks/serve_scaleout.py --policies round_robin,power_of_two --fault

The lab's nodes are sshd guests on this one machine: their servers share its cores, so
on a 2-core host two nodes cannot hold twice one node's load. What this measures is the
router, the front door and the client at N servers on the cores there are; on a cluster
each node brings its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

from vcfslm.analysis.report import known_slos, load_inputs  # noqa: E402
from vcfslm.analysis.serve import analyse  # noqa: E402

VCFSLM = [sys.executable, "-m", "vcfslm.cli"]
VLLM_VENV = ROOT / ".venv-vllm"


def run(*args: str, env: dict[str, str], timeout: float = 3600) -> str:
    done = subprocess.run([*VCFSLM, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"vcfslm {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def lab_env(lab: Path) -> dict[str, str]:
    env = dict(os.environ)
    for line in (lab / "lab.env").read_text().splitlines():
        line = line.removeprefix("export ").strip()
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v.strip("'\"")
    return env


@contextlib.contextmanager
def served_lab(lab_dir: str | None, nodes: int, prefix: str) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """(a new work folder, the lab folder, the lab's environment) for a benchmark that serves on
    the lab. A lab is brought up unless one is already in `lab_dir`; on the way out, even on an
    error or a timeout's SIGTERM, the service goes down, and so does a lab this brought up."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    lab = Path(lab_dir) if lab_dir else work / "lab"
    started = not (lab / "lab.env").exists()
    if started:
        run("lab", "up", "--nodes", str(nodes), "--dir", str(lab), env=dict(os.environ), timeout=1800)
    env = lab_env(lab)
    try:
        yield work, lab, env
    finally:
        subprocess.run([*VCFSLM, "serve", "down", str(lab / "serve.yaml")], env=env, capture_output=True)
        if started:
            subprocess.run([*VCFSLM, "lab", "down", "--dir", str(lab)], env=env, capture_output=True)


def serve_inventory(lab: Path, model: Path, nodes: int, policy: str, slots: int) -> Path:
    doc = yaml.safe_load((lab / "inventory.yaml").read_text())
    doc["guest"]["model"] = str(model)
    doc["bench"]["serve"]["vllm"]["venv"] = str(VLLM_VENV)
    doc["bench"]["serve"]["slots"] = slots
    doc["serve"] = {"nodes": [n["name"] for n in doc["nodes"][:nodes]], "max_model_len": 512,
                    "router": {"policy": policy}, "health_timeout_s": 900}
    path = lab / "serve.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def bench(inventory: Path, key: Path, runs: Path, run_id: str, args, env, *extra: str) -> Path:
    run("bench", "--serve", "--deployment", str(inventory), "--key-file", str(key), "--rates", args.rates,
        "--input-tokens", str(args.input_tokens), "--output-tokens", str(args.output_tokens),
        "--duration", str(args.duration), "--warmup-s", "2", "--cooldown-s", "2", "--sweep",
        "--run-id", run_id, "--runs-dir", str(runs), *extra, env=env, timeout=7200)
    return runs / run_id


def thresholds(run_dirs: list[Path]):
    analysis, _ = load_inputs([str(p) for p in run_dirs])
    slos, _ = known_slos([r.meta for r in analysis.runs])
    return analyse(analysis.runs, slos, analysis.cells)


def interval(iv: dict | None) -> str:
    if not iv:
        return ""
    low = "–" if iv.get("low") is None else f"{iv['low']:.2f}"
    high = "–" if iv.get("high") is None else f"{iv['high']:.2f}"
    return f" [{low}, {high}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:tiny-64", help="Written with `vcfslm model write`.")
    p.add_argument("--nodes", type=int, default=2, help="The largest node count (lab guests).")
    p.add_argument("--rates", default="2,4,8,16,32", help="Requests/s at the endpoint, before the sweep.")
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=20.0, help="Seconds of arrivals per window.")
    p.add_argument("--slots", type=int, default=8, help="max_num_seqs per server.")
    p.add_argument("--policy", default="auto", help="The router's policy for the scale-out (serve.router.policy).")
    p.add_argument("--policies", default="", help="Router policies to compare at the top node count.")
    p.add_argument("--fault", action="store_true", help="Also a window with node 1's server killed.")
    p.add_argument("--lab-dir", default=None, help="Lab folder (default: a new one, taken down at the end).")
    args = p.parse_args()
    print(cpu_line())
    with served_lab(args.lab_dir, args.nodes, "vcfslm-scaleout-") as (work, lab, env):
        key, runs = work / "slm.key", work / "runs"
        model = work / "model"
        run("model", "write", args.model, str(model), env=env)
        inventory = serve_inventory(lab, model, args.nodes, args.policy, args.slots)
        run("serve", "up", str(inventory), "--key-file", str(key), env=env, timeout=3600)
        scale = ",".join(str(n) for n in range(1, args.nodes + 1))
        scaled = bench(inventory, key, runs, "scaleout", args, env, "--scale-out", scale)
        serving = thresholds([scaled])
        print(f"\nscale-out under serving: {args.model}, {args.input_tokens}/{args.output_tokens} tokens, "
              f"{args.slots} slots per server, Poisson arrivals, router policy {args.policy}")
        shared = yaml.safe_load(inventory.read_text())["nodes"][0]["management_ip"].startswith("127.")
        if shared:
            print(f"note: the lab's nodes are guests of this one host and share its {os.cpu_count()} CPUs; "
                  "at N > 1 their servers run on the same cores, so this reads the router and the "
                  "shared cores, not what N separate hosts hold")
        print(f"{'SLO':<6}{'N':>3}  {'threshold req/s [interval]':<30}{'N x one node':>14}  efficiency [interval]")
        for curve in serving.scale_outs:
            for row in curve.to_dict()["rows"]:
                thr = "–" if row["threshold"] is None else f"{row['threshold']:.2f}"
                ideal = "–" if row["ideal"] is None else f"{row['ideal']:.2f}"
                print(f"{curve.slo.name:<6}{row['nodes']:>3}  {thr + interval(row['threshold_interval']):<30}"
                      f"{ideal:>14}  {row['efficiency_text']}")
            shares = curve.rows[-1].split()
            if shares:
                print(f"       split at N={curve.rows[-1].nodes}: "
                      + ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items())))
        for policy in [x for x in args.policies.split(",") if x]:
            inventory = serve_inventory(lab, model, args.nodes, policy, args.slots)
            run("serve", "up", str(inventory), "--key-file", str(key), "--no-install", env=env, timeout=1800)
            folder = bench(inventory, key, runs, f"policy-{policy}", args, env)
            for t in thresholds([folder]).primaries:
                passing = "–" if t.passing is None else f"{t.passing:.2f}"
                print(f"policy {policy:<14} SLO {t.slo.name}: {passing} req/s at N={args.nodes} ({t.status}; "
                      f"first failing {t.failing})")
        if args.fault:
            inventory = serve_inventory(lab, model, args.nodes, args.policy, args.slots)
            run("serve", "up", str(inventory), "--key-file", str(key), "--no-install", env=env, timeout=1800)
            node = yaml.safe_load(inventory.read_text())["serve"]["nodes"][-1]
            run("bench", "--serve", "--deployment", str(inventory), "--key-file", str(key),
                "--rates", args.rates.split(",")[0], "--input-tokens", str(args.input_tokens),
                "--output-tokens", str(args.output_tokens), "--duration", str(max(args.duration, 40.0)),
                "--warmup-s", "2", "--cooldown-s", "2", "--fault", f"kill:{node}/vllm-node0@5",
                "--run-id", "fault", "--runs-dir", str(runs), env=env, timeout=3600)
            for fault in thresholds([runs / "fault"]).faults:
                print("fault window:", json.dumps(fault.to_dict(), sort_keys=True))
    print(f"\nruns in {runs}")


if __name__ == "__main__":
    main()
