"""vcfslm::gemv, the GEMV as a C++ op: built against this torch, the same bits as the ctypes
call, what compiled graphs call for the GEMV's rows (eager stays on ctypes), following the
kernel library a benchmark swaps in, and its benchmark modes (timed, skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from vcfslm.engine import dense_gemv, gemv, gemv_op  # noqa: E402
from vcfslm.engine.linear import DENSE_BF16, ONEDNN_PACKED, KernelPlan, PackedLinear, pack_linears  # noqa: E402

# ------------------------------------------------------------------ decisions


def test_flags_name_the_torch_they_build_against():
    got = gemv_op.flags(Path("/venv/torch"), "2.13.0+cpu", True)
    assert "-DVCFSLM_TORCH_VERSION=2.13.0+cpu" in got and "-D_GLIBCXX_USE_CXX11_ABI=1" in got
    assert got[got.index("-L") + 1] == "/venv/torch/lib" and got[-2:] == ("-lc10", "-ltorch_cpu")
    # The -l flags come before the source on the command line: --as-needed would drop them.
    assert got.index("-Wl,--no-as-needed") < got.index("-lc10")
    assert gemv_op.flags(Path("/venv/torch"), "2.14.1", False) != got


def test_the_wheels_name_follows_the_source_and_torch():
    name = gemv_op.packaged_name(b"source", "2.13.0+cpu")
    assert name.startswith("vcfslm-gemv-op-src-") and name.endswith(".so")
    assert name == gemv_op.packaged_name(b"source", "2.13.0+cpu")
    assert name != gemv_op.packaged_name(b"source", "2.14.1+cpu")
    assert name != gemv_op.packaged_name(b"source 2", "2.13.0+cpu")


@pytest.fixture
def fresh_verdicts():
    gemv_op.layouts.cache_clear()
    yield
    gemv_op.layouts.cache_clear()


def test_without_either_gemv_there_is_no_op(monkeypatch, fresh_verdicts):
    monkeypatch.setattr(gemv, "status", lambda: gemv.GemvStatus(False, "the CPU has no AVX512-BF16"))
    monkeypatch.setattr(dense_gemv, "status", lambda: gemv.GemvStatus(False, "the CPU has no AVX2 with FMA"))
    want = ("no GEMV runs here (oneDNN-packed: the CPU has no AVX512-BF16; plain: the CPU has no AVX2 "
            "with FMA)")
    for layout in (gemv_op.PACKED, gemv_op.PLAIN):
        assert not gemv_op.usable(layout) and gemv_op.status(layout).reason == want


def test_each_layout_has_its_own_verdict(monkeypatch, fresh_verdicts):
    """The AVX512-BF16 loop absent (an AVX2 host), the op still serves plain weights."""
    if not dense_gemv.status().usable:
        pytest.skip(f"the AVX2 GEMV does not run here: {dense_gemv.status().reason}")
    monkeypatch.setattr(gemv, "status", lambda: gemv.GemvStatus(False, "the CPU has no AVX512-BF16"))
    assert gemv_op.status(gemv_op.PACKED).reason == "the GEMV does not run here: the CPU has no AVX512-BF16"
    plain = gemv_op.status(gemv_op.PLAIN)
    assert plain.usable and plain.reason == "vcfslm::gemv agrees with the ctypes call (plain weight)"


# ------------------------------------------------------------------ the op itself


@pytest.fixture(scope="module")
def op():
    """The op, on a CPU the GEMV runs on; there, an op that does not build or load fails."""
    if not gemv.status().usable:
        pytest.skip(f"the GEMV does not run here ({gemv.status().reason}): no op to call")
    verdict = gemv_op.status()
    assert verdict.usable, verdict.reason
    return verdict


def _packed(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    return w, torch.ops.mkldnn._reorder_linear_weight(w, gemv.PACKED_FOR_ROWS), gen


@pytest.mark.parametrize("rows", [1, 4, 6, 7, 16, 32])
def test_same_bits_as_the_ctypes_call_with_and_without_bias(op, rows):
    w, packed, gen = _packed(192, 128, rows)
    bias = torch.randn(192, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
    address = gemv_op.address_of(packed)
    plain = gemv_op.call(x, address, 192, None)
    assert torch.equal(plain, gemv.run(x, packed, 192))
    assert torch.equal(gemv_op.call(x, address, 192, bias), plain + bias)
    want = F.linear(x.float(), w.float())
    assert (plain.float() - want).abs().max().item() <= 0.01 * want.abs().max().item()
    # A strided input (a slice of a wider one) is made contiguous first.
    wide = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    assert torch.equal(gemv_op.call(wide[:, :128], address, 192, None), gemv.run(wide[:, :128].contiguous(), packed, 192))


def test_bad_input_is_refused_with_what_it_was(op):
    _, packed, _ = _packed(128, 96, 0)
    address = gemv_op.address_of(packed)
    with pytest.raises(RuntimeError, match="2-D bf16 CPU input"):
        gemv_op.call(torch.randn(2, 96), address, 128, None)
    with pytest.raises(RuntimeError, match="refused rows=33 n=128 k=96"):
        gemv_op.call(torch.randn(33, 96).to(torch.bfloat16), address, 128, None)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 192, dtype=torch.bfloat16), torch.nn.SiLU(),
                            torch.nn.Linear(192, 64, bias=False, dtype=torch.bfloat16))
    pack_linears(m, KernelPlan(ONEDNN_PACKED, 4, 8))
    return m


def _timed_by_the_op(compiled, x):
    """(compiled(x), the seconds vcfslm::gemv spent in its kernel during that call)."""
    gemv_op.take_seconds()
    gemv_op.set_mode(gemv_op.TIMED)
    try:
        got = compiled(x)
    finally:
        gemv_op.set_mode(gemv_op.RUN)
    return got, gemv_op.take_seconds()


def test_compiled_graphs_call_the_op_and_eager_stays_on_ctypes(op, monkeypatch):
    m = _model(1)
    packed = [p for p in m.modules() if isinstance(p, PackedLinear)]
    assert all(p.gemv_address is not None and "gemv_op=True" in repr(p) for p in packed)
    ctypes_rows = []
    real = gemv.run
    monkeypatch.setattr(gemv, "run", lambda x, p, n, lib=None: ctypes_rows.append(x.shape[0]) or real(x, p, n, lib))
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            eager = m(x)
            assert ctypes_rows == [rows, rows]
            ctypes_rows.clear()
            got, kernel_s = _timed_by_the_op(compiled, x)
            assert torch.equal(got, eager)
            assert ctypes_rows == [] and kernel_s > 0   # the op ran the kernel, in C++
        # Beyond the GEMV's rows the graph keeps vcfslm::linear (oneDNN): the op is not called.
        x = torch.randn(9, 64).to(torch.bfloat16)
        gemv_op.set_mode(gemv_op.TIMED)
        try:
            assert torch.equal(compiled(x), m(x))
        finally:
            gemv_op.set_mode(gemv_op.RUN)
        assert gemv_op.take_seconds() == 0


def test_another_replicas_graph_comes_from_the_cache_and_runs_its_own_weights(op, tmp_path, monkeypatch):
    """A graph carries no packed weight's address (each is an input), so a replica packed
    elsewhere, as in the next process, gets its graph from Inductor's FX graph cache, and that
    graph reads the new replica's weights."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", True)
    x = torch.randn(1, 64).to(torch.bfloat16)
    got = []
    with torch.inference_mode():
        for seed in (3, 4):
            torch._dynamo.reset()
            counters.clear()
            m = _model(seed)
            got.append((torch.compile(m, fullgraph=True, dynamic=False)(x), m(x),
                        dict(counters["inductor"])))
    (first, first_eager, cold), (second, second_eager, warm) = got
    assert cold.get("fxgraph_cache_miss") == 1 and not cold.get("fxgraph_cache_hit")
    assert warm.get("fxgraph_cache_hit") == 1 and not warm.get("fxgraph_cache_miss")
    assert torch.equal(first, first_eager) and torch.equal(second, second_eager)
    assert not torch.equal(second, first)


