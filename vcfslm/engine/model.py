"""Model sources for the rank worker: a local Hugging Face folder, a hub id, or a synthetic
model with random bf16 weights of an exact published shape (`vcfslm.presets`), of any
decoder config.json, or tiny for tests.

A source is written as text (the worker's `--model`):

    /models/phi3                       a folder with config.json + *.safetensors
    microsoft/Phi-3-mini-128k-instruct a hub id (downloaded once into the HF cache)
    synthetic:phi-3-mini               3.82B params, 32 layers, hidden 3072, vocab 32064
    synthetic:llama-3.2-3b             any preset of vcfslm.presets (`vcfslm model presets`)
    synthetic:phi-3-mini,layers=8      the same layers, fewer of them (quick benchmarks)
    synthetic:config=cfg/config.json   the exact shape of a decoder config.json
    synthetic:tiny                     2 layers, hidden 64, for tests
    synthetic:tiny-64                  2 layers, hidden 128 in two heads of 64: tiny, in a head
                                       size vLLM's CPU attention accepts (16 is not)

torch and transformers are imported inside the functions that need them, so parsing a
source stays cheap for the CLI.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import presets
from ..presets import SYNTHETIC_PREFIX, SyntheticSpecError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# Phi-3-mini-128k-instruct's LongRoPE window: the tiny test models share it.
PHI3_ORIGINAL_CONTEXT = 4096
PHI3_MAX_CONTEXT = 131072


class ModelSourceError(ValueError):
    """A model source that cannot be parsed or found, or a shape the engine cannot run."""


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model source. kind: "synthetic" | "dir" | "hub"; name: the preset, test
    model or `config=PATH` of a synthetic source, else the folder or hub id; layers: a
    synthetic layer override."""

    kind: str
    name: str
    layers: int | None = None

    def __str__(self) -> str:
        if self.kind == "synthetic":
            return SYNTHETIC_PREFIX + self.name + (f",layers={self.layers}" if self.layers else "")
        return self.name

    @property
    def synthetic(self) -> presets.SyntheticSpec:
        return presets.parse_synthetic(str(self))


def parse_model_spec(text: str) -> ModelSpec:
    """Parse a model source (see the module docstring); raises ModelSourceError."""
    text = text.strip()
    if text.startswith(SYNTHETIC_PREFIX):
        try:
            spec = presets.parse_synthetic(text)
        except SyntheticSpecError as exc:
            raise ModelSourceError(str(exc)) from None
        return ModelSpec("synthetic", spec.name, spec.layers)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{text}: folder has no config.json")
        return ModelSpec("dir", str(path.resolve()))
    if text.startswith(("/", ".", "~")) or not _HUB_ID.match(text):
        raise ModelSourceError(f"{text}: no such model folder (and not a hub id like org/name)")
    return ModelSpec("hub", text)


def config_from_values(values: dict[str, Any], origin: str):
    """A transformers config from config fields (a preset's or a config.json's); a family the
    installed transformers does not know is a ModelSourceError naming it."""
    from transformers import AutoConfig

    values = dict(values)
    model_type = values.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as exc:
        import transformers

        raise ModelSourceError(f"{origin}: transformers {transformers.__version__} cannot build model_type "
                               f"{model_type!r} ({str(exc).splitlines()[0][:160]})") from None


def synthetic_config(spec: ModelSpec):
    """The transformers config of a synthetic source (no weights: cheap to check)."""
    if spec.name in TEST_CONFIGS:
        return TEST_CONFIGS[spec.name](spec.layers)
    try:
        values = presets.config_values(spec.synthetic)
    except SyntheticSpecError as exc:
        raise ModelSourceError(str(exc)) from None
    config = config_from_values(values, str(spec))
    unsupported = engine_unsupported(config)
    if unsupported:
        raise ModelSourceError(f"{spec}: {unsupported}")
    return config


