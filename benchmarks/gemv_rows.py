"""vcfslm's GEMV against oneDNN's kernel on the same packed weights, row count by row count
(decode at batch 1-32, a short prompt's prefill), and against another revision's GEMV, side
by side in one run.

    .venv/bin/python benchmarks/gemv_rows.py                     # 4 Phi-3-mini layers, 9 rounds
    .venv/bin/python benchmarks/gemv_rows.py --base HEAD~1       # this tree's loop against that revision's
    .venv/bin/python benchmarks/gemv_rows.py --rows 5,6,8 --rounds 15
    .venv/bin/python benchmarks/gemv_rows.py --base HEAD~1 --engine-layers 8   # and the engine's TPOT/TTFT on each loop
    .venv/bin/python benchmarks/gemv_rows.py --dense             # the dense-bf16 plan: vcfslm's AVX2 GEMV against ATen
    .venv/bin/python benchmarks/gemv_rows.py --dense --base HEAD~1   # and against that revision's AVX2 loop

The weight set is Phi-3-mini's four linear shapes (qkv 3072->9216, o 3072->3072, gate_up
3072->16384, down 8192->3072) repeated `--layers` times: far larger than any cache, so every
pass streams it from memory, as a step does. The weights are packed once, as a replica packs
them. For each row count, every round runs the whole set once per kernel, the kernels taking
turns, so the host's drift (bandwidth and clock both swing within seconds on shared hosts)
hits them alike. Kernels:
- oneDNN's inner product on its packed weight, fewer rows padded up to the plan's min_rows,
  as the engine calls it;
- vcfslm's GEMV (vcfslm.engine.gemv), this tree's source;
- with `--base REV`: the same loop built from REV's source (same compiler and flags).
Each kernel's TFLOP/s and weight GB/s are medians over rounds; each ratio is the median of
its per-round time ratio (below 1: the first is faster). The `plan runs` column names the
kernel the engine's plan takes at that row count on this CPU (vcfslm.engine.gemv.rows_for: every
row count on AVX512-BF16, 1-6 beside AMX), and the closing PLAN line says whether it took the
faster one at each, beyond a 5 % margin: the check of that choice on any CPU.

With `--dense`, and on a CPU where oneDNN has no bf16 (there is no packed weight then), the
table is the dense-bf16 plan's instead, on the plain weights: vcfslm's AVX2 GEMV
(vcfslm.engine.dense_gemv) against the plan's path without it (ATen's bf16 GEMV one row at a
time up to 4 rows, the weight converted to fp32 in slices for SGEMM beyond), as
vcfslm.engine.linear runs both.

With `--base` and `--engine-layers N`, the engine itself is then timed on both loops: one
process loads synthetic:phi-3-mini with N of its 32 layers, packed and compiled as a rank
runs it, and for each of `--engine-batches` runs generation windows (`--prompt` tokens in,
16 out) with the two libraries taking turns (gemv.library_in_use), the order flipping every
round. Same graphs, same weights, same process: only the loop differs. The table gives TPOT
and TTFT per loop (medians) and the median per-round ratio this tree / base, with its range.

Like a rank (rank.sh), the run puts large allocations on 2 MiB pages. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vcfslm.bench.pages import ask_for_huge_pages  # noqa: E402

ask_for_huge_pages()   # before torch allocates: weights on 2 MiB pages, as in a rank

import torch  # noqa: E402
from decode_efficiency import cpu_line  # noqa: E402  (one CPU line for every benchmark)
from gemv_hypotheses import SHAPES  # noqa: E402  (one weight set for the GEMV benchmarks)

from vcfslm.engine import dense_gemv, gemv, linear  # noqa: E402

DEFAULT_ROWS = (1, 2, 4, 5, 6, 7, 8, 12, 16, 24, 32)


def base_library(rev: str, folder: Path, loop=gemv):
    """A loop (vcfslm.engine.gemv's or dense_gemv's) built from revision `rev`'s source, loaded
    (its ABI must be this tree's), with this tree's compiler flags."""
    rel = loop.SOURCE.relative_to(ROOT).as_posix()
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, check=False)
    if shown.returncode != 0:
        raise SystemExit(f"--base {rev}: git show {rev}:{rel} failed: {shown.stderr.decode().strip()}")
    source = folder / f"base-{loop.SOURCE.name}"
    source.write_bytes(shown.stdout)
    try:
        return gemv.load(gemv.build(folder, "base.so", source, loop.FLAGS), loop.ABI)
    except gemv.GemvBuildError as exc:   # a revision before this ABI, or one that does not build here
        raise SystemExit(f"--base {rev}: {exc}") from exc


def weight_set(layers: int, min_rows: int) -> list[tuple[int, int, torch.Tensor, int]]:
    """(n, k, oneDNN-packed weight, its address) for each linear of `layers` layers."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in SHAPES * layers:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, min_rows)
        out.append((n, k, packed, torch.ops.mkldnn.data_ptr(packed)))
    return out


def kernels(weights, lib, base_lib, min_rows: int) -> dict:
    """name -> a function of the inputs {k: x [rows, k]} that runs the whole weight set once."""

    def onednn(xs):
        for _n, k, packed, _ in weights:
            x = xs[k]
            if x.shape[0] < min_rows:   # the engine pads few rows for oneDNN (linear.KernelPlan)
                x = torch.nn.functional.pad(x, (0, 0, 0, min_rows - x.shape[0]))
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def loop(library):
        def run(xs):
            for n, k, _, address in weights:
                gemv.run_at(address, xs[k], n, library)
        return run

    out = {"oneDNN": onednn, "vcfslm": loop(lib)}
    if base_lib is not None:
        out["base"] = loop(base_lib)
    return out


def dense_kernels(layers: int, base_lib=None) -> tuple[dict, int]:
    """The dense-bf16 plan's two few-row paths on plain weights (and `base_lib`, another build
    of the AVX2 loop): name -> a function of the inputs, as kernels(); and the weights' bytes."""
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for n, k in SHAPES * layers]

    def aten(xs):
        for w in ws:
            linear.linear_eager(xs[w.shape[1]], w, None, w.shape[0], linear.DENSE_BF16, 1, 0)

    def loop(library):
        def run(xs):
            for w in ws:
                dense_gemv.run(xs[w.shape[1]], w, library)
        return run

    out = {"ATen": aten, "vcfslm": loop(None)}
    if base_lib is not None:
        out["base"] = loop(base_lib)
    return out, sum(w.numel() * 2 for w in ws)


