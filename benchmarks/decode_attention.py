"""A decode token's attention: the engine's two batched matmuls against SDPA, side by side.

    .venv/bin/python benchmarks/decode_attention.py              # Phi-3-mini's heads, 1 and 16 lanes
    .venv/bin/python benchmarks/decode_attention.py --contexts 64,4096 --rounds 20

One query token per lane over its lane's rows of the KV store (Phi-3-mini: 32 heads of 96,
32 KV heads), a mask that hides the store's unused tail, compiled as the engine compiles
its step, eager as a rank without a compiler runs it. Each round runs every variant once,
in turn; the ratio is the median of the per-round ratios SDPA / engine, so host drift hits
both alike. The output error is each variant's largest difference from fp32 SDPA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vcfslm.engine.decode import decode_attention  # noqa: E402


def sdpa(q, k, v, mask, scaling):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)   # [lanes, heads, 1, dim]
    return out.transpose(1, 2)


def sdpa_grouped(q, k, v, mask, scaling, groups):
    return sdpa(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), mask, scaling)


def engine_attention(q, k, v, mask, scaling, groups):
    return decode_attention(q, k, v, mask, scaling)


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_efficiency import cpu_line

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lanes", default="1,16")
    ap.add_argument("--contexts", default="64,512,1024")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"threads {args.threads}; {args.heads} heads of {args.dim}, {args.kv_heads} KV heads; "
          f"{args.rounds} rounds; ms per layer per step, median")
    print(f"{'lanes':>5} {'context':>7} {'mode':<8} {'SDPA ms':>8} {'engine ms':>9} {'SDPA/engine':>11}  "
          f"{'err SDPA':>8} {'err engine':>10}")
    scaling = args.dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    for lanes in (int(x) for x in args.lanes.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            q = torch.randn(lanes, args.heads, 1, args.dim, generator=gen).to(torch.bfloat16)
            k = torch.randn(lanes, args.kv_heads, context, args.dim, generator=gen).to(torch.bfloat16)
            v = torch.randn(lanes, args.kv_heads, context, args.dim, generator=gen).to(torch.bfloat16)
            mask = torch.ones(lanes, 1, 1, context, dtype=torch.bool)
            mask[..., context * 3 // 4:] = False
            groups = args.heads // args.kv_heads
            want = sdpa(q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1),
                        mask, scaling)
            inputs = (q, k, v, mask, scaling, groups)
            for mode in ("compile", "eager"):
                variants = {"sdpa": sdpa_grouped, "engine": engine_attention}
                if mode == "compile":
                    variants = {name: torch.compile(fn, dynamic=False) for name, fn in variants.items()}
                times: dict[str, list[float]] = {name: [] for name in variants}
                errors = {}
                with torch.inference_mode():
                    for name, fn in variants.items():
                        errors[name] = (fn(*inputs).float() - want).abs().max().item()
                        fn(*inputs)
                    for _ in range(args.rounds):
                        for name, fn in variants.items():
                            t0 = time.perf_counter()
                            fn(*inputs)
                            times[name].append(time.perf_counter() - t0)
                ratio = statistics.median(a / b for a, b in zip(times["sdpa"], times["engine"], strict=True))
                print(f"{lanes:>5} {context:>7} {mode:<8} {statistics.median(times['sdpa']) * 1e3:8.3f} "
                      f"{statistics.median(times['engine']) * 1e3:9.3f} {ratio:11.2f}  {errors['sdpa']:8.4f} "
                      f"{errors['engine']:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
