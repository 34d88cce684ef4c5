"""benchmarks/peers.py's equivalence check on real engines: a 1-layer Phi-3-mini-width
checkpoint, HF eager in float32 as the reference, then each engine's greedy continuation
of the same prompt ids, and one engine handed a conversion with a changed rope theta
(OpenVINO: the check that catches it is the same for every peer, and vLLM is started once).
vcfslm, vLLM (`make vllm`) and OpenVINO GenAI (`make peers-wheels`) are all part of `make
test`, so they run in CI; llama.cpp only where `make peers` has built it (~9 minutes from
source, too long for CI): its skip says so, and the manual run is
`.venv/bin/python benchmarks/peers.py --equivalence-only --break-rope llama.cpp`."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vcfslm.lab.vcsim import cache_root

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists() and not os.environ.get("CI"),
                                reason="vLLM's venv is absent (make vllm); CI always has it")


# What the cached checkpoint, its broken copy, the OpenVINO IR and HF's reference are made
# from: the benchmark, the model it builds and the pins of both venvs. Any change to them is a
# new folder, so the cache is never older than the code that reads it.
CACHE_INPUTS = ("benchmarks/peers.py", "benchmarks/decode_efficiency.py", "benchmarks/peers-setup.sh",
                "constraints.txt", "vcfslm/engine/model.py", "vcfslm/presets.py")


def cache_key() -> str:
    digest = hashlib.sha256()
    for name in CACHE_INPUTS:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def cache():
    """The checkpoint folder, kept under the user's cache folder (like vcsim's build and the
    fresh guests' root) and keyed by what its contents are made from: the 1-layer
    checkpoint, its broken-rope copy, the OpenVINO IRs and HF's reference are built by the
    first run on a machine only (about a minute of two cores). A lock keeps two suites on one
    machine from building into it at once. The module runs on one worker: these tests are
    CPU-bound, so spreading them over workers would not shorten the suite."""
    folder = cache_root() / "peers-equivalence" / cache_key()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.utime(folder)
        # About 2 GB a key: the newest other one stays (a second checkout at another commit), no more.
        older = sorted((p for p in folder.parent.iterdir() if p.is_dir() and p != folder),
                       key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in older[1:]:
            shutil.rmtree(stale, ignore_errors=True)
        yield folder


def check(cache: Path, *extra: str) -> tuple[int, dict[str, str], str]:
    done = subprocess.run([sys.executable, str(PEERS), "--equivalence-only", "--equivalence-layers", "1",
                           "--tokens", "16", "--cache", str(cache), *extra],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    verdicts = {}
    for line in done.stdout.splitlines():
        if line.startswith("EQUIVALENCE "):
            engine, _, rest = line[len("EQUIVALENCE "):].partition(": ")
            verdicts[engine] = rest
    return done.returncode, verdicts, done.stdout + done.stderr[-3000:]


@needs_vllm
def test_vcfslm_and_vllm_compute_the_reference_model(cache):
    rc, verdicts, out = check(cache, "--engines", "vcfslm,vllm")
    assert rc == 0, out
    for engine in ("vcfslm", "vllm"):
        assert verdicts[engine].startswith("equivalent |"), out
    assert "logit correlation" in verdicts["vcfslm"] and "full vocabulary" in verdicts["vcfslm"]
    assert "top 20" in verdicts["vllm"]
    header = next(line for line in out.splitlines() if line.startswith("threads "))
    assert "; equivalence only, seed " in header and "layers=" not in header, header


def peers_venv_has(module: str) -> bool:
    return PEERS_PYTHON.exists() and subprocess.run([str(PEERS_PYTHON), "-c", f"import {module}"],
                                                    capture_output=True).returncode == 0


needs_openvino = pytest.mark.skipif(not peers_venv_has("openvino_genai") and not os.environ.get("CI"),
                                    reason="OpenVINO GenAI is absent (make peers-wheels); CI always has it")
needs_llama = pytest.mark.skipif(not peers_venv_has("llama_cpp"), reason="llama.cpp is not built here (make "
                                 "peers, ~9 minutes from source, so never in CI); manual run: .venv/bin/python "
                                 "benchmarks/peers.py --equivalence-only --break-rope llama.cpp")


@needs_openvino
def test_openvino_computes_the_reference_model_and_its_broken_conversion_is_caught(cache):
    rc, verdicts, out = check(cache, "--engines", "openvino,openvino-u8kv", "--break-rope", "openvino")
    assert rc == 0, out
    assert "openvino is given a broken conversion: rope theta 10000 -> 1e+06" in out
    assert verdicts["openvino"].startswith("NOT EQUIVALENT: "), out
    assert verdicts["openvino-u8kv"].startswith("equivalent |"), out
    assert "tokens only" in verdicts["openvino-u8kv"]


@needs_llama
def test_llama_cpp_computes_the_reference_model_and_its_broken_gguf_is_caught(cache):
    rc, verdicts, out = check(cache, "--engines", "llama.cpp,openvino", "--break-rope", "llama.cpp")
    assert rc == 0, out
    assert verdicts["llama.cpp"].startswith("NOT EQUIVALENT: "), out
    assert verdicts["openvino"].startswith("equivalent |"), out
    rc, verdicts, out = check(cache, "--engines", "llama.cpp")
    assert rc == 0 and verdicts["llama.cpp"].startswith("equivalent |"), out
    assert "full vocabulary" in verdicts["llama.cpp"]
