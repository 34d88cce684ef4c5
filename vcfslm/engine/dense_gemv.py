"""vcfslm's GEMV for 1-32 bf16 rows on CPUs without bf16 instructions (AVX2 with FMA), reading
the dense-bf16 plan's plain weight in place.

Where oneDNN has no bf16 (no AVX512-BF16, no AMX), a replica keeps each weight as a plain
row-major bf16 matrix (vcfslm.engine.linear's dense-bf16 plan). Decode at small batch then
went through ATen's bf16 GEMV one row at a time: on a 2-core AVX2 EPYC it read the weights at
~0.55 of the read probe for one row, and every further row read them again (at 4 rows, ~5 GB/s
of weights), and 5+ rows converted each weight slice to fp32 for SGEMM. The loop in
`gemv_avx2.cpp` widens bf16 to fp32 in registers and reads the same bytes at ~0.95 of the
probe for one row, ~0.9 for two (2-4 rows prefetch the next rows a tile ahead), serves 5-7
rows from L1-sized chunks of the weight, and 8-32 rows (bound by the FMAs) by broadcasting
weight pairs against four input rows at once, at most 16 rows per pass, the rest from cache
(benchmarks/gemv_hypotheses.py and benchmarks/gemv_rows.py print both, side by side).
Nothing is copied or repacked: prefill's many-row calls stay on the fp32 slices and SGEMM.

It is used only where all of these hold, and `status()` says which one did not:
- the CPU has AVX2 and FMA;
- the library is there: the project's wheel carries one (no compiler on a guest), or a C++
  compiler here builds it once per source and compiler into the kernel cache folder
  (vcfslm.engine.gemv's build and lookup, shared);
- its output matches F.linear on a test weight at every row count it has a loop for;
- `VCFSLM_GEMV` is not `off` (the switch turns off both GEMVs).
Each weight is checked again when it is packed (vcfslm.engine.linear's pack check).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from . import gemv
from .cpuinfo import parse_cpu_flags, read_cpuinfo

SOURCE = Path(__file__).with_name("gemv_avx2.cpp")
ABI = 1
MAX_ROWS = 32
K_STEP = 16   # bf16 per load: a weight qualifies when this divides its input width
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-mavx2", "-mfma")
LABEL = "vcfslm AVX2 GEMV on the plain bf16 weight"
# Row counts with a loop of their own (1-4 stream; 5 and 7 the chunked loop, on tiles of 4
# and of 3 weight rows, over its two row groups and a k chunk boundary; 8-16 the broadcast
# loop, at 2, 3 and 4 groups of four rows, 11 padded, 10 and 13 with rows left in the dot
# form; 17-23 16 rows broadcast and the rest in the dot form, in one and two groups; 24-32
# broadcast twice, 16 rows and the rest): the check runs each.
CHECK_ROWS = (1, 2, 3, 4, 5, 7, 8, 10, 11, 12, 13, 16, 17, 22, 27, 32)


# ------------------------------------------------------------------ decisions (pure)


def cpu_runs_it(cpuinfo_text: str) -> bool:
    """Whether /proc/cpuinfo's first flags line lists avx2 and fma."""
    return {"avx2", "fma"} <= parse_cpu_flags(cpuinfo_text)


def fits(k: int, rows: int) -> bool:
    """Whether a weight of input width k, at `rows` rows, is one the loop covers."""
    return 1 <= rows <= MAX_ROWS and k >= K_STEP and k % K_STEP == 0


def packaged_name(source: bytes) -> str:
    """The library's name inside the wheel (a digest of its source, as vcfslm.engine.gemv's)."""
    return gemv.packaged_name(source, "vcfslm-gemv-avx2")


# ------------------------------------------------------------------ build and load


def build(folder: Path | None = None, name: str | None = None) -> Path:
    """The library for this source and compiler, compiled into the kernel cache when missing."""
    return gemv.build(folder, name, SOURCE, FLAGS)


def build_packaged(folder: Path) -> Path:
    """The library under the name the wheel carries it by (the wheel's build hook)."""
    return build(folder, packaged_name(SOURCE.read_bytes()))


def load(path: Path) -> ctypes.CDLL:
    return gemv.load(path, ABI)


def packaged_library(folder: Path = gemv.PACKAGED_DIR) -> Path | None:
    path = folder / packaged_name(SOURCE.read_bytes())
    return path if path.is_file() else None


# ------------------------------------------------------------------ the call


def run(x2, weight, lib: ctypes.CDLL | None = None):
    """y [rows, n] bf16 = x2 [rows, k] (contiguous bf16) times weight.T ([n, k] contiguous
    bf16)."""
    import torch

    rows, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    rc = (lib or library()).vcfslm_gemv_bf16(weight.data_ptr(), x2.data_ptr(), y.data_ptr(), rows, n, k,
                                              torch.get_num_threads(), 0)
    if rc != 0:
        raise ValueError(f"vcfslm AVX2 GEMV refused rows={rows} n={n} k={k}")
    return y


def matches_linear(lib: ctypes.CDLL) -> tuple[bool, str]:
    """Whether the loop gives F.linear's output on a test weight at every CHECK_ROWS count. The
    shape has outputs left over after whole tiles (8 and 3) and a k past one chunk."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    n, k = 29, 1024 + 3 * K_STEP
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    for rows in CHECK_ROWS:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        want = F.linear(x.float(), w.float())
        got = run(x, w, lib).float()
        err = (got - want).abs().max().item() / (want.abs().max().item() or 1.0)
        if not err <= gemv.LAYOUT_RTOL:
            return False, f"the AVX2 GEMV differs from F.linear at {rows} rows (max relative error {err:.3g})"
    return True, "checked against F.linear"


_state: dict = {}


def library() -> ctypes.CDLL:
    """The checked library of this process: what vcfslm.engine.gemv_op points its op at for
    plain weights."""
    if "lib" not in _state and not status().usable:
        raise RuntimeError(f"vcfslm's AVX2 GEMV does not run here: {status().reason}")
    return _state["lib"]


@functools.cache
def status() -> gemv.GemvStatus:
    """This process's verdict (once): usable, or the first condition that failed."""
    verdict, lib = gemv.checked_library(cpu_runs_it(read_cpuinfo()), "the CPU has no AVX2 with FMA",
                                        lambda: gemv.find_library(packaged_library(), build, load), matches_linear)
    if lib is not None:
        _state["lib"] = lib
    return verdict


def usable_rows() -> int:
    """Rows up to which the loop runs in this process (0: never)."""
    return MAX_ROWS if status().usable else 0


def report() -> dict:
    """The status, with the library built even where it will not run."""
    return gemv.report(status(), build)
