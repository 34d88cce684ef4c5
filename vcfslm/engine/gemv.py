"""vcfslm's GEMV for 1-32 bf16 rows, reading oneDNN's packed weight in place.

Decode at small batch is a weight stream: every byte of every linear once per step. oneDNN's
kernel for a few rows reads its own packed layout at ~0.7 of the read probe on the CPUs
measured (benchmarks/gemv_hypotheses.py prints the comparison). The loop in
`gemv_avx512bf16.cpp` reads the same bytes, in the same layout, at ~0.9 for 1-4 rows, and
streams 5-6 rows the same way (one pass holds them); for 7-32 rows (decode at batch 16, a
short prompt's prefill) it runs the weight in L1-sized chunks with L2 and L1 prefetches
ahead and does ~1.05-1.5x oneDNN's FLOP rate at the same rows (at 48-64 rows the two are
even, so longer prefills stay on oneDNN; benchmarks/gemv_rows.py prints both, row count by
row count). Nothing is copied or repacked, so a replica still holds one copy of its
weights; only the few-row calls change kernel. On a CPU with AMX it takes 1-6 rows only:
7-32 stay on oneDNN's tile kernel, which computes several times what the loop can
(`rows_for`).

It is used only where all of these hold, and `status()` says which one did not:
- the CPU has AVX512-BF16 (`vdpbf16ps`), so oneDNN packs bf16 weights (the engine's
  onednn-packed plan);
- the library is there: the project's wheel carries one built with it (so a guest needs no
  compiler), or else a C++ compiler here builds it once per source and compiler into a cache
  folder (`make setup` does, for a source checkout); with neither, oneDNN's kernel stays;
- oneDNN packed a test weight in the layout the loop reads (AB16b64a2b): the loop's output
  must match F.linear on it, or the layout is not the one assumed;
- `VCFSLM_GEMV` is not `off`.
Each packed weight is checked again when it is packed (vcfslm.engine.linear's pack check).

`python -m vcfslm.engine.gemv` builds the library and prints the status as JSON.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .cpuinfo import parse_cpu_flags, read_cpuinfo

SOURCE = Path(__file__).with_name("gemv_avx512bf16.cpp")
ABI = 4
MAX_ROWS = 32
STREAM_ROWS = 6   # up to here each block streams once; above, the L1-chunked loop
PACKED_FOR_ROWS = 4   # the batch hint weights are packed with (vcfslm.engine.linear's min_rows)
BLOCK_N, BLOCK_K = 64, 32   # the layout's blocks: a weight qualifies when both divide it
PACKAGED_DIR = Path(__file__).with_name("kernels")   # where the wheel puts its prebuilt library
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bf16")
LABEL = "vcfslm AVX512-BF16 GEMV on oneDNN's packed weight"
ENV_SWITCH = "VCFSLM_GEMV"
# The loop's output against F.linear in fp32: bf16 output rounding (2^-8) plus another
# accumulation order, as the pack check allows.
LAYOUT_RTOL = 2e-2


@dataclass(frozen=True)
class GemvStatus:
    """Whether the GEMV runs in this process, and if not, why (also vcfslm.engine.gemv_op's
    verdict on its op)."""

    usable: bool
    reason: str
    library: str | None = None
    origin: str | None = None   # "wheel" (prebuilt by the project's install) or "built here"

    def to_dict(self) -> dict:
        return asdict(self)


class GemvBuildError(RuntimeError):
    """The compiler failed on the kernel source."""


# ------------------------------------------------------------------ decisions (pure)


def cpu_has_avx512_bf16(cpuinfo_text: str) -> bool:
    """Whether /proc/cpuinfo's first flags line lists avx512f and avx512_bf16."""
    return {"avx512f", "avx512_bf16"} <= parse_cpu_flags(cpuinfo_text)


def rows_for(cpuinfo_text: str) -> int:
    """The most rows the loop takes on this CPU. Past STREAM_ROWS the loop is bound by
    vdpbf16ps, not by the read (on 2 AVX512-BF16 EPYC cores, 16 rows read the weights at
    ~22 GB/s against ~50 at 1-6 rows), and there it beats oneDNN's AVX512-BF16 kernel. Beside
    AMX, oneDNN's tile kernel computes several times that rate (a 2-core AMX Xeon's bf16
    GEMM probe: 2.65 against ~0.43 TFLOP/s here), so the loop keeps only the rows it
    streams at the read rate and 7-32 rows (batch-16 decode) stay on AMX."""
    return STREAM_ROWS if "amx_bf16" in parse_cpu_flags(cpuinfo_text) else MAX_ROWS


def switched_off(environ) -> bool:
    return str(environ.get(ENV_SWITCH, "")).strip().lower() in ("0", "off", "no", "false")


def library_name(source: bytes, compiler_version: str, flags=FLAGS) -> str:
    """The library's file name: a digest of what built it, so a changed source, compiler or
    flag builds a new one instead of loading a stale one."""
    digest = hashlib.sha256(source + b"\0" + compiler_version.encode() + b"\0" + " ".join(flags).encode())
    return f"vcfslm-gemv-{digest.hexdigest()[:16]}.so"


