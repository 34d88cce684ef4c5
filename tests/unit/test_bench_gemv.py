"""vcfslm's GEMV: when it runs and why not, a library rebuilt when what built it changes,
the same numbers as F.linear at 1-32 rows on oneDNN's packed weight, and a wrong layout or
a broken loop caught before any window is measured."""

from __future__ import annotations

import os
import stat

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from vcfslm.engine import dense_gemv, gemv, linear  # noqa: E402
from vcfslm.engine.linear import (  # noqa: E402
    DENSE_BF16,
    ONEDNN_PACKED,
    KernelPlan,
    PackCheckError,
    PackedLinear,
    choose_plan,
    pack_linears,
)


def _cpu_runs_it() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return gemv.cpu_has_avx512_bf16(fh.read()) and linear.onednn_bf16()
    except OSError:
        return False


needs_avx512_bf16 = pytest.mark.skipif(not _cpu_runs_it(), reason="the CPU has no AVX512-BF16: the GEMV cannot "
                                       "run here (its decisions and build are tested above)")
needs_compiler = pytest.mark.skipif(gemv.compiler() is None, reason="no C++ compiler to build the GEMV")

FLAGS = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"


# ------------------------------------------------------------------ decisions


def test_the_cpu_flags_decide():
    assert gemv.cpu_has_avx512_bf16("processor\t: 0\n" + FLAGS)
    assert not gemv.cpu_has_avx512_bf16("flags\t\t: fpu sse2 avx2 fma\n")
    assert not gemv.cpu_has_avx512_bf16("flags\t\t: avx512_bf16\n")  # no avx512f
    assert not gemv.cpu_has_avx512_bf16("")


def test_beside_amx_the_loop_keeps_only_the_rows_it_streams():
    assert gemv.rows_for("processor\t: 0\n" + FLAGS) == gemv.MAX_ROWS == 32
    # An AMX Xeon: 7-32 rows (batch-16 decode) stay on oneDNN's tile kernel.
    amx = FLAGS.replace("avx512_vnni", "avx512_vnni amx_bf16 amx_tile amx_int8")
    assert gemv.cpu_has_avx512_bf16(amx) and gemv.rows_for(amx) == gemv.STREAM_ROWS == 6
    assert gemv.rows_for("") == gemv.MAX_ROWS


@pytest.mark.parametrize("value,off", [("off", True), ("0", True), ("OFF", True), ("on", False), ("", False)])
def test_the_switch(value, off):
    assert gemv.switched_off({gemv.ENV_SWITCH: value}) is off
    assert not gemv.switched_off({})


def test_what_built_the_library_names_it():
    base = gemv.library_name(b"source", "g++ 12")
    assert base == gemv.library_name(b"source", "g++ 12")
    assert base != gemv.library_name(b"source 2", "g++ 12")
    assert base != gemv.library_name(b"source", "g++ 13")
    assert base != gemv.library_name(b"source", "g++ 12", flags=("-O2",))


@pytest.mark.parametrize("n,k,nbytes,rows,fits", [
    (9216, 3072, 9216 * 3072 * 2, 1, True),
    (32064, 3072, 32064 * 3072 * 2, 4, True),
    (9216, 3072, 9216 * 3072 * 2, 16, True),      # batch-16 decode: the chunked loop
    (9216, 3072, 9216 * 3072 * 2, 32, True),      # a 32-token prompt's prefill too
    (9216, 3072, 9216 * 3072 * 2, 33, False),     # more rows: oneDNN
    (9216, 3072, 9216 * 3072 * 2, 0, False),
    (160, 96, 192 * 96 * 2, 1, False),            # n not whole blocks (oneDNN padded it)
    (128, 48, 128 * 48 * 2, 1, False),            # k not whole pairs of 16
    (128, 96, 128 * 96 * 2 + 64, 1, False),       # a buffer of another size: another layout
])
def test_which_weights_fit(n, k, nbytes, rows, fits):
    assert gemv.fits(n, k, nbytes, rows) is fits


