"""vcfslm's AVX2 GEMV on the dense-bf16 plan's plain weight: when it runs, that it computes
F.linear at every row count and shape edge, that a wrong loop is refused, and that the plan
sends few-row calls through it and many-row ones to the fp32 slices."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from vcfslm.engine import dense_gemv, gemv, linear  # noqa: E402
from vcfslm.engine.linear import DENSE_BF16, KernelPlan, PackedLinear, choose_plan, pack_linears  # noqa: E402

AVX2_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"

# ------------------------------------------------------------------ decisions


def test_it_needs_avx2_and_fma():
    assert dense_gemv.cpu_runs_it(AVX2_FLAGS)
    assert not dense_gemv.cpu_runs_it("flags\t\t: fpu sse2 avx avx2\n")
    assert not dense_gemv.cpu_runs_it("flags\t\t: fpu sse2 avx fma\n")
    assert not dense_gemv.cpu_runs_it("")


@pytest.mark.parametrize(("k", "rows", "fits"), [(3072, 1, True), (16, 32, True), (8192, 16, True),
                                                  (24, 1, False), (8, 1, False), (3072, 33, False),
                                                  (3072, 0, False)])
def test_what_the_loop_covers(k, rows, fits):
    assert dense_gemv.fits(k, rows) is fits


def test_the_wheels_name_is_its_own():
    name = dense_gemv.packaged_name(b"source")
    assert name.startswith("vcfslm-gemv-avx2-src-") and name.endswith(".so")
    assert name != gemv.packaged_name(b"source") and name != dense_gemv.packaged_name(b"source 2")


def test_the_plan_takes_the_dense_gemvs_rows():
    plan = choose_plan(False, gemv_rows=dense_gemv.MAX_ROWS)
    assert plan == KernelPlan(DENSE_BF16, gemv_rows=32)
    assert plan.label == f"dense-bf16 (1-32 rows: {dense_gemv.LABEL})"
    assert choose_plan(False).label == "dense-bf16"
    with pytest.raises(ValueError, match="gemv_rows must be within 0-32 for dense-bf16"):
        KernelPlan(DENSE_BF16, gemv_rows=33)


def test_switched_off_or_on_another_cpu_it_does_not_run(monkeypatch):
    dense_gemv.status.cache_clear()
    try:
        monkeypatch.setenv("VCFSLM_GEMV", "off")
        assert dense_gemv.status() == gemv.GemvStatus(False, "VCFSLM_GEMV=off")
        assert dense_gemv.usable_rows() == 0
        dense_gemv.status.cache_clear()
        monkeypatch.delenv("VCFSLM_GEMV")
        monkeypatch.setattr(dense_gemv, "read_cpuinfo", lambda: "flags\t\t: fpu sse2 avx\n")
        assert dense_gemv.status() == gemv.GemvStatus(False, "the CPU has no AVX2 with FMA")
    finally:
        dense_gemv.status.cache_clear()


# ------------------------------------------------------------------ the loop itself

needs_it = pytest.mark.skipif(not dense_gemv.status().usable,
                              reason=f"the AVX2 GEMV does not run here: {dense_gemv.status().reason}")


@pytest.mark.skipif(not dense_gemv.cpu_runs_it(dense_gemv.read_cpuinfo()), reason="the CPU has no AVX2 with FMA")
def test_where_the_cpu_runs_it_the_loop_passes_its_check(monkeypatch):
    """A loop that builds but computes wrongly is refused, and every test below would then
    skip: on a CPU that runs it, that is a failure here instead."""
    monkeypatch.delenv("VCFSLM_GEMV", raising=False)
    dense_gemv.status.cache_clear()
    try:
        assert dense_gemv.status().usable, dense_gemv.status().reason
    finally:
        dense_gemv.status.cache_clear()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want).abs().max().item() / want.abs().max().item()


@needs_it
@pytest.mark.parametrize("rows", [*range(1, 18), 19, 20, 21, 22, 23, 24, 26, 29, 31, 32])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (7, 48), (37, 1040), (64, 3072), (25, 2064)])
def test_it_computes_f_linear(rows, n, k):
    """Every row count (1-4 stream, 2-4 prefetching the next tile; 5-7 in two groups over k
    chunks of 1024, 3 + 2 and 3 + 3 rows on tiles of 4 weight rows, 4 + 3 on tiles of 3; 8-16
    broadcast against 2, 3 or 4 groups of four rows, 11 and 15 padded, 9, 10, 13 and 14 with
    1-2 rows left in the dot form; 17-23 as 16 rows broadcast and then 1-7 in the dot form, in
    one group or two as even as they can be; 24-32 as 16 rows and then the rest broadcast, the
    last group padded), outputs left over after whole tiles of 8, 6, 4 and 3, and k inside,
    at, and past a chunk."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = dense_gemv.run(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert _relative_error(got, F.linear(x.float(), w.float())) <= 0.01


