"""The wheel carries templates/, playbooks/, inventories/ and platforms/, found at run time from
it, and the GEMV library built for it, so a guest without a compiler runs the kernel (and,
built beside torch, the GEMV op's library for that torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vcfslm.engine import gemv
from vcfslm.resources import resource_dir

ROOT = Path(__file__).resolve().parents[2]


def test_resources_found_in_checkout():
    for kind in ("templates", "playbooks", "inventories", "platforms"):
        assert resource_dir(kind) == ROOT / kind


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_contains_data_folders(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "vcfslm/_data/inventories/vx650v4-4node.yaml" in names
    for kind in ("templates", "playbooks", "inventories", "platforms"):
        shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / kind).rglob("*") if p.is_file()}
        assert {f"vcfslm/_data/{s}" for s in shipped} <= set(names), kind


def test_installed_wheel_finds_its_data(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = ("from vcfslm.resources import resource_dir; import sys;"
            "print(resource_dir('inventories'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "vcfslm" / "_data" / "inventories")


def _build_wheel(out: Path, env: dict | None = None) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, env=env)
    [whl] = out.glob("vcfslm-*.whl")
    return whl


@pytest.mark.skipif(gemv.compiler() is None, reason="no C++ compiler to build the GEMV into the wheel")
def test_wheel_carries_the_gemv_library_for_its_source(wheel, tmp_path):
    name = f"vcfslm/engine/kernels/{gemv.packaged_name(gemv.SOURCE.read_bytes())}"
    assert name in zipfile.ZipFile(wheel).namelist()
    # A binary inside: the wheel says which platform it is for (no Python ABI in the library).
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")
    zipfile.ZipFile(wheel).extract(name, tmp_path)
    assert gemv.load(tmp_path / name).vcfslm_gemv_abi() == gemv.ABI


@pytest.mark.skipif(gemv.compiler() is None, reason="no C++ compiler to build the GEMV into the wheel")
def test_wheel_carries_the_avx2_gemv_library_for_its_source(wheel, tmp_path):
    from vcfslm.engine import dense_gemv

    name = f"vcfslm/engine/kernels/{dense_gemv.packaged_name(dense_gemv.SOURCE.read_bytes())}"
    assert name in zipfile.ZipFile(wheel).namelist()
    zipfile.ZipFile(wheel).extract(name, tmp_path)
    assert dense_gemv.load(tmp_path / name).vcfslm_gemv_abi() == dense_gemv.ABI


@pytest.mark.skipif(gemv.compiler() is None, reason="no C++ compiler to build the GEMV into the wheel")
def test_wheel_built_beside_torch_carries_the_gemv_ops_library_for_that_torch(wheel, tmp_path):
    torch = pytest.importorskip("torch")
    from vcfslm.engine import gemv_op

    name = f"vcfslm/engine/kernels/{gemv_op.packaged_name(gemv_op.SOURCE.read_bytes(), torch.__version__)}"
    assert name in zipfile.ZipFile(wheel).namelist()
    zipfile.ZipFile(wheel).extract(name, tmp_path)
    # In a process of its own: loading it registers vcfslm::gemv, which this one may hold.
    code = f"import ctypes, torch; print(ctypes.CDLL({str(tmp_path / name)!r}).vcfslm_gemv_op_abi())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(gemv_op.ABI)


def test_wheel_without_a_compiler_is_pure_and_still_builds(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-compiler"), VCFSLM_KERNEL_DIR=str(tmp_path / "cache"))
    whl = _build_wheel(tmp_path / "out", env)
    assert whl.name.endswith("-py3-none-any.whl")
    assert not [n for n in zipfile.ZipFile(whl).namelist() if "/kernels/" in n]
