"""The rank engine: one packed copy of the weights, one KV store, and one compiled step that
takes a flat list of tokens, for static windows and serving alike.

Why it is built this way (gpt-fast's recipe on CPU, with Sarathi-Serve's stall-free
batching on top):
- Every linear holds one copy of its weight, in the layout of the CPU's fastest bf16
  kernel (vcfslm.engine.linear), and every call goes through that kernel. The compiled
  graphs hold no constants, so a replica stays near 1x its weights and Inductor's FX
  graph cache can be on (the brief's "warm compilation cache").
- Decode is memory-bound: a step reads every weight once, whatever its token count up to
  the GEMM/bandwidth balance. So one step carries every running stream's next token AND
  prompt tokens of the requests being admitted, through each linear as one [tokens,
  hidden] matrix: the prompts ride on the weight reads the decode needs anyway, instead
  of stalling every stream for a whole prefill of its own.
- Tokens are flat: the model sees input_ids [1, T] with each token's own position. The
  attention function registered here (`vcfslm-flat`) writes each token's K/V at (its
  row, its position) of the KV store and attends per request:
  - decode lanes 0..D-1 are the slots: lane i is row i's next token, attending over row i
    (a free lane writes into the junk row and sees key 0 of its own row only: finite,
    touching nothing);
  - each prompt piece comes after the lanes, goes into its own slot's row (free until
    its last piece is in) and attends over that row causally; the step that takes a
    prompt's last piece gives its first token, and the slot decodes from the next step.
  Attention is therefore per request, at its own positions, without forking the model:
  transformers passes the step's kwargs through to the attention function.
- One graph per token count: a serving step's lanes are rounded up over the highest busy
  slot to 1, then powers of the kernel's row padding (onednn-packed pads rows to 4, so
  1, 4, 16; dense-bf16 1, 2, 4, ...), then the slots, so a lone stream pays a batch-1
  step, not the full slot shape; a step with one prompt piece adds `chunk_tokens` to its
  lanes (a shorter piece is padded), sized so the piece's FLOPs fit under the bandwidth
  floor. Every such bucket is compiled before the first window (TokenSlots.prime), so a
  window never compiles. A step with several pieces, or more than a chunk (the
  scheduler's answer to a backlog), runs eagerly at its exact token count: it is then
  the pieces' GEMMs, which eager runs as fast, and no shape needs a graph.
- Static windows are this engine's special case: every stream is admitted at t=0 and
  decodes through the same step family (T = batch, rows 0..batch-1). Their prompts are
  prefilled in one piece (eager, all prompts in one batch, the same attention function in
  its prefill form): all of them at once is the batched step's largest case, and one
  [batch, length] call avoids building the flat lists of batch x length tokens
  (benchmarks/decode_efficiency.py prints the static figures).
- On CPU every op is synchronous: the time after a call returns is when its tokens
  exist; the loop needs no `.item()`.

Compiles are counted by the backend itself, so a window can tell whether a compile
happened inside it (and is then flagged invalid by the worker). A new KV store shape
resets Dynamo first, so a matrix of many shapes never reaches Dynamo's recompile limit
(past it a step would silently run eagerly): one engine per process.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..contract import MEASUREMENT_MODES, normalize_compile_mode
from .linear import KernelPlan, PackReport, default_plan, pack_linears
from .loader import packed_report

log = logging.getLogger(__name__)

ATTENTION = "vcfslm-flat"
# Each token count is its own graph of one code object; a serving rank holds a handful
# (its lane counts, each alone and with a prompt piece) plus the gate's: well past Dynamo's
# default of 8, past which it would run the step eagerly without saying so.
RECOMPILE_LIMIT = 64


class CompileCounter:
    """A torch.compile backend (Inductor) that counts the graphs it compiles."""

    def __init__(self):
        self.graphs = 0
        self.seconds = 0.0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        started = time.perf_counter()
        shapes = [tuple(x.shape) for x in example_inputs if hasattr(x, "shape")][:3]
        log.debug("compile: graph %d, first input shapes %s", self.graphs, shapes)
        try:
            return compile_fx(gm, example_inputs)
        finally:
            took = time.perf_counter() - started
            self.seconds += took
            log.debug("compile: graph %d done in %.1f s (%.1f s in all)", self.graphs, took, self.seconds)


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


class PromptPieces(NamedTuple):
    """The prompt pieces a flat step carries after its decode lanes: the store row (slot)
    each attends over, int64 [pieces], and each one's (offset after the lanes, length)."""

    rows: torch.Tensor
    spans: tuple[tuple[int, int], ...]


