"""vcfslm's serving client against vLLM's own (`vllm bench serve`), on one OpenAI endpoint.

The endpoint is a vLLM CPU server this script starts (as the bench starts it: the rendered
launch script, the run's key in its environment), or one already running (`--endpoint`,
e.g. a router's front door, its key read from `--key-file`). Rounds of two clients then
run one after the other at the same Poisson rate, lengths and request count:

  vcfslm      vcfslm.serve.http_serve's window (a thread per request, sent when planned) and
              vcfslm.serve.openai_client, token-id prompts, the bench's request body
  vllm bench  `vllm bench serve --dataset-name random --random-range-ratio 0 --ignore-eos`

Made the same, so that what is left is the clients' own clocks:
- The count and the schedule. Both send exactly --requests requests: a gap drawn per
  request, the first request one gap after the start, the times stretched so the last
  arrival is at requests/rate (vllm/benchmarks/serve.py get_request; vcfslm.serving.
  counted_arrival_times, run through the bench's own window by counted_window). vcfslm
  draws from the generator state `vllm bench serve --seed k` draws from (numpy's global
  MT19937 seeded with k, whose exponential is Python's expovariate on the same doubles),
  so in round k both clients send their requests at the same offsets; the script prints
  how far apart the two runs' send offsets came out. With `--independent-draws` vcfslm
  draws its own times instead, and the two schedules are two samples of the process.
- The request body. vllm bench sends vcfslm's sampling (temperature 0, min_tokens,
  return_token_ids) through --extra-body; left alone it sends no temperature, and the
  server then samples at its own default (1.0 for these checkpoints) where vcfslm's
  requests decode greedily.
- No extra request. vllm bench's ready check is off: it sends request 0's prompt before
  the run, and the measured request 0 then finds it in the prefix cache.
- Completed req/s over the same span: completed requests over the time from the run's
  start (one gap before the first send) to its last token, as vllm bench's duration runs
  from benchmark_start_time, taken before the first gap, to the last request's end.
- Every request of a run is counted by both (no warm-up or cool-down exclusion).

Left as they are, each a definition (vcfslm's as docs/ARCHITECTURE.md states them):
- TTFT's start. vcfslm times TTFT from the planned arrival, so a request its client sends
  late counts the lag against the server (the script prints the largest lag, and
  vcfslm's p50 TTFT from its sends); vllm bench times it from its own send
  (lib/endpoint_request_func.py: `st` just before the session's post).
- The connection. vcfslm opens one per request, so its TCP connect is inside its TTFT
  (well under a millisecond on loopback, a network round trip to a remote front door);
  vllm bench reuses keep-alive connections from its pool.
- The prompt. vcfslm sends token ids; vllm bench sends text that its tokenizer made from
  --input-tokens ids and the server tokenizes again. The prompt tokens each run printed
  are the server's own usage counts.
- The first token. vcfslm's is the first event carrying a token; vllm bench's the first
  event with a choice, even one with empty text. A vLLM server sends no choice before the
  first token, so both take the same event from it.
- TPOT is (last token - first token) / (output tokens - 1) in both, the last token the
  last event with one (not the usage event), the output tokens the server's usage count
  (vllm bench re-tokenizes the text only when there is no usage). ITL is not compared:
  vllm bench's is per event, vcfslm times each token.

Each client reports p50 TTFT, p50 TPOT and completed requests per second; the two agree
when p50 TTFT and p50 TPOT are within 10 % and completed req/s within 5 %: the script
prints each ratio, the per-round values averaged over the rounds, and which hold. Each
round's requests are kept in the work folder: vllm bench's detailed result
(bench-<k>.json) and vcfslm's times (vcfslm-<k>.json), request by request, on the same
schedule.

    .venv/bin/python benchmarks/vllm_crosscheck.py                       # full Phi-3-mini shape
    .venv/bin/python benchmarks/vllm_crosscheck.py --model synthetic:tiny-64 --rate 4 --requests 60
    .venv/bin/python benchmarks/vllm_crosscheck.py --model synthetic:phi-3-mini,layers=4 --rate 1 --requests 40
    .venv/bin/python benchmarks/vllm_crosscheck.py --model synthetic:tiny-64 --workload rag --rate 1 --requests 60

With `--workload NAME|FILE` (a single-turn mix or a JSONL file of requests, vcfslm/workloads.py)
both clients send requests of the same lengths in the same order: `--requests` drawn from the
workload with the round's seed, each prompt text the model's tokenizer decodes from token ids
(so the server's count is the drawn length), each with its own output length. Each client's
tokens are its own: with the same text the second client would find every prompt of the
first in the server's prefix cache. vllm bench reads them as its custom dataset (`--dataset-name custom
--custom-output-len -1 --skip-chat-template --disable-shuffle --no-oversample`).

    .venv/bin/python benchmarks/vllm_crosscheck.py --endpoint http://10.0.0.5:8000 --key-file key.txt \\
        --model-name phi-3-mini --model models/phi-3-mini              # a running endpoint
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
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

from vcfslm import serving  # noqa: E402
from vcfslm.bench import local  # noqa: E402
from vcfslm.deploy.material import client_ca  # noqa: E402
from vcfslm.guest.templates import render_template  # noqa: E402
from vcfslm.serve.http_backend import HttpDriver, model_facts, prompt_ids  # noqa: E402
from vcfslm.serve.http_serve import run_http_window  # noqa: E402
from vcfslm.serve.openai_client import Endpoint, get, stream_completion  # noqa: E402
from vcfslm.serve.server_process import descendants  # noqa: E402
from vcfslm.servers import ServerSpec, completion_body  # noqa: E402
from vcfslm.serving import ServeSpec  # noqa: E402
from vcfslm.workloads import WindowPlan, Workload, parse_workload, segment_ids, stable_key  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TOLERANCE = {"p50 TTFT (s)": 0.10, "p50 TPOT (ms)": 0.10, "completed req/s": 0.05}
# What vllm bench serve puts in every completion body itself (endpoint_request_func.py):
# the rest of vcfslm's body goes to it as --extra-body.
VLLM_BENCH_SETS = ("model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos")
WARMUP_S = 20.0


@dataclasses.dataclass(frozen=True)
class Target:
    """The endpoint both clients drive: where, with which key and model name, and the model
    folder whose vocabulary (vcfslm's token ids) and tokenizer (vllm bench's prompts) fit it."""

    endpoint: Endpoint
    prefix: str                 # a path before /v1/... (a front door may mount the API under one)
    model_dir: str
    vocab: int

    @property
    def base_url(self) -> str:
        scheme = "https" if self.endpoint.tls else "http"
        return f"{scheme}://{self.endpoint.host}:{self.endpoint.port}{self.prefix}"

    @property
    def completions(self) -> str:
        return f"{self.prefix}/v1/completions"


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


@dataclasses.dataclass(frozen=True)
class Requests:
    """The requests of one round drawn from a workload: each prompt as text and its output
    length, and vllm bench's custom dataset holding the same."""

    prompts: list[str]
    outputs: list[int]
    dataset: Path


