"""Continuous batching for the rank engine: a fixed number of slots decoded together.

A serving rank receives requests at arbitrary times and of different lengths; a batch
that waits for its slowest member wastes the step, and a new batch shape per occupancy
would compile a graph per shape. So the rank keeps `slots` rows that are decoded by one
step of one static shape, [slots, 1], and requests come and go between steps:

- Slots. Each row of one static KV cache belongs to a slot; a request is admitted into
  a free slot (its prompt is prefilled eagerly, in one batch with other prompts of the
  same length, and its K/V copied into that slot's rows), decodes one token per step at
  its own position, and is evicted when done. Nothing is moved when another slot joins
  or leaves.
- Masks. Rows sit at different positions, so the step builds its own 4-D boolean mask
  [slots, 1, 1, max_context]: row i sees keys 0..positions[i]. transformers 5.24 returns
  a 4-D mask untouched (masking_utils._preprocess_mask_arguments exits early on any
  4-D tensor, before asking the cache for sizes), and sdpa gets it as-is. A free slot
  stays at position 0: it writes its junk K/V into key 0 of its own row and attends to
  that key only, so it is finite and touches no other row. Stale rows of an evicted
  request need no clearing: the next occupant's mask hides everything past its own
  position, and its prefill overwrites the rest.
- One graph. Positions live in one int64 tensor with a static address, shared by the
  model call (position_ids) and by every cache layer, whose `update` scatters row i's
  new K/V to positions[i]. Admitting, stepping and evicting change only tensor values,
  never shapes or Python state the graph reads, so the step compiles once per
  (slots, max_context) and never again, whatever the occupancy. A free slot costs its
  share of the step (its row of every matrix product and a one-key attention), which
  benchmarks/serve_step.py measures.

The compile counter is the DecodeEngine's, so a window can tell whether either compiled.
Dynamo's state is the process's: DecodeEngine.cache_for at a new shape resets it, and the
slot step then compiles again at its next call (counted); serve one shape per process.
"""

from __future__ import annotations

import gc
import logging

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticLayer

from .engine import DecodeEngine

log = logging.getLogger(__name__)


class SlotLayer(StaticLayer):
    """A static cache layer whose update writes row i's one new K/V at positions[i]."""

    def __init__(self, max_cache_len: int, positions: torch.Tensor):
        super().__init__(max_cache_len=max_cache_len)
        self.positions = positions  # [slots], shared with SlotEngine and every layer

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] != 1:
            raise ValueError("a slot cache takes one token per row and step (prefill elsewhere)")
        # keys[row, :, positions[row]] = new K of row: an index_put_, which Inductor's
        # reinplacing pass writes in place. (A scatter_ is functionalized into a copy of the
        # whole cache per layer and step: the same result at several times the step's cost.)
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self.keys[rows, :, self.positions] = key_states[:, :, 0]
        self.values[rows, :, self.positions] = value_states[:, :, 0]
        return self.keys, self.values


class SlotCache(Cache):
    """One SlotLayer per model layer, allocated up front (no lazy init inside the graph)."""

    def __init__(self, config, slots: int, max_context: int, dtype: torch.dtype):
        self.positions = torch.zeros(slots, dtype=torch.long)
        super().__init__(layers=[SlotLayer(max_context, self.positions)
                                 for _ in range(config.num_hidden_layers)])
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        probe = torch.empty(slots, kv_heads, 1, head_dim, dtype=dtype)
        for layer in self.layers:
            layer.lazy_initialization(probe, probe)  # allocates keys/values, marks them static
        torch._dynamo.mark_static_address(self.positions)