class KvStep(NamedTuple):
    """What flat_attention reads besides the attention inputs (a NamedTuple: Dynamo traces
    it as plainly as the tensors and ints it holds).

    store: the KV store's per-layer (keys, values). rows None: a one-piece prefill. Else a
    flat step: token t is written at (rows[t], positions[t]); lanes: the decode lanes in
    front; pieces: the prompt pieces after them (None: none), each under its part of
    prompt_mask [1, 1, T - lanes, context].
    """

    store: Any
    rows: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    lanes: int = 0
    pieces: PromptPieces | None = None
    prompt_mask: torch.Tensor | None = None


def flat_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                   kv_step: KvStep | None = None, **kwargs):
    """Attention over the engine's KV store (see the module docstring).

    Without `kv_step` it is transformers' sdpa attention. With it and no `kv_step.rows`, a
    one-piece prefill: rows [:batch] at positions [:length] take the new K/V, and the
    prompt attends causally to itself exactly as sdpa would. With rows a flat step:
    query [1, heads, T, dim], token t written at (rows[t], positions[t]); lanes
    0..lanes-1 attend over their own rows under `attention_mask` [lanes, 1, 1,
    context]; prompt piece j (tokens lanes+offset .. +length, `pieces.spans[j]`) attends
    over store row `pieces.rows[j]` (its slot) under its part of `prompt_mask` [1, 1,
    T - lanes, context].
    """
    sdpa = _sdpa()
    if kv_step is None:
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    keys, values = kv_step.store[module.layer_idx]
    kv_rows, kv_positions, prompt_mask = kv_step.rows, kv_step.positions, kv_step.prompt_mask
    prompt_rows, prompt_spans = (kv_step.pieces.rows, kv_step.pieces.spans) if kv_step.pieces else (None, ())
    if kv_rows is None:
        batch, _, length, _ = key.shape
        keys[:batch, :, :length] = key
        values[:batch, :, :length] = value
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # keys[row, :, position] = new K of each token: an index_put_, which Inductor's
    # reinplacing pass writes in place (a scatter_ would be functionalized into a copy of
    # the whole store per layer and step).
    keys[kv_rows, :, kv_positions] = key[0].transpose(0, 1)
    values[kv_rows, :, kv_positions] = value[0].transpose(0, 1)
    lanes = kv_step.lanes
    # A sliding-window layer (Mistral v0.1, Qwen2 past max_window_layers, Gemma 3's local
    # layers) sees only the keys within `window` of the query, as transformers' own mask
    # has it (key > query - window); the step's masks are causal only, so it is added here.
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window:
        key_index = torch.arange(keys.shape[2], device=kv_positions.device)
        in_window = key_index[None] > kv_positions[:, None] - window                # [T, context]
        attention_mask = attention_mask & in_window[:lanes, None, None, :]
        if prompt_mask is not None:
            prompt_mask = prompt_mask & in_window[None, None, lanes:]
    q_lanes = query[0, :, :lanes].transpose(0, 1).unsqueeze(2)               # [lanes, heads, 1, dim]
    out = decode_attention(q_lanes, keys[:lanes], values[:lanes], attention_mask,
                           query.shape[-1] ** -0.5 if scaling is None else scaling)   # [lanes, 1, heads, dim]
    parts = [out.transpose(0, 1)]                                             # [1, lanes, heads, dim]
    for j, (offset, length) in enumerate(prompt_spans):
        # The slot's row, gathered by a tensor index: one graph serves every slot.
        row = prompt_rows[j:j + 1]
        q_piece = query[:, :, lanes + offset:lanes + offset + length]          # [1, heads, n, dim]
        piece_out, _ = sdpa(module, q_piece, keys.index_select(0, row), values.index_select(0, row),
                            prompt_mask[:, :, offset:offset + length], scaling=scaling, dropout=dropout,
                            is_causal=False)                                  # [1, n, heads, dim]
        parts.append(piece_out)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), None