def workload_requests(workload: Workload, count: int, seed: int, target: Target, out_dir: Path,
                      client: str) -> Requests:
    """`count` requests of the workload, drawn with `seed`, their prompts decoded from token
    ids by the model's tokenizer (so each is its drawn length when encoded again).

    The lengths are the round's; the tokens are the client's own (each segment's key salted
    with its name): the server's prefix cache would otherwise serve the second client every
    prompt the first had sent. What a workload shares within a run (a system prompt) stays
    shared within each client's run."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(target.model_dir) / "tokenizer.json"))
    rng = random.Random(seed)
    plan = WindowPlan(workload, None, 0.0, rng, lambda rate, r: 1.0 / rate)
    asks = [plan.draw(0.0) for _ in range(count)]
    salt = stable_key(client)
    prompts = [tokenizer.decode(segment_ids([(stable_key(key, client), n) for key, n in a.segments], target.vocab)
                                if a.segments else prompt_ids(seed + salt, i, a.input_tokens, target.vocab))
               for i, a in enumerate(asks)]
    outputs = [max(2, a.output_tokens) for a in asks]
    dataset = out_dir / f"dataset-{seed}-{client.replace(' ', '-')}.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": text, "output_tokens": n}) + "\n"
                               for text, n in zip(prompts, outputs, strict=True)))
    return Requests(prompts, outputs, dataset)


def vllm_bench_draws(seed: int) -> random.Random:
    """A generator in the state `vllm bench serve --seed seed` draws its gaps from.

    vllm bench seeds numpy's global legacy generator (np.random.seed in serve.py's
    main_async) and draws np.random.gamma(shape=1, scale=1/rate) per request; at shape 1
    that is -log(1 - U) * scale, U the MT19937 53-bit double Python's random() also makes.
    Python's expovariate on the same state therefore draws the same gaps."""
    import numpy as np

    keys, pos = np.random.RandomState(seed).get_state()[1:3]
    rng = random.Random()
    rng.setstate((3, (*(int(k) for k in keys), int(pos)), None))
    return rng


