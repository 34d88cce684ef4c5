"""vcfslm's serving client against vLLM's own (`vllm bench serve`), on one vLLM CPU server.

One server (started as the bench starts it: the rendered launch script, the run's key in
its environment), then rounds of two clients one after the other at the same Poisson
rate, lengths and request count:

  vcfslm      vcfslm.serve.http_serve: its open-loop arrivals, token-id prompts, ignore_eos
  vllm bench  `vllm bench serve --dataset-name random --random-range-ratio 0 --ignore-eos`

Both see every request of their run (no warm-up or cool-down exclusion), and each reports
p50 TTFT, p50 TPOT and completed requests per second (completed over the span from the
first send to the last token). The two clients agree when p50 TTFT and p50 TPOT are
within 10 % and completed req/s within 5 %: the script prints each ratio, pooled over the
rounds, and which hold.

    .venv/bin/python benchmarks/vllm_crosscheck.py                       # full Phi-3-mini shape
    .venv/bin/python benchmarks/vllm_crosscheck.py --model synthetic:tiny-64 --rate 4 --requests 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

from vcfslm.bench import local  # noqa: E402
from vcfslm.guest.templates import render_template  # noqa: E402
from vcfslm.serve.http_backend import HttpDriver  # noqa: E402
from vcfslm.serve.http_serve import run_http_window  # noqa: E402
from vcfslm.serve.openai_client import stream_completion  # noqa: E402
from vcfslm.servers import ServerSpec, completion_body  # noqa: E402
from vcfslm.serving import ServeSpec  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TOLERANCE = {"p50 TTFT (s)": 0.10, "p50 TPOT (ms)": 0.10, "completed req/s": 0.05}


def checkpoint(model: str, seed: int = 0) -> str:
    """A synthetic model as the checkpoint folder the server loads, written once per source
    and seed into the folder `vcfslm bench` writes it to (so either reuses the other's)."""
    if not model.startswith("synthetic:"):
        return model
    import re
    import shutil

    from vcfslm.engine.checkpoint import write_checkpoint

    cache = Path(os.environ.get("VCFSLM_MODEL_CACHE") or "~/.cache/vcfslm/models").expanduser()
    folder = cache / f"{re.sub(r'[^A-Za-z0-9.=-]+', '-', model)}-seed{seed}"
    if not (folder / "config.json").exists():
        print(f"  writing {model} (seed {seed}) as a checkpoint for the server: {folder}", flush=True)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_checkpoint(model, partial, seed=seed)
        partial.rename(folder)
    return str(folder)


def vcfslm_client(driver: HttpDriver, spec: ServeSpec, rate: float, seed: int) -> dict:
    """One window of vcfslm's client over every request it sends."""
    def send(r, deadline):
        ids = [random.Random(seed * 7919 + r.index * 31 + i).randrange(3, driver.vocab) for i in range(r.input_tokens)]
        return stream_completion(driver.endpoint, "/v1/completions", completion_body(driver.endpoint.model, ids,
                                 r.output_tokens), deadline_s=deadline)

    out = run_http_window(send, spec, rate, spec.input_tokens[0], random.Random(seed))
    done = [r for r in out.requests if r.done]
    ttft = [r.first_s - r.arrival_s for r in done]
    tpot = [(r.last_s - r.first_s) / (r.produced - 1) * 1000 for r in done if r.produced > 1]
    span = max(r.last_s for r in done) - min(r.started_s for r in done)
    return {"requests": len(out.requests), "completed": len(done), "p50 TTFT (s)": statistics.median(ttft),
            "p50 TPOT (ms)": statistics.median(tpot), "completed req/s": len(done) / span,
            "max send lag (s)": max(out.lags_s, default=0.0)}


def vllm_client(driver: HttpDriver, entry: Path, model_dir: str, args, seed: int, out_dir: Path) -> dict:
    """One run of `vllm bench serve` against the same server."""
    name = f"bench-{seed}.json"
    cmd = [str(args.vllm_python), str(entry), "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://{driver.endpoint.host}:{driver.endpoint.port}", "--endpoint", "/v1/completions",
           "--model", driver.endpoint.model, "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", str(args.input_tokens), "--random-output-len", str(args.output_tokens),
           "--random-range-ratio", "0", "--ignore-eos", "--request-rate", f"{args.rate:g}",
           "--num-prompts", str(args.requests), "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    env = {**os.environ, "OPENAI_API_KEY": driver.endpoint.key, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"vllm bench serve failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out_dir / name).read_text())
    return {"requests": args.requests, "completed": result["completed"],
            "p50 TTFT (s)": result["median_ttft_ms"] / 1000, "p50 TPOT (ms)": result["median_tpot_ms"],
            "completed req/s": result["request_throughput"], "max send lag (s)": None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:phi-3-mini", help="folder or synthetic:NAME (written once)")
    p.add_argument("--rate", type=float, default=0.5, help="Poisson requests/s")
    p.add_argument("--requests", type=int, default=40, help="requests per client run")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=16, help="--max-num-seqs")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (vcfslm, vllm bench) one after the other")
    p.add_argument("--port", type=int, default=8190)
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    args = p.parse_args(argv)
    print(cpu_line(), flush=True)
    if not args.vllm_python.exists():
        sys.exit(f"no vLLM at {args.vllm_python}: make vllm")
    model_dir = checkpoint(args.model)
    work = Path(tempfile.mkdtemp(prefix="vcfslm-crosscheck-"))
    duration = args.requests / args.rate
    spec = ServeSpec(loads=(args.rate,), input_tokens=(args.input_tokens,), output_tokens=args.output_tokens,
                     slots=args.slots, duration_s=duration, warmup_s=0.0, cooldown_s=0.0, drain_s=max(120.0, duration))
    cpus = sorted(os.sched_getaffinity(0))
    slot = [{"local_rank": 0, "numa_node": 0, "cpus": ",".join(map(str, cpus)), "bind": "node"}]
    server = local.render_server_scripts(work / "launch", ServerSpec(name="vllm", port=args.port), slot, spec,
                                         model_dir, True, str(args.vllm_python), render_template)
    # vllm bench serve re-encodes its random prompts, which can come out longer than asked:
    # the server's context leaves them room (its 400s would count as failed requests).
    roomy = dataclasses.replace(spec, input_tokens=(2 * args.input_tokens,))
    driver = HttpDriver(server, roomy, model_dir=model_dir, numa_node=0, node_cpus=cpus, out=work, node="local", rank=0)
    print(f"model {model_dir}; {args.input_tokens}+{args.output_tokens} tokens, {args.slots} sequences, Poisson "
          f"{args.rate:g} req/s, {args.requests} requests per run, {args.rounds} round(s); work in {work}", flush=True)
    started = time.perf_counter()
    driver.start()
    facts = driver.facts()
    print(f"vLLM {facts['version']} healthy after {driver.startup_s:.0f} s; CPUs {facts['server_cpus']}; "
          f"KV cache {facts['kv_cache_gib']} GiB", flush=True)
    for line in facts["log_facts"][:6]:
        print(f"  | {line[:160]}")
    runs: dict[str, list[dict]] = {"vcfslm": [], "vllm bench": []}
    try:
        warm = dataclasses.replace(spec, duration_s=min(duration, 20.0), drain_s=120.0)
        vcfslm_client(driver, warm, args.rate, 999)                  # a warm-up, discarded
        for k in range(args.rounds):
            for name in ("vcfslm", "vllm bench") if k % 2 == 0 else ("vllm bench", "vcfslm"):
                t = time.perf_counter()
                got = (vcfslm_client(driver, spec, args.rate, k) if name == "vcfslm" else
                       vllm_client(driver, work / "launch" / "vllm-entry.py", model_dir, args, k, work))
                runs[name].append(got)
                print(f"  round {k + 1} {name:<10}: {got['completed']}/{got['requests']} completed, p50 TTFT "
                      f"{got['p50 TTFT (s)']:.3f} s, p50 TPOT {got['p50 TPOT (ms)']:.1f} ms, "
                      f"{got['completed req/s']:.3f} req/s ({time.perf_counter() - t:.0f} s)", flush=True)
    finally:
        driver.stop()
    print(f"\n{'metric':<18} {'vcfslm':>10} {'vllm bench':>11} {'ratio':>7}  within")
    agree = True
    for metric, tol in TOLERANCE.items():
        a = statistics.mean(r[metric] for r in runs["vcfslm"])
        b = statistics.mean(r[metric] for r in runs["vllm bench"])
        ok = abs(a / b - 1) <= tol
        agree &= ok
        print(f"{metric:<18} {a:>10.4g} {b:>11.4g} {a / b:>7.3f}  {'yes' if ok else 'NO'} (±{tol:.0%})")
    print(f"the clients {'agree' if agree else 'DISAGREE'}; {time.perf_counter() - started:.0f} s in all")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
