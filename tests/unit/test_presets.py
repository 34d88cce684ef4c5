"""Presets and synthetic sources (pure: no torch): parsing, config files, and the counts
the inventory, the roofline and `predict --model` use, checked by hand for a GQA model
with a tied embedding (Llama-3.2-3B) and a GQA model with biases and its own head
(Qwen2.5-7B). test_model_families.py holds every preset to transformers' own count."""

from __future__ import annotations

import json

import pytest

from vcfslm import footprint, presets, roofline
from vcfslm.presets import SyntheticSpec, SyntheticSpecError, parse_synthetic


@pytest.mark.parametrize("text,spec", [
    ("synthetic:llama-3.2-3b", SyntheticSpec(preset="llama-3.2-3b")),
    ("synthetic:qwen2.5-7b,layers=4", SyntheticSpec(preset="qwen2.5-7b", layers=4)),
    ("synthetic:config=/cfg/config.json", SyntheticSpec(config_path="/cfg/config.json")),
    ("synthetic:config=cfg/config.json,layers=2", SyntheticSpec(config_path="cfg/config.json", layers=2)),
    ("synthetic:tiny", SyntheticSpec(preset="tiny")),
])
def test_parse_round_trips(text, spec):
    assert parse_synthetic(text) == spec and str(spec) == text


@pytest.mark.parametrize("text,message", [
    ("synthetic:llama-9b", "unknown synthetic model 'llama-9b'"),
    ("synthetic:config=", "needs the path of a config.json"),
    ("synthetic:qwen3-4b,heads=2", "expected layers=N"),
    ("llama-3.2-3b", "not a synthetic source"),
])
def test_parse_refuses(text, message):
    with pytest.raises(SyntheticSpecError, match=message):
        parse_synthetic(text)


def test_config_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "hidden_size": 64,\n  oops\n}')
    with pytest.raises(SyntheticSpecError, match=rf"{bad}:3: not JSON"):
        presets.config_values(parse_synthetic(f"synthetic:config={bad}"))
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(SyntheticSpecError, match="not a decoder config: missing vocab_size, intermediate_size"):
        presets.config_values(parse_synthetic(f"synthetic:config={bad}"))
    with pytest.raises(SyntheticSpecError, match="cannot read the config"):
        presets.config_values(parse_synthetic(f"synthetic:config={tmp_path / 'none.json'}"))


def test_a_multimodal_config_gives_its_text_decoder(tmp_path):
    text = presets.config_values(SyntheticSpec(preset="gemma-3-1b"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    values = presets.config_values(parse_synthetic(f"synthetic:config={tmp_path / 'config.json'},layers=3"))
    assert values["model_type"] == "gemma3_text" and values["num_hidden_layers"] == 3


def test_llama_3_2_3b_by_hand():
    """GQA (24 heads, 8 KV heads of 128) and a tied embedding."""
    hidden, inter, layers, vocab, q, kv = 3072, 8192, 28, 128256, 24 * 128, 8 * 128
    matrices = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    per_layer = matrices + 2 * hidden                     # two RMSNorms
    params = vocab * hidden + layers * per_layer + hidden  # the head is the embedding
    c = presets.preset_counts("llama-3.2-3b")
    assert c.params == params == 3_212_749_824 and c.tied
    assert c.step_weight_bytes == 2 * params             # the embedding is read, as the head
    assert c.kv_bytes_per_token == 2 * layers * kv * 2 == 114_688
    dims = presets.model_dims("llama-3.2-3b")
    assert roofline.decode_linear_flops(dims, 1) == 2 * (layers * matrices + hidden * vocab)
    assert roofline.decode_attention_flops(dims, 1, 1000) == 2 * 2 * 1000 * q * layers
    shape = footprint.shape_of("synthetic:llama-3.2-3b")
    assert shape == footprint.shape_of("meta-llama/Llama-3.2-3B-Instruct")
    assert shape.held_weight_bytes == 2 * (params + vocab * hidden)  # a packed head beside the embedding


def test_qwen2_5_7b_by_hand():
    """GQA (28 heads, 4 KV heads of 128), q/k/v biases, an lm_head of its own."""
    hidden, inter, layers, vocab, q, kv = 3584, 18944, 28, 152064, 28 * 128, 4 * 128
    matrices = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    per_layer = matrices + (q + 2 * kv) + 2 * hidden
    params = 2 * vocab * hidden + layers * per_layer + hidden
    c = presets.preset_counts("qwen2.5-7b")
    assert c.params == params == 7_615_616_512 and not c.tied
    assert c.step_weight_bytes == 2 * (params - vocab * hidden)   # the embedding is a lookup
    assert c.kv_bytes_per_token == 2 * layers * kv * 2 == 57_344
    per_token = footprint.rank_memory_bytes(footprint.shape_of("synthetic:qwen2.5-7b"), 1, 1)
    assert per_token == 2 * params + 57_344 + footprint.RANK_RUNTIME_BYTES
    floor_ms = roofline.roofline_tpot_ms(c.step_weight_bytes, 20.0)
    assert floor_ms == pytest.approx(c.step_weight_bytes / 20e9 * 1e3)


def test_a_layer_override_scales_the_layers_only():
    full, one = presets.preset_counts("mistral-7b"), presets.preset_counts("mistral-7b", layers=1)
    per_layer = (full.params - one.params) / 31
    assert one.params == full.params - 31 * per_layer
    assert one.kv_bytes_per_token * 32 == full.kv_bytes_per_token


def test_unknown_sources_have_no_shape(tmp_path):
    assert presets.counts_of_source("org/unlisted") is None
    assert presets.counts_of_source("synthetic:tiny") is None      # built by the engine
    assert footprint.shape_of(str(tmp_path)) is None                 # a folder without config.json
    (tmp_path / "config.json").write_text(json.dumps(presets.config_values(SyntheticSpec(preset="qwen3-4b"))))
    assert footprint.shape_of(str(tmp_path)).params == presets.preset_counts("qwen3-4b").params