def vcfslm_client(target: Target, base: ServeSpec, rate: float, count: int, seed: int, own_draws: bool,
                  out_dir: Path | None = None, requests: Requests | None = None) -> dict:
    """One window of vcfslm's client sending exactly `count` requests, over every request it
    sent; its requests' times go to out_dir/vcfslm-<seed>.json (beside vllm bench's)."""
    rng = random.Random(seed) if own_draws else vllm_bench_draws(seed)
    window_rate, duration = serving.counted_window(rate, count, rng)
    spec = dataclasses.replace(base, loads=(window_rate,), duration_s=duration, warmup_s=0.0, cooldown_s=0.0,
                               drain_s=max(120.0, duration))
    prompt_tokens: dict[int, int | None] = {}

    def send(r, deadline):
        if requests is None:
            body = completion_body(target.endpoint.model, prompt_ids(seed, r.index, r.input_tokens, target.vocab),
                                   r.output_tokens)
        else:       # the round's r.index-th request, as vllm bench sends it
            body = completion_body(target.endpoint.model, [0], requests.outputs[r.index])
            body["prompt"] = requests.prompts[r.index]
        stream = stream_completion(target.endpoint, target.completions, body, deadline_s=deadline)
        prompt_tokens[r.index] = stream.prompt_tokens
        return stream

    out = run_http_window(send, spec, window_rate, base.input_tokens[0], rng)
    if len(out.requests) != count:
        sys.exit(f"vcfslm's window planned {len(out.requests)} requests, not {count}")
    done = [r for r in out.requests if r.done]
    if not done:
        sys.exit(f"vcfslm: no request completed; errors: {out.errors}")
    ttft = [r.first_s - r.arrival_s for r in done]
    tpot = [(r.last_s - r.first_s) / (r.produced - 1) * 1000 for r in done if r.produced > 1]
    # From the window's start (the clock's 0, one gap before the first send) to the last token.
    span = max(r.last_s for r in done)
    counted = [v for v in prompt_tokens.values() if v is not None]
    if out_dir is not None:
        (out_dir / f"vcfslm-{seed}.json").write_text(json.dumps({"window_rate": window_rate, "requests": [
            {"arrival_s": r.arrival_s, "sent_s": r.started_s, "first_s": r.first_s, "last_s": r.last_s,
             "tokens": r.produced, "prompt_tokens": prompt_tokens.get(r.index), "error": r.error}
            for r in out.requests]}, indent=1))
    return {"requests": len(out.requests), "completed": len(done), "p50 TTFT (s)": statistics.median(ttft),
            "p50 TPOT (ms)": statistics.median(tpot), "completed req/s": len(done) / span,
            "mean prompt tokens": statistics.mean(counted) if counted else None,
            "max send lag (s)": max(out.lags_s, default=0.0),
            "p50 TTFT from send (s)": statistics.median(r.first_s - r.started_s for r in done),
            "sent": [r.started_s for r in out.requests], "errors": out.errors,
            "each": [(r.first_s - r.arrival_s, (r.last_s - r.first_s) / (r.produced - 1) * 1000)
                     if r.done and r.produced > 1 else None for r in out.requests]}


