"""The wheel's build hook: it compiles vcfslm's GEMV library into the wheel, so a guest that
installs the wheel runs the kernel without a compiler of its own.

The library is plain C ABI code loaded with ctypes (no Python ABI in it), built for x86-64
with AVX512-BF16 instructions; vcfslm.bench.gemv runs it only on a CPU that has them and
after its layout check. The wheel is then tagged py3-none-linux_x86_64. A build machine
without a compiler, or one whose compiler cannot target AVX512-BF16, still builds the wheel:
a pure one, without the library (a guest with a compiler then builds it at its first rank).
Editable installs skip it: a source checkout builds into its cache folder (`make setup`).
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).resolve().parent
GEMV_MODULE = ROOT / "vcfslm" / "bench" / "gemv.py"
WHEEL_DIR = "vcfslm/bench/kernels"


def _gemv():
    """vcfslm.bench.gemv by path: the build needs none of the package's dependencies."""
    name = "_vcfslm_gemv_build"
    spec = importlib.util.spec_from_file_location(name, GEMV_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class KernelBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or version != "standard":
            return
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            return
        gemv = _gemv()
        try:
            # Into the kernel cache, under the wheel's name: pip builds twice (metadata, then
            # the wheel), and an unchanged source is compiled once.
            lib = gemv.build(gemv.cache_dir(), gemv.packaged_name(gemv.SOURCE.read_bytes()))
        except gemv.GemvBuildError as exc:
            sys.stderr.write(f"vcfslm: the wheel goes without the GEMV library ({exc})\n")
            return
        build_data["force_include"][str(lib)] = f"{WHEEL_DIR}/{lib.name}"
        build_data["pure_python"] = False
        build_data["tag"] = "py3-none-linux_x86_64"
