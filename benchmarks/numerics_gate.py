"""What the numerics gate costs on the Phi-3-mini shape: the unpacked model's reference
(taken before packing), one static scenario's gate, and the serving slot step's gated prime,
each beside what it is paid against.

    .venv/bin/python benchmarks/numerics_gate.py                     # 4 of the 32 layers
    .venv/bin/python benchmarks/numerics_gate.py --layers 32         # the full shape (~8 GB)

Model: synthetic:phi-3-mini with `--layers` of its 32 layers (every matrix shape kept). The
gate's sizes are the worker's: REFERENCE_ROWS rows of GATE_PROMPT_TOKENS prompt tokens and
`--gate-steps` forced tokens. Printed ratios:
- reference / model load: what taking the reference adds to a rank's start;
- static gate / one window of the scenario (batch x input, `--output` tokens): the gate
  replaces the compile the first window would otherwise pay, plus that many eager steps;
- gated prime / plain prime of the slot step: the eager twins the serving gate adds.
The compile is paid once either way and is counted inside the gate and the primes. Nothing
here asserts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vcfslm.engine.decode import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.engine.model import load_model  # noqa: E402
from vcfslm.engine.numerics import (  # noqa: E402
    GATE_PROMPT_TOKENS,
    REFERENCE_ROWS,
    gate_inputs,
    reference_logits,
    run_gate,
    slot_gates,
)
from vcfslm.engine.slots import TokenSlots, slot_gate_fit  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--input", type=int, default=128)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--gate-steps", type=int, default=8)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = f"synthetic:phi-3-mini,layers={args.layers}"
    context = args.input + args.output
    loaded, load_s = timed(lambda: load_model(source, seed=0, max_context=context))
    vocab = loaded.config.vocab_size
    prompt, forced = gate_inputs(REFERENCE_ROWS, args.gate_steps, vocab, seed=0)
    reference, reference_s = timed(lambda: reference_logits(loaded.model, prompt, forced))
    p1, s1 = slot_gate_fit(GATE_PROMPT_TOKENS, args.gate_steps, context)
    slot_prompt, slot_forced = gate_inputs(1, s1, vocab, seed=0, prompt_tokens=p1)
    slot_reference = reference_logits(loaded.model, slot_prompt, slot_forced)
    print(cpu_line(), flush=True)
    print(f"model {source}, {torch.get_num_threads()} threads, load {load_s:.2f} s", flush=True)
    print(f"reference ({REFERENCE_ROWS} rows x {GATE_PROMPT_TOKENS}+{args.gate_steps} tokens): "
          f"{reference_s:.3f} s, reference/load {reference_s / load_s:.3f}", flush=True)
    engine = DecodeEngine(loaded.model, "compile")

    rows = gate_inputs(args.batch, args.gate_steps, vocab, seed=0)
    gate, gate_s = timed(lambda: run_gate(engine, *rows, max_len=context, reference=reference,
                                          graph=f"static {args.batch}x{args.input}"))
    scenario_prompt = synthetic_prompt(args.batch, args.input, vocab, seed=1)
    window = engine.generate(scenario_prompt, args.output)
    window_s = window.last_token - window.request_start
    print(f"static gate {args.batch}x{args.input} (compile included, window compiles {window.compiles}): "
          f"{gate_s:.2f} s; one window {window_s:.2f} s; gate/window {gate_s / window_s:.2f}; "
          f"rel diff vs eager {gate.compiled.max_rel_diff:.4f}, vs unpacked {gate.reference.max_rel_diff:.4f}, "
          f"passed {gate.passed}", flush=True)

    slots = TokenSlots(engine, args.slots, context, args.chunk_tokens)
    checks, gated_prime_s = timed(lambda: slots.prime(slot_prompt[0], slot_forced[0]))
    slot_results = slot_gates(checks, slot_reference)
    _, plain_prime_s = timed(lambda: slots.prime(slot_prompt[0]))   # the graphs exist: steps only
    _, gated_again_s = timed(lambda: slots.prime(slot_prompt[0], slot_forced[0]))
    print(f"slot prime, {args.slots} slots, chunk {args.chunk_tokens}: gated (compiles included) "
          f"{gated_prime_s:.2f} s; warm: gated {gated_again_s:.2f} s, plain {plain_prime_s:.2f} s, "
          f"gated/plain {gated_again_s / plain_prime_s:.2f}")
    for g in slot_results:
        ref = f", vs unpacked {g.reference.max_rel_diff:.4f}" if g.reference else ""
        print(f"  {g.graph}: rel diff vs eager {g.compiled.max_rel_diff:.4f}{ref}, passed {g.passed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
