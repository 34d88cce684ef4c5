"""Model memory footprint estimates (pure): weights and KV-cache bytes of known shapes.

Used by inventory validation (will ranks_per_node replicas fit in the VM?) and by the
roofline (bytes read per decode step). Unknown models (a local directory, an unlisted
hub id) have no estimate: the checks that need one are skipped, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that decide its memory traffic."""

    params: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> int:
        return self.params * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, one token, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


PHI3_MINI = ModelShape(params=3_821_079_552, layers=32, hidden=3072, kv_heads=32, head_dim=96)
TINY = ModelShape(params=2_179_392, layers=2, hidden=64, kv_heads=4, head_dim=16)

KNOWN_SHAPES: dict[str, ModelShape] = {
    "synthetic:phi-3-mini": PHI3_MINI,
    "synthetic:tiny": TINY,
    "microsoft/phi-3-mini-128k-instruct": PHI3_MINI,
    "microsoft/phi-3-mini-4k-instruct": PHI3_MINI,
}


def shape_of(model: str) -> ModelShape | None:
    """The known shape of a model source, or None when it cannot be known without loading it."""
    return KNOWN_SHAPES.get(model.lower())


# What a rank holds beside its weights and KV cache: the Python/torch runtime, compiled
# kernels, oneDNN scratch, and while packing one weight twice (at most the lm_head, 0.2 GB
# for Phi-3-mini). benchmarks/decode_efficiency.py measured 0.28 GB before loading and
# ~0.45 GB steady beyond the weights with the full shape; 1 GiB leaves room for the peak.
RANK_RUNTIME_BYTES = 1024**3


def rank_memory_bytes(shape: ModelShape, batch: int, context_tokens: int) -> int:
    """One replica's resident bytes, as the engine holds them: one copy of the weights (the
    engine packs each linear in place and keeps no second copy), a static KV cache of
    batch x context tokens, and the runtime."""
    return shape.weight_bytes + batch * context_tokens * shape.kv_bytes_per_token + RANK_RUNTIME_BYTES


def decode_step_bytes(shape: ModelShape, batch: int, context_tokens: int) -> int:
    """Bytes one decode step reads: every weight once + the KV cache it attends over."""
    return shape.weight_bytes + batch * context_tokens * shape.kv_bytes_per_token