class _SlotStep(torch.nn.Module):
    """One greedy decode step over every slot (what torch.compile traces)."""

    def __init__(self, model, max_context: int):
        super().__init__()
        self.model = model
        self.max_context = max_context

    def forward(self, tokens, positions, cache):
        keys = torch.arange(self.max_context, device=positions.device)
        mask = (keys.unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
        logits = self.model(input_ids=tokens, position_ids=positions.unsqueeze(1),
                            attention_mask=mask, cache=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1, :]
        return logits.argmax(dim=-1, keepdim=True), logits


class SlotEngine:
    """Slots decoded together, each at its own position with its own KV rows of one static cache.

    engine: a DecodeEngine whose model (already packed), mode and compile counter are
    reused. slots: rows decoded per step. max_context: the cache length of every slot
    (prompt plus generated tokens).
    """

    def __init__(self, engine: DecodeEngine, slots: int, max_context: int):
        if slots < 1 or max_context < 2:
            raise ValueError("slots must be >= 1 and max_context >= 2")
        window = getattr(engine.model.config, "sliding_window", None)
        if window is not None and window < max_context:
            raise ValueError(f"sliding window {window} < max_context {max_context}: "
                             "slots support full attention only")
        self.engine = engine
        self.slots = slots
        self.max_context = max_context
        self._module = _SlotStep(engine.model, max_context).eval()
        self._step = self._make_step()
        self._cache: SlotCache | None = None
        self._tokens: torch.Tensor | None = None  # [slots, 1]: each slot's last token
        self._live: torch.Tensor | None = None    # [slots]: 1 where occupied (positions += it)
        self._length = [0] * slots                # positions, mirrored in Python for the checks
        self._occupied = [False] * slots
        self.last_logits: torch.Tensor | None = None  # [slots, vocab] of the last step

    def _make_step(self):
        if self.engine.mode == "eager":
            return self._module
        return torch.compile(self._module, backend=self.engine.counter, fullgraph=True,
                             dynamic=False)

    @property
    def compiles(self) -> int:
        return self.engine.counter.graphs

    @property
    def active(self) -> list[int]:
        return [i for i, used in enumerate(self._occupied) if used]

    def free(self) -> list[int]:
        return [i for i, used in enumerate(self._occupied) if not used]

    def position(self, slot: int) -> int:
        """Where the slot's next token is written (its prompt plus generated tokens so far)."""
        return self._length[slot]

    @torch.inference_mode()
    def _ensure_cache(self) -> SlotCache:
        if self._cache is None:
            dtype = next(self.engine.model.parameters()).dtype
            self._cache = SlotCache(self.engine.model.config, self.slots, self.max_context, dtype)
            self._tokens = torch.zeros(self.slots, 1, dtype=torch.long)
            self._live = torch.zeros(self.slots, dtype=torch.long)
        return self._cache

    # ------------------------------------------------------------ admission

    @torch.inference_mode()
    def admit(self, requests: list[tuple[int, torch.Tensor]]) -> list[int]:
        """Prefill each (slot, prompt) into its free slot; the first greedy token of each, in order.

        prompt: int64 1-D. Prompts of equal length are prefilled as one batch. Every request
        is checked before any runs, so a bad one admits none.
        """
        seen: set[int] = set()
        for slot, prompt in requests:
            if not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} out of range 0..{self.slots - 1}")
            if self._occupied[slot] or slot in seen:
                raise ValueError(f"slot {slot} is occupied")
            if prompt.dim() != 1 or prompt.numel() < 1:
                raise ValueError(f"slot {slot}: prompt must be a non-empty 1-D tensor")
            if prompt.numel() + 1 > self.max_context:
                raise ValueError(f"slot {slot}: prompt of {prompt.numel()} tokens + 1 exceeds "
                                 f"max_context {self.max_context}")
            seen.add(slot)
        cache = self._ensure_cache()
        by_length: dict[int, list[int]] = {}
        for i, (_, prompt) in enumerate(requests):
            by_length.setdefault(prompt.numel(), []).append(i)
        first = [0] * len(requests)
        for length, members in by_length.items():
            batch = torch.stack([requests[i][1].to(torch.long) for i in members])
            # A throwaway dynamic cache: prefill computes exactly what it would alone (the
            # same kernels as DecodeEngine.prefill), then its K/V move into the slots' rows.
            scratch = DynamicCache(config=self.engine.model.config)
            tokens = self.engine.prefill(batch, scratch).argmax(dim=-1)
            rows = torch.tensor([requests[i][0] for i in members])
            for layer, src in zip(cache.layers, scratch.layers, strict=True):
                layer.keys[rows, :, :length] = src.keys
                layer.values[rows, :, :length] = src.values
            cache.positions[rows] = length
            self._tokens[rows, 0] = tokens
            for j, i in enumerate(members):
                first[i] = int(tokens[j])
        for slot, prompt in requests:
            self._occupied[slot] = True
            self._length[slot] = prompt.numel()
            self._live[slot] = 1
        return first

    def evict(self, slot: int) -> None:
        """Free the slot; its rows are left as they are (masks hide them)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1}")
        self._occupied[slot] = False
        self._length[slot] = 0
        if self._cache is not None:
            with torch.inference_mode():
                self._cache.positions[slot] = 0  # a free row sees key 0 only
                self._live[slot] = 0

    # ---------------------------------------------------------------- decode

    @torch.inference_mode()
    def step(self, tokens: dict[int, int] | None = None) -> dict[int, int]:
        """One decode step over all slots; {slot: next greedy token} for occupied slots.

        tokens: feed these tokens to the listed occupied slots instead of their last
        generated ones (teacher forcing, for numerics checks). With no slot occupied
        nothing runs.
        """
        active = self.active
        if not active:
            return {}
        cache = self._ensure_cache()
        full = [s for s in active if self._length[s] >= self.max_context]
        if full:
            raise ValueError(f"slots {full} are at max_context {self.max_context}: "
                             "evict them first")
        for slot, token in (tokens or {}).items():
            if not self._occupied[slot]:
                raise ValueError(f"slot {slot} is free")
            self._tokens[slot, 0] = token
        nxt, logits = self._step(self._tokens, cache.positions, cache)
        self.last_logits = logits
        self._tokens.copy_(nxt)
        cache.positions.add_(self._live)  # free rows stay at 0
        for s in active:
            self._length[s] += 1
        values = nxt[:, 0].tolist()
        return {s: values[s] for s in active}

    # ------------------------------------------------------------- lifetime

    def reset(self) -> None:
        """All slots free; the cache (same addresses) and the compiled graph are kept."""
        self._occupied = [False] * self.slots
        self._length = [0] * self.slots
        if self._cache is not None:
            with torch.inference_mode():
                self._cache.positions.zero_()
                self._live.zero_()

    def release(self) -> None:
        """Drop the cache and every compiled graph (torch._dynamo.reset, like DecodeEngine)."""
        self._occupied = [False] * self.slots
        self._length = [0] * self.slots
        self._cache = self._tokens = self._live = None
        self.last_logits = None
        if self.engine.mode != "eager":
            log.debug("compile: slot engine released, compiled graphs dropped (dynamo reset)")
            torch._dynamo.reset()
            self._step = self._make_step()
        gc.collect()