def test_cache_folder(tmp_path):
    assert gemv.cache_dir({"VCFSLM_KERNEL_DIR": str(tmp_path)}) == tmp_path
    assert gemv.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "vcfslm" / "kernels"


def test_plan_carries_the_gemv():
    plan = choose_plan(True, gemv_rows=4)
    assert plan == KernelPlan(ONEDNN_PACKED, linear.DEFAULT_MIN_ROWS, 4)
    assert "1-4 rows: " + gemv.LABEL in plan.label
    assert [plan.rows_computed(r) for r in (1, 3, 4, 5, 16)] == [1, 3, 4, 5, 16]
    without = choose_plan(True)
    assert [without.rows_computed(r) for r in (1, 3, 4, 5)] == [4, 4, 4, 5]
    # Without oneDNN's bf16 the rows are the AVX2 GEMV's (vcfslm.engine.dense_gemv).
    assert choose_plan(False, gemv_rows=4) == KernelPlan(DENSE_BF16, gemv_rows=4)
    assert "1-16 rows: " + gemv.LABEL in choose_plan(True, gemv_rows=16).label
    with pytest.raises(ValueError, match="within 0-32"):
        KernelPlan(ONEDNN_PACKED, 4, 33)


def test_switched_off_it_does_not_run(monkeypatch):
    """The switch turns off both GEMVs: the plan on any CPU has none."""
    monkeypatch.setenv(gemv.ENV_SWITCH, "off")
    gemv.status.cache_clear()
    dense_gemv.status.cache_clear()
    try:
        assert gemv.status() == gemv.GemvStatus(False, "VCFSLM_GEMV=off")
        assert gemv.usable_rows() == 0
        assert linear.default_plan().gemv_rows == 0
    finally:
        monkeypatch.delenv(gemv.ENV_SWITCH)
        gemv.status.cache_clear()
        dense_gemv.status.cache_clear()


# ------------------------------------------------------------------ build


def test_a_failing_compiler_is_a_build_error(tmp_path, monkeypatch):
    fake = tmp_path / "fake-g++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fake 1.0'; exit 0; }\necho 'no such flag' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(gemv.GemvBuildError, match="failed on gemv_avx512bf16.cpp: no such flag"):
        gemv.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())   # no half-written library left behind
    monkeypatch.setenv("CXX", str(tmp_path / "missing"))
    with pytest.raises(gemv.GemvBuildError, match="no C\\+\\+ compiler"):
        gemv.build(tmp_path / "cache")


@needs_compiler
def test_the_library_builds_once(tmp_path):
    first = gemv.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert first.name.startswith("vcfslm-gemv-") and first.suffix == ".so"
    assert gemv.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def _fresh_status(monkeypatch, packaged_dir, cxx):
    """status() as a new process with this wheel folder and compiler would give it."""
    monkeypatch.setattr(gemv, "PACKAGED_DIR", packaged_dir)
    monkeypatch.setattr(gemv.packaged_library, "__defaults__", (packaged_dir,))
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.delenv(gemv.ENV_SWITCH, raising=False)
    gemv.status.cache_clear()
    gemv._state.clear()
    try:
        return gemv.status()
    finally:
        gemv.status.cache_clear()
        gemv._state.clear()


def test_the_wheels_name_follows_the_source_alone():
    assert gemv.packaged_name(b"a") == gemv.packaged_name(b"a") != gemv.packaged_name(b"b")
    assert gemv.packaged_library(gemv.PACKAGED_DIR.with_name("no-such-folder")) is None


@needs_avx512_bf16
@needs_compiler
def test_a_guest_without_a_compiler_runs_the_wheels_library(tmp_path, monkeypatch):
    wheel_dir = tmp_path / "kernels"
    prebuilt = gemv.build(wheel_dir, gemv.packaged_name(gemv.SOURCE.read_bytes()))
    monkeypatch.setenv("VCFSLM_KERNEL_DIR", str(tmp_path / "cache"))
    got = _fresh_status(monkeypatch, wheel_dir, str(tmp_path / "no-compiler"))
    if not got.usable and "layout" in got.reason:
        pytest.skip(f"oneDNN packs another layout on this CPU: {got.reason}")
    assert got == gemv.GemvStatus(True, "layout AB16b64a2b checked", str(prebuilt), "wheel")
    assert not (tmp_path / "cache").exists()   # nothing compiled


