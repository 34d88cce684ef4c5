"""The roofline of one replica (pure): bytes and FLOPs of a decode step and of a prefill,
and the floors they set at a measured bandwidth and GEMM rate.

Decode reads every weight once per step plus each stream's KV cache, so its floor is
those bytes at the read bandwidth, or its FLOPs at the GEMM rate when that is longer.
Prefill is compute-bound: its floor is the prompt's FLOPs at the GEMM rate, or one read
of the weights when the prompt is short. The probes (`vcfslm.bench.probe`) measure the
rates; the worker, the report and the performance model (`vcfslm.analysis.perfmodel`)
share this arithmetic.

`config` is anything with a Hugging Face config's attribute names (`hidden_size`,
`num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`,
`num_hidden_layers`, `vocab_size`): a transformers config, or `ModelDims` rebuilt from a
run's recorded facts.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    """What the roofline needs of a decoder-only model, under a config's attribute names."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    step_weight_bytes: int      # the weights one decode step reads (the embedding is a lookup)
    kv_bytes_per_token: int     # K and V of every layer for one token

    FACT_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                 "step_weight_bytes", "kv_bytes_per_token")

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> ModelDims:
        """From the `model` facts a rank records (bench.model.describe); KeyError names what is missing."""
        missing = [k for k in cls.FACT_KEYS if facts.get(k) is None]
        if missing:
            raise KeyError(", ".join(missing))
        return cls(*(int(facts[k]) for k in cls.FACT_KEYS))

    def to_facts(self) -> dict[str, int]:
        return dict(zip(self.FACT_KEYS, astuple(self), strict=True))


def mean_decode_context(input_tokens: int, output_tokens: int) -> float:
    """Mean number of cached tokens a decode step attends over.

    Steps 1..output_tokens-1 attend over input_tokens + 1 .. input_tokens + output_tokens - 1
    tokens (the first token comes from prefill).
    """
    if output_tokens <= 1:
        return float(input_tokens)
    return input_tokens + output_tokens / 2


def decode_step_bytes(step_weight_bytes: int, kv_bytes_per_token: int, batch: int,
                      context_tokens: float) -> float:
    """Bytes one decode step must read: every weight once + each stream's KV cache."""
    return step_weight_bytes + batch * context_tokens * kv_bytes_per_token


def roofline_tpot_ms(step_bytes: float, read_gbs: float, step_flops: float = 0.0,
                     tflops: float | None = None) -> float | None:
    """The floor of one decode step in ms: its bytes at the read bandwidth, or its FLOPs at
    the GEMM rate when that is longer (big batches on CPUs without AMX); None without a
    bandwidth."""
    if not read_gbs or read_gbs <= 0:
        return None
    memory = step_bytes / (read_gbs * 1e9)
    compute = step_flops / (tflops * 1e12) if tflops and tflops > 0 else 0.0
    return max(memory, compute) * 1000.0


def _linear_params_per_token(config) -> tuple[int, int]:
    """(matrix parameters one token meets in one layer, heads x head_dim)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim   # q, k, v
                 + heads * head_dim * hidden                    # o
                 + hidden * 2 * inter + inter * hidden)         # gate+up, down (SwiGLU)
    return per_layer, heads * head_dim


def decode_linear_flops(config, batch: int) -> float:
    """FLOPs of one decode step's linears and lm_head: one row per stream through every matrix."""
    per_layer, _ = _linear_params_per_token(config)
    return 2.0 * batch * (per_layer * config.num_hidden_layers + config.hidden_size * config.vocab_size)


def decode_attention_flops(config, batch: int, context_tokens: float) -> float:
    """FLOPs of one decode step's attention: QK^T and AV of one query per stream over its context."""
    _, attn_width = _linear_params_per_token(config)
    return 2.0 * 2.0 * batch * context_tokens * attn_width * config.num_hidden_layers


def decode_step_flops(config, batch: int, context_tokens: float) -> float:
    """FLOPs of one decode step: every linear and the lm_head on one row per stream, and
    attention over each stream's cached context."""
    return decode_linear_flops(config, batch) + decode_attention_flops(config, batch, context_tokens)


def prefill_linear_flops(config, batch: int, tokens: int) -> float:
    """FLOPs of one prefill's linears on every prompt row, and the lm_head on one row per stream
    (the engine keeps only the last position's logits)."""
    per_layer, _ = _linear_params_per_token(config)
    return (2.0 * batch * tokens * per_layer * config.num_hidden_layers
            + 2.0 * batch * config.hidden_size * config.vocab_size)


def prefill_attention_flops(config, batch: int, tokens: int) -> float:
    """FLOPs of one prefill's causal attention (QK^T and AV): each query attends over its
    causal prefix, (tokens + 1) / 2 keys on average."""
    _, attn_width = _linear_params_per_token(config)
    return 2.0 * 2.0 * batch * tokens * (tokens + 1) / 2 * attn_width * config.num_hidden_layers


def prefill_flops(config, batch: int, tokens: int) -> float:
    """FLOPs of one prefill: its linears and lm_head, and causal attention."""
    return prefill_linear_flops(config, batch, tokens) + prefill_attention_flops(config, batch, tokens)


def roofline_ttft_s(flops: float, tflops: float | None, weight_bytes: float = 0.0,
                    read_gbs: float | None = None) -> float | None:
    """The TTFT floor: the prompt's FLOPs at the GEMM rate, or one read of the weights at
    the read bandwidth when that is longer (short prompts); None without a GEMM rate."""
    if not tflops or tflops <= 0:
        return None
    compute = flops / (tflops * 1e12)
    memory = weight_bytes / (read_gbs * 1e9) if read_gbs and read_gbs > 0 else 0.0
    return max(compute, memory)


def scenario_floors(config, step_weight_bytes: int, kv_bytes_per_token: int, batch: int,
                    input_tokens: int, output_tokens: int, read_gbs: float | None,
                    tflops: float | None) -> tuple[float | None, float | None]:
    """(TPOT floor ms, TTFT floor s) of one scenario from a replica's shape and its probes;
    each is None when the probe it needs is missing."""
    tpot = ttft = None
    if read_gbs:
        context = mean_decode_context(input_tokens, output_tokens)
        step_bytes = decode_step_bytes(step_weight_bytes, kv_bytes_per_token, batch, context)
        tpot = roofline_tpot_ms(step_bytes, read_gbs, decode_step_flops(config, batch, context), tflops)
    if tflops:
        ttft = roofline_ttft_s(prefill_flops(config, batch, input_tokens), tflops, step_weight_bytes, read_gbs)
    return tpot, ttft


