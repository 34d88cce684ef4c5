"""The wheel's build hook: it compiles vcfslm's GEMV libraries into the wheel, so a guest that
installs the wheel runs the kernel without a compiler of its own; and, when the build runs
beside torch (the project's guest wheel is built without isolation, in the operator's venv),
the library of the GEMV's op (vcfslm.engine.gemv_op), named for that torch's version.

The kernel libraries are plain C ABI code loaded with ctypes (no Python ABI in them), built
for x86-64: one with AVX512-BF16 instructions (vcfslm.engine.gemv), one with AVX2 and FMA
(vcfslm.engine.dense_gemv); each module runs its library only on a CPU that has them and after
its check. The wheel is then tagged py3-none-linux_x86_64. A build machine without a
compiler still builds the wheel: a pure one, without the libraries (a guest with a compiler
then builds them at its first rank); one whose compiler cannot target AVX512-BF16 carries
the AVX2 library alone.
Editable installs skip it: a source checkout builds into its cache folder (`make setup`).
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
import types
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).resolve().parent
BENCH_DIR = ROOT / "vcfslm" / "engine"
WHEEL_DIR = "vcfslm/engine/kernels"
BUILD_PACKAGE = "_vcfslm_kernel_build"


def _bench_module(name: str):
    """vcfslm.bench's `name` from this checkout, under a package of its own whose __init__ is
    empty: the build needs none of vcfslm's dependencies (gemv_op's relative import of gemv
    resolves within it)."""
    if BUILD_PACKAGE not in sys.modules:
        package = types.ModuleType(BUILD_PACKAGE)
        package.__path__ = [str(BENCH_DIR)]
        sys.modules[BUILD_PACKAGE] = package
    return importlib.import_module(f"{BUILD_PACKAGE}.{name}")


class KernelBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or version != "standard":
            return
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            return
        gemv = _bench_module("gemv")
        built = False
        for name, what in (("gemv", "GEMV library"), ("dense_gemv", "AVX2 GEMV library")):
            try:
                # Into the kernel cache, under the wheel's name: pip builds twice (metadata,
                # then the wheel), and an unchanged source is compiled once.
                lib = _bench_module(name).build_packaged(gemv.cache_dir())
            except gemv.GemvBuildError as exc:
                sys.stderr.write(f"vcfslm: the wheel goes without the {what} ({exc})\n")
                continue
            build_data["force_include"][str(lib)] = f"{WHEEL_DIR}/{lib.name}"
            built = True
        if not built:
            return
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-linux_x86_64"
        if importlib.util.find_spec("torch") is None:
            return   # an isolated build: the op's library is built where it runs
        try:
            op = _bench_module("gemv_op").build_packaged(gemv.cache_dir())
        except gemv.GemvBuildError as exc:
            sys.stderr.write(f"vcfslm: the wheel goes without the GEMV op's library ({exc})\n")
            return
        build_data["force_include"][str(op)] = f"{WHEEL_DIR}/{op.name}"