@needs_avx512_bf16
@needs_compiler
def test_a_wheels_library_that_does_not_load_falls_back_to_a_build(tmp_path, monkeypatch):
    wheel_dir = tmp_path / "kernels"
    wheel_dir.mkdir()
    (wheel_dir / gemv.packaged_name(gemv.SOURCE.read_bytes())).write_bytes(b"not an ELF file")
    monkeypatch.setenv("VCFSLM_KERNEL_DIR", str(tmp_path / "cache"))
    got = _fresh_status(monkeypatch, wheel_dir, gemv.compiler())
    if not got.usable and "layout" in got.reason:
        pytest.skip(f"oneDNN packs another layout on this CPU: {got.reason}")
    assert got.usable and got.origin == "built here"
    assert got.library.startswith(str(tmp_path / "cache"))
    # Neither a loadable library nor a compiler: oneDNN's kernel, and the reason names both.
    got = _fresh_status(monkeypatch, wheel_dir, str(tmp_path / "no-compiler"))
    assert not got.usable
    assert "did not load" in got.reason and "no C++ compiler" in got.reason


# ------------------------------------------------------------------ numbers


@pytest.fixture(scope="module")
def lib():
    """The built library, where oneDNN packs in the layout it reads. Another layout (oneDNN
    on a CPU it picks other blocks for) is the one condition that skips: the engine then
    keeps oneDNN's kernel, and test_a_layout_other_than_the_assumed_one_is_caught shows the
    check that decides it."""
    built = gemv.load(gemv.build())
    ok, why = gemv.layout_matches(built)
    if not ok:
        pytest.skip(f"oneDNN packs another layout on this CPU: {why}")
    return built


@pytest.fixture
def settled(lib):
    """The process's verdict, settled before a test breaks the kernel: the verdict's layout
    check runs through gemv.run too, and a test that patches it must break the kernel the
    pack check sees, not the verdict."""
    verdict = gemv.status()
    assert verdict.usable, verdict.reason
    return verdict


@needs_avx512_bf16
@needs_compiler
@pytest.mark.parametrize("n,k", [(128, 96), (192, 64), (1024, 3072), (64, 8192)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 16, 17, 23, 32])
def test_same_numbers_as_f_linear(lib, n, k, rows):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    got = gemv.run(x, packed, n, lib).float()
    want = F.linear(x.float(), w.float())
    assert got.shape == (rows, n)
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()


@needs_avx512_bf16
@needs_compiler
def test_a_library_builds_from_another_source_and_stands_in(tmp_path, settled, lib):
    """What benchmarks/gemv_rows.py --base does: the loop of another revision, built and
    loaded beside this one, and run in its place for a block; a source that does not compile
    is named in the error."""
    other = tmp_path / "other.cpp"
    other.write_text(gemv.SOURCE.read_text().replace("kNearPrefetch = 2 * 1024", "kNearPrefetch = 4 * 1024"))
    older = gemv.load(gemv.build(tmp_path, "other.so", source=other))
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(128, 96, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    for rows in (3, 9):
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        assert torch.equal(gemv.run(x, packed, 128, older), gemv.run(x, packed, 128, lib))
    own = gemv._library()
    with pytest.raises(KeyError), gemv.library_in_use(older):
        assert gemv._library() is older   # what every PackedLinear call now runs
        raise KeyError("a failing window")
    assert gemv._library() is own         # and after the block, even a failed one, this tree's again
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(gemv.GemvBuildError, match="failed on broken.cpp"):
        gemv.build(tmp_path, "broken.so", source=broken)
    assert not (tmp_path / "broken.so").exists()


@needs_avx512_bf16
@needs_compiler
def test_rows_beyond_the_loop_are_refused(lib):
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(128, 96).to(torch.bfloat16), 4)
    with pytest.raises(ValueError, match="refused rows=33"):
        gemv.run(torch.randn(33, 96).to(torch.bfloat16), packed, 128, lib)


