"""The wheel carries templates/, playbooks/, inventories/ and platforms/, found at run time from
it, and is a plain pure-Python wheel (py3-none-any): the engine's kernels are torch's own."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
        # Bytecode Python wrote beside a template it imported is a cache, not a part: it stays out.
        shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / kind).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts}
        assert {f"vcfslm/_data/{s}" for s in shipped} <= set(names), kind
    assert not [n for n in names if "__pycache__" in n]


def test_installed_wheel_finds_its_data(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = ("from vcfslm.resources import resource_dir; import sys;"
            "print(resource_dir('inventories'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "vcfslm" / "_data" / "inventories")


def _build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True)
    [whl] = out.glob("vcfslm-*.whl")
    return whl


def test_wheel_is_pure_python(wheel):
    """No build hook and no compiled code: one wheel installs on any guest, whatever its CPU."""
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".so", ".cpp", ".c", ".dll", ".dylib"))]
    assert not [n for n in names if "/kernels/" in n or n == "hatch_build.py"]