@needs_it
@pytest.mark.parametrize("rows", [4, 5, 16, 32])
def test_its_rounding_is_torchs(rows):
    """Outputs exact in fp32 round to bf16 as PyTorch rounds them: to nearest, ties to even
    (in the streaming loop at 4 rows, the chunked one at 5 and the broadcast one at 16 and
    32)."""
    w = torch.zeros(4, 16, dtype=torch.bfloat16)
    w[:, :2] = 1.0
    x = torch.zeros(rows, 16, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    x[0, 1] = 2 ** -8        # 1 + 2^-8: halfway between 1 and 1 + 2^-7, ties to 1
    x[1, 1] = 3 * 2 ** -8    # halfway between 1 + 2^-7 and 1 + 2^-6, ties to 1 + 2^-6
    x[2, 0] = float("nan")
    x[3, 0] = float("inf")
    got = dense_gemv.run(x, w)
    assert got[0, 0].item() == 1.0 and got[1, 0].item() == 1 + 2 ** -6
    assert torch.equal(got[:2], F.linear(x[:2].float(), w.float()).to(torch.bfloat16))
    assert got[2].isnan().all() and (got[3] == float("inf")).all()


@needs_it
def test_shapes_outside_the_loop_are_refused():
    w = torch.randn(8, 24).to(torch.bfloat16)
    with pytest.raises(ValueError, match="refused rows=1 n=8 k=24"):
        dense_gemv.run(torch.randn(1, 24).to(torch.bfloat16), w)
    w = torch.randn(8, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="refused rows=33 n=8 k=32"):
        dense_gemv.run(torch.randn(33, 32).to(torch.bfloat16), w)


@needs_it
def test_a_wrong_loop_fails_the_check(tmp_path):
    """A library that builds and loads but computes something else is never used."""
    source = tmp_path / "zeros.cpp"
    source.write_text(
        '#include <stdint.h>\n#include <string.h>\nextern "C" {\n'
        f"int vcfslm_gemv_abi(void) {{ return {dense_gemv.ABI}; }}\n"
        "int vcfslm_gemv_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t rows, int64_t n,\n"
        "                     int64_t k, int threads, int64_t prefetch) {\n"
        "  memset(y, 0, rows * n * 2); return 0; }\n}\n")
    wrong = dense_gemv.load(gemv.build(tmp_path, "zeros.so", source=source))
    ok, why = dense_gemv.matches_linear(wrong)
    assert not ok and why.startswith("the AVX2 GEMV differs from F.linear at 1 rows")
    assert dense_gemv.matches_linear(dense_gemv.library()) == (True, "checked against F.linear")


@needs_it
def test_a_library_of_another_abi_is_refused(tmp_path):
    source = tmp_path / "old.cpp"
    source.write_text('extern "C" int vcfslm_gemv_abi(void) { return 99; }\n')
    with pytest.raises(gemv.GemvBuildError, match="implements ABI 99, not 1"):
        dense_gemv.load(gemv.build(tmp_path, "old.so", source=source))


# ------------------------------------------------------------------ in the plan


@needs_it
def test_packed_linears_take_it_at_few_rows_and_sgemm_beyond(monkeypatch):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(96, 40, dtype=torch.bfloat16),
                            torch.nn.Linear(40, 24, dtype=torch.bfloat16))   # 40: no whole step of 16
    originals = [layer.weight.detach().clone() for layer in m]
    report = pack_linears(m, KernelPlan(DENSE_BF16, gemv_rows=8))
    first, second = m
    assert isinstance(first, PackedLinear) and first.gemv_rows == 8
    assert second.gemv_rows == 0 and second.gemv_address is None   # stays on ATen at every row count
    assert report.plan.label.endswith(f"1-8 rows: {dense_gemv.LABEL})")
    calls = []
    real = dense_gemv.run
    monkeypatch.setattr(dense_gemv, "run", lambda x, w, lib=None: calls.append(x.shape[0]) or real(x, w, lib))
    with torch.inference_mode():
        for rows, want_calls in ((1, [1]), (8, [8]), (9, [])):
            calls.clear()
            x = torch.randn(rows, 96).to(torch.bfloat16)
            got = first(x)
            assert calls == want_calls
            assert _relative_error(got, F.linear(x.float(), originals[0].float(), m[0].bias.float())) <= 0.02


@needs_it
def test_the_default_plan_on_a_cpu_without_onednn_bf16(monkeypatch):
    monkeypatch.setattr(linear, "onednn_bf16", lambda: False)
    assert linear.default_plan() == KernelPlan(DENSE_BF16, gemv_rows=dense_gemv.MAX_ROWS)


def test_a_ranks_record_names_its_plans_gemv():
    """The worker's placement record reports the GEMV of the plan the engine took."""
    assert linear.gemv_status(KernelPlan(DENSE_BF16)) == dense_gemv.status()
    assert linear.gemv_status(KernelPlan(linear.ONEDNN_PACKED)) == gemv.status()