@needs_avx512_bf16
@needs_compiler
def test_a_layout_other_than_the_assumed_one_is_caught(lib, monkeypatch):
    assert gemv.layout_matches(lib) == (True, "layout AB16b64a2b checked")
    real = gemv.run
    # A loop reading another layout puts each output's sum in another output's place.
    monkeypatch.setattr(gemv, "run", lambda x, p, n, lib=None: real(x, p, n, lib).roll(1, dims=1))
    ok, why = gemv.layout_matches(lib)
    assert not ok and "layout other than AB16b64a2b" in why


@needs_avx512_bf16
@needs_compiler
def test_packed_linear_takes_the_gemv_for_few_rows_only(lib, monkeypatch):
    gemv.status()
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 128, bias=True, dtype=torch.bfloat16)
    fitting = PackedLinear(plain.weight, plain.bias, KernelPlan(ONEDNN_PACKED, 4, 4))
    odd = PackedLinear(torch.randn(160, 96).to(torch.bfloat16), None, KernelPlan(ONEDNN_PACKED, 4, 4))
    assert (fitting.gemv_rows, odd.gemv_rows) == (4, 0)   # 160 outputs: not whole blocks
    calls = []
    real = gemv.run
    monkeypatch.setattr(gemv, "run", lambda x, p, n, lib=None: calls.append(x.shape[0]) or real(x, p, n, lib))
    with torch.inference_mode():
        for rows in (1, 4, 5, 17):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            want = F.linear(x.float(), plain.weight.float(), plain.bias.float())
            got = fitting(x).float()
            assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
        odd(torch.randn(1, 96).to(torch.bfloat16))
    assert calls == [1, 4]
    batch = PackedLinear(plain.weight, plain.bias, KernelPlan(ONEDNN_PACKED, 4, 16))
    calls.clear()
    with torch.inference_mode():
        for rows in (1, 5, 16, 17):
            batch(torch.randn(rows, 96).to(torch.bfloat16))
    assert calls == [1, 5, 16]   # batch-16 decode on the chunked loop, 17 rows on oneDNN
    full = PackedLinear(plain.weight, plain.bias, KernelPlan(ONEDNN_PACKED, 4, gemv.MAX_ROWS))
    calls.clear()
    with torch.inference_mode():
        for rows in (17, 32, 33):
            full(torch.randn(rows, 96).to(torch.bfloat16))
    assert calls == [17, 32]     # a 32-token prefill on the chunked loop, 33 rows on oneDNN


@needs_avx512_bf16
@needs_compiler
def test_a_broken_gemv_fails_the_pack_check(settled, monkeypatch):
    monkeypatch.setattr(gemv, "run", lambda x, p, n, lib=None: torch.zeros(x.shape[0], n, dtype=torch.bfloat16))
    m = torch.nn.Sequential(torch.nn.Linear(96, 128, dtype=torch.bfloat16))
    with pytest.raises(PackCheckError, match=r"at 3 rows \(vcfslm GEMV\)"):
        pack_linears(m, KernelPlan(ONEDNN_PACKED, 4, 4))


@needs_avx512_bf16
@needs_compiler
def test_a_broken_chunked_loop_fails_the_pack_check_at_batch_rows(settled, monkeypatch):
    real = gemv.run
    # Right at 1-6 rows (the streaming loop), wrong above (the chunked one).
    monkeypatch.setattr(gemv, "run", lambda x, p, n, lib=None: real(x, p, n, lib) * (1 if x.shape[0] <= gemv.STREAM_ROWS else 1.5))
    with pytest.raises(PackCheckError, match=r"at 7 rows \(vcfslm GEMV\)"):
        pack_linears(torch.nn.Sequential(torch.nn.Linear(96, 128, dtype=torch.bfloat16)), KernelPlan(ONEDNN_PACKED, 4, 16))
    # A plan that keeps 5+ rows on oneDNN never runs the chunked loop: the same module packs.
    pack_linears(torch.nn.Sequential(torch.nn.Linear(96, 128, dtype=torch.bfloat16)), KernelPlan(ONEDNN_PACKED, 4, 4))


