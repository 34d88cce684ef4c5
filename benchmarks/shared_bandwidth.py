"""What lab nodes on disjoint cores still share: the probe on one core alone against the
same probe on two cores at once.

`vcfslm lab up --cores-per-node 1` gives each lab node a core of its own, but both cores
read one machine's memory through one memory controller and one last-level cache. A
serving measurement at N=2 on the lab is then N nodes that do not share cores, and do share
bandwidth. This measures how much that costs: the rank's probe (`python -m
vcfslm.bench.probe`, one thread) pinned to CPU 0 alone, to CPU 1 alone, then to CPU 0 and
CPU 1 at the same moment, alternated over rounds, and prints each figure side by side with
the together/alone ratio: the read bandwidth, the triad, and the engine's decode linears
at 1 and 4 rows (what a decode step's time is made of).

    flock /tmp/heavy.lock .venv/bin/python benchmarks/shared_bandwidth.py --rounds 3
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

PROBE = [sys.executable, "-m", "vcfslm.bench.probe", "--threads", "1", "--repeats", "3"]


def start(cpu: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(["taskset", "-c", str(cpu), *PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)


def figures(proc: subprocess.Popen) -> dict[str, float]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"the probe failed (exit {proc.returncode}):\n{err[-2000:]}")
    doc = json.loads(out.splitlines()[-1])
    curve = doc.get("decode_linears") or {}
    rates = dict(zip(curve.get("rows", []), curve.get("gbs", []), strict=False))
    return {"read GB/s": doc["read_gbs"], "triad GB/s": doc["triad_gbs"],
            "decode linears 1 row GB/s": rates.get(1, float("nan")),
            "decode linears 4 rows GB/s": rates.get(4, float("nan"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two CPUs")
    print(cpu_line(), flush=True)
    alone: dict[str, list[float]] = {}
    together: dict[str, list[float]] = {}
    for k in range(args.rounds):
        for cpu in (0, 1):
            for name, v in figures(start(cpu)).items():
                alone.setdefault(name, []).append(v)
        both = [start(0), start(1)]
        for proc in both:
            for name, v in figures(proc).items():
                together.setdefault(name, []).append(v)
        print(f"  round {k + 1} of {args.rounds} done", flush=True)
    print()
    print("| figure (one thread, one core) | alone (median) | both cores at once (median) | together / alone |")
    print("|---|---|---|---|")
    for name in alone:
        a, t = statistics.median(alone[name]), statistics.median(together[name])
        print(f"| {name} | {a:.2f} | {t:.2f} | {t / a:.2f} |")
    print()
    print(f"{args.rounds} rounds; each: CPU 0 alone, CPU 1 alone, then both at once (each core's own figure).")


if __name__ == "__main__":
    main()
