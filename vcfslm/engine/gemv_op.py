"""`vcfslm::gemv`, the GEMV as a C++ op: what a compiled step calls for its few-row linears.

Why an op of its own: a batch-1 decode step makes 129 GEMV calls, each right behind a weight
stream that has just emptied the caches, so whatever runs between two kernels runs on cold
caches. Through `vcfslm::linear` that is the dispatcher, the op's Python kernel, and ctypes'
argument conversion, once per call. Through this op the compiled graph's wrapper calls the
dispatcher and C++ straight to the kernel. Paired step by step against its linears alone,
a full-shape Phi-3-mini batch-1 step took 1.078x them through vcfslm::linear and 1.053x
through this op (benchmarks/step_call_path.py; benchmarks/gemv_hypotheses.py has the call
paths without the step around them).

The op's library holds no kernel: for each weight layout it runs the loop its module loaded
and checked: PACKED, oneDNN's packed buffer (vcfslm.engine.gemv, AVX512-BF16; its
`library_in_use` points the op at another build, and every compiled graph follows without a
recompile); PLAIN, the dense-bf16 plan's row-major matrix (vcfslm.engine.dense_gemv, AVX2). Each
call names its layout. Eager calls (the pack check, an eager prefill) stay on the ctypes path;
the op is checked against it, layout by layout, once per process before any graph uses it.

The library links against this torch's C++ API, so its name carries torch's version. It is
built like the kernel's: by the wheel's build hook when the wheel is built beside torch (the
project's own guest wheel), else once here into the kernel cache. Where it cannot be had (no
compiler, no headers), compiled steps keep the Python path and `status()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path

import torch

from . import dense_gemv, gemv

SOURCE = Path(__file__).with_name("gemv_op.cpp")
ABI = 3
# The weight layouts the op has a kernel slot for (gemv_op.cpp).
PACKED, PLAIN = 0, 1
LAYOUT_NAMES = {PACKED: "oneDNN-packed", PLAIN: "plain"}
# Mode of the op's kernel call (gemv_op.cpp): run, run timed, skip.
RUN, TIMED, SKIP = 0, 1, 2


# ------------------------------------------------------------------ decisions (pure)


def flags(torch_dir: Path, torch_version: str, cxx11_abi: bool) -> tuple[str, ...]:
    """The compiler flags for the op's library against the torch installed at torch_dir. The
    version is a define nothing reads: it puts torch's version into the library's digest, so
    another torch builds another library instead of loading one built for its predecessor."""
    include = torch_dir / "include"
    return ("-O2", "-std=c++17", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
            f"-DVCFSLM_TORCH_VERSION={torch_version}", "-isystem", str(include),
            "-isystem", str(include / "torch" / "csrc" / "api" / "include"),
            # The libraries come before the source on build()'s command line: keep them.
            "-L", str(torch_dir / "lib"), "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu")


def packaged_name(source: bytes, torch_version: str) -> str:
    """The library's name inside the wheel: the source and the torch it was built against."""
    digest = hashlib.sha256(source + b"\0" + torch_version.encode()).hexdigest()[:16]
    return f"vcfslm-gemv-op-src-{digest}.so"


# ------------------------------------------------------------------ build and load