@needs_avx512_bf16
@needs_compiler
def test_a_broken_many_row_path_fails_the_pack_check_under_the_gemv_plan(settled, monkeypatch):
    """Under a plan whose GEMV takes 1-32 rows, longer prefills still run oneDNN: the check
    runs 33 rows too."""
    real = linear._run

    def wrong_above_16(x2, weight, bias, kernel, min_rows, gemv_rows, out_features):
        y = real(x2, weight, bias, kernel, min_rows, gemv_rows, out_features)
        return y if x2.shape[0] <= gemv_rows else y.flip(1)

    monkeypatch.setattr(linear, "_run", wrong_above_16)
    with pytest.raises(PackCheckError, match=r"at 33 rows \(onednn-packed\)"):
        pack_linears(torch.nn.Sequential(torch.nn.Linear(96, 128, dtype=torch.bfloat16)),
                     KernelPlan(ONEDNN_PACKED, 4, gemv.MAX_ROWS))


@needs_avx512_bf16
@needs_compiler
def test_compiled_and_eager_agree_through_the_gemv(lib):
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(64, 192, dtype=torch.bfloat16), torch.nn.SiLU(),
                            torch.nn.Linear(192, 64, dtype=torch.bfloat16))
    pack_linears(m, KernelPlan(ONEDNN_PACKED, 4, 4))
    assert all(p.gemv_rows == 4 for p in m.modules() if isinstance(p, PackedLinear))
    x = torch.randn(1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True, dynamic=False)(x)
    assert torch.equal(eager, compiled)


def test_a_plan_asking_for_the_gemv_where_it_cannot_run_is_refused(monkeypatch):
    if not linear.onednn_bf16():
        pytest.skip("oneDNN has no bf16 here: no onednn-packed weight to build")
    monkeypatch.setattr(gemv, "status", lambda: gemv.GemvStatus(False, "the CPU has no AVX512-BF16"))
    with pytest.raises(ValueError, match="does not run here: the CPU has no AVX512-BF16"):
        PackedLinear(torch.randn(128, 96).to(torch.bfloat16), None, KernelPlan(ONEDNN_PACKED, 4, 4))


def test_the_command_prints_its_status(capsys):
    assert gemv.main([]) == 0
    out = capsys.readouterr().out
    import json

    doc = json.loads(out)
    assert set(doc) >= {"usable", "reason", "library"}
    assert doc["usable"] == gemv.status().usable
    if doc["library"]:
        assert os.path.exists(doc["library"])


# ------------------------------------------------------------------ pages under the weights


def test_huge_pages_facts(monkeypatch):
    from vcfslm.bench import pages

    assert pages.thp_mode("always [madvise] never\n") == "madvise"
    assert pages.thp_mode("[always] madvise never") == "always"
    assert pages.thp_mode("garbled") is None
    monkeypatch.setattr(pages, "thp_mode", lambda text=None: "never")
    assert pages.huge_pages_facts({"THP_MEM_ALLOC_ENABLE": "1"}) == {
        "thp_mem_alloc": True, "thp_mode": "never", "huge_pages": False}
    monkeypatch.setattr(pages, "thp_mode", lambda text=None: "madvise")
    assert pages.huge_pages_facts({"THP_MEM_ALLOC_ENABLE": "1"})["huge_pages"]
    assert not pages.huge_pages_facts({})["huge_pages"]


def test_rank_script_puts_weights_on_huge_pages():
    from pathlib import Path

    from vcfslm.bench.pages import HUGE_PAGES_ENV

    text = (Path(__file__).resolve().parents[2] / "templates" / "rank.sh.j2").read_text()
    for key, value in HUGE_PAGES_ENV.items():
        assert f"\nexport {key}={value}\n" in text
