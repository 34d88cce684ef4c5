"""What keeps a decode linear from reading its weight as fast as the machine reads memory:
each hypothesis timed on the same weight set, side by side, round after round.

    .venv/bin/python benchmarks/gemv_hypotheses.py                  # 4 Phi-3-mini layers + lm_head (~1 GB)
    .venv/bin/python benchmarks/gemv_hypotheses.py --layers 2 --rounds 5 --no-autotune

The weight set is Phi-3-mini's four linear shapes (qkv 3072->9216, o 3072->3072, gate_up
3072->16384, down 8192->3072) repeated `--layers` times, and its lm_head: far larger than
any cache, so every pass streams it from memory as a decode step does. Every row runs the
whole set once per round; rows take turns within a round, and each row is reported as the
median of its per-round ratio to the plain read of the same round (`sum` over fp32), so
the host's bandwidth drift (1.5x within seconds here) hits every row alike.

Rows:
- the read kernels the probe takes its bandwidth from (sum, MKL SGEMV), and sum over random
  values (is a buffer of ones read faster? it must not be);
- oneDNN's packed weight at 1 row and padded to 4 rows, and packed for 16 rows (the block
  layout it picks; its verbose log names it AB16b64a2b on AVX512-BF16); these, the N split,
  Inductor's micro-GEMM and vcfslm's AVX512-BF16 GEMV only where oneDNN has bf16;
- the dense-bf16 plan's few-row kernels on the plain weight (any AVX2 CPU): ATen's bf16 GEMV
  one row at a time, and vcfslm's AVX2 GEMV (vcfslm.engine.dense_gemv) at 1, 2 and 4 rows,
  with one thread, and through its call paths;
- the unpacked weight through ATen's F.linear and torch.ops.mkldnn._linear_pointwise;
- an Inductor-compiled reduction over a [N/16, K, 16] blocked copy, and Inductor's own C++
  micro-GEMM (max-autotune, frozen weights: a second copy per compiled shape, so not
  something a replica can hold);
- an N split: two Python threads, each running oneDNN on half the rows with one thread;
- vcfslm's GEMV (vcfslm.engine.gemv) on oneDNN's packed bytes: at 1 and 4 rows, with one
  thread against the plain read with one thread, with software prefetch 512 to 4096 bytes
  ahead, and on a copy of the packed bytes in 2 MiB transparent huge pages;
- the call path around the GEMV: the eager PackedLinear's function, the vcfslm::linear op
  through the dispatcher (what a compiled graph calls where vcfslm::gemv does not run), the
  vcfslm::gemv op (C++ to the kernel: what a compiled graph calls), and the same kernel
  registered through torch.library.custom_op.

Like a rank (rank.sh), the run puts large allocations on 2 MiB pages (THP_MEM_ALLOC_ENABLE).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vcfslm.bench.pages import ask_for_huge_pages  # noqa: E402

# The rank's environment (rank.sh): weights on 2 MiB pages. On 4 KiB pages the same packed
# bytes read at 0.67-0.92 of the probe from one allocation to the next on the same machine:
# which memory they got decided it.
ask_for_huge_pages()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vcfslm.engine import dense_gemv, gemv, gemv_op, linear  # noqa: E402

SHAPES = ((9216, 3072), (3072, 3072), (16384, 3072), (3072, 8192))
LM_HEAD = (32064, 3072)


@dataclass
class Row:
    name: str
    tests: str
    fn: object
    times: list
    threads: int = 0   # 0: the run's threads
    one_core: bool = False   # judged against the one-thread read, not the plain one


def _mkldnn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _thp_copy(packed_list, sizes):
    """Copies of the packed bytes in anonymous memory advised to use 2 MiB pages; the
    mappings stay referenced by the returned list."""
    maps, addresses = [], []
    for packed, size in zip(packed_list, sizes, strict=True):
        m = mmap.mmap(-1, size + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        start = (base + (2 << 20) - 1) & ~((2 << 20) - 1)
        ctypes.memmove(start, torch.ops.mkldnn.data_ptr(packed), size)
        maps.append(m)
        addresses.append(start)
    return maps, addresses


def _custom_op_twin():
    """vcfslm::linear's kernel registered the other way, through torch.library.custom_op."""
    @torch.library.custom_op("vcfslm_hypotheses::linear", mutates_args=())
    def twin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, kernel: str,
             min_rows: int, gemv_rows: int) -> torch.Tensor:
        return linear.linear_eager(x, weight, bias, out_features, kernel, min_rows, gemv_rows)

    return twin


