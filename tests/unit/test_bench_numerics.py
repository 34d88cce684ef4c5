"""The numerics gate: a stated tolerance, a pass on the real compiled step, and a failure
on a perturbed one (so the gate can fail)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vcfslm.engine.decode import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.engine.numerics import (  # noqa: E402
    REFERENCE_ROWS,
    compare_logits,
    gate_inputs,
    rank_numerics,
    reference_logits,
    run_gate,
    slot_gates,
)
from vcfslm.engine.slots import TokenSlots, slot_gate_fit  # noqa: E402
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


def test_a_flip_counts_only_beyond_a_near_tie():
    # eager's top two at every position 0.05 of the largest logit apart: rounding may swap them
    eager = torch.zeros(1, 8, 50)
    eager[..., 7] = 10.0
    eager[..., 3] = 9.5
    swapped = eager.clone()
    swapped[..., 3] = 10.2                                     # the compiled step picks token 3 everywhere
    result = compare_logits(swapped, eager)
    assert result.top1_agreement == 0.0 and result.top1_beyond_ties == 1.0 and result.passed
    far = eager.clone()
    far[..., 3] = 8.5                                          # 0.15 of the largest logit below the top
    far_swapped = far.clone()
    far_swapped[..., 3] = 10.2
    far_swapped[:, :3, 3] = 8.5                                # 3 of 8 positions keep eager's top token
    result = compare_logits(far_swapped, far)
    assert result.top1_beyond_ties == result.top1_agreement == 3 / 8 and not result.passed
    assert "top-1 agreement 0.38 < 0.75 (flips within 0.1 of the largest logit counted as ties; 0.38 without)" \
        in result.reason
    assert compare_logits(swapped, eager, tie=0.01).top1_beyond_ties == 0.0   # the tie is the caller's to state


def perturb_compiled(engine, scale=0.5, tokens=None):
    """Noise of `scale` x the largest logit on the engine's compiled step (at `tokens` tokens
    only, when given): what a wrong graph looks like to the gate."""
    step = engine.run_step
    gen = torch.Generator().manual_seed(0)

    def perturbed(tok, *args, eager=False, **kwargs):
        nxt, out = step(tok, *args, eager=eager, **kwargs)
        if not eager and (tokens is None or tok.shape[1] == tokens):
            out = out + scale * float(out.abs().max()) * torch.randn(out.shape, generator=gen).to(out.dtype)
        return nxt, out

    engine.run_step = perturbed


def test_gate_on_the_compiled_tiny_model_passes_and_a_perturbed_step_fails():
    from vcfslm.engine.model import load_model

    tiny = load_model("synthetic:tiny", seed=0, max_context=64)
    engine = DecodeEngine(tiny.model, "compile")
    prompt = synthetic_prompt(2, 8, 16384, seed=1)
    forced = synthetic_prompt(2, 6, 16384, seed=2)
    good = run_gate(engine, prompt, forced, max_len=32, graph="static 2x8")
    assert good.passed, good.reason
    assert good.compiled.steps == 6 and good.compiled.batch == 2 and good.compiled.top1_agreement >= 0.75
    assert good.reference is None and good.invalid_reason is None
    compiles = engine.compiles
    perturb_compiled(engine)
    bad = run_gate(engine, prompt, forced, max_len=32, graph="static 2x8")
    assert not bad.passed and math.isfinite(bad.compiled.max_abs_diff)
    assert bad.invalid_reason.startswith(NUMERICS_GATE_PREFIX + "static 2x8: against eager: ")
    assert engine.compiles == compiles  # the same (batch, cache length) graph was reused


def test_a_batch_one_gate_compiles_the_graph_its_windows_use():
    """The gate's forced tokens are sliced from one tensor made outside inference mode; at
    batch 1 such a slice differs from a generated token in stride and dispatch keys, and
    Dynamo would compile a second graph of the same shape for the windows."""
    from vcfslm.engine.model import load_model

    tiny = load_model("synthetic:tiny", seed=0, max_context=64)
    engine = DecodeEngine(tiny.model, "compile")
    gate = run_gate(engine, synthetic_prompt(1, 8, 16384, seed=1), synthetic_prompt(1, 6, 16384, seed=2),
                    max_len=24)
    assert gate.passed and engine.compiles == 1
    assert engine.generate(synthetic_prompt(1, 16, 16384, seed=3), 8).compiles == 0


def test_the_unpacked_models_reference_agrees_with_every_static_shape_and_a_packing_bug_fails():
    """The reference is taken before packing; its rows are the first rows of any shape's
    gate, so one reference checks every static graph. A packed weight that is wrong passes
    compiled-against-eager (both run it) and fails against the unpacked model."""
    from vcfslm.engine.linear import PackedLinear
    from vcfslm.engine.model import load_model

    tiny = load_model("synthetic:tiny", seed=0, max_context=64)
    prompt, forced = gate_inputs(REFERENCE_ROWS, 6, 16384, seed=3)
    reference = reference_logits(tiny.model, prompt, forced)
    assert tuple(reference.shape) == (REFERENCE_ROWS, 6, 16384) and reference.dtype == torch.float32
    wider = gate_inputs(3, 6, 16384, seed=3)
    assert torch.equal(wider[0][:REFERENCE_ROWS], prompt) and torch.equal(wider[1][:REFERENCE_ROWS], forced)
    engine = DecodeEngine(tiny.model, "eager")
    for batch, context in ((1, 24), (3, 40)):
        rows = gate_inputs(batch, 6, 16384, seed=3)
        good = run_gate(engine, *rows, max_len=context, reference=reference, graph=f"static {batch}x8")
        assert good.passed and good.reference.passed, good.reason
        assert good.reference.batch == min(batch, REFERENCE_ROWS) and good.reference.steps == 6
    # the packing bug: one linear packed from the wrong weight
    mlp = engine.model.model.layers[0].mlp
    wrong = torch.randn(mlp.down_proj.out_features, mlp.down_proj.in_features,
                        generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    mlp.down_proj = PackedLinear(wrong * 0.5, None, engine.plan)
    bad = run_gate(engine, prompt, forced, max_len=24, reference=reference, graph="static 2x8")
    assert bad.compiled.passed and not bad.reference.passed and not bad.passed
    assert bad.invalid_reason.startswith(NUMERICS_GATE_PREFIX + "static 2x8: against the unpacked model: ")
    facts = rank_numerics([good, bad])
    assert not facts["passed"] and facts["failed"] == ["static 2x8"] and len(facts["graphs"]) == 2


def test_priming_gates_every_slot_graph_with_the_compiles_the_windows_need():
    """TokenSlots.prime with forced tokens runs each slot graph's gate on the way: one result
    per graph (lanes, alone or with a piece), the one-lane decode also against the unpacked
    model, and no compile beyond the primed graphs. A perturbed graph fails alone."""
    from vcfslm.engine.model import load_model

    tiny = load_model("synthetic:tiny", seed=0, max_context=64)
    prompt_tokens, steps = slot_gate_fit(8, 6, 40)
    assert (prompt_tokens, steps) == (8, 6) and slot_gate_fit(8, 6, 9) == (2, 3)
    prompt, forced = gate_inputs(1, steps, 16384, seed=4, prompt_tokens=prompt_tokens)
    reference = reference_logits(tiny.model, prompt, forced)
    engine = DecodeEngine(tiny.model, "compile")
    slots = TokenSlots(engine, 2, 40, 4, 16)
    checks = slots.prime(prompt[0], forced[0])
    assert engine.compiles == len(slots.buckets()) == 4 and sorted(checks) == [(1, 0), (1, 4), (2, 0), (2, 4)]
    assert checks[(1, 0)][0].shape == (steps, 16384)       # slot 0's forced decode, step by step
    gates = slot_gates(checks, reference)
    assert [g.graph for g in gates] == ["slot step 1 tokens (1 lanes)", "slot step 5 tokens (1 lanes + a 4-token piece)",
                                        "slot step 2 tokens (2 lanes)", "slot step 6 tokens (2 lanes + a 4-token piece)"]
    assert all(g.passed for g in gates), [g.reason for g in gates]
    assert gates[0].reference is not None and gates[0].reference.passed
    assert all(g.reference is None for g in gates[1:])
    # A step that reads the shifted reference is far off: the reference comparison can fail.
    shifted = torch.cat([reference[:, 1:], reference[:, :1]], dim=1)
    assert not slot_gates({(1, 0): checks[(1, 0)]}, shifted)[0].passed
    perturb_compiled(engine, tokens=6)
    again = slot_gates(slots.prime(prompt[0], forced[0]), reference)
    assert engine.compiles == 4                              # priming again compiled nothing
    assert [g.passed for g in again] == [True, True, True, False]
    assert again[3].invalid_reason.startswith(NUMERICS_GATE_PREFIX + "slot step 6 tokens")
    with pytest.raises(ValueError, match="do not fit max_context 40"):
        slots.prime(synthetic_prompt(1, 30, 16384, seed=5)[0], forced[0])
