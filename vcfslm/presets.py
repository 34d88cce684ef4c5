"""The model shapes vcfslm can build without downloading a weight (pure): the published
configs of the small decoder families an enterprise weighs, and a synthetic model
source written as text.

A synthetic source is random bf16 weights of an exact shape, so a site that has not
chosen (or cannot fetch) a model still measures what that shape costs on its hosts:

    synthetic:llama-3.2-3b             a named preset (PRESETS below)
    synthetic:qwen2.5-7b,layers=4      the same layers, fewer of them (quick runs)
    synthetic:config=path/config.json  the shape of any decoder config.json

Each preset is the `config.json` of the model it names, with its source cited. Only the
fields that decide the shape and what the forward computes are kept (the rest take
transformers' defaults): the cost of a step does not depend on the weights' values.

The counts below (parameters, bytes per step, KV bytes per token) are computed from the
config alone, so the inventory check, the roofline and `predict --model` know a shape
without torch; tests build every preset on the meta device to hold them to transformers'
own count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .roofline import ModelDims

SYNTHETIC_PREFIX = "synthetic:"
CONFIG_OPTION = "config="
BF16_BYTES = 2


class SyntheticSpecError(ValueError):
    """A synthetic model source that cannot be parsed, or a config it cannot use."""


@dataclass(frozen=True)
class Preset:
    """A published model's shape: its transformers model_type, the config fields that set
    the shape, the hub id it stands for, and where the numbers come from."""

    name: str
    family: str
    hub_id: str
    config: Mapping[str, Any] = field(repr=False)

    @property
    def source(self) -> str:
        """Where the numbers come from: the model's own config.json on the Hugging Face hub."""
        return f"https://huggingface.co/{self.hub_id}/blob/main/config.json"


def _longrope(rotary_dims: int, short_step: float, long_step: float) -> dict[str, Any]:
    """Phi-3's LongRoPE parameters with factors of the right length (rotary dims / 2).

    The published factors are not reproduced: a factor only scales a rotary frequency, it
    costs the same whatever its value."""
    half = rotary_dims // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 131072 / 4096,
            "short_factor": [1.0 + short_step * i / half for i in range(half)],
            "long_factor": [1.0 + long_step * i / half for i in range(half)]}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _default_rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


_PHI3_MINI = dict(
    model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=131072,
    original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_parameters=_longrope(96, 0.05, 63.0),
    sliding_window=262144, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000)

_QWEN2 = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False,
              sliding_window=None, max_position_embeddings=32768, rope_parameters=_default_rope(1000000.0),
              bos_token_id=151643, eos_token_id=151645)
