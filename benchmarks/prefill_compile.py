"""Would a compiled prefill shorten TTFT? The engine's eager prefill against the same
forward under torch.compile (Inductor, fullgraph, one static graph per prompt shape), side by
side in one process.

    .venv/bin/python benchmarks/prefill_compile.py                       # 8 layers, 1x32 and 16x32
    .venv/bin/python benchmarks/prefill_compile.py --layers 32 --shapes 1x32

Model: synthetic:phi-3-mini with `--layers` of its 32 layers (every matrix shape kept),
packed as the rank packs it. For each shape (batch x prompt tokens) the compiled prefill is
built once (its compile time is printed), its last-position logits are compared with the
eager prefill's, and then `--rounds` rounds alternate eager / compiled, so the host's drift
hits both alike. The table gives each side's median and the median per-round ratio
compiled / eager (below 1: the compiled prefill is faster), and how much of an eager
prefill is spent outside the linears' kernels (timed inside it): the most a compiled graph
could save. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from decode_efficiency import cpu_line, linear_kernels, spec_for  # noqa: E402  (one CPU line, one model spec)

from vcfslm.engine.decode import CompileCounter, DecodeEngine, KvStep, synthetic_prompt  # noqa: E402
from vcfslm.engine.model import load_model  # noqa: E402

OUTPUT_TOKENS = 32   # the store's room after the prompt, as a static window has it


class Prefill(torch.nn.Module):
    """The engine's prefill forward (DecodeEngine.prefill) as a module torch.compile can trace:
    `torch.compile(engine.prefill, fullgraph=True)` itself fails in Inductor on the store's
    in-place update ("Cannot set version_counter for inference tensor"), with the store's
    layers passed in as a module input it compiles."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, prompt, positions, store):
        return self.model(input_ids=prompt, position_ids=positions, use_cache=False, logits_to_keep=1,
                          kv_step=KvStep(store)).logits[:, -1, :]


def outside_linears_ms(engine: DecodeEngine, prompt: torch.Tensor, store, repeats: int = 3) -> float:
    """Per eager prefill, the time outside the linears' kernels (timed inside the prefill,
    decode_efficiency.linear_kernels): what a compiled graph could fuse at most."""
    with linear_kernels(skip=False) as timing:
        started = time.perf_counter()
        for _ in range(repeats):
            engine.prefill(prompt, store)
        total = time.perf_counter() - started
    return (total - timing.seconds) * 1e3 / repeats


def measure(engine: DecodeEngine, batch: int, length: int, rounds: int) -> dict:
    store = engine.store_for(batch, length + OUTPUT_TOKENS)
    prompt = synthetic_prompt(batch, length, engine.model.config.vocab_size, seed=1)
    positions = torch.arange(length, dtype=torch.long).unsqueeze(0).expand(batch, -1)
    counter = CompileCounter()
    compiled = torch.compile(Prefill(engine.model).eval(), backend=counter, fullgraph=True, dynamic=False)
    started = time.perf_counter()
    first = compiled(prompt, positions, store.layers)
    compile_s = time.perf_counter() - started
    eager_logits = engine.prefill(prompt, store).float()
    rel = float((first.float() - eager_logits).abs().max() / eager_logits.abs().max())
    eager, fused = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        engine.prefill(prompt, store)
        eager.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiled(prompt, positions, store.layers)
        fused.append(time.perf_counter() - started)
    return {"compile_s": compile_s, "graphs": counter.graphs, "rel_diff": rel,
            "eager_ms": statistics.median(eager) * 1e3, "compiled_ms": statistics.median(fused) * 1e3,
            "ratio": statistics.median(f / e for f, e in zip(fused, eager, strict=True)),
            "outside_ms": outside_linears_ms(engine, prompt, store)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="Phi-3-mini layers to keep (32 = full model)")
    ap.add_argument("--shapes", default="1x32,16x32", help="batch x prompt tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=9, help="eager / compiled rounds per shape")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    longest = max(length for _, length in shapes) + OUTPUT_TOKENS
    loaded = load_model(spec_for(args.layers), seed=0, max_context=longest)
    engine = DecodeEngine(loaded.model)
    print(f"model {spec_for(args.layers)}; threads {args.threads}; {args.rounds} rounds per shape", flush=True)
    print("| shape | eager ms | compiled ms | compiled / eager | eager outside the linears' kernels ms "
          "| compile s | logits rel diff |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for batch, length in shapes:
            r = measure(engine, batch, length, args.rounds)
            print(f"| {batch}x{length} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['ratio']:.3f} "
                  f"| {r['outside_ms']:.1f} ({r['outside_ms'] / r['eager_ms']:.0%}) | {r['compile_s']:.1f} "
                  f"| {r['rel_diff']:.4f} |", flush=True)
            engine.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
