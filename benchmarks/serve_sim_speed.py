"""How fast the serving simulator runs, and why it is a plain loop and not simpy.

1. The event loop chosen (`--compare`, needs simpy importable, e.g. `pip install --target
   DIR simpy` and PYTHONPATH=DIR): the same one-server continuous-batching model (Poisson
   arrivals, a step of a + g x batch, a prompt as one step, fixed output tokens) stepped
   one step at a time in simpy (an arrival process and a server process) and in a plain
   heapq loop, side by side in one process: steps per second of each, and the same
   completions from both.
2. The simulator itself (vcfslm.sim): one simulated hour of a fleet of N nodes x servers per
   node behind power_of_two, on one core: seconds of CPU, requests, microseconds per request.
   Its steps are vcfslm's scheduler with the SLO rule's chunks, on step costs of the shape the
   fit gives (a 100 ms decode step growing 2 ms per lane, 2 ms per prompt token).

    .venv/bin/python benchmarks/serve_sim_speed.py [--nodes 64] [--per-node 1] [--rate 0.5]
    PYTHONPATH=/tmp/simpy .venv/bin/python benchmarks/serve_sim_speed.py --compare
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

from vcfslm.analysis.calibration import KNOWN_DIMS  # noqa: E402
from vcfslm.serving.decisions import ServeSpec  # noqa: E402
from vcfslm.sim.cost import StepModel  # noqa: E402
from vcfslm.sim.fleet import POWER_OF_TWO, Fleet, simulate_window  # noqa: E402
from vcfslm.sim.server import Policy  # noqa: E402

A, G, PREFILL, OUT, SLOTS = 0.10, 0.002, 0.25, 16, 16


def plain_loop(rate: float, horizon: float, seed: int) -> tuple[int, int]:
    """(steps, completions) of the per-step model, with a heapq of arrivals."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            break
        heapq.heappush(arrivals, t)
    now, waiting, running, steps, done = 0.0, deque(), [], 0, 0
    while arrivals or waiting or running:
        while arrivals and arrivals[0] <= now:
            waiting.append(heapq.heappop(arrivals))
        if not running and not waiting:
            now = arrivals[0]
            continue
        if waiting and len(running) < SLOTS:
            waiting.popleft()
            now += PREFILL + A + G * len(running)
            running = [r - 1 for r in running if r > 1]
            running.append(OUT - 1)
        else:
            now += A + G * len(running)
            done += sum(1 for r in running if r == 1)
            running = [r - 1 for r in running if r > 1]
        steps += 1
    return steps, done


def simpy_loop(rate: float, horizon: float, seed: int) -> tuple[int, int]:
    """The same model as simpy processes: arrivals into a Store, one server process."""
    import simpy

    rng = random.Random(seed)
    env = simpy.Environment()
    queue = simpy.Store(env)
    stats = {"steps": 0, "done": 0}

    def arrive():
        while True:
            yield env.timeout(rng.expovariate(rate))
            if env.now >= horizon:
                return
            yield queue.put(env.now)

    def serve():
        running: list[int] = []
        while True:
            if not running and not queue.items:
                yield queue.get()
                yield env.timeout(PREFILL + A)
                running.append(OUT - 1)
                stats["steps"] += 1
                continue
            if queue.items and len(running) < SLOTS:
                yield queue.get()
                yield env.timeout(PREFILL + A + G * len(running))
                running = [r - 1 for r in running if r > 1]
                running.append(OUT - 1)
            else:
                yield env.timeout(A + G * len(running))
                stats["done"] += sum(1 for r in running if r == 1)
                running = [r - 1 for r in running if r > 1]
            stats["steps"] += 1

    env.process(arrive())
    env.process(serve())
    env.run(until=horizon * 3)
    return stats["steps"], stats["done"]


def compare(rate: float, horizon: float) -> None:
    for name, fn in (("heapq loop", plain_loop), ("simpy", simpy_loop)):
        t = time.process_time()
        steps, done = fn(rate, horizon, 1)
        took = time.process_time() - t
        print(f"  {name:10s}: {steps} steps, {done} completions in {took:.2f} s CPU: "
              f"{steps / took / 1e3:.0f} k steps/s", flush=True)


def fleet(nodes: int, per_node: int, rate: float, hours: float, output_tokens: int = OUT) -> None:
    dims = KNOWN_DIMS["phi-3-mini"]
    lanes = (0.0, *(A + G * b for b in range(1, SLOTS + 1)))
    cost = StepModel(lanes, 2e-7, PREFILL / 128, 0.0, 1e-13, A, dims, SLOTS, attention_pair=1e9)
    policy = Policy("vcfslm", SLOTS, 2048, chunks=((1, 64), (2, 48), (4, 32), (8, 24), (16, 16)),
                    lane_buckets=(1, 2, 4, 8, 16), capped=True)
    spec = ServeSpec(loads=(rate,), input_tokens=(128,), output_tokens=output_tokens, duration_s=3600.0 * hours)
    servers = nodes * per_node
    t = time.process_time()
    records = simulate_window(cost, policy, spec, rate, 128, {"B": {"tpot_ms": 200.0, "ttft_s": 5.0}},
                              fleet_of=Fleet(servers, POWER_OF_TWO))
    took = time.process_time() - t
    done = sum(r.completed for r in records)
    steps = sum(r.steps for r in records)
    print(f"  {nodes} nodes x {per_node} server(s), {rate:g} req/s each, {hours:g} h simulated: "
          f"{took:.1f} s CPU, {done} requests, {took / done * 1e6:.0f} us/request, {steps} steps "
          f"({steps / took / 1e3:.0f} k steps per CPU second)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--per-node", type=int, default=1, help="servers per node (the brief's VM: 4)")
    p.add_argument("--rate", type=float, default=0.5, help="requests/s per server")
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--output-tokens", type=int, default=OUT)
    p.add_argument("--compare", action="store_true", help="simpy against the heapq loop first")
    args = p.parse_args()
    print(cpu_line(), flush=True)
    if args.compare:
        compare(args.rate, 3600.0)
    fleet(args.nodes, args.per_node, args.rate, args.hours, args.output_tokens)


if __name__ == "__main__":
    main()
