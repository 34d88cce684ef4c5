"""The lint the project holds itself to runs in the suite, so `make test` (and CI) fails on
it: ruff over vcfslm/, tests/ and benchmarks/ with pyproject.toml's rules, max-args 8 in
vcfslm/ among them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("ruff")


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_the_tree_is_clean():
    done = ruff("vcfslm", "tests", "benchmarks")
    assert done.returncode == 0, done.stdout + done.stderr


NINE = "def f(a, b, c, d, e, g, h, i, j):\n    return a\n"


def test_nine_parameters_fail_in_the_package_and_pass_in_tests():
    package = ruff("--stdin-filename", "vcfslm/analysis/new.py", "-", stdin=NINE)
    assert package.returncode == 1 and "PLR0913" in package.stdout, package.stdout
    test = ruff("--stdin-filename", "tests/unit/test_new.py", "-", stdin=NINE)
    assert test.returncode == 0, test.stdout