def engine_unsupported(config) -> str | None:
    """Why the engine cannot run a config faithfully, or None. The engine's attention is
    transformers' sdpa over its own KV store: logit soft-capping (Gemma 2) has no sdpa form,
    so a model with it would be timed computing something else."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None):
            return (f"{config.model_type} uses {key}={getattr(config, key)}, which the engine's "
                    "attention does not apply; choose another family or a config without it")
    return None


def phi3_mini_config(layers: int | None = None, **overrides: Any):
    """The exact Phi-3-mini-128k-instruct configuration (layers may be reduced)."""
    values = presets.config_values(presets.SyntheticSpec(preset="phi-3-mini", layers=layers))
    values.update(overrides)
    return config_from_values(values, "synthetic:phi-3-mini")


def tiny_config(layers: int | None = None, **overrides: Any):
    """A tiny Phi-3 (same architecture and LongRoPE, ~2.2M params) for tests."""
    from transformers import Phi3Config

    values: dict[str, Any] = dict(
        vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2,
        num_attention_heads=4, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=PHI3_MAX_CONTEXT, original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "factor": PHI3_MAX_CONTEXT / PHI3_ORIGINAL_CONTEXT,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + i for i in range(8)]},
        sliding_window=None, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    return Phi3Config(**values)


def tiny64_config(layers: int | None = None, **overrides: Any):
    """The tiny Phi-3 with heads of 64 (vLLM's CPU attention takes 32, 64, 80, 96, ...: not 16)
    and a vocabulary of 2048, so that a server loads it in seconds."""
    values: dict[str, Any] = dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, vocab_size=2048,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "factor": PHI3_MAX_CONTEXT / PHI3_ORIGINAL_CONTEXT,
                         "short_factor": [1.0 + 0.02 * i for i in range(32)],
                         "long_factor": [2.0 + 0.1 * i for i in range(32)]})
    values.update(overrides)
    return tiny_config(layers, **values)


# The test suite's models (presets.TEST_MODELS): tiny, so a test builds one in milliseconds.
TEST_CONFIGS = {"tiny": tiny_config, "tiny-64": tiny64_config}


@dataclass
class LoadedModel:
    """A model ready for the engine, with the facts the roofline and the records need."""

    model: Any
    spec: ModelSpec
    load_s: float
    rope_pinned: bool
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight of the replica at the model's own precision (bf16), each tensor
        once (a tied embedding once): what the roofline, the probes' rates and the SLO floors
        count, whatever precision the kernel plan holds them in."""
        return self._weight_bytes(held=False)

    @property
    def held_weight_bytes(self) -> int:
        """Bytes the replica holds for its weights: its parameters, and the weights its packed
        linears hold as buffers (vcfslm.engine.linear; `held_nbytes`) unless they are a
        parameter's own storage (a tied head on a kernel that reads the plain matrix). A plan
        that holds its linears in fp32 (onednn-fp32) holds twice their bf16 bytes."""
        return self._weight_bytes(held=True)

    def _weight_bytes(self, *, held: bool) -> int:
        params = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
        total = 0
        for m in self.model.modules():
            if not hasattr(m, "held_nbytes"):
                continue
            weight = getattr(m, "packed_weight", None)
            if weight is not None and _storage_ptr(weight) in params:
                total += m.held_nbytes - m.weight_nbytes   # its bias only
            else:
                total += m.held_nbytes if held else m.model_nbytes
        return sum(params.values()) + total

    @property
    def step_weight_bytes(self) -> int:
        """Weight bytes one decode step reads, at the model's precision (bf16): every matrix
        once, the lm_head included, but not the input embedding (one row per token) unless it
        is the lm_head (tied). A plan holding fp32 reads twice this (`held_bytes_per_weight`)."""
        embed = self.model.get_input_embeddings().weight
        embed_bytes = embed.numel() * embed.element_size()
        return self.weight_bytes - embed_bytes + (embed_bytes if self.head_reads_embedding else 0)

    @property
    def head_reads_embedding(self) -> bool:
        """The lm_head's matrix is the input embedding's storage (tied, not packed apart)."""
        head = self.model.get_output_embeddings()
        weight = getattr(head, "packed_weight", None)
        if weight is None:
            weight = getattr(head, "weight", None)
        return weight is not None and _storage_ptr(weight) == self.model.get_input_embeddings().weight.data_ptr()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token adds to the cache (every layer)."""
        return kv_bytes_per_token(self.config)


def _storage_ptr(tensor) -> int | None:
    """Where a tensor's data starts; None for an opaque (oneDNN-packed) one."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V, every layer, one token."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def load_model(source: str | ModelSpec, *, seed: int = 0, max_context: int | None = None,
               attn_implementation: str = "sdpa", plan=None,
               before_pack: Callable[[Any], None] | None = None) -> LoadedModel:
    """Load (or build) a bf16 causal LM in eval mode; pin LongRoPE's short factor when the
    longest context of the run (`max_context`) fits the original window.

    A folder or hub id loads through vcfslm.engine.loader: a unit at a time from the
    safetensors files (safe_open) into a meta-device skeleton, at about one copy of the
    weights. plan (a linear.KernelPlan): pack every nn.Linear as it arrives (the engine then
    keeps that pack); without it the model comes back unpacked, as transformers builds it.
    before_pack(model): called once with the whole model loaded (for a checkpoint: zero-copy
    views of the mapped files) and not yet packed. Raises ModelSourceError for a checkpoint
    the model does not match.
    """
    spec = parse_model_spec(source) if isinstance(source, str) else source
    started = time.perf_counter()
    pinned = False

    def prepare(model) -> None:
        nonlocal pinned
        model.eval()
        model.requires_grad_(False)
        if max_context:
            pinned = pin_short_rope(model, max_context)
            drop_idle_sliding_window(model.config, max_context)

    if spec.kind == "synthetic":
        config = synthetic_config(spec)
        model = build_random_model(config, seed=seed, attn_implementation=attn_implementation)
        prepare(model)
        if before_pack is not None:
            before_pack(model)
        if plan is not None:
            from .linear import pack_linears
            from .loader import mark_packed

            mark_packed(model, pack_linears(model, plan))
    else:
        model = load_checkpoint(checkpoint_folder(spec), plan=plan, prepare=prepare, before_pack=before_pack,
                                attn_implementation=attn_implementation)
    loaded = LoadedModel(model, spec, time.perf_counter() - started, pinned)
    loaded.facts = describe(loaded)
    return loaded


