"""Memory-bandwidth probe (STREAM-like, with the rank's threads) and the decode roofline.

Decode reads every weight once per step, so the fastest possible step is
bytes read per step / read bandwidth. The probe measures that bandwidth where the rank
runs (the worker calls it after numactl has pinned it, so it sees its own NUMA node):

- read:  the faster of two read-only passes over a float32 buffer: a sum, and a
         matrix-vector product (MKL's SGEMV streams the matrix like decode streams
         weights). Taking the faster keeps the roofline a floor: a slow read kernel
         would understate bandwidth and flatter the engine's efficiency;
- triad: a = b + s * c over float32 arrays (STREAM's triad; 2 reads + 1 write, counted
         as STREAM counts them, without write-allocate traffic).

Each figure is the best of `repeats` passes (STREAM's convention: the best pass is the
one least disturbed). Buffers are far larger than any last-level cache.

`python -m vcfslm.bench.probe [--threads T] [--mib M]` prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass

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

    def to_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(threads: int | None = None, mib: int = DEFAULT_MIB, repeats: int = 5) -> Bandwidth:
    """Read and triad bandwidth with `threads` torch threads over a `mib` MiB buffer."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    n = max(mib * 1024 * 1024 // 4, 4096)
    n -= n % 4096
    buf = torch.ones(n, dtype=torch.float32)  # written once: pages are resident before timing
    vec = torch.ones(4096, dtype=torch.float32)
    kernels = {"sum": _best(buf.sum, repeats),
               "sgemv": _best(functools.partial(torch.mv, buf.view(-1, 4096), vec), repeats)}
    read_kernel = min(kernels, key=kernels.get)
    read_s = kernels[read_kernel]
    read_bytes = buf.numel() * buf.element_size()
    del buf, vec
    m = max(n // 4, 1024)  # triad: three arrays, together ~3/4 of the read buffer
    a = torch.zeros(m, dtype=torch.float32)
    b = torch.ones(m, dtype=torch.float32)
    c = torch.full((m,), 2.0, dtype=torch.float32)
    triad_s = _best(functools.partial(torch.add, b, c, alpha=3.0, out=a), repeats)
    triad_bytes = 3 * m * 4
    del a, b, c
    return Bandwidth(read_gbs=read_bytes / read_s / 1e9, triad_gbs=triad_bytes / triad_s / 1e9,
                     read_kernel=read_kernel,
                     threads=torch.get_num_threads(), buffer_bytes=read_bytes, repeats=repeats,
                     seconds=time.perf_counter() - started)


def _best(fn, repeats: int) -> float:
    fn()  # first touch / warm the code path
    best = float("inf")
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mean_decode_context(input_tokens: int, output_tokens: int) -> float:
    """Mean number of cached tokens a decode step attends over.

    Steps 1..output_tokens-1 attend over input_tokens + 1 .. input_tokens + output_tokens - 1
    tokens (the first token comes from prefill).
    """
    if output_tokens <= 1:
        return float(input_tokens)
    return input_tokens + output_tokens / 2


def decode_step_bytes(step_weight_bytes: int, kv_bytes_per_token: int, batch: int,
                      context_tokens: float) -> float:
    """Bytes one decode step must read: every weight once + each stream's KV cache."""
    return step_weight_bytes + batch * context_tokens * kv_bytes_per_token


def roofline_tpot_ms(step_bytes: float, read_gbs: float) -> float | None:
    """The bandwidth floor of one decode step in ms (None without a bandwidth)."""
    if not read_gbs or read_gbs <= 0:
        return None
    return step_bytes / (read_gbs * 1e9) * 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcfslm.bench.probe",
                                     description="Memory bandwidth probe (read + triad), JSON on stdout.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--mib", type=int, default=DEFAULT_MIB, help="read buffer size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    result = measure_bandwidth(args.threads, args.mib, args.repeats).to_dict()
    try:
        import torch

        from .placement import placement_facts

        facts = placement_facts(torch)
        result["cpu_affinity"] = facts["cpu_affinity"]
        result["memory_numa_node"] = facts["memory_numa_node"]
        result["cpu_numa_nodes"] = facts["cpu_numa_nodes"]
    except Exception as exc:  # placement is extra detail; the bandwidth is the answer
        result["placement_error"] = str(exc)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