def anon_huge_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def build_rows(layers: int, threads: int, autotune: bool) -> tuple[list[Row], int, list]:
    gen = torch.Generator().manual_seed(0)
    shapes = [*SHAPES * layers, LM_HEAD]
    ws = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for n, k in shapes]
    nbytes = sum(w.numel() * 2 for w in ws)
    x1 = {k: torch.randn(1, k, generator=gen).to(torch.bfloat16) for k in (3072, 8192)}
    x4 = {k: torch.randn(4, k, generator=gen).to(torch.bfloat16) for k in (3072, 8192)}
    keep: list = []
    rows: list[Row] = []

    def add(name, tests, fn, threads_=0, one_core=False):
        rows.append(Row(name, tests, fn, [], threads_, one_core))

    ones = torch.ones(nbytes // 4)
    noise = torch.randn(nbytes // 4, generator=gen)
    vec = torch.ones(4096)
    keep += [ones, noise, vec]
    add("sum fp32 (read probe)", "the plain read, every ratio's reference", ones.sum)
    add("sum fp32, 1 thread", "what one core reads", ones.sum, 1)
    add("sum fp32 over random values", "a buffer of ones is not read faster", noise.sum)
    add("MKL SGEMV fp32 (read probe)", "the probe's other read kernel", lambda: torch.mv(ones.view(-1, 4096), vec))

    add("F.linear, unpacked, 1 row", "no packing at all (ATen)", lambda: [F.linear(x1[w.shape[1]], w) for w in ws])
    has_onednn_bf16 = linear.onednn_bf16()
    packed: list = []
    if has_onednn_bf16:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in ws]
        keep.append(packed)
        add("oneDNN packed, 1 row", "oneDNN's one-row path",
            lambda: [_mkldnn(x1[w.shape[1]], p) for w, p in zip(ws, packed, strict=True)])
        add("oneDNN packed, padded to 4 rows", "the padding the plan used",
            lambda: [_mkldnn(x4[w.shape[1]], p) for w, p in zip(ws, packed, strict=True)])
        add("mkldnn._linear_pointwise, unpacked, 1 row", "a torch.ops.mkldnn variant on the plain weight",
            lambda: [_mkldnn(x1[w.shape[1]], w) for w in ws])
    else:
        print("oneDNN has no bf16 here: its packed weight, its N split, Inductor's bf16 micro-GEMM and vcfslm's "
              "AVX512-BF16 GEMV are not run")
    _dense_rows(add, ws, x1, x4)

    with torch.no_grad():
        blocked = [w.view(w.shape[0] // 16, 16, w.shape[1]).transpose(1, 2).contiguous() for w in ws]
        keep.append(blocked)

        def reduce16(x, b):
            return (x[:, None, :, None].float() * b[None].float()).sum(2).reshape(1, -1).to(torch.bfloat16)

        add("Inductor reduction, [N/16,K,16] copy, 1 row", "a compiled loop on a 16-wide block layout",
            torch.compile(lambda: [reduce16(x1[b.shape[1]], b) for b in blocked], dynamic=False))

    if autotune and has_onednn_bf16:
        import torch._inductor.config as inductor_config

        class Stack(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ls = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
                                              for w in ws)
                for lin, w in zip(self.ls, ws, strict=True):
                    lin.weight.data = w

            def forward(self, a, b):
                return [lin(a if lin.in_features == 3072 else b) for lin in self.ls]

        with inductor_config.patch(freezing=True, max_autotune_gemm_backends="CPP,ATEN"), torch.no_grad():
            stack = Stack().eval()
            micro = torch.compile(stack, mode="max-autotune", dynamic=False)
            micro(x1[3072], x1[8192])
        keep.append(micro)
        add("Inductor C++ micro-GEMM (max-autotune, frozen)", "Inductor's template; a copy per compiled shape",
            lambda: micro(x1[3072], x1[8192]))

    if not has_onednn_bf16:
        return rows, nbytes, keep
    halves = [(torch.ops.mkldnn._reorder_linear_weight(w[: w.shape[0] // 2].contiguous(), 4),
               torch.ops.mkldnn._reorder_linear_weight(w[w.shape[0] // 2:].contiguous(), 4)) for w in ws]
    keep.append(halves)

    def n_split():
        def half(i):
            for w, h in zip(ws, halves, strict=True):
                _mkldnn(x4[w.shape[1]], h[i])
        t = threading.Thread(target=half, args=(1,))
        t.start()
        half(0)
        t.join()

    add("N split: 2 threads x oneDNN on half the rows", "splitting N across threads by hand", n_split, 1)

    status = gemv.status()
    if status.usable:
        lib = gemv._library()
        add("vcfslm GEMV on oneDNN's packed bytes, 1 row", "the engine's few-row kernel",
            lambda: [gemv.run(x1[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, packed, strict=True)])
        # The call path around the kernel: a decode step makes 129 of these calls, each
        # starting with caches the weight stream has just flushed.
        gemv_rows = linear.default_plan().gemv_rows or gemv.MAX_ROWS
        add("vcfslm GEMV via linear_eager (an eager PackedLinear)", "the engine's eager call path",
            lambda: [linear.linear_eager(x1[w.shape[1]], p, None, w.shape[0], linear.ONEDNN_PACKED, 4, gemv_rows)
                     for w, p in zip(ws, packed, strict=True)])
        add("vcfslm GEMV via the vcfslm::linear op", "the dispatcher and the op's Python kernel",
            lambda: [torch.ops.vcfslm.linear.default(x1[w.shape[1]], p, None, w.shape[0], linear.ONEDNN_PACKED, 4,
                                                     gemv_rows) for w, p in zip(ws, packed, strict=True)])
        if gemv_op.usable():
            weights_at = [gemv_op.address_of(p) for p in packed]   # as each PackedLinear holds it
            add("vcfslm GEMV via the vcfslm::gemv op", "what a compiled graph calls: C++ to the kernel",
                lambda: [gemv_op.call(x1[w.shape[1]], a, w.shape[0], None) for w, a in zip(ws, weights_at, strict=True)])
        twin = _custom_op_twin()
        add("vcfslm GEMV via a torch.library.custom_op twin", "custom_op's wrappers around the same kernel",
            lambda: [twin(x1[w.shape[1]], p, None, w.shape[0], linear.ONEDNN_PACKED, 4, gemv_rows)
                     for w, p in zip(ws, packed, strict=True)])
        add("vcfslm GEMV, 4 rows", "4 rows cost the same reads",
            lambda: [gemv.run(x4[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, packed, strict=True)])
        add("vcfslm GEMV, 1 thread", "one core's share (against sum, 1 thread)",
            lambda: [gemv.run_at(torch.ops.mkldnn.data_ptr(p), x1[w.shape[1]], w.shape[0], lib, threads=1)
                     for w, p in zip(ws, packed, strict=True)], 1, one_core=True)
        for distance in (512, 1024, 4096):
            add(f"vcfslm GEMV, prefetch {distance} B ahead", "software prefetch distance",
                lambda d=distance: [gemv.run_at(torch.ops.mkldnn.data_ptr(p), x1[w.shape[1]], w.shape[0], lib,
                                                prefetch=d) for w, p in zip(ws, packed, strict=True)])
        before = anon_huge_kb()
        maps, addresses = _thp_copy(packed, [w.numel() * 2 for w in ws])
        keep.append(maps)
        huge_mib = (anon_huge_kb() - before) // 1024
        add(f"vcfslm GEMV, weight in 2 MiB pages ({huge_mib} MiB huge)", "page size (TLB reach)",
            lambda: [gemv.run_at(a, x1[w.shape[1]], w.shape[0], lib) for w, a in zip(ws, addresses, strict=True)])
    else:
        print(f"vcfslm GEMV: not run here ({status.reason})")
    return rows, nbytes, keep


def _dense_rows(add, ws, x1, x4) -> None:
    """The dense-bf16 plan's few-row kernels on the plain weight (any AVX2 CPU; the plan's on
    one where oneDNN has no bf16): vcfslm's AVX2 GEMV, its call paths, and ATen's per-row GEMV
    it replaces."""
    status = dense_gemv.status()
    if not status.usable:
        print(f"vcfslm AVX2 GEMV: not run here ({status.reason})")
        return
    lib = dense_gemv.library()
    x2 = {k: torch.randn(2, k).to(torch.bfloat16) for k in x1}
    add("ATen bf16 GEMV, 4 rows one at a time", "the dense-bf16 plan's few rows without vcfslm's GEMV",
        lambda: [linear.linear_eager(x4[w.shape[1]], w, None, w.shape[0], linear.DENSE_BF16, 1, 0) for w in ws])
    add("vcfslm AVX2 GEMV on the plain weight, 1 row", "the dense-bf16 plan's few-row kernel",
        lambda: [dense_gemv.run(x1[w.shape[1]], w, lib) for w in ws])
    add("vcfslm AVX2 GEMV, 2 rows", "2 rows in one pass over the weight",
        lambda: [dense_gemv.run(x2[w.shape[1]], w, lib) for w in ws])
    add("vcfslm AVX2 GEMV, 4 rows", "4 rows in one pass, the next tile prefetched",
        lambda: [dense_gemv.run(x4[w.shape[1]], w, lib) for w in ws])
    add("vcfslm AVX2 GEMV, 1 thread", "one core's share (against sum, 1 thread)",
        lambda: [dense_gemv.run(x1[w.shape[1]], w, lib) for w in ws], 1, one_core=True)
    add("vcfslm AVX2 GEMV via linear_eager (dense-bf16)", "the engine's eager call path",
        lambda: [linear.linear_eager(x1[w.shape[1]], w, None, w.shape[0], linear.DENSE_BF16, 1, dense_gemv.MAX_ROWS)
                 for w in ws])
    if gemv_op.usable(gemv_op.PLAIN):
        weights_at = [gemv_op.address_of(w, gemv_op.PLAIN) for w in ws]
        add("vcfslm AVX2 GEMV via the vcfslm::gemv op", "what a compiled graph calls: C++ to the kernel",
            lambda: [gemv_op.call(x1[w.shape[1]], a, w.shape[0], None, gemv_op.PLAIN)
                     for w, a in zip(ws, weights_at, strict=True)])


def measure(rows: list[Row], rounds: int, threads: int) -> None:
    with torch.inference_mode():
        for row in rows:   # warm every code path once
            torch.set_num_threads(row.threads or threads)
            row.fn()
        for _ in range(rounds):
            for row in rows:
                torch.set_num_threads(row.threads or threads)
                t0 = time.perf_counter()
                row.fn()
                row.times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)


def table(rows: list[Row], nbytes: int, threads: int) -> list[str]:
    ref = rows[0].times
    ref1 = next((r.times for r in rows if r.name == "sum fp32, 1 thread"), ref)
    out = [f"{'hypothesis':<58} {'GB/s':>6} {'of sum':>7}  tests"]
    for row in rows:
        base = ref1 if row.one_core else ref
        ratio = statistics.median(b / t for b, t in zip(base, row.times, strict=True))
        gbs = statistics.median(nbytes / t / 1e9 for t in row.times)
        threads_note = "" if not row.threads or row.threads == threads else f" [{row.threads} thread]"
        out.append(f"{row.name + threads_note:<58} {gbs:6.1f} {ratio:7.2f}  {row.tests}")
    return out


def run(layers: int = 4, rounds: int = 7, threads: int | None = None, autotune: bool = True) -> list[str]:
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    rows, nbytes, keep = build_rows(layers, threads, autotune)
    measure(rows, rounds, threads)
    lines = [f"GEMV hypotheses: {nbytes / 1e9:.2f} GB of bf16 weights ({layers} Phi-3-mini layers + lm_head), "
             f"{threads} threads, {rounds} rounds; GB/s median, 'of sum' = median per-round ratio to the plain read "
             f"(1-thread rows: to the 1-thread read)"]
    lines += table(rows, nbytes, threads)
    del keep
    return lines


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_efficiency import cpu_line

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-autotune", action="store_true", help="skip Inductor's max-autotune micro-GEMM (slow to compile)")
    args = ap.parse_args()
    print(cpu_line())
    print(f"vcfslm GEMV: {gemv.status().reason}; AVX2 GEMV: {dense_gemv.status().reason}; "
          f"plan {linear.default_plan().label}")
    for line in run(args.layers, args.rounds, args.threads, not args.no_autotune):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
