"""What a serving step costs: decode-only steps at several occupancies, the same steps with a
prompt piece of `chunk_tokens` riding on them, and the static decode step, side by side in one
run; and what admitting a prompt cost before chunking (one eager prefill that every running
stream waited for).

    .venv/bin/python benchmarks/serve_step.py                           # 16 slots, 2 layers
    .venv/bin/python benchmarks/serve_step.py --layers 32 --context 144 --prompt 128

Model: synthetic:phi-3-mini with `--layers` of its 32 layers (every matrix shape kept). The
chunk is `--chunk-tokens`, or (0) the engine's default from this run's probes: the largest
piece whose FLOPs fit under the decode step's bandwidth floor. The ratios say whether the
piece rides on the decode step's weight reads (near 1) or costs a step of its own (near 2
and beyond), and whether a lone stream pays a batch-1 step (decode bucket 1 against the
static batch-1 step).

Rounds alternate configuration by configuration, so drift hits all alike. Each timed step
starts from the same positions (the slots are refilled between rounds, untimed). The median
step of all rounds is printed. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vcfslm.bench import probe  # noqa: E402
from vcfslm.engine.decode import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.engine.model import load_model  # noqa: E402
from vcfslm.engine.slots import TokenSlots  # noqa: E402
from vcfslm.engine.step_cost import chunk_for_probes  # noqa: E402
from vcfslm.serving.decisions import Piece  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)


def fill(slots: TokenSlots, prompt: torch.Tensor, streams: int) -> None:
    """Slots 0..streams-1 busy with `prompt` (admitted whole, untimed)."""
    slots.reset()
    for s in range(streams):
        slots.admit(s, prompt)


def time_steps(slots: TokenSlots, prompt: torch.Tensor, streams: int, piece: torch.Tensor | None,
               steps: int) -> list[float]:
    """`steps` steps with `streams` decoding, each carrying the whole `piece` when given."""
    out = []
    for _ in range(steps):
        fill(slots, prompt, streams)
        p = None if piece is None else Piece(slots.slots - 1, piece, 0, piece.numel(), piece.numel())
        started = time.perf_counter()
        slots.step(p)
        out.append(time.perf_counter() - started)
    return out


def time_static(engine: DecodeEngine, prompt: torch.Tensor, steps: int) -> list[float]:
    gen = engine.generate(prompt, steps + 1, record_steps=True)
    return gen.step_s


def time_prefill(engine: DecodeEngine, prompt: torch.Tensor, rounds: int, context: int) -> list[float]:
    """The unchunked admission: one eager prefill of the prompt (into the static engine's
    store, whose shape stays the static decode's: a new shape would drop every graph)."""
    out = []
    for _ in range(rounds):
        store = engine.store_for(1, context)
        started = time.perf_counter()
        engine.prefill(prompt, store)
        out.append(time.perf_counter() - started)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the request being admitted")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="0: the engine's default from the probes")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over every configuration")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompt + 2 + args.steps > args.context:
        sys.exit("--prompt + --steps + 2 must fit --context")

    print(cpu_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    spec = f"synthetic:phi-3-mini,layers={args.layers}"
    loaded = load_model(spec, seed=0, max_context=args.context)
    vocab = loaded.config.vocab_size
    serving = DecodeEngine(loaded.model, "compile")
    # The model is packed once: the static engine shares its weights, with a store and graphs of its own.
    static = DecodeEngine(loaded.model, "compile", plan=serving.plan, check_packing=False)
    bandwidth = probe.measure_bandwidth(torch.get_num_threads(), 256)
    gemm = probe.measure_gemm(torch.get_num_threads(), plan=serving.plan)
    linears = probe.measure_decode_linears(torch.get_num_threads(), plan=serving.plan)
    default = chunk_for_probes(loaded.step_weight_bytes, bandwidth.read_gbs, gemm.tflops, linears.rows, linears.gbs)
    chunk = args.chunk_tokens or default
    print(f"model {spec}, {loaded.weight_bytes / 1e9:.2f} GB of weights; linears {serving.plan.label}")
    curve = ", ".join(f"{r}: {g:.1f}" for r, g in zip(linears.rows, linears.gbs, strict=True))
    print(f"probes: read {bandwidth.read_gbs:.1f} GB/s, GEMM {gemm.tflops:.3f} TFLOP/s, linears GB/s by rows "
          f"{curve} -> default chunk {default} tokens; this run: chunk {chunk}, slots {args.slots}, "
          f"context {args.context}")

    slots = TokenSlots(serving, args.slots, args.context, chunk)
    stream_prompt = synthetic_prompt(1, 8, vocab, seed=1)[0]
    piece = synthetic_prompt(1, min(chunk, args.prompt), vocab, seed=2)[0]
    whole = synthetic_prompt(1, args.prompt, vocab, seed=3)
    n, half = args.slots, max(1, args.slots // 2)
    configs = {
        "decode, 1 stream": lambda: time_steps(slots, stream_prompt, 1, None, args.steps),
        f"decode, {half} streams": lambda: time_steps(slots, stream_prompt, half, None, args.steps),
        f"decode, {n - 1} streams": lambda: time_steps(slots, stream_prompt, n - 1, None, args.steps),
        f"1 stream + {piece.numel()} prompt": lambda: time_steps(slots, stream_prompt, 1, piece, args.steps),
        f"{n - 1} streams + {piece.numel()} prompt":
            lambda: time_steps(slots, stream_prompt, n - 1, piece, args.steps),
        "static decode, batch 1": lambda: time_static(static, whole, args.steps),
        f"eager prefill, {args.prompt} tokens":
            lambda: time_prefill(static, whole, args.steps, args.prompt + args.steps + 1),
    }
    started = time.perf_counter()
    with torch.inference_mode():
        slots.prime(stream_prompt)
        for run in configs.values():  # warm-up: every graph compiles here
            run()
    graphs = serving.compiles + static.compiles
    print(f"warm-up (compiles) {time.perf_counter() - started:.0f} s, {graphs} graphs")

    times: dict[str, list[float]] = {name: [] for name in configs}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, run in configs.items():
                times[name] += run()
    recompiled = serving.compiles + static.compiles != graphs
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"\n{'configuration':<32} {'median ms':>10} {'min ms':>8}   ({args.repeats} rounds x {args.steps})")
    for name, t in times.items():
        print(f"{name:<32} {med[name]:>10.1f} {min(t) * 1e3:>8.1f}")
    d1, dh, dn, m1, mn, s1, pre = configs
    pieces = math.ceil(args.prompt / chunk)
    ratios = [
        (f"{mn} / {dn}", med[mn] / med[dn], "the piece riding on a full batch's reads (1: free)"),
        (f"{m1} / {d1}", med[m1] / med[d1], "... on a lone stream's"),
        (f"{d1} / {s1}", med[d1] / med[s1], "a lone stream pays a batch-1 step (1: yes)"),
        (f"{dn} / {d1}", med[dn] / med[d1], "a full batch over one stream"),
        (f"{dh} / {d1}", med[dh] / med[d1], ""),
    ]
    print(f"\n{'ratios of step times':<58} median")
    for label, value, note in ratios:
        print(f"  {label:<56} {value:6.2f}" + (f"   ({note})" if note else ""))
    chunked = pieces * (med[mn] - med[dn])
    print(f"admitting a {args.prompt}-token prompt beside {n - 1} streams: unchunked, every stream waits "
          f"{med[pre]:.0f} ms (one eager prefill); chunked, {pieces} piece(s) add {chunked:.0f} ms to "
          f"{pieces} step(s) ({chunked / med[pre]:.2f} of the stall)")
    print("recompiles during the measured rounds: " + ("YES (figures invalid)" if recompiled else "none"))


if __name__ == "__main__":
    main()