def measure(fns: dict, rows: int, rounds: int) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (3072, 8192)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        for fn in fns.values():   # warm each code path once
            fn(xs)
        for r in range(rounds):
            turns = list(fns.items())
            for name, fn in turns if r % 2 == 0 else turns[::-1]:   # no kernel always runs first
                started = time.perf_counter()
                fn(xs)
                times[name].append(time.perf_counter() - started)
    return times


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def engine_table(layers: int, batches: list[int], prompt: int, rounds: int, lib, base_lib, base: str) -> None:
    """Prints the engine's TPOT and TTFT on this tree's loop and on `base`'s, taking turns in
    one process (see the module's docstring), a row per batch as it is measured."""
    from decode_efficiency import engine_window, spec_for

    from vcfslm.engine.decode import DecodeEngine, synthetic_prompt
    from vcfslm.engine.model import load_model

    tokens = 16
    replica = load_model(spec_for(layers), seed=0, max_context=prompt + tokens)
    engine = DecodeEngine(replica.model, "compile")
    print(f"engine: {spec_for(layers)}, {engine.label}; prompt {prompt}, {tokens} generated, "
          f"{rounds} rounds per batch")
    print(f"| batch | {base} TPOT ms | this tree TPOT ms | TPOT this / {base} (range) "
          f"| {base} TTFT s | this tree TTFT s | TTFT this / {base} (range) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    with torch.inference_mode():
        for batch in batches:
            p = synthetic_prompt(batch, prompt, replica.config.vocab_size, seed=batch)
            engine_window(engine, p, tokens)   # this shape's compile, discarded
            got: dict[str, list[dict]] = {"this": [], "base": []}
            for r in range(rounds):
                turns = [("base", base_lib), ("this", lib)]
                for name, library in turns if r % 2 == 0 else turns[::-1]:
                    with gemv.library_in_use(library):
                        got[name].append(engine_window(engine, p, tokens))
            cells = []
            for key, digits in (("tpot_ms", 1), ("ttft_s", 3)):
                b = [w[key] for w in got["base"]]
                t = [w[key] for w in got["this"]]
                per_round = [x / y for x, y in zip(t, b, strict=True)]
                cells += [f"{statistics.median(b):.{digits}f}", f"{statistics.median(t):.{digits}f}",
                          f"{statistics.median(per_round):.3f} ({min(per_round):.2f}-{max(per_round):.2f})"]
            print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="Phi-3-mini layers' linears in the weight set")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help=f"row counts, 1-{gemv.MAX_ROWS}")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--base", metavar="REV", help="also time the GEMV built from this revision's source")
    ap.add_argument("--engine-layers", type=int, default=0,
                    help="with --base: then time the engine on both loops, this many Phi-3-mini layers (0: not)")
    ap.add_argument("--engine-batches", default="1,8,16")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the engine's windows")
    ap.add_argument("--engine-rounds", type=int, default=6)
    ap.add_argument("--dense", action="store_true",
                    help="the dense-bf16 plan's table (the default where oneDNN has no bf16)")
    args = ap.parse_args()
    if args.engine_layers and not args.base:
        ap.error("--engine-layers compares two loops: it needs --base")
    dense = args.dense or not linear.onednn_bf16()
    if dense and args.engine_layers:
        ap.error("--engine-layers swaps builds of the AVX512-BF16 loop: not with the dense-bf16 table "
                 "(benchmarks/engine_ab.py compares the engine at two revisions)")
    row_counts = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= gemv.MAX_ROWS for r in row_counts):
        ap.error(f"--rows: each must be within 1-{gemv.MAX_ROWS}")
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if dense:
        return dense_table(args.layers, row_counts, args.rounds, args.threads, args.base)
    status = gemv.status()
    if not status.usable:
        print(f"vcfslm GEMV does not run here ({status.reason}): nothing to compare")
        return 1
    min_rows = linear.DEFAULT_MIN_ROWS
    with tempfile.TemporaryDirectory(prefix="vcfslm-gemv-base-") as folder:
        base_lib = base_library(args.base, Path(folder)) if args.base else None
        weights = weight_set(args.layers, min_rows)
        nbytes = sum(n * k * 2 for n, k, _, _ in weights)
        fns = kernels(weights, gemv._library(), base_lib, min_rows)
        print(f"vcfslm GEMV: {status.reason}; {nbytes / 1e9:.2f} GB of bf16 weights ({args.layers} Phi-3-mini "
              f"layers' linears), {args.threads} threads, {args.rounds} rounds"
              + (f"; base: the loop at {args.base}" if args.base else ""))
        rows_table(fns, "oneDNN", nbytes, row_counts, args.rounds, gemv.usable_rows(), args.base)
        if args.engine_layers:
            del weights, fns
            engine_table(args.engine_layers, [int(b) for b in args.engine_batches.split(",")],
                         args.prompt, args.engine_rounds, gemv._library(), base_lib, args.base)
    return 0