def checkpoint_folder(spec: ModelSpec) -> Path:
    """The local folder of a "dir" or "hub" source; a hub id's config and safetensors files are
    fetched into the Hugging Face cache first (once)."""
    if spec.kind == "dir":
        return Path(spec.name)
    import json

    from transformers.utils import cached_file

    from .checkpoint_files import INDEX_NAME, SINGLE_NAME

    folder = Path(cached_file(spec.name, "config.json")).parent
    index = cached_file(spec.name, INDEX_NAME, _raise_exceptions_for_missing_entries=False)
    shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values())) if index else [SINGLE_NAME]
    for shard in shards:
        cached_file(spec.name, shard)
    return folder


def load_checkpoint(folder: Path, *, plan=None, prepare: Callable[[Any], None] | None = None,
                    before_pack: Callable[[Any], None] | None = None, attn_implementation: str = "sdpa"):
    """The bf16 model of a save_pretrained folder: its skeleton built from config.json on the
    meta device, its non-persistent buffers computed, then filled (and packed, with a plan)
    by vcfslm.engine.loader. prepare(model) runs on the skeleton (it may set the config, the
    mode and buffers, not read a weight); before_pack(model) once the whole model is there
    as views of the mapped files, before packing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .checkpoint_files import CheckpointError
    from .loader import load_weights

    config = AutoConfig.from_pretrained(folder)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    rebuild_nonpersistent_buffers(model)
    if prepare is not None:
        prepare(model)
    try:
        load_weights(model, folder, plan=plan, before_pack=before_pack)
    except CheckpointError as exc:
        raise ModelSourceError(str(exc)) from exc
    return model


# The files a saved tokenizer consists of (fast, sentencepiece, or BPE vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: str | ModelSpec):
    """The tokenizer of a model folder or hub id; None for synthetic models or when the
    source ships none (the numerics gate then records no text)."""
    spec = parse_model_spec(source) if isinstance(source, str) else source
    if spec.kind == "synthetic":
        return None
    if spec.kind == "dir" and not any((Path(spec.name) / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json's model type alone
        # (Qwen2: a vocabulary of one token), which decodes nothing a person can read.
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.name)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_random_model(config, *, seed: int = 0, attn_implementation: str = "sdpa"):
    """A model of `config` with random bf16 weights, built without an fp32 detour.

    The module is created on the meta device, materialised in bf16, and filled from a
    seeded generator (uniform with the config's initializer std; norms at 1), so ranks
    built with one seed hold identical replicas.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    # to_empty gives each parameter its own storage: a tied lm_head would become a second,
    # different matrix (twice the memory, and not the model the config describes).
    model.tie_weights()
    gen = torch.Generator().manual_seed(seed)
    bound = getattr(config, "initializer_range", 0.02) * 3 ** 0.5  # uniform with that std
    # Drawing 3.8B numbers one by one takes ~30 s on a small VM; tiling each weight from
    # a seeded random pool at a random offset takes ~2 s and reads exactly the same bytes.
    pool = torch.empty(_POOL_ELEMENTS, dtype=torch.bfloat16).uniform_(-bound, bound, generator=gen)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # RMSNorm weights
                param.fill_(1.0)
            else:
                offset = int(torch.randint(0, _POOL_ELEMENTS, (1,), generator=gen))
                _tile_from_pool(param.view(-1), pool, offset)
        rebuild_nonpersistent_buffers(model)
    return model


# A prime-sized pool: rows of any width start at different pool positions.
_POOL_ELEMENTS = 16_777_259


def _tile_from_pool(flat, pool, offset: int) -> None:
    """Fill `flat` with `pool` starting at `offset`, wrapping around."""
    done, n, size = 0, flat.numel(), pool.numel()
    while done < n:
        take = min(size - offset, n - done)
        flat[done:done + take].copy_(pool[offset:offset + take])
        done += take
        offset = 0


def rebuild_nonpersistent_buffers(model) -> None:
    """Give every non-persistent buffer its real value after a meta-device build: they are
    not in a checkpoint, and are left on the meta device (or, after `to_empty`, as
    uninitialised memory).

    - A module that holds such buffers and no parameters (every family's rotary embedding,
      whatever its buffers are called: Gemma 3 keeps one inv_freq per layer type) is built
      afresh from its config, in fp32 as transformers builds it.
    - Gemma's scaled word embedding keeps its scale as a buffer beside its weight: it is
      refilled from the scalar it was made with.
    - Any other such buffer is an error naming it, so a new family fails here instead of
      running on garbage.
    """
    import torch

    for name, module in list(model.named_modules()):
        buffers = module._non_persistent_buffers_set
        if not buffers:
            continue
        if not any(True for _ in module.parameters(recurse=False)) and hasattr(module, "config"):
            fresh = type(module)(config=module.config)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)
        elif buffers == {"embed_scale"} and hasattr(module, "scalar_embed_scale"):
            if module.embed_scale.is_meta:
                module.embed_scale = torch.empty_like(module.embed_scale, device="cpu")
            with torch.no_grad():
                module.embed_scale.copy_(torch.tensor(module.scalar_embed_scale))
        else:
            raise ModelSourceError(f"{type(model).__name__}: cannot give {name or 'the model'}'s non-persistent "
                                   f"buffer(s) {sorted(buffers)} a value after a meta-device build")