def _materialize_kernel(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


# A copy of x that Inductor cannot fuse through: what produced x is computed once, into a
# buffer, and never inlined into the consumer (see decode_attention). A plain Library
# registration, like vcfslm::linear: custom_op's wrappers cost more than the copy.
_OPS = torch.library.Library("vcfslm", "FRAGMENT")
_OPS.define("materialize(Tensor x) -> Tensor")
_OPS.impl("materialize", _materialize_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("vcfslm::materialize", lib=_OPS)
def _materialize_fake(x):
    return torch.empty_like(x)


def materialize(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.vcfslm.materialize.default(x)


def decode_attention(query, keys, values, mask, scaling: float):
    """One query token per lane over its own rows of the store: query [lanes, heads, 1, dim],
    keys/values [lanes, kv_heads, context, dim], mask [lanes, 1, 1, context] (True: attend)
    or None -> [lanes, 1, heads, dim].

    Not SDPA: ATen's CPU flash attention runs one tiny GEMM pair per (lane, head) for a
    single query token, ~5 ms per layer for 16 lanes x 32 heads at 64 positions on 2 cores
    (the K/V reads are ~13 MB). Two batched matmuls with the softmax between them (fp32,
    fused by Inductor when compiled) take 0.7 ms there, and 15 against 86 ms at 1024
    positions. Eager and compiled run the same ops, so they pick the same tokens. A fully
    masked lane (an idle slot) gets a uniform average, not NaN."""
    lanes, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    if torch.compiler.is_compiling():
        # Inductor lowers a one-row bmm on CPU to a multiply-and-sum, and then inlines the
        # query's producer (the rotary embedding: a cos and a sin per element) into that
        # sum, recomputing it once per key position: 3.5 of 4.5 ms per layer at 16 lanes
        # and 36 positions, and growing with the context. The query becomes a buffer first
        # (eager has nothing to inline).
        query = materialize(query)
    q = query.reshape(lanes, kv_heads, heads // kv_heads, dim)               # grouped query heads
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling       # [lanes, kv, groups, context]
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    return out.reshape(lanes, 1, heads, dim)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, flat_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


class KVStore:
    """Per layer one keys and one values tensor [rows, kv_heads, context, head_dim], zeroed
    (a free lane reads key 0 of its row: it must be finite), at static addresses."""

    def __init__(self, config, rows: int, context: int, dtype: torch.dtype):
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rows, self.context = rows, context
        self.layers = []
        for _ in range(config.num_hidden_layers):
            pair = (torch.zeros(rows, kv_heads, context, head_dim, dtype=dtype),
                    torch.zeros(rows, kv_heads, context, head_dim, dtype=dtype))
            for t in pair:
                torch._dynamo.mark_static_address(t)
            self.layers.append(pair)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.context)


class _FlatStep(torch.nn.Module):
    """One step over a flat token list (what torch.compile traces): greedy tokens and logits
    at the kept positions (the lanes, then the prompt piece's last token)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, rows, live, keep, store, lanes: int, pieces: PromptPieces | None = None):
        context = store[0][0].shape[2]
        keys = torch.arange(context, device=positions.device)
        lane_pos = positions[0, :lanes]
        # Lane i sees keys 0..its position when live, key 0 only when free.
        lane_mask = ((keys[None] <= lane_pos[:, None]) & live[:, None]) | (keys[None] == 0)
        prompt_mask = None
        if pieces:
            prompt_mask = (keys[None] <= positions[0, lanes:, None])[None, None]
        kv_step = KvStep(store, rows, positions[0], lanes, pieces, prompt_mask)
        logits = self.model(input_ids=tokens, position_ids=positions, attention_mask=lane_mask[:, None, None, :],
                            use_cache=False, logits_to_keep=keep, kv_step=kv_step).logits[0]
        return logits.argmax(dim=-1), logits


@dataclass
class Generation:
    """One batched generation: tokens and the times (time.perf_counter) that define metrics."""

    tokens: torch.Tensor          # [batch, output_tokens]
    request_start: float
    first_token: float            # prefill done, first token of every stream available
    last_token: float             # last decode step done
    step_s: list[float] = field(default_factory=list)  # each decode step's duration
    compiles: int = 0             # graphs compiled during this generation

    @property
    def decode_s(self) -> float:
        return self.last_token - self.first_token


class DecodeEngine:
    """Greedy generation with packed weights, one KV store and one compiled step family.

    model: a bf16 causal LM; its nn.Linear layers are replaced in place by packed ones
    (the originals are dropped) and its attention by `vcfslm-flat`. A model its loader
    already packed (vcfslm.engine.loader) is taken as it is, with the loader's PackReport
    (each linear was checked as it was packed). mode: "compile" or "eager". plan: the
    linear kernel (default: the best this CPU offers, or the loader's). Static windows
    call generate(); serving builds a TokenSlots on the engine.
    """

    def __init__(self, model, mode: str = "compile", *, plan: KernelPlan | None = None,
                 check_packing: bool = True):
        self.model = model
        self.mode = normalize_compile_mode(mode)
        prepacked = packed_report(model)
        if prepacked is not None:
            if plan is not None and plan != prepacked.plan:
                raise ValueError(f"the model's linears are packed as {prepacked.plan.label}; "
                                 f"they cannot be repacked as {plan.label}")
            self.plan, self.pack = prepacked.plan, prepacked
        else:
            self.plan = plan or default_plan()
            self.pack: PackReport = pack_linears(model, self.plan, check=check_packing)
        _register_attention()
        model.config._attn_implementation = ATTENTION
        self.counter = CompileCounter()
        self._module = _FlatStep(model).eval()
        self._step = self._make_step()
        self.store: KVStore | None = None
        self.dtype = next(model.parameters()).dtype

    @property
    def label(self) -> str:
        return f"{self.mode}, linears {self.plan.label}"

    @property
    def is_measurement_mode(self) -> bool:
        return self.mode in MEASUREMENT_MODES

    def _make_step(self):
        if self.mode == "eager":
            return self._module
        limit = torch._dynamo.config
        limit.recompile_limit = max(limit.recompile_limit, RECOMPILE_LIMIT)
        limit.accumulated_recompile_limit = max(limit.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        return torch.compile(self._module, backend=self.counter, fullgraph=True, dynamic=False)

    @property
    def compiles(self) -> int:
        return self.counter.graphs

    # ------------------------------------------------------------------ store

    def store_for(self, rows: int, context: int) -> KVStore:
        """The KV store of (rows, context); a new shape drops the old store and every graph."""
        if self.store is None or self.store.shape != (rows, context):
            if self.store is not None:
                self.release()
            self.store = KVStore(self.model.config, rows, context, self.dtype)
        return self.store

    def release(self) -> None:
        """Drop the store and every compiled graph."""
        self.store = None
        if self.mode != "eager":
            log.debug("compile: new shape, compiled graphs dropped (dynamo reset)")
            torch._dynamo.reset()
            self._step = self._make_step()
        gc.collect()

    # ------------------------------------------------------------------- steps

    def run_step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, live: torch.Tensor,
                 keep: torch.Tensor, *, lanes: int, pieces: PromptPieces | None = None, eager: bool = False):
        """One flat step (compiled unless eager): (greedy tokens [kept], logits [kept, vocab]).

        tokens, positions: int64 [1, T]; rows: int64 [T] (each token's store row); live: bool
        [lanes]; keep: int64 indices of the tokens whose logits are wanted; pieces: the prompt
        pieces after the lanes, each one's row and (offset after the lanes, length) (None: none)."""
        step = self._module if eager else self._step
        return step(tokens, positions, rows, live, keep, self.store.layers, lanes, pieces)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, store: KVStore | None = None) -> torch.Tensor:
        """Prompts [batch, length] in one piece (eager) into rows [:batch]; last positions' logits."""
        store = store or self.store
        batch, length = prompt.shape
        positions = torch.arange(length, dtype=torch.long).unsqueeze(0).expand(batch, -1)
        out = self.model(input_ids=prompt, position_ids=positions, use_cache=False, logits_to_keep=1,
                         kv_step=KvStep(store.layers))
        return out.logits[:, -1, :]

    def _static_inputs(self, batch: int):
        lanes = torch.arange(batch, dtype=torch.long)
        return lanes, torch.ones(batch, dtype=torch.bool), lanes.clone()

    # ------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, output_tokens: int, *, record_steps: bool = False,
                 eager: bool = False) -> Generation:
        """Generate exactly `output_tokens` greedy tokens per stream (EOS ignored).

        prompt: int64 [batch, input_tokens]. The request starts when this is called.
        eager: run the step without compile (a check, never a measurement).
        """
        if output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        batch, prompt_len = prompt.shape
        compiles_before = self.counter.graphs
        request_start = time.perf_counter()
        store = self.store_for(batch, prompt_len + output_tokens)
        token = self.prefill(prompt, store).argmax(dim=-1)
        first_token = time.perf_counter()
        out = [token]
        rows, live, keep = self._static_inputs(batch)
        position = torch.full((1, batch), prompt_len, dtype=torch.long)
        steps: list[float] = []
        last = first_token
        for _ in range(output_tokens - 1):
            fed = token.view(1, batch).clone(memory_format=torch.contiguous_format)
            token, _ = self.run_step(fed, position, rows, live, keep, lanes=batch, eager=eager)
            out.append(token)
            position = position + 1
            if record_steps:
                now = time.perf_counter()
                steps.append(now - last)
                last = now
        last_token = time.perf_counter()
        return Generation(torch.stack(out, dim=1), request_start, first_token, last_token, steps,
                          self.counter.graphs - compiles_before)

    @torch.inference_mode()
    def step_logits(self, prompt: torch.Tensor, forced: torch.Tensor, *, compiled: bool = True,
                    max_len: int | None = None) -> torch.Tensor:
        """Logits of each decode step when the tokens fed are `forced` [batch, steps].

        Teacher forcing makes the compiled and the eager step see identical inputs, so
        their logits compare position by position (free-running greedy tokens diverge
        on near-ties). max_len: the store's context (default prompt + steps; pass a
        scenario's context to reuse its compiled graph). Returns float32 [batch, steps, vocab].
        """
        batch, prompt_len = prompt.shape
        steps = forced.shape[1]
        store = self.store_for(batch, max(max_len or 0, prompt_len + steps))
        self.prefill(prompt, store)
        rows, live, keep = self._static_inputs(batch)
        out = []
        for i in range(steps):
            position = torch.full((1, batch), prompt_len + i, dtype=torch.long)
            # clone: a fresh inference tensor of plain strides, as generate's tokens are, so
            # Dynamo's guards match and the gate reuses the generation's graph
            tokens = forced[:, i].reshape(1, batch).clone(memory_format=torch.contiguous_format)
            _, logits = self.run_step(tokens, position, rows, live, keep, lanes=batch, eager=not compiled)
            out.append(logits.float().clone())
        return torch.stack(out, dim=1)


def synthetic_prompt(batch: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A deterministic random prompt (the same on every rank for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    # Skip the first 100 ids: special tokens live there in real vocabularies.
    low = min(100, vocab_size - 1)
    return torch.randint(low, vocab_size, (batch, length), generator=gen, dtype=torch.long)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size now (from /proc/self/statm), 0 when unknown."""
    import os

    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