def vllm_client(target: Target, args, seed: int, out_dir: Path, requests: Requests | None = None) -> dict:
    """One run of `vllm bench serve` against the same endpoint (on the round's requests)."""
    name = f"bench-{seed}.json"
    body = completion_body(target.endpoint.model, [0], args.output_tokens)
    extra = {k: v for k, v in body.items() if k not in VLLM_BENCH_SETS}
    if requests is not None:
        # One --extra-body for every request: each has its own output length (max_tokens, with
        # --ignore-eos exactly that many), so no one min_tokens fits them all.
        extra.pop("min_tokens", None)
    entry = out_dir / "vllm-entry.py"           # vLLM's own command line, as the server's launch runs it
    if not entry.exists():
        entry.write_text(render_template("vllm-entry.py", {}))
    cmd = [str(args.vllm_python), str(entry), "bench", "serve", "--backend", "vllm",
           "--base-url", target.base_url, "--endpoint", "/v1/completions",
           "--model", target.endpoint.model, "--tokenizer", target.model_dir,
           *(["--dataset-name", "random", "--random-input-len", str(args.input_tokens), "--random-output-len",
              str(args.output_tokens), "--random-range-ratio", "0"] if requests is None else
             ["--dataset-name", "custom", "--dataset-path", str(requests.dataset), "--custom-output-len", "-1",
              "--skip-chat-template", "--disable-shuffle", "--no-oversample"]),
           "--ignore-eos", "--request-rate", f"{args.rate:g}",
           "--num-prompts", str(args.requests), "--seed", str(seed), "--disable-tqdm",
           "--extra-body", json.dumps(extra), "--ready-check-timeout-sec", "0",
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
           "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if target.endpoint.key:
        env["OPENAI_API_KEY"] = target.endpoint.key
    if target.endpoint.ca_file:
        env["SSL_CERT_FILE"] = target.endpoint.ca_file       # vllm bench's aiohttp verifies with it
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(redact(f"vllm bench serve failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                        f"{done.stderr[-3000:]}", target.endpoint.key))
    result = json.loads((out_dir / name).read_text())
    ok = [i for i, e in enumerate(result.get("errors") or []) if not e]
    starts = result.get("start_times") or []
    return {"requests": args.requests, "completed": result["completed"],
            "p50 TTFT (s)": result["median_ttft_ms"] / 1000, "p50 TPOT (ms)": result["median_tpot_ms"],
            "completed req/s": result["request_throughput"],
            "mean prompt tokens": statistics.mean(result["input_lens"][i] for i in ok) if ok else None,
            "max send lag (s)": None, "p50 TTFT from send (s)": result["median_ttft_ms"] / 1000,
            "sent": [t - starts[0] for t in starts] if starts else [],
            "each": [(ttft, (lat - ttft) / (n - 1) * 1000) if not e and n and n > 1 else None
                     for ttft, lat, n, e in zip(result["ttfts"], result["latencies"], result["output_lens"],
                                                result["errors"], strict=True)],
            "errors": sorted({e.strip().splitlines()[-1][:200] for e in result.get("errors") or [] if e})[:3]}


def paired(a: list, b: list) -> tuple[float, float] | None:
    """Median per-request differences (vcfslm - vllm bench) of TTFT (s) and TPOT (ms), request
    i of one run against request i of the other: on one schedule, the same arrival."""
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    if len(a) != len(b) or not pairs:
        return None
    return (statistics.median(x[0] - y[0] for x, y in pairs), statistics.median(x[1] - y[1] for x, y in pairs))


def cpu_seconds(server_pid: int | None) -> float:
    """CPU seconds this machine spent outside this script, its children and the server so far.

    A 2-core machine shared with other work: whatever else runs during a round slows the
    server for whichever client is driving it then, which no client definition explains."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    busy = sum(fields) - fields[3] - fields[4]                     # all but idle and iowait
    ours = 0
    for pid in ([server_pid, *descendants(server_pid)] if server_pid else []):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ours += int(stat[11]) + int(stat[12])                      # utime, stime
    me = os.times()
    return (busy - ours) / tick - (me.user + me.system + me.children_user + me.children_system)


def send_offsets_apart(a: list[float | None], b: list[float]) -> float | None:
    """The largest difference between two runs' send offsets (each from its own first send)."""
    if len(a) != len(b) or not a or a[0] is None:
        return None
    return max(abs((x - a[0]) - y) for x, y in zip(a, b, strict=True) if x is not None)


def busy(got: dict) -> str:
    other = got.get("other CPU (s)")
    return "" if other is None else f"; other processes {max(other, 0.0):.1f} CPU-s"


def redact(text: str, key: str) -> str:
    return text.replace(key, "<key>") if key else text


def endpoint_target(args) -> Target:
    """The running endpoint `--endpoint` names, checked to take the key and serve the model."""
    url = urlsplit(args.endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        sys.exit(f"--endpoint {args.endpoint}: give https://HOST[:PORT][/PREFIX] (or http://)")
    if not args.model_name:
        sys.exit("--endpoint needs --model-name, the name the endpoint serves the model under")
    key = ""
    if args.key_file:
        try:
            key = Path(args.key_file).read_text().strip()
        except OSError as exc:
            sys.exit(f"--key-file {args.key_file}: {exc.strerror}")
        if not key:
            sys.exit(f"--key-file {args.key_file} is empty")
    prefix = url.path.rstrip("/").removesuffix("/v1")
    model_dir = checkpoint(args.model)
    tls = url.scheme == "https"
    # A deployment's door: verified against its CA (beside its key file, or --ca-file).
    ca_file = args.ca_file or (client_ca(args.key_file) if args.key_file and tls else None)
    target = Target(Endpoint(url.hostname, url.port or (443 if tls else 80), key, args.model_name, tls, ca_file),
                    prefix, model_dir, model_facts(model_dir)["vocab_size"])
    try:
        status, body = get(target.endpoint, f"{prefix}/v1/models", timeout_s=10.0)
    except OSError as exc:
        sys.exit(f"{target.base_url}: {exc}")
    if status != 200:
        sys.exit(f"{target.base_url}/v1/models answered HTTP {status}: {redact(body[:300], key)}")
    served = [m.get("id") for m in json.loads(body).get("data", [])]
    if args.model_name not in served:
        sys.exit(f"{target.base_url} does not serve {args.model_name!r}; it serves {served}")
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:phi-3-mini",
                   help="the model's folder or synthetic:NAME (written once): the server loads it, vllm bench "
                        "takes its tokenizer, vcfslm its vocabulary")
    p.add_argument("--rate", type=float, default=0.5, help="Poisson requests/s")
    p.add_argument("--requests", type=int, default=40, help="requests per client run, exactly")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=16, help="--max-num-seqs of a server this script starts")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (vcfslm, vllm bench) one after the other")
    p.add_argument("--port", type=int, default=8190, help="of a server this script starts")
    p.add_argument("--endpoint", help="drive this running OpenAI endpoint (http://HOST:PORT[/PREFIX]) instead of "
                                      "starting a server")
    p.add_argument("--key-file", help="with --endpoint: a file holding its API key (never printed)")
    p.add_argument("--model-name", help="with --endpoint: the model name it serves")
    p.add_argument("--ca-file", help="with an https --endpoint: the CA to trust (default: the deployment's, "
                                     "beside --key-file; else the system's store)")
    p.add_argument("--independent-draws", action="store_true",
                   help="vcfslm draws its own arrival times instead of vllm bench's for the same seed")
    p.add_argument("--workload", help="a single-turn workload (a mix or a JSONL file of requests) both clients "
                                      "send, request for request, instead of fixed lengths")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    args = p.parse_args(argv)
    workload = parse_workload(args.workload) if args.workload else None
    if workload is not None and (workload.replay or workload.multi_turn):
        sys.exit(f"{workload.name}: the cross-check sends single-turn requests on its own schedule; a replay or a "
                 "conversation has its own")
    if workload is not None:
        args.input_tokens, args.output_tokens = workload.max_input, workload.max_output
    print(cpu_line(), flush=True)
    if not args.vllm_python.exists():
        sys.exit(f"no vLLM at {args.vllm_python}: make vllm")
    if (args.key_file or args.model_name) and not args.endpoint:
        sys.exit("--key-file and --model-name go with --endpoint (a server this script starts has its own)")
    work = Path(tempfile.mkdtemp(prefix="vcfslm-crosscheck-"))
    duration = args.requests / args.rate
    spec = ServeSpec(loads=(args.rate,), input_tokens=(args.input_tokens,), output_tokens=args.output_tokens,
                     slots=args.slots, duration_s=duration, warmup_s=0.0, cooldown_s=0.0, drain_s=max(120.0, duration))
    driver, server_pid = None, None
    started = time.perf_counter()
    if args.endpoint:
        target = endpoint_target(args)
        try:
            status, body = get(target.endpoint, f"{target.prefix}/version")
            version = json.loads(body).get("version", "?") if status == 200 else f"unknown (/version: HTTP {status})"
        except (OSError, ValueError, AttributeError) as exc:        # a front door need not answer /version
            version = f"unknown ({type(exc).__name__})"
        print(f"endpoint {target.base_url}, model {args.model_name} (server version {version}); tokenizer and "
              f"vocabulary from {target.model_dir}", flush=True)
    else:
        model_dir = checkpoint(args.model)
        cpus = sorted(os.sched_getaffinity(0))
        slot = [{"local_rank": 0, "numa_node": 0, "cpus": ",".join(map(str, cpus)), "bind": "node"}]
        server = local.render_server_scripts(work / "launch", ServerSpec(name="vllm", port=args.port), slot, spec,
                                             model_dir, True, str(args.vllm_python), render_template)
        # The server's context leaves room over the prompts: a tokenizer that re-encodes
        # vllm bench's text longer than asked would otherwise see 400s (failed requests).
        roomy = dataclasses.replace(spec, input_tokens=(2 * args.input_tokens,))
        driver = HttpDriver(server, roomy, model_dir=model_dir, numa_node=0, node_cpus=cpus, out=work,
                            node="local", rank=0)
        driver.start()
        facts = driver.facts()
        print(f"vLLM {facts['version']} healthy after {driver.startup_s:.0f} s; CPUs {facts['server_cpus']}; "
              f"KV cache {facts['kv_cache_gib']} GiB; model {model_dir}", flush=True)
        for line in facts["log_facts"][:6]:
            print(f"  | {line[:160]}")
        target = Target(driver.endpoint, "", model_dir, driver.vocab)
        server_pid = facts["pid"]
    shape = f"workload {workload.name}" if workload else f"{args.input_tokens}+{args.output_tokens} tokens"
    print(f"{shape}, Poisson {args.rate:g} req/s, {args.requests} requests "
          f"per run, {args.rounds} round(s), vcfslm on {'its own' if args.independent_draws else 'vllm bench'}'s "
          f"arrival draws; work in {work}", flush=True)
    runs: dict[str, list[dict]] = {"vcfslm": [], "vllm bench": []}
    try:
        warm = min(args.requests, max(2, round(args.rate * WARMUP_S)))
        warm_asks = workload_requests(workload, warm, 999, target, work, "warm-up") if workload else None
        vcfslm_client(target, spec, args.rate, warm, 999, True, None, warm_asks)     # a warm-up, discarded
        for k in range(args.rounds):
            for name in ("vcfslm", "vllm bench") if k % 2 == 0 else ("vllm bench", "vcfslm"):
                t, other = time.perf_counter(), cpu_seconds(server_pid)
                asks = workload_requests(workload, args.requests, k, target, work, name) if workload else None
                got = (vcfslm_client(target, spec, args.rate, args.requests, k, args.independent_draws, work, asks)
                       if name == "vcfslm" else vllm_client(target, args, k, work, asks))
                runs[name].append(got)
                got["other CPU (s)"] = cpu_seconds(server_pid) - other if server_pid else None
                lag = "" if got["max send lag (s)"] is None else f", max send lag {got['max send lag (s)'] * 1000:.1f} ms"
                print(f"  round {k + 1} {name:<10}: {got['completed']}/{got['requests']} completed, p50 TTFT "
                      f"{got['p50 TTFT (s)']:.3f} s, p50 TPOT {got['p50 TPOT (ms)']:.1f} ms, "
                      f"{got['completed req/s']:.3f} req/s, {got['mean prompt tokens']} prompt tokens{lag} "
                      f"({time.perf_counter() - t:.0f} s{busy(got)})", flush=True)
                for error in got["errors"]:
                    print(f"    error: {redact(error, target.endpoint.key)[:200]}")
            apart = send_offsets_apart(runs["vcfslm"][-1]["sent"], runs["vllm bench"][-1]["sent"])
            diff = paired(runs["vcfslm"][-1]["each"], runs["vllm bench"][-1]["each"])
            if apart is not None and diff is not None and not args.independent_draws:
                print(f"  round {k + 1}: the two clients' send offsets at most {apart * 1000:.1f} ms apart; request "
                      f"by request, vcfslm's TTFT {diff[0] * 1000:+.1f} ms and TPOT {diff[1]:+.2f} ms from vllm "
                      f"bench's (medians)")
    finally:
        if driver is not None:
            driver.stop()
    print(f"\n{'metric':<18} {'vcfslm':>10} {'vllm bench':>11} {'ratio':>7}  within")
    agree = True
    for metric, tol in TOLERANCE.items():
        a = statistics.mean(r[metric] for r in runs["vcfslm"])
        b = statistics.mean(r[metric] for r in runs["vllm bench"])
        ok = abs(a / b - 1) <= tol
        agree &= ok
        print(f"{metric:<18} {a:>10.4g} {b:>11.4g} {a / b:>7.3f}  {'yes' if ok else 'NO'} (±{tol:.0%})")
    disturbed = [r["other CPU (s)"] for rs in runs.values() for r in rs if (r["other CPU (s)"] or 0) > 1.0]
    if disturbed:
        print(f"(other processes took up to {max(disturbed):.1f} CPU-s during a run: the server was slowed for "
              f"whichever client ran then; compare rounds in the work folder request by request)")
    from_send = statistics.mean(r["p50 TTFT from send (s)"] for r in runs["vcfslm"])
    print(f"(vcfslm's p50 TTFT timed from its sends, as vllm bench times it: {from_send:.4g} s)")
    print(f"the clients {'agree' if agree else 'DISAGREE'}; {time.perf_counter() - started:.0f} s in all")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
