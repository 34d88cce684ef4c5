"""The numerics gate: a stated tolerance, a pass on the real compiled step, and a failure
on a perturbed one (so the gate can fail)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vcfslm.bench.engine import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.bench.numerics import compare_logits, run_gate  # noqa: E402
from vcfslm.verdicts import NUMERICS_GATE_PREFIX, is_numerics_gate  # noqa: E402


def logits(seed=0, shape=(2, 4, 50)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5


def test_identical_and_slightly_rounded_logits_pass():
    ref = logits()
    assert compare_logits(ref, ref.clone()).passed
    rounded = ref.to(torch.bfloat16).float()  # bf16 rounding: ~0.4% relative
    result = compare_logits(rounded, ref)
    assert result.passed and result.top1_agreement == 1.0 and result.invalid_reason is None
    assert 0 < result.max_rel_diff < 0.01


@pytest.mark.parametrize("bad, reason", [
    (lambda r: r + 0.2 * r.abs().max(), "max logit difference"),
    (lambda r: r.roll(1, dims=1), "top-1 agreement"),
    (lambda r: r * float("nan"), "max logit difference"),
    (lambda r: r[:, :3], "shape"),
])
def test_wrong_logits_fail_with_a_reason(bad, reason):
    ref = logits()
    result = compare_logits(bad(ref), ref)
    assert not result.passed
    assert reason in result.reason
    assert result.invalid_reason.startswith(NUMERICS_GATE_PREFIX)
    assert is_numerics_gate(result.invalid_reason)


def test_gate_on_the_compiled_tiny_model_passes_and_a_perturbed_step_fails():
    from vcfslm.bench.model import load_model

    tiny = load_model("synthetic:tiny", seed=0, max_context=64)
    engine = DecodeEngine(tiny.model, "compile")
    prompt = synthetic_prompt(2, 8, 16384, seed=1)
    forced = synthetic_prompt(2, 6, 16384, seed=2)
    good = run_gate(engine, prompt, forced, max_len=32)
    assert good.passed, good.reason
    assert good.steps == 6 and good.batch == 2 and good.top1_agreement >= 0.75
    compiles = engine.compiles
    bad = run_gate(engine, prompt, forced, max_len=32, perturb=0.5)
    assert not bad.passed and math.isfinite(bad.max_abs_diff)
    assert engine.compiles == compiles  # the same (batch, cache length) graph was reused


def test_a_batch_one_gate_compiles_the_graph_its_windows_use():
    """The gate's forced tokens are sliced from one tensor made outside inference mode; at
    batch 1 such a slice differs from a generated token in stride and dispatch keys, and
    Dynamo would compile a second graph of the same shape for the windows."""
    from vcfslm.bench.model import load_model

    tiny = load_model("synthetic:tiny", seed=0, max_context=64)
    engine = DecodeEngine(tiny.model, "compile")
    gate = run_gate(engine, synthetic_prompt(1, 8, 16384, seed=1), synthetic_prompt(1, 6, 16384, seed=2),
                    max_len=24)
    assert gate.passed and engine.compiles == 1
    assert engine.generate(synthetic_prompt(1, 16, 16384, seed=3), 8).compiles == 0