def rows_table(fns: dict, reference: str, nbytes: int, row_counts: list[int], rounds: int,
               plan_rows: int, base: str | None = None) -> None:
    """Prints a row per row count: `reference`'s and vcfslm's TFLOP/s, vcfslm's weight GB/s, the
    time ratio, the kernel the plan runs there (vcfslm's GEMV up to `plan_rows`) (and base's,
    when fns has it); then the PLAN line (plan_verdict)."""
    head = f"| rows | {reference} TFLOP/s | vcfslm TFLOP/s | vcfslm GB/s | vcfslm / {reference} time | plan runs |"
    rule = "|---|---|---|---|---|---|"
    if "base" in fns:
        head += f" {base} TFLOP/s | this tree / {base} time |"
        rule += "---|---|"
    print(head)
    print(rule)
    ratios = []
    for rows in row_counts:
        times = measure(fns, rows, rounds)
        flops = 2 * rows * nbytes / 2
        rate = {name: statistics.median(flops / t / 1e12 for t in ts) for name, ts in times.items()}
        gbs = statistics.median(nbytes / t / 1e9 for t in times["vcfslm"])
        ratios.append((rows, ratio(times["vcfslm"], times[reference])))
        line = (f"| {rows} | {rate[reference]:.3f} | {rate['vcfslm']:.3f} | {gbs:.1f} "
                f"| {ratios[-1][1]:.2f} | {'vcfslm' if rows <= plan_rows else reference} |")
        if "base" in fns:
            line += f" {rate['base']:.3f} | {ratio(times['vcfslm'], times['base']):.2f} |"
        print(line, flush=True)
    print(plan_verdict(ratios, plan_rows, reference))


