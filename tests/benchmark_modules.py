"""Imports a script of benchmarks/ as a module, for the tests of its helpers."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(name: str):
    """benchmarks/<name>.py as a module. The scripts ask for 2 MiB pages through the
    environment at import, for torch and its children: the test process's environment is
    put back as it was."""
    saved = dict(os.environ)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
        os.environ.clear()
        os.environ.update(saved)