def test_the_address_must_be_one_int64(op):
    _, packed, _ = _packed(128, 96, 0)
    x = torch.randn(1, 96).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="one-element int64 CPU tensor"):
        gemv_op.call(x, gemv_op.address_of(packed).int(), 128, None)
    with pytest.raises(RuntimeError, match="one-element int64 CPU tensor"):
        gemv_op.call(x, gemv_op.address_of(packed).repeat(2), 128, None)


def test_a_swapped_kernel_library_reaches_compiled_graphs_and_is_put_back(op, tmp_path):
    """gemv.library_in_use points the op at another loop (what benchmarks/gemv_rows.py
    --engine-layers compares), without a recompile, and back after the block."""
    zeros = tmp_path / "zeros.cpp"
    zeros.write_text(
        '#include <stdint.h>\n#include <string.h>\nextern "C" {\n'
        f"int vcfslm_gemv_abi(void) {{ return {gemv.ABI}; }}\n"
        "int vcfslm_gemv_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t rows, int64_t n,\n"
        "                     int64_t k, int threads, int64_t prefetch) {\n"
        "  memset(y, 0, rows * n * 2); return 0; }\n}\n")
    other = gemv.load(gemv.build(tmp_path, "zeros.so", source=zeros))
    m = _model(2)
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    x = torch.randn(1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = compiled(x)
        assert before.abs().sum() > 0
        with pytest.raises(KeyError), gemv.library_in_use(other):
            assert torch.equal(compiled(x), torch.zeros(1, 64, dtype=torch.bfloat16))
            raise KeyError("a failing window")
        assert torch.equal(compiled(x), before)


def test_skip_mode_runs_no_kernel_and_keeps_the_shape(op):
    _, packed, gen = _packed(128, 96, 3)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    gemv_op.take_seconds()
    gemv_op.set_mode(gemv_op.SKIP)
    try:
        # Refused rows pass in skip mode: the kernel, which checks them, is not called.
        y = gemv_op.call(torch.randn(33, 96).to(torch.bfloat16), gemv_op.address_of(packed), 128, None)
    finally:
        gemv_op.set_mode(gemv_op.RUN)
    assert y.shape == (33, 128) and y.dtype == torch.bfloat16
    assert gemv_op.take_seconds() == 0
    assert torch.equal(gemv_op.call(x, gemv_op.address_of(packed), 128, None), gemv.run(x, packed, 128))


def test_the_command_reports_the_op(op):
    out = subprocess.run([sys.executable, "-m", "vcfslm.engine.gemv_op"], capture_output=True, text=True, check=True)
    verdict = json.loads(out.stdout)["op"]
    assert verdict["usable"] and verdict["reason"] == "vcfslm::gemv agrees with the ctypes call (oneDNN-packed weight)"


# ------------------------------------------------------------------ plain weights (the AVX2 loop)


@pytest.fixture(scope="module")
def plain_op():
    """The op for plain weights, on a CPU the AVX2 GEMV runs on (any AVX2 host, AVX512 ones
    included); there, an op that does not build or load fails."""
    if not dense_gemv.status().usable:
        pytest.skip(f"the AVX2 GEMV does not run here ({dense_gemv.status().reason}): no op to call")
    verdict = gemv_op.status(gemv_op.PLAIN)
    assert verdict.usable, verdict.reason
    return verdict


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 32])
def test_plain_weights_same_bits_as_the_ctypes_call(plain_op, rows):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(37, 96, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(37, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    address = gemv_op.address_of(w, gemv_op.PLAIN)
    assert address.item() == w.data_ptr()
    plain = gemv_op.call(x, address, 37, None, gemv_op.PLAIN)
    assert torch.equal(plain, dense_gemv.run(x, w))
    assert torch.equal(gemv_op.call(x, address, 37, bias, gemv_op.PLAIN), plain + bias)


def test_a_layout_the_op_does_not_know_is_refused(plain_op):
    w = torch.randn(16, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="no weight layout 2"):
        gemv_op.call(torch.randn(1, 32).to(torch.bfloat16), gemv_op.address_of(w, gemv_op.PLAIN), 16, None, 2)
    with pytest.raises(ValueError, match="no weight layout 5"):
        gemv_op.point_at(None, 5)


def test_compiled_dense_graphs_call_the_op_with_the_plain_layout(plain_op, monkeypatch):
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(64, 48, dtype=torch.bfloat16), torch.nn.SiLU(),
                            torch.nn.Linear(48, 64, bias=False, dtype=torch.bfloat16))
    pack_linears(m, KernelPlan(DENSE_BF16, gemv_rows=8))
    packed = [p for p in m.modules() if isinstance(p, PackedLinear)]
    assert all(p.gemv_rows == 8 and p.gemv_address.item() == p.packed_weight.data_ptr() for p in packed)
    ctypes_rows = []
    real = dense_gemv.run
    monkeypatch.setattr(dense_gemv, "run", lambda x, w, lib=None: ctypes_rows.append(x.shape[0]) or real(x, w, lib))
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        x = torch.randn(3, 64).to(torch.bfloat16)
        eager = m(x)
        assert ctypes_rows == [3, 3]
        ctypes_rows.clear()
        got, kernel_s = _timed_by_the_op(compiled, x)
        assert torch.equal(got, eager)
        assert ctypes_rows == [] and kernel_s > 0


def test_the_command_reports_the_avx2_op(plain_op):
    out = subprocess.run([sys.executable, "-m", "vcfslm.engine.gemv_op"], capture_output=True, text=True, check=True)
    verdict = json.loads(out.stdout)["avx2"]
    assert verdict["usable"] and verdict["reason"] == "checked against F.linear"
    assert verdict["op"]["usable"] and verdict["op"]["reason"] == "vcfslm::gemv agrees with the ctypes call (plain weight)"