def torch_flags() -> tuple[str, ...]:
    return flags(Path(torch.__file__).parent, torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def build(folder: Path | None = None) -> Path:
    """The op's library for this source, compiler and torch, compiled when missing."""
    return gemv.build(folder, None, SOURCE, torch_flags())


def build_packaged(folder: Path) -> Path:
    """The library under the name the wheel carries it by (the wheel's build hook)."""
    return gemv.build(folder, packaged_name(SOURCE.read_bytes(), torch.__version__), SOURCE, torch_flags())


def load(path: Path) -> ctypes.CDLL:
    """Loads the library, which registers vcfslm::gemv with the dispatcher, and gives the op
    its shape function for torch.compile."""
    lib = ctypes.CDLL(str(path))
    lib.vcfslm_gemv_op_abi.restype = ctypes.c_int
    if lib.vcfslm_gemv_op_abi() != ABI:
        raise gemv.GemvBuildError(f"{path} implements op ABI {lib.vcfslm_gemv_op_abi()}, not {ABI}")
    lib.vcfslm_gemv_op_use.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.vcfslm_gemv_op_use.restype = ctypes.c_int
    lib.vcfslm_gemv_op_mode.argtypes = [ctypes.c_int]
    lib.vcfslm_gemv_op_take_ns.restype = ctypes.c_int64
    if "fake" not in _state:
        @torch.library.register_fake("vcfslm::gemv")
        def _gemv_fake(x, weight, out_features, bias, layout):
            return x.new_empty(x.shape[0], out_features)

        _state["fake"] = _gemv_fake
    return lib


_state: dict = {}


def point_at(kernel_lib: ctypes.CDLL | None, layout: int = PACKED) -> None:
    """The op runs `kernel_lib`'s loop for `layout` from now on (None: no kernel for it)."""
    lib = _state.get("lib")
    if lib is not None:
        fn = None if kernel_lib is None else ctypes.cast(kernel_lib.vcfslm_gemv_bf16, ctypes.c_void_p)
        if lib.vcfslm_gemv_op_use(layout, fn) != 0:
            raise ValueError(f"the op's library has no weight layout {layout}")


def _follow_packed(kernel_lib: ctypes.CDLL) -> None:
    """gemv.library_in_use's swaps, followed by the PACKED slot (one function, registered once)."""
    point_at(kernel_lib, PACKED)


def address_of(weight, layout: int = PACKED) -> torch.Tensor:
    """The op's handle on a weight: the address of its bytes in a one-element int64 tensor
    (PACKED: oneDNN's buffer; PLAIN: the tensor's data). A graph input, not a constant: graphs
    then carry no address of this process and come from Inductor's FX graph cache in the next
    one."""
    address = gemv.packed_address(weight) if layout == PACKED else weight.data_ptr()
    return torch.tensor([address], dtype=torch.int64)


def call(x2, address: torch.Tensor, out_features: int, bias, layout: int = PACKED):
    """y [rows, out_features] = x2 [rows, k] times the weight at `address` (address_of), held in
    `layout`, + bias."""
    return torch.ops.vcfslm.gemv.default(x2, address, out_features, bias, layout)


def _test_weight(layout: int, gen: torch.Generator):
    """(what the ctypes call takes, n, k) for one test weight in `layout`: shapes with whole
    blocks for PACKED, outputs past whole tiles for PLAIN."""
    if layout == PACKED:
        n, k = 2 * gemv.BLOCK_N, 3 * gemv.BLOCK_K
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        return torch.ops.mkldnn._reorder_linear_weight(w, gemv.PACKED_FOR_ROWS), n, k
    n, k = 19, 6 * dense_gemv.K_STEP
    return torch.randn(n, k, generator=gen).to(torch.bfloat16), n, k


def _ctypes_run(layout: int, x, weight, n: int, kernel_lib: ctypes.CDLL):
    return gemv.run(x, weight, n, kernel_lib) if layout == PACKED else dense_gemv.run(x, weight, kernel_lib)


def agrees_with_ctypes(kernel_lib: ctypes.CDLL, layout: int = PACKED) -> tuple[bool, str]:
    """The op against the ctypes call on one test weight in `layout`, at a row count of each
    loop and a bias: the same kernel on the same bytes, so the same bits."""
    gen = torch.Generator().manual_seed(1)
    weight, n, k = _test_weight(layout, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    address = address_of(weight, layout)
    for rows in (1, 3, gemv.STREAM_ROWS + 1, gemv.MAX_ROWS):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        if not torch.equal(call(x, address, n, bias, layout), _ctypes_run(layout, x, weight, n, kernel_lib) + bias):
            return False, f"vcfslm::gemv differs from the ctypes call at {rows} rows ({LAYOUT_NAMES[layout]} weight)"
    return True, f"vcfslm::gemv agrees with the ctypes call ({LAYOUT_NAMES[layout]} weight)"


def _kernels() -> dict[int, tuple[gemv.GemvStatus, object]]:
    """Each layout's kernel verdict, and how to get its checked library."""
    return {PACKED: (gemv.status(), gemv._library), PLAIN: (dense_gemv.status(), dense_gemv.library)}


@functools.cache
def layouts() -> dict[int, gemv.GemvStatus]:
    """This process's verdict per layout (once): compiled graphs call vcfslm::gemv for weights
    in that layout, or why not (library and origin: the op's)."""
    kernels = _kernels()
    if not any(verdict.usable for verdict, _ in kernels.values()):
        reasons = "; ".join(f"{LAYOUT_NAMES[layout]}: {verdict.reason}" for layout, (verdict, _) in kernels.items())
        verdict = gemv.GemvStatus(False, f"no GEMV runs here ({reasons})")
        return {layout: verdict for layout in kernels}
    try:
        path, origin, lib = _find_library()
    except (gemv.GemvBuildError, OSError, RuntimeError) as exc:
        verdict = gemv.GemvStatus(False, f"not built: {exc}")
        return {layout: verdict for layout in kernels}
    _state["lib"] = lib
    out = {}
    for layout, (kernel, library) in kernels.items():
        if not kernel.usable:
            out[layout] = gemv.GemvStatus(False, f"the GEMV does not run here: {kernel.reason}")
            continue
        point_at(library(), layout)
        ok, why = agrees_with_ctypes(library(), layout)
        if not ok:
            point_at(None, layout)
        out[layout] = gemv.GemvStatus(ok, why, str(path), origin)
    gemv.follow_library(_follow_packed)
    return out


def status(layout: int = PACKED) -> gemv.GemvStatus:
    """The verdict for weights in `layout` (layouts())."""
    return layouts()[layout]


def _find_library() -> tuple[Path, str, ctypes.CDLL]:
    packaged = gemv.PACKAGED_DIR / packaged_name(SOURCE.read_bytes(), torch.__version__)
    return gemv.find_library(packaged if packaged.is_file() else None, build, load)


def usable(layout: int = PACKED) -> bool:
    return status(layout).usable


def set_mode(how: int) -> None:
    """Every vcfslm::gemv call from now on runs in mode `how` (TIMED: read the kernels' time
    with take_seconds(); SKIP: no kernel at all) until the next set_mode."""
    lib = _state.get("lib")
    if lib is not None:
        lib.vcfslm_gemv_op_mode(how)


def take_seconds() -> float:
    """The kernel time TIMED calls summed since the last take, in seconds."""
    lib = _state.get("lib")
    return lib.vcfslm_gemv_op_take_ns() / 1e9 if lib is not None else 0.0


def main(argv: list[str] | None = None) -> int:
    """`python -m vcfslm.engine.gemv_op`: builds the kernels' libraries and the op's, and prints
    the AVX512-BF16 kernel's status (as `python -m vcfslm.engine.gemv` does) with the op's for
    its layout under "op", and the AVX2 kernel's with its own "op" under "avx2"."""
    import argparse
    import json
    import sys

    argparse.ArgumentParser(prog="python -m vcfslm.engine.gemv_op",
                            description="Build vcfslm's GEMV libraries and their op's, and print whether they "
                                        "run here.").parse_args(argv)
    report = {**gemv.report(), "op": status(PACKED).to_dict(),
              "avx2": {**dense_gemv.report(), "op": status(PLAIN).to_dict()}}
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