def pin_short_rope(model, max_context: int) -> bool:
    """Pin LongRoPE to its short factor when every position stays within the original window.

    transformers re-selects short/long factors on every forward from max(position_ids);
    that data-dependent update mutates a buffer inside the compiled decode step. Below the
    switch point the short factor is the only possible answer, so it is fixed once here.
    Returns True when a rotary module was pinned.
    """
    import torch

    pinned = False
    for module in model.modules():
        if getattr(module, "rope_type", None) != "longrope":
            continue
        params = module.config.rope_parameters
        original = params.get("original_max_position_embeddings") or getattr(
            module.config, "original_max_position_embeddings", None)
        if original is None or max_context > original:
            continue
        with torch.no_grad():
            module.inv_freq.copy_(module.original_inv_freq)
        module.rope_type = "longrope-short-pinned"  # not "longrope": no per-forward update
        pinned = True
    return pinned


def drop_idle_sliding_window(config, max_context: int) -> bool:
    """Turn off a sliding window that no context of the run can reach.

    Phi-3-mini-128k declares sliding_window=262144. transformers then builds sliding
    static cache layers that track their length in a Python int, and the compiled decode
    step recompiles at every position. A window wider than every context masks nothing,
    so plain causal attention computes the same thing. Returns True when dropped.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or max_context > window:
        return False
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        # Per-layer windows (Gemma 3, Qwen2's layer_types): the layers read the window from
        # the config, and a window past every context already masks nothing.
        return False
    config.sliding_window = None
    return True


def parameter_count(model) -> int:
    """Parameters of the model, the weights its packed linears hold included; a tied lm_head
    counts once (the embedding's), packed or not."""
    tied = getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings()
    packed = sum(m.in_features * m.out_features + (0 if m.bias is None else m.bias.numel())
                 for m in model.modules() if hasattr(m, "held_nbytes") and m is not tied)
    return sum(p.numel() for p in model.parameters()) + packed


def describe(loaded: LoadedModel) -> dict[str, Any]:
    """Shape facts for meta.json and the records: enough to rebuild the roofline (roofline.ModelDims)."""
    c = loaded.config
    return {
        "source": str(loaded.spec),
        "architecture": type(loaded.model).__name__,
        "params": parameter_count(loaded.model),
        "layers": c.num_hidden_layers,
        "hidden": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "intermediate": c.intermediate_size,
        "vocab": c.vocab_size,
        "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
        "weight_bytes": loaded.weight_bytes,
        "held_weight_bytes": loaded.held_weight_bytes,
        "step_weight_bytes": loaded.step_weight_bytes,
        "kv_bytes_per_token": loaded.kv_bytes_per_token,
        "rope_pinned_short": loaded.rope_pinned,
        "load_s": round(loaded.load_s, 3),
    }