def packaged_name(source: bytes, stem: str = "vcfslm-gemv") -> str:
    """The library's name inside the wheel: a digest of the source alone (a guest without a
    compiler cannot name the compiler that built it), so a library built from another source
    is never loaded; its flags are FLAGS, and the ABI check stands behind them. stem: each
    loop's own (vcfslm.engine.dense_gemv's)."""
    return f"{stem}-src-{hashlib.sha256(source).hexdigest()[:16]}.so"


def fits(n: int, k: int, packed_nbytes: int, rows: int) -> bool:
    """Whether a [n, k] weight packed into `packed_nbytes` bytes, at `rows` rows, is one the
    loop covers: whole blocks (oneDNN pads other shapes) and at most MAX_ROWS rows."""
    return 1 <= rows <= MAX_ROWS and n % BLOCK_N == 0 and k % BLOCK_K == 0 and packed_nbytes == n * k * 2


def cache_dir(environ=os.environ) -> Path:
    if environ.get("VCFSLM_KERNEL_DIR"):
        return Path(environ["VCFSLM_KERNEL_DIR"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vcfslm" / "kernels"


# ------------------------------------------------------------------ build and load


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def packaged_library(folder: Path = PACKAGED_DIR) -> Path | None:
    """The wheel's prebuilt library for this very source, if the wheel carries one."""
    path = folder / packaged_name(SOURCE.read_bytes())
    return path if path.is_file() else None


def build(folder: Path | None = None, name: str | None = None, source: Path = SOURCE,
          flags: tuple[str, ...] = FLAGS) -> Path:
    """The library for this source, compiler and flags, compiled into `folder` (as `name`)
    when missing. Ranks starting together each compile to a file of their own and rename it
    into place. source: another revision's loop, for a benchmark to set beside this one (or
    vcfslm.engine.gemv_op's source, with its flags)."""
    cxx = compiler()
    if cxx is None:
        raise GemvBuildError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    version = version.splitlines()[0] if version else cxx
    folder = folder or cache_dir()
    target = folder / (name or library_name(source.read_bytes(), version, flags))
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise GemvBuildError(f"{cxx} failed on {source.name}: {done.stderr.strip()[-600:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_packaged(folder: Path) -> Path:
    """The library under the name the wheel carries it by (the wheel's build hook)."""
    return build(folder, packaged_name(SOURCE.read_bytes()))


def load(path: Path, abi: int = ABI) -> ctypes.CDLL:
    """A kernel library (this loop's, or vcfslm.engine.dense_gemv's at its `abi`: both export
    vcfslm_gemv_bf16 with one signature)."""
    lib = ctypes.CDLL(str(path))
    lib.vcfslm_gemv_abi.restype = ctypes.c_int
    if lib.vcfslm_gemv_abi() != abi:
        raise GemvBuildError(f"{path} implements ABI {lib.vcfslm_gemv_abi()}, not {abi}")
    fn = lib.vcfslm_gemv_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int64]
    return lib


# ------------------------------------------------------------------ the call

_state: dict = {}


# Each packed weight's address, looked up once and kept on the tensor object:
# torch.ops.mkldnn.data_ptr is a dispatcher call, and a decode step makes 129 GEMV calls,
# each with caches the weight stream has just flushed (the call path's cost shows in
# benchmarks/gemv_hypotheses.py). An opaque oneDNN tensor's memory never moves.
_ADDRESS_ATTR = "_vcfslm_gemv_address"


def packed_address(packed) -> int:
    """Where the oneDNN-packed weight's bytes are (looked up once per tensor)."""
    address = getattr(packed, _ADDRESS_ATTR, None)
    if address is None:
        import torch

        address = torch.ops.mkldnn.data_ptr(packed)
        setattr(packed, _ADDRESS_ATTR, address)
    return address


def run(x2, packed, n: int, lib: ctypes.CDLL | None = None):
    """y [rows, n] bf16 = x2 [rows, k] (contiguous bf16) times the oneDNN-packed weight."""
    return run_at(packed_address(packed), x2, n, lib or _library())


def run_at(address: int, x2, n: int, lib: ctypes.CDLL, *, threads: int | None = None, prefetch: int = 0):
    """The loop on packed bytes at `address` (a copy of them elsewhere, say): the benchmark's
    hypotheses vary the threads, the prefetch distance and the pages under the weight."""
    import torch

    rows, k = x2.shape
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    rc = lib.vcfslm_gemv_bf16(address, x2.data_ptr(), y.data_ptr(), rows, n, k,
                              threads or torch.get_num_threads(), prefetch)
    if rc != 0:
        raise ValueError(f"vcfslm GEMV refused rows={rows} n={n} k={k}")
    return y


def layout_matches(lib: ctypes.CDLL) -> tuple[bool, str]:
    """Whether the loop, on a weight oneDNN just packed, gives F.linear's output at 1-6 rows
    (the streaming loop) and at 7, 8, 16 and 32 rows (the chunked one, over a chunk boundary)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    n, k = 2 * BLOCK_N, 5 * BLOCK_K   # 80 k-pairs: one chunk of 64 and a partial one
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACKED_FOR_ROWS)
    if torch.ops.mkldnn._nbytes(packed) != n * k * 2:
        return False, "oneDNN's packed weight is not n x k bf16 (padded or another layout)"
    for rows in (*range(1, STREAM_ROWS + 1), STREAM_ROWS + 1, 8, 16, MAX_ROWS):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        want = F.linear(x.float(), w.float())
        got = run(x, packed, n, lib).float()
        err = (got - want).abs().max().item() / (want.abs().max().item() or 1.0)
        if not err <= LAYOUT_RTOL:
            return False, (f"oneDNN packed a test weight in a layout other than AB16b64a2b "
                           f"(max relative error {err:.3g} at {rows} rows)")
    return True, "layout AB16b64a2b checked"


@contextlib.contextmanager
def library_in_use(lib: ctypes.CDLL):
    """Every GEMV call of this process runs `lib` inside the block, compiled graphs' included:
    a benchmark sets another build of the loop beside this one on the same packed model (each
    weight's address is the weight's, not the library's, so nothing else changes)."""
    previous = _library()
    _state["lib"] = lib
    for follow in _followers:
        follow(lib)
    try:
        yield lib
    finally:
        _state["lib"] = previous
        for follow in _followers:
            follow(previous)


# What else calls the loop and must follow a swap: vcfslm.engine.gemv_op's op, which compiled
# graphs call, registers here when it loads (it imports this module, not the other way).
_followers: list = []


def follow_library(callback) -> None:
    """`callback(lib)` runs whenever library_in_use swaps the loop in or back (once, however
    often it is registered)."""
    if callback not in _followers:
        _followers.append(callback)


def _library() -> ctypes.CDLL:
    if "lib" not in _state and not status().usable:
        raise RuntimeError(f"vcfslm's GEMV does not run here: {status().reason}")
    return _state["lib"]


@functools.cache
def status() -> GemvStatus:
    """This process's verdict (once): usable, or the first condition that failed. (A CPU
    with AVX512-BF16 is one oneDNN has bf16 on; the layout check would catch it if not.)"""
    verdict, lib = checked_library(cpu_has_avx512_bf16(read_cpuinfo()), "the CPU has no AVX512-BF16",
                                   _find_library, layout_matches)
    if lib is not None:
        _state["lib"] = lib
    return verdict


def checked_library(cpu_runs_it: bool, no_cpu: str, find, check) -> tuple[GemvStatus, ctypes.CDLL | None]:
    """Every loop's verdict, condition by condition: the switch, the CPU (`no_cpu` says what it
    lacks), the library (`find()`: find_library's answer), and `check(lib)` -> (ok, why).
    Also the checked library, or None. vcfslm.engine.dense_gemv's status() is this too."""
    if switched_off(os.environ):
        return GemvStatus(False, f"{ENV_SWITCH}=off"), None
    if not cpu_runs_it:
        return GemvStatus(False, no_cpu), None
    try:
        path, origin, lib = find()
    except (GemvBuildError, OSError) as exc:
        return GemvStatus(False, f"not built: {exc}"), None
    ok, why = check(lib)
    return GemvStatus(ok, why, str(path), origin), lib if ok else None


def _find_library() -> tuple[Path, str, ctypes.CDLL]:
    return find_library(packaged_library(), build, load)


def find_library(packaged: Path | None, build_here, load_it) -> tuple[Path, str, ctypes.CDLL]:
    """(path, origin, loaded library): the wheel's prebuilt one first (no compile on a rank's
    start, no compiler on a guest), else `build_here()`; a prebuilt one that does not load
    falls back to a build, and a build that fails then says both. Also gemv_op's lookup."""
    failed = ""
    if packaged is not None:
        try:
            return packaged, "wheel", load_it(packaged)
        except (GemvBuildError, OSError) as exc:
            failed = f"the wheel's {packaged.name} did not load ({exc}); "
    try:
        path = build_here()
    except GemvBuildError as exc:
        raise GemvBuildError(f"{failed}{exc}") from exc
    return path, "built here", load_it(path)


def usable_rows() -> int:
    """Rows up to which the GEMV runs in this process (0: never)."""
    return rows_for(read_cpuinfo()) if status().usable else 0


def report(verdict: GemvStatus | None = None, build_here=build) -> dict:
    """The status, with the library built even where it will not run (an AVX2 host building
    for its guests' cache). verdict, build_here: another loop's (vcfslm.engine.dense_gemv's)."""
    out = (status() if verdict is None else verdict).to_dict()
    if out["library"] is None and compiler() is not None:
        try:
            out["library"] = str(build_here())
        except GemvBuildError as exc:
            out["build_error"] = str(exc)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vcfslm.engine.gemv",
                                     description="Build vcfslm's GEMV library and print whether it runs here "
                                                 "(python -m vcfslm.engine.gemv_op: and its op's).")
    parser.parse_args(argv)
    sys.stdout.write(json.dumps(report(), sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