_QWEN3 = dict(model_type="qwen3", hidden_act="silu", rms_norm_eps=1e-6, use_sliding_window=False,
              sliding_window=None, head_dim=128, attention_bias=False, max_position_embeddings=40960,
              rope_parameters=_default_rope(1000000.0), bos_token_id=151643, eos_token_id=151645)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False,
               mlp_bias=False, max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128009)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("phi-3-mini", "phi3", "microsoft/Phi-3-mini-128k-instruct", _PHI3_MINI),
    Preset("phi-3.5-mini", "phi3", "microsoft/Phi-3.5-mini-instruct",
           {**_PHI3_MINI, "rope_parameters": _longrope(96, 0.04, 50.0)}),
    # Phi-4-mini: GQA (24 heads, 8 KV), a 200k vocabulary tied to the embedding, and rotary
    # on 3/4 of each head (partial_rotary_factor 0.75: 96 of 128 dims, 48 factors).
    Preset("phi-4-mini", "phi3", "microsoft/Phi-4-mini-instruct",
           {**_PHI3_MINI, "vocab_size": 200064, "num_attention_heads": 24, "num_key_value_heads": 8,
            "rope_parameters": {**_longrope(96, 0.05, 40.0), "partial_rotary_factor": 0.75},
            "tie_word_embeddings": True, "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999}),
    Preset("llama-3.2-1b", "llama", "meta-llama/Llama-3.2-1B-Instruct",
           {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "rope_parameters": _llama3_rope(32.0), "tie_word_embeddings": True}),
    Preset("llama-3.2-3b", "llama", "meta-llama/Llama-3.2-3B-Instruct",
           {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
            "rope_parameters": _llama3_rope(32.0), "tie_word_embeddings": True}),
    Preset("llama-3.1-8b", "llama", "meta-llama/Llama-3.1-8B-Instruct",
           {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rope_parameters": _llama3_rope(8.0), "tie_word_embeddings": False}),
    # Qwen2.5: biases on q, k and v (Qwen2's attention always has them), 2-4 KV heads.
    Preset("qwen2.5-1.5b", "qwen2", "Qwen/Qwen2.5-1.5B-Instruct",
           {**_QWEN2, "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
            "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
            "tie_word_embeddings": True}),
    Preset("qwen2.5-3b", "qwen2", "Qwen/Qwen2.5-3B-Instruct",
           {**_QWEN2, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
            "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
            "tie_word_embeddings": True}),
    Preset("qwen2.5-7b", "qwen2", "Qwen/Qwen2.5-7B-Instruct",
           {**_QWEN2, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "tie_word_embeddings": False}),
    # Qwen3: an RMSNorm on each head's q and k, head_dim 128 set apart from hidden / heads.
    Preset("qwen3-4b", "qwen3", "Qwen/Qwen3-4B",
           {**_QWEN3, "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "tie_word_embeddings": True}),
    Preset("qwen3-8b", "qwen3", "Qwen/Qwen3-8B",
           {**_QWEN3, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "tie_word_embeddings": False}),
    Preset("mistral-7b", "mistral", "mistralai/Mistral-7B-Instruct-v0.3",
           dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5,
                rope_parameters=_default_rope(1000000.0), sliding_window=None, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)),
    # Gemma 3 1B: one KV head of 256, a 262k vocabulary tied to the embedding, five
    # sliding-window layers (512 keys) to each global one, and norms around both blocks.
    Preset("gemma-3-1b", "gemma3", "google/gemma-3-1b-it",
           dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, rms_norm_eps=1e-6,
                query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                rope_parameters={"sliding_attention": _default_rope(10000.0),
                                 "full_attention": _default_rope(1000000.0)},
                final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
                bos_token_id=2, eos_token_id=1, pad_token_id=0)),
)}
PRESET_NAMES = tuple(PRESETS)
# Hub ids of the same shape as a preset (the 4k Phi-3-mini differs only in its rotary scaling).
_SAME_SHAPE_HUB_IDS = {"microsoft/phi-3-mini-4k-instruct": "phi-3-mini"}
HUB_IDS = {**{p.hub_id.lower(): p for p in PRESETS.values()},
           **{hub: PRESETS[name] for hub, name in _SAME_SHAPE_HUB_IDS.items()}}


# ------------------------------------------------------------------ synthetic sources


@dataclass(frozen=True)
class SyntheticSpec:
    """`synthetic:NAME[,layers=N]` or `synthetic:config=PATH[,layers=N]`, parsed."""

    preset: str | None = None
    config_path: str | None = None
    layers: int | None = None

    def __str__(self) -> str:
        head = self.preset if self.preset else CONFIG_OPTION + str(self.config_path)
        return SYNTHETIC_PREFIX + head + (f",layers={self.layers}" if self.layers else "")

    @property
    def name(self) -> str:
        """The source without its prefix and options: a preset name, or config=PATH."""
        return self.preset or CONFIG_OPTION + str(self.config_path)


# The small models of the test suite, defined with the engine (engine/model.py): not shapes
# a site sizes, so they have no preset row; their names parse all the same.
TEST_MODELS = ("tiny", "tiny-64")


def parse_synthetic(text: str) -> SyntheticSpec:
    """Parse a synthetic source (module docstring); SyntheticSpecError says what is wrong."""
    if not text.startswith(SYNTHETIC_PREFIX):
        raise SyntheticSpecError(f"{text!r} is not a synthetic source ({SYNTHETIC_PREFIX}NAME)")
    head, *options = text[len(SYNTHETIC_PREFIX):].split(",")
    head = head.strip()
    layers = None
    for option in options:
        key, _, value = option.partition("=")
        if key.strip() != "layers" or not value.strip().isdigit() or int(value) < 1:
            raise SyntheticSpecError(f"bad synthetic option {option!r} (expected layers=N, N >= 1)")
        layers = int(value)
    if head.startswith(CONFIG_OPTION):
        path = head[len(CONFIG_OPTION):].strip()
        if not path:
            raise SyntheticSpecError("synthetic:config= needs the path of a config.json")
        return SyntheticSpec(config_path=path, layers=layers)
    if head not in PRESETS and head not in TEST_MODELS:
        raise SyntheticSpecError(f"unknown synthetic model {head!r}; known: "
                                 + ", ".join(SYNTHETIC_PREFIX + n for n in (*PRESET_NAMES, *TEST_MODELS))
                                 + f", or {SYNTHETIC_PREFIX}{CONFIG_OPTION}path/to/config.json")
    return SyntheticSpec(preset=head, layers=layers)


def read_config(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict of config fields; SyntheticSpecError names the file and what
    is wrong (unreadable, not JSON, not a decoder config)."""
    path = Path(path).expanduser()
    try:
        values = json.loads(path.read_text())
    except OSError as exc:
        raise SyntheticSpecError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SyntheticSpecError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(values, dict):
        raise SyntheticSpecError(f"{path}: a config.json holds one object, not {type(values).__name__}")
    # A multimodal config (Gemma 3 4B and up, Llama 4, ...) keeps its decoder in text_config.
    if "text_config" in values and "num_hidden_layers" not in values:
        values = dict(values["text_config"])
    missing = [k for k in REQUIRED_FIELDS if values.get(k) is None]
    if missing or "model_type" not in values:
        raise SyntheticSpecError(f"{path}: not a decoder config: missing "
                                 + ", ".join(missing + ([] if "model_type" in values else ["model_type"])))
    return values


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_values(spec: SyntheticSpec) -> dict[str, Any]:
    """The config fields of a synthetic source, with its layer override applied (not for
    the test models, whose configs live with the engine)."""
    if spec.config_path is not None:
        values = read_config(spec.config_path)
    elif spec.preset in PRESETS:
        values = json.loads(json.dumps(PRESETS[spec.preset].config))  # a deep copy
    else:
        raise SyntheticSpecError(f"{spec.preset} is a test model: its config is built by the engine")
    if spec.layers:
        values["num_hidden_layers"] = spec.layers
        types = values.get("layer_types")
        if isinstance(types, list):
            values["layer_types"] = types[:spec.layers]
    return values


# ------------------------------------------------------------------ counts


@dataclass(frozen=True)
class ShapeCounts:
    """What a config says about a model's size, as the engine holds and reads it (bf16)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int            # every parameter, a tied embedding once
    embedding_params: int  # the input embedding (vocab x hidden)
    tied: bool             # the lm_head is the input embedding

    @property
    def weight_bytes(self) -> int:
        return self.params * BF16_BYTES

    @property
    def step_weight_bytes(self) -> int:
        """The weights one decode step reads: every matrix once, the lm_head included, but
        the input embedding only as the lm_head when they are one tensor (its rows are a
        lookup of one row per token)."""
        head = self.embedding_params if self.tied else 0
        return (self.params - self.embedding_params + head) * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, bf16: KV heads x head_dim, not hidden."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES

    def dims(self) -> ModelDims:
        return ModelDims(num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                         num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate, vocab_size=self.vocab,
                         step_weight_bytes=self.step_weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token)


# Per-layer norms (hidden-wide) beside the two every family has, and per-head q/k norms.
_EXTRA_LAYER_NORMS = {"gemma3_text": 2, "gemma2": 2}
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "olmo2")
# Families whose attention has biases on q, k and v but not o (Qwen2's attention always).
_QKV_BIAS = ("qwen2",)


def counts(values: Mapping[str, Any]) -> ShapeCounts:
    """Parameter and byte counts of a decoder config (pure; checked against transformers
    for every preset by the tests). SwiGLU/GeGLU MLPs (gate, up, down), RMSNorms."""
    hidden, layers = int(values["hidden_size"]), int(values["num_hidden_layers"])
    heads = int(values["num_attention_heads"])
    kv_heads = int(values.get("num_key_value_heads") or heads)
    head_dim = int(values.get("head_dim") or hidden // heads)
    inter, vocab = int(values["intermediate_size"]), int(values["vocab_size"])
    model_type = values.get("model_type", "")
    attn_bias = bool(values.get("attention_bias"))
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    if model_type in _QKV_BIAS:
        per_layer += q + 2 * kv
    elif attn_bias:
        per_layer += q + 2 * kv + hidden
    if values.get("mlp_bias"):
        per_layer += 2 * inter + hidden
    per_layer += (2 + _EXTRA_LAYER_NORMS.get(model_type, 0)) * hidden
    if model_type in _QK_NORM:
        per_layer += 2 * head_dim
    tied = bool(values.get("tie_word_embeddings", False))
    embedding = vocab * hidden
    params = embedding + layers * per_layer + hidden + (0 if tied else embedding)
    return ShapeCounts(layers, hidden, heads, kv_heads, head_dim, inter, vocab, params, embedding, tied)


def preset_counts(name: str, layers: int | None = None) -> ShapeCounts:
    """Counts of a named preset (KeyError for an unknown name)."""
    return counts(config_values(SyntheticSpec(preset=PRESETS[name].name, layers=layers)))


def model_dims(name: str) -> ModelDims:
    """The roofline's view of a named preset (KeyError for an unknown name)."""
    return preset_counts(name).dims()


def counts_of_source(model: str) -> ShapeCounts | None:
    """Counts for a model source known without loading it: a preset (synthetic or its hub
    id) or a synthetic config file; None otherwise (a folder, an unlisted hub id, a test
    model, a config that cannot be read)."""
    if model.startswith(SYNTHETIC_PREFIX):
        try:
            spec = parse_synthetic(model)
            return None if spec.preset in TEST_MODELS else counts(config_values(spec))
        except (SyntheticSpecError, KeyError, TypeError, ValueError):
            return None
    preset = HUB_IDS.get(model.lower())
    return preset_counts(preset.name) if preset else None


def describe_preset(preset: Preset) -> dict[str, Any]:
    """One preset as a row (for `vcfslm model presets`)."""
    c = preset_counts(preset.name)
    return {"name": preset.name, "family": preset.family, "hub_id": preset.hub_id,
            "params_b": round(c.params / 1e9, 2), "weights_gib": round(c.weight_bytes / 2**30, 2),
            "layers": c.layers, "heads": c.heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
            "tied": c.tied, "kv_kib_per_token": round(c.kv_bytes_per_token / 1024, 1),
            "source": preset.source}


# ------------------------------------------------------------------ tiny same-structure models

TINY_HIDDEN, TINY_HEADS, TINY_VOCAB, TINY_INTERMEDIATE = 64, 4, 512, 128


def tiny_values(name: str, layers: int = 2) -> dict[str, Any]:
    """A preset shrunk to a few thousand parameters with its structure kept: GQA ratio (at
    least one KV head), a head_dim set apart from hidden / heads, tied embeddings, biases,
    q/k norms, rotary kind and partial rotary, and sliding windows (a window of 8, below a
    test's context, with a local and a global layer). What the engine must get right for
    a family, at a size a unit test runs in a second."""
    values = config_values(SyntheticSpec(preset=PRESETS[name].name))
    heads, kv_heads = int(values["num_attention_heads"]), int(values.get("num_key_value_heads") or 0)
    kv_heads = kv_heads or heads
    own_head_dim = values.get("head_dim") not in (None, int(values["hidden_size"]) // heads)
    values.update(hidden_size=TINY_HIDDEN, num_attention_heads=TINY_HEADS,
                  num_key_value_heads=max(1, TINY_HEADS * kv_heads // heads),
                  intermediate_size=TINY_INTERMEDIATE, vocab_size=TINY_VOCAB, num_hidden_layers=layers)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in values:
            values[key] = min(int(values[key]), TINY_VOCAB - 1)
    head_dim = 32 if own_head_dim else TINY_HIDDEN // TINY_HEADS
    if own_head_dim or "head_dim" in values:
        values["head_dim"] = head_dim
    rope = values.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        rope["short_factor"] = [1.0 + 0.1 * i for i in range(half)]
        rope["long_factor"] = [2.0 + i for i in range(half)]
    if "query_pre_attn_scalar" in values:
        values["query_pre_attn_scalar"] = head_dim
    if values.get("sliding_window"):
        values["sliding_window"] = 8
        if values.get("sliding_window_pattern"):
            values["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return values
