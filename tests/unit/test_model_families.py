"""Every preset family, built tiny from its preset's structure: the packed engine computes
what transformers' own eager model computes, and the pure counts are transformers' counts."""

from __future__ import annotations

import copy

import pytest

from vcfslm import presets

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPT, FORCED = 12, 6   # past the tiny window of 8: the sliding layers mask something


def tiny_model(name: str):
    from vcfslm.engine.model import build_random_model, config_from_values

    return build_random_model(config_from_values(presets.tiny_values(name), name), seed=1)


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own eager attention on the unpacked weights, every position."""
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    with torch.inference_mode():
        logits = ref(input_ids=ids, use_cache=False).logits.float()
    # Logits near zero would make any engine agree: the build must give real activations.
    assert torch.isfinite(logits).all() and logits.abs().max() > 1e-2
    return logits


def engine_logits(model, ids: torch.Tensor, mode: str) -> torch.Tensor:
    from vcfslm.engine.decode import DecodeEngine

    engine = DecodeEngine(model, mode)
    with torch.inference_mode():
        return engine.step_logits(ids[:, :PROMPT], ids[:, PROMPT:], compiled=mode == "compile")


def family_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, PROMPT + FORCED), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", presets.PRESET_NAMES)
def test_packed_engine_matches_hf_eager(name):
    from vcfslm.engine.numerics import compare_logits

    model = tiny_model(name)
    ids = family_ids(model.config.vocab_size)
    want = reference_logits(model, ids)[:, PROMPT:]   # the logits after each forced token
    got = engine_logits(model, ids, "eager")
    gate = compare_logits(got, want)
    assert gate.passed, f"{name}: {gate.reason}"


@pytest.mark.parametrize("name", ["gemma-3-1b", "llama-3.2-3b"])
def test_compiled_step_matches_hf_eager(name):
    """Compiled too, for a sliding-window GQA family and a tied GQA one."""
    from vcfslm.engine.numerics import compare_logits

    model = tiny_model(name)
    ids = family_ids(model.config.vocab_size)
    want = reference_logits(model, ids)[:, PROMPT:]
    gate = compare_logits(engine_logits(model, ids, "compile"), want)
    assert gate.passed, f"{name}: {gate.reason}"


def test_the_window_is_applied_in_the_step():
    """Without the sliding window the local layers would see the whole prompt: the engine's
    answer must then differ from the windowed reference, or the test proves nothing."""
    from vcfslm.engine.numerics import compare_logits

    model = tiny_model("gemma-3-1b")
    ids = family_ids(model.config.vocab_size)
    want = reference_logits(model, ids)[:, PROMPT:]
    wide = copy.deepcopy(model)
    for layer in wide.model.layers:
        layer.self_attn.sliding_window = None
    unwindowed = engine_logits(wide, ids, "eager")
    assert not compare_logits(unwindowed, want).passed      # measured 1.43 of the largest logit
    assert compare_logits(engine_logits(model, ids, "eager"), want).passed  # measured 0.025


@pytest.mark.parametrize("name", presets.PRESET_NAMES)
def test_counts_are_transformers_counts(name):
    from transformers import AutoModelForCausalLM

    from vcfslm.engine.model import config_from_values

    for values in (presets.config_values(presets.SyntheticSpec(preset=name)), presets.tiny_values(name)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config_from_values(values, name))
        assert sum(p.numel() for p in model.parameters()) == presets.counts(values).params


def test_every_linear_is_packed_and_each_distinct_shape_listed():
    """Whatever the family calls its linears, each is packed, and the pack report lists each
    (name, in -> out, kernel) once with its count: Qwen2's GQA k/v are narrower than q."""
    from vcfslm.engine.decode import DecodeEngine
    from vcfslm.engine.linear import packed_kernels

    model = tiny_model("qwen2.5-7b")
    engine = DecodeEngine(model, "eager")
    assert "torch.nn.Linear" not in packed_kernels(model)
    table = {line.split()[2]: line.split() for line in engine.pack.shapes}
    assert set(table) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert table["k_proj"][:6] == ["2", "x", "k_proj", "64", "->", str(model.config.num_key_value_heads * 16)]
    assert table["lm_head"][:6] == ["1", "x", "lm_head", "64", "->", "512"]
    assert engine.pack.to_dict()["shapes"] == list(engine.pack.shapes)
