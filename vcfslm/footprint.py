"""Model memory footprint estimates (pure): weights and KV-cache bytes of known shapes.

Used by inventory validation (will ranks_per_node replicas fit in the VM, and one vNUMA
node's replicas in its memory?) and by the roofline (bytes read per decode step). A shape
is known for every preset of `vcfslm.presets` (as `synthetic:NAME` or by its hub id), for
a `synthetic:config=PATH` and for a local folder's config.json. Other models (an unlisted
hub id) have no estimate: the checks that need one are skipped, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import presets

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that decide its memory traffic."""

    params: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    # The lm_head is the input embedding: the engine's oneDNN layout packs a second copy of
    # it for the head (the embedding lookup needs the plain rows), so a replica holds it twice.
    tied_embedding_params: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.params * BF16_BYTES

    @property
    def held_weight_bytes(self) -> int:
        """What a replica holds: the weights, and the packed head of a tied embedding."""
        return (self.params + self.tied_embedding_params) * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, one token, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


def shape_from_counts(c: presets.ShapeCounts) -> ModelShape:
    return ModelShape(params=c.params, layers=c.layers, hidden=c.hidden, kv_heads=c.kv_heads,
                      head_dim=c.head_dim, tied_embedding_params=c.embedding_params if c.tied else 0)


PHI3_MINI = shape_from_counts(presets.preset_counts("phi-3-mini"))
# The test suite's synthetic:tiny (built by the engine, not a preset).
TINY = ModelShape(params=2_179_392, layers=2, hidden=64, kv_heads=4, head_dim=16)
_TEST_SHAPES = {"synthetic:tiny": TINY}


def shape_of(model: str) -> ModelShape | None:
    """The shape of a model source when it is known without loading it (module docstring)."""
    if model.lower() in _TEST_SHAPES:
        return _TEST_SHAPES[model.lower()]
    counts = presets.counts_of_source(model)
    if counts is None and not model.startswith(presets.SYNTHETIC_PREFIX):
        counts = _folder_counts(model)
    return None if counts is None else shape_from_counts(counts)


def _folder_counts(model: str) -> presets.ShapeCounts | None:
    """A local folder's config.json, read as a synthetic config is (a multimodal config's
    text decoder included); None for anything else."""
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        return presets.counts(presets.read_config(config))
    except (presets.SyntheticSpecError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


# What a rank holds beside its weights and KV cache: the Python/torch runtime, compiled
# kernels, oneDNN scratch, and while packing one weight twice (at most the lm_head, 0.2 GB
# for Phi-3-mini). benchmarks/decode_efficiency.py measured 0.28 GB before loading and
# ~0.45 GB steady beyond the weights with the full shape; 1 GiB leaves room for the peak.
RANK_RUNTIME_BYTES = 1024**3


def rank_memory_bytes(shape: ModelShape, batch: int, context_tokens: int) -> int:
    """One replica's resident bytes, as the engine holds them: one copy of the weights (the
    engine packs each linear in place and keeps no second copy; a tied head is packed apart,
    see ModelShape), a static KV cache of batch x context tokens, and the runtime."""
    return shape.held_weight_bytes + batch * context_tokens * shape.kv_bytes_per_token + RANK_RUNTIME_BYTES



def replica_breakdown(shape: ModelShape, batch: int, context_tokens: int) -> str:
    """rank_memory_bytes in words, for a refusal that shows its numbers."""
    gib = 1024**3
    kv = batch * context_tokens * shape.kv_bytes_per_token
    return (f"{shape.held_weight_bytes / gib:.1f} GiB weights + {kv / gib:.1f} GiB KV cache at batch {batch} x "
            f"{context_tokens} tokens + {RANK_RUNTIME_BYTES / gib:.1f} GiB runtime")


def node_shortfall(shape: ModelShape, replicas_per_node: int, batch: int, context_tokens: int,
                   node_bytes: float) -> int | None:
    """The bytes one NUMA node's replicas need when they exceed `node_bytes`, else None: a
    rank is bound to its node's memory, so what fits the machine may not fit a node."""
    need = replicas_per_node * rank_memory_bytes(shape, batch, context_tokens)
    return need if need > node_bytes else None