# Beyond this, a time ratio is a kernel choice the plan should not have made; within it, the
# two kernels are even on a shared host (the rounds of one run swing by a few percent).
PLAN_MARGIN = 0.05


def plan_verdict(ratios: list[tuple[int, float]], plan_rows: int, reference: str,
                 margin: float = PLAN_MARGIN) -> str:
    """One line (pure): whether the plan runs the faster kernel at each measured row count.
    ratios: (rows, vcfslm's time / the reference's); the plan runs vcfslm's GEMV at 1-plan_rows
    rows and `reference` beyond (gemv.rows_for: 1-6 beside AMX, where oneDNN's tile kernel is
    meant to win from 7 rows). A wrong choice costs more than `margin`."""
    if not plan_rows:
        split = f"{reference} at every row count (vcfslm's GEMV does not run here)"
    else:
        split = f"vcfslm's GEMV at 1-{plan_rows} rows" + (
            f", {reference} beyond" if any(rows > plan_rows for rows, _ in ratios) else "")
    wrong = []
    for rows, r in ratios:
        at = f"{rows} row{'' if rows == 1 else 's'}"
        if rows <= plan_rows and r > 1 + margin:
            wrong.append(f"{at} ({reference} takes {1 / r:.2f} of vcfslm's time)")
        elif rows > plan_rows and r < 1 - margin:
            wrong.append(f"{at} (vcfslm takes {r:.2f} of {reference}'s time)")
    if not wrong:
        return (f"PLAN the plan runs {split}: the faster kernel, within {margin:.0%}, "
                f"at every row count measured")
    return f"PLAN the plan runs {split}: the slower kernel at " + "; ".join(wrong)


def dense_table(layers: int, row_counts: list[int], rounds: int, threads: int, base: str | None) -> int:
    status = dense_gemv.status()
    if not status.usable:
        print(f"vcfslm AVX2 GEMV does not run here ({status.reason}): nothing to compare")
        return 1
    with tempfile.TemporaryDirectory(prefix="vcfslm-gemv-base-") as folder:
        base_lib = base_library(base, Path(folder), dense_gemv) if base else None
        fns, nbytes = dense_kernels(layers, base_lib)
        print(f"vcfslm AVX2 GEMV: {status.reason}; {nbytes / 1e9:.2f} GB of plain bf16 weights ({layers} Phi-3-mini "
              f"layers' linears), {threads} threads, {rounds} rounds; ATen: the dense-bf16 plan without it"
              + (f"; base: the loop at {base}" if base else ""))
        rows_table(fns, "ATen", nbytes, row_counts, rounds, dense_gemv.usable_rows(), base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
