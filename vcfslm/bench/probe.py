"""Memory-bandwidth probe (STREAM-like, with the rank's threads) and GEMM-rate probe.

Decode reads every weight once per step, so the fastest possible step is
bytes read per step / read bandwidth. The probe measures that bandwidth where the rank
runs (the worker calls it after numactl has pinned it, so it sees its own NUMA node):

- read:  the fastest of three read-only passes over a buffer of the same size: a sum
         over float32, MKL's SGEMV over float32, and the engine's own bf16 linear kernel
         over a bf16 matrix (vcfslm.engine.linear, a few rows: it streams the matrix like
         decode streams weights). Taking the fastest keeps the roofline a floor: a slow
         read kernel would understate bandwidth and flatter the engine's efficiency
         (on an AVX512-BF16 EPYC oneDNN's packed GEMV read ~40 GB/s where the sum read
         ~33);
- triad: a = b + s * c over float32 arrays (STREAM's triad; 2 reads + 1 write, counted
         as STREAM counts them, without write-allocate traffic).

Prefill is compute-bound, so its floor is a matrix-product rate: `measure_gemm` times a
prefill-shaped bf16 GEMM (Phi-3-mini's 3072 x 8192 weight, hundreds of rows) with the
rank's threads, on every kernel that could serve it (the engine's packed one, plain
`F.linear`, fp32 SGEMM) and keeps the fastest, for the same reason as above. The TTFT
floor of a scenario is then the larger of its prompt FLOPs at that rate and one read
of the weights at the read bandwidth (the arithmetic: `vcfslm.roofline`).

Each figure is the best of `repeats` passes (STREAM's convention: the best pass is the
one least disturbed). Buffers are far larger than any last-level cache.

A busy machine disturbs every pass, the best one too, so `measure_probe` (the whole probe:
bandwidth, GEMM, decode-batch curve) also keeps each figure's spread (how much slower its
median pass ran than its best) and the CPU time other processes took on the probe's CPUs
(/proc/stat around it, less its own), and judges the probe steady or busy
(vcfslm.steadiness). The verdict rides in the bandwidth's `steadiness`.

`python -m vcfslm.bench.probe [--threads T] [--mib M]` prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field

from .. import steadiness as steady

DEFAULT_MIB = 1024


@dataclass(frozen=True)
class Bandwidth:
    """Measured bandwidth in GB/s (1e9 bytes per second)."""

    read_gbs: float
    triad_gbs: float
    read_kernel: str
    threads: int
    buffer_bytes: int
    repeats: int
    seconds: float
    read_kernels: dict = field(default_factory=dict)  # GB/s of every read kernel tried
    spreads: dict = field(default_factory=dict)       # "read", "triad": steadiness.Spread.to_dict()
    steadiness: dict | None = None                    # the whole probe's verdict (measure_probe)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(threads: int | None = None, mib: int = DEFAULT_MIB, repeats: int = 5, *,
                      engine_kernel: bool = True) -> Bandwidth:
    """Read and triad bandwidth with `threads` torch threads over a `mib` MiB buffer.

    engine_kernel: also read with the engine's bf16 linear kernel (needs vcfslm.engine.linear).
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    buf = _read_buffer(mib)
    n = buf.numel()
    vec = torch.ones(4096, dtype=torch.float32)
    passes: dict[str, tuple[float, ...] | None] = {}

    def timed(name: str, measure, *args) -> float:
        """measure(*args): a best pass in seconds; the passes behind it are kept for its spread."""
        with _recording() as runs:
            best_s = measure(*args)
        passes[name] = _passes_of(runs, best_s)
        return best_s

    kernels = {"sum": timed("sum", _best, buf.sum, repeats),
               "sgemv": timed("sgemv", _best, functools.partial(torch.mv, buf.view(-1, 4096), vec), repeats)}
    read_bytes = buf.numel() * buf.element_size()
    del buf, vec
    if engine_kernel:
        # The same bytes held by the engine's linear kernel: twice the elements in bf16, as many
        # in fp32 (a plan that holds fp32 reads 4 bytes a weight).
        kernels[ENGINE_READ_KERNEL] = timed(ENGINE_READ_KERNEL, _engine_read_s, read_bytes, repeats)
    read_kernel = min(kernels, key=kernels.get)
    read_s = kernels[read_kernel]
    m = max(n // 4, 1024)  # triad: three arrays, together ~3/4 of the read buffer
    a = torch.zeros(m, dtype=torch.float32)
    b = torch.ones(m, dtype=torch.float32)
    c = torch.full((m,), 2.0, dtype=torch.float32)
    triad_s = timed("triad", _best, functools.partial(torch.add, b, c, alpha=3.0, out=a), repeats)
    triad_bytes = 3 * m * 4
    del a, b, c
    spreads = {figure: steady.spread_of(times).to_dict()
               for figure, times in (("read", passes[read_kernel]), ("triad", passes["triad"])) if times}
    return Bandwidth(read_gbs=read_bytes / read_s / 1e9, triad_gbs=triad_bytes / triad_s / 1e9,
                     read_kernel=read_kernel,
                     read_kernels={k: round(read_bytes / v / 1e9, 2) for k, v in kernels.items()},
                     threads=torch.get_num_threads(), buffer_bytes=read_bytes, repeats=repeats,
                     seconds=time.perf_counter() - started, spreads=spreads)


def _read_buffer(mib: int):
    """The read probe's float32 buffer of about `mib` MiB (whole rows of 4096), written once so
    its pages are resident before anything is timed."""
    import torch

    n = max(mib * 1024 * 1024 // 4, 4096)
    return torch.ones(n - n % 4096, dtype=torch.float32)


# The read kernel's name for the engine's own linear kernel (whatever precision its plan holds).
ENGINE_READ_KERNEL = "engine bf16 linear"


def _engine_read_s(held_bytes: int, repeats: int) -> float:
    """Seconds of one pass of the engine's linear kernel over weights that hold `held_bytes`
    in its plan's layout (bf16, or fp32 where the plan holds fp32)."""
    import torch

    from ..engine import linear

    plan = linear.default_plan()
    slices = _engine_slices(held_bytes // plan.held_bytes_per_weight, plan)
    x = torch.ones(plan.rows_computed(1), slices[0].in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        return _best(lambda: [layer(x) for layer in slices], repeats)


def _engine_slices(elements: int, plan) -> list:
    """`elements` bf16 weights as the engine's packed linears, cut into Phi-3-sized slices
    (3072 columns, at most 16384 rows) packed one at a time, so the probe never holds two
    copies of its buffer."""
    import torch

    from ..engine import linear

    k, rows_per = 3072, 16384
    rows_total = max(elements // k, 1)
    slices = []
    while rows_total > 0:
        rows = min(rows_per, rows_total)
        slices.append(linear.PackedLinear(torch.ones(rows, k, dtype=torch.bfloat16), None, plan))
        rows_total -= rows
    return slices


class SustainedRead:
    """The read probe's sum kernel held on one buffer, read for as many bytes as a long pass
    reads: the like-for-like neighbour of a decode window or of a pass over every weight.

    `measure_bandwidth` keeps the best of a few passes over 1 GiB (~25 ms each), STREAM's
    convention. On a shared host whose bandwidth bursts within seconds, that best pass
    catches a burst that a pass of seconds cannot hold for its whole length, so a long
    pass judged against it is judged against a rate nobody could sustain that long. This
    reads the same number of bytes, over the same stretch of time, right beside it.
    """

    def __init__(self, mib: int = DEFAULT_MIB):
        self.buffer = _read_buffer(mib)
        self.buffer_bytes = self.buffer.numel() * self.buffer.element_size()
        self.buffer.sum()   # warm the code path
        self.fastest_pass_gbs = 0.0   # the last read's fastest single pass: what the best-of convention keeps

    def gbs(self, nbytes: int) -> float:
        """GB/s over whole passes of the buffer, at least `nbytes` bytes in all."""
        passes = max(-(-nbytes // self.buffer_bytes), 1)
        stamps = [time.perf_counter()]
        for _ in range(passes):
            self.buffer.sum()
            stamps.append(time.perf_counter())
        self.fastest_pass_gbs = self.buffer_bytes / min(b - a for a, b in itertools.pairwise(stamps)) / 1e9
        return passes * self.buffer_bytes / (stamps[-1] - stamps[0]) / 1e9


@dataclass(frozen=True)
class DecodeLinears:
    """How fast the engine's linear kernel consumes streamed weights at decode batch sizes.

    gbs[i]: weight GB/s at rows[i] rows (streams). At one row it is the read bandwidth;
    as rows grow each weight byte carries more FLOPs, and where the kernel turns
    compute-bound the rate falls. The curve is the measured knee between the two sides
    of the decode roofline, which the performance model uses instead of assuming one.
    """

    rows: tuple[int, ...]
    gbs: tuple[float, ...]
    kernel: str
    threads: int
    buffer_bytes: int
    seconds: float
    # Bytes the plan holds per weight: 4 where it holds fp32 (onednn-fp32). `gbs` counts the
    # model's bf16 bytes either way, as the roofline does, so a step's weights over it is the
    # step's time; the memory read is gbs x held_bytes_per_weight / 2.
    held_bytes_per_weight: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
DECODE_MIB = 512


def measure_decode_linears(threads: int | None = None, rows: tuple[int, ...] = DECODE_ROWS,
                           mib: int = DECODE_MIB, repeats: int = 3, plan=None) -> DecodeLinears:
    """The weight rate of the engine's linear kernel at each decode batch in `rows`, over a
    `mib` MiB weight set far larger than any last-level cache (so weights stream from memory
    as in a decode step). plan: the engine's KernelPlan (default: this CPU's)."""
    import torch

    from ..engine import linear

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    plan = plan or linear.default_plan()
    elements = max(mib * 1024 * 1024 // 2, 3072)
    slices = _engine_slices(elements, plan)
    weight_bytes = sum(layer.weight_nbytes for layer in slices)
    rates = []
    with torch.inference_mode():
        for m in rows:
            # The engine computes the rows it would for a batch this size (padded or not).
            x = torch.ones(plan.rows_computed(m), slices[0].in_features, dtype=torch.bfloat16)
            rates.append(weight_bytes / _best(lambda x=x: [layer(x) for layer in slices], repeats) / 1e9)
    return DecodeLinears(rows=tuple(rows), gbs=tuple(round(r, 3) for r in rates), kernel=plan.kernel,
                         held_bytes_per_weight=plan.held_bytes_per_weight,
                         threads=torch.get_num_threads(), buffer_bytes=weight_bytes,
                         seconds=time.perf_counter() - started)


@dataclass(frozen=True)
class GemmRate:
    """Measured bf16 matrix-product rate in TFLOP/s (1e12 FLOP per second)."""

    tflops: float
    kernel: str
    rows: int
    k: int
    n: int
    threads: int
    rates: dict
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


GEMM_ROWS = (256, 1024)
GEMM_K, GEMM_N = 3072, 8192
# A larger M is measured only while a call at the smaller one took less than this. A call that
# slow is compute-bound many times over (the 3072x8192 weight is read in a few milliseconds),
# so more rows cannot raise its rate: the AMX and AVX512-BF16 CPUs whose rate still grows with
# M take ~1-10 ms at M=256. On a 2-core AVX2 EPYC (one thread, fp32) a call at M=256 took
# ~0.17 s and one at M=1024 ~0.7 s: the larger M was 5.3 of the GEMM probe's 7.2 s, in
# every rank of every run.
GEMM_LARGER_M_BELOW_S = 0.05


def measure_gemm(threads: int | None = None, rows: tuple[int, ...] = GEMM_ROWS, k: int = GEMM_K,
                 n: int = GEMM_N, repeats: int = 3, plan=None) -> GemmRate:
    """The fastest prefill-shaped GEMM rate over the kernels that could run it, at each M of
    `rows` in turn while the previous M's fastest call took under GEMM_LARGER_M_BELOW_S
    (`rates` names the M measured).

    plan: the engine's vcfslm.engine.linear.KernelPlan (default: this CPU's).
    """
    import torch
    import torch.nn.functional as F

    from ..engine import linear

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    plan = plan or linear.default_plan()
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    packed = linear.PackedLinear(weight, None, plan)
    weight32 = weight.float() if plan.kernel != linear.ONEDNN_PACKED else None
    rates: dict[str, float] = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x32 = x.float() if weight32 is not None else None
            flop = 2.0 * m * k * n
            candidates = {f"engine {plan.kernel}": functools.partial(packed, x)}
            # Without oneDNN bf16 a bf16 GEMM crawls (seconds per call here) and fp32 is
            # the fast path; with it, fp32 SGEMM is the slower one.
            if plan.kernel == linear.ONEDNN_PACKED:
                candidates["F.linear bf16"] = functools.partial(F.linear, x, weight)
            else:
                candidates["F.linear fp32"] = functools.partial(F.linear, x32, weight32)
            for name, fn in candidates.items():
                rates[f"{name} M={m}"] = flop / _best(fn, repeats) / 1e12
            fastest_call_s = flop / (max(rates[f"{name} M={m}"] for name in candidates) * 1e12)
            if fastest_call_s >= GEMM_LARGER_M_BELOW_S:
                break
    best = max(rates, key=rates.get)
    name, _, m_text = best.rpartition(" M=")
    return GemmRate(tflops=rates[best], kernel=name, rows=int(m_text), k=k, n=n,
                    threads=torch.get_num_threads(),
                    rates={key: float(f"{v:.4g}") for key, v in rates.items()},  # 4 figures: slow CPUs probe ~0.03
                    seconds=time.perf_counter() - started)


def _best(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one untimed call); every pass's
    time also goes to each recording open (`_recording`), for the figure's spread."""
    fn()  # first touch / warm the code path
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    for runs in _RECORDINGS:
        runs.append(tuple(times))
    return min(times)


# The recordings open around measurements: each gets every _best call's pass times, in order.
_RECORDINGS: list[list[tuple[float, ...]]] = []


@contextlib.contextmanager
def _recording() -> Iterator[list[tuple[float, ...]]]:
    """The pass times of every _best call made inside the block, one tuple per call."""
    runs: list[tuple[float, ...]] = []
    _RECORDINGS.append(runs)
    try:
        yield runs
    finally:
        del _RECORDINGS[next(i for i, open_runs in enumerate(_RECORDINGS) if open_runs is runs)]


def _passes_of(runs: list[tuple[float, ...]], best_s: float, rel: float = 1e-9) -> tuple[float, ...] | None:
    """The one recorded call whose best pass is `best_s` (within `rel`); None when none is, or
    several are (the figure's spread is then unknown rather than another call's)."""
    found = [times for times in runs if math.isclose(min(times), best_s, rel_tol=rel)]
    return found[0] if len(found) == 1 else None


# ---------------------------------------------------------------- the whole probe, watched


@dataclass(frozen=True)
class Probe:
    """One probe: its figures, and whether the machine was quiet while it took them
    (`bandwidth.steadiness` holds the verdict's dict too, so it travels with the probe)."""

    bandwidth: Bandwidth
    gemm: GemmRate | None
    decode_linears: DecodeLinears | None
    steadiness: steady.Steadiness


def measure_probe(threads: int | None = None, mib: int = DEFAULT_MIB, repeats: int = 5, *, gemm: bool = True,
                  decode_mib: int = DECODE_MIB, plan=None, cpus: Collection[int] | None = None) -> Probe:
    """Bandwidth, then (with `gemm`) the GEMM rate and the decode-batch curve, watched: every
    figure's spread over its passes, and the CPU time others took on `cpus` (the CPUs the
    probe may run on; default: this process's affinity) meanwhile, judged steady or busy."""
    if cpus is None and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
    with _Watch(cpus) as watch:
        bandwidth = measure_bandwidth(threads, mib, repeats)
        rate = curve = None
        if gemm:
            with _recording() as gemm_runs:
                rate = measure_gemm(threads, plan=plan)
            with _recording() as curve_runs:
                curve = measure_decode_linears(threads, mib=decode_mib, plan=plan)
    spreads = {name: steady.Spread(**{k: s[k] for k in ("passes", "best_s", "median_s")})
               for name, s in bandwidth.spreads.items()}
    if rate is not None:
        times = _passes_of(gemm_runs, 2.0 * rate.rows * rate.k * rate.n / (rate.tflops * 1e12))
        if times:
            spreads["gemm"] = steady.spread_of(times)
    if curve is not None:
        spreads.update(_curve_spreads(curve, curve_runs))
    verdict = steady.judge(spreads, watch.others())
    return Probe(bandwidth=dataclasses.replace(bandwidth, steadiness=verdict.to_dict()), gemm=rate,
                 decode_linears=curve, steadiness=verdict)


def _curve_spreads(curve: DecodeLinears, runs: list[tuple[float, ...]]) -> dict[str, steady.Spread]:
    """The decode-batch curve's spread at its first row count: the decode rate a step meets,
    which the SLO scaling and the roofline take. (Its compute-bound rows scatter by a quarter
    on a quiet machine, so they would only cry wolf.) The curve times one call per
    row count, in order; empty when the calls do not line up with the rows."""
    if len(runs) != len(curve.rows) or not runs:
        return {}
    first = curve.rows[0]
    return {f"decode linears at {first} row{'s' if first > 1 else ''}": steady.spread_of(runs[0])}


class _Watch:
    """Around a block: /proc/stat and this process's CPU time (children included) at its start
    and its end, for the CPU time others took on `cpus` meanwhile."""

    def __init__(self, cpus: Collection[int] | None):
        self.cpus = tuple(cpus) if cpus else None
        self.start = self.end = None

    def __enter__(self) -> _Watch:
        self.start = _reading()
        return self

    def __exit__(self, *exc) -> None:
        self.end = _reading()

    def others(self) -> steady.OthersCpu:
        (stat0, own0, t0), (stat1, own1, t1) = self.start, self.end
        return steady.others_cpu(stat0, stat1, self.cpus, own1 - own0, t1 - t0, os.sysconf("SC_CLK_TCK"))


def _reading() -> tuple[str | None, float, float]:
    """(/proc/stat's text or None, this process's CPU seconds, a perf_counter stamp)."""
    times = os.times()
    return _proc_stat(), times.user + times.system + times.children_user + times.children_system, \
        time.perf_counter()


def _proc_stat() -> str | None:
    """/proc/stat's text; None where there is none (not Linux, a sandbox without /proc)."""
    try:
        with open("/proc/stat", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcfslm.bench.probe",
                                     description="Memory bandwidth probe (read + triad), JSON on stdout.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--mib", type=int, default=DEFAULT_MIB, help="read buffer size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-gemm", action="store_true",
                        help="skip the bf16 GEMM rate and the decode-batch linear rates")
    args = parser.parse_args(argv)
    from ..topology import parse_cpu_list
    from .placement import start_binding

    binding = start_binding()   # before OpenMP binds the main thread to one core
    cpus = parse_cpu_list(binding["cpus"]) if binding.get("cpus") else None
    probe = measure_probe(args.threads, args.mib, args.repeats, gemm=not args.no_gemm, cpus=cpus)
    result = probe.bandwidth.to_dict()
    if probe.gemm is not None:
        result["gemm"] = probe.gemm.to_dict()
    if probe.decode_linears is not None:
        result["decode_linears"] = probe.decode_linears.to_dict()
    try:
        import torch

        from .placement import placement_facts

        facts = placement_facts(torch, binding)
        result["cpu_affinity"] = facts["cpu_affinity"]
        result["memory_numa_node"] = facts["memory_numa_node"]
        result["cpu_numa_nodes"] = facts["cpu_numa_nodes"]
    except Exception as exc:  # placement is extra detail; the bandwidth is the answer
        result["placement_error"] = str(exc)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
