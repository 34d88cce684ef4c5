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
import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..contract import MEASUREMENT_MODES, normalize_compile_mode
from ..serving import Piece
from .linear import KernelPlan, PackReport, default_plan, pack_linears
from .loader import packed_report

log = logging.getLogger(__name__)

ATTENTION = "vcfslm-flat"
# Each token count is its own graph of one code object; a serving rank holds a handful
# (its lane counts, each alone and with a prompt piece) plus the gate's: well past Dynamo's
# default of 8, past which it would run the step eagerly without saying so.
RECOMPILE_LIMIT = 64
# The chunk when no probe says better: a prompt piece this long costs a few decode steps'
# FLOPs on the CPUs measured (AMX: about the floor; AVX2: a few floors).
DEFAULT_CHUNK_TOKENS = 64
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 16, 512


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


def chunk_tokens_for(step_weight_bytes: int, read_gbs: float | None, gemm_tflops: float | None,
                     bytes_per_weight: int = 2) -> int:
    """The largest prompt piece whose linears' FLOPs fit under the decode step's bandwidth
    floor (pure): step time x GEMM rate / (2 x params), with the step time the time to read
    the step's weights and params the weights it reads (bf16: 2 bytes each). Without
    probes, DEFAULT_CHUNK_TOKENS; clamped to [16, 512], a multiple of 8."""
    if not (read_gbs and gemm_tflops and step_weight_bytes) or read_gbs <= 0 or gemm_tflops <= 0:
        return DEFAULT_CHUNK_TOKENS
    floor_s = step_weight_bytes / (read_gbs * 1e9)
    params = step_weight_bytes / bytes_per_weight
    tokens = floor_s * gemm_tflops * 1e12 / (2.0 * params)
    if not math.isfinite(tokens):
        return DEFAULT_CHUNK_TOKENS
    return int(min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, tokens // 8 * 8)))


# A piece is free while the linears at its row count run within this share of the best rate
# at fewer rows (the rates are weight bytes per second: equal rate, equal time).
FREE_ROWS_SHARE = 0.9


def free_rows(rows: tuple[int, ...] | list[int], gbs: tuple[float, ...] | list[float]) -> int | None:
    """The largest probed row count whose linears still run at the decode rate (pure): within
    FREE_ROWS_SHARE of the best rate at or below it (one noisy point below it does not end
    the flat part). None without a curve."""
    best, free = 0.0, None
    for r, rate in sorted(zip(rows, gbs, strict=True)):
        best = max(best, rate)
        if rate >= FREE_ROWS_SHARE * best:
            free = r
    return free


def chunk_for_probes(step_weight_bytes: int, read_gbs: float | None, gemm_tflops: float | None,
                     linear_rows=None, linear_gbs=None) -> int:
    """The chunk from a rank's probes (pure): where the measured decode-linears curve stops
    being flat (a piece that long costs the step nothing: the kernel, not a model, says
    so), within [16, 512] and a multiple of 8; when the curve is flat to its end, or
    missing, chunk_tokens_for's FLOP balance, whichever is larger."""
    balance = chunk_tokens_for(step_weight_bytes, read_gbs, gemm_tflops)
    free = free_rows(linear_rows, linear_gbs) if linear_rows and linear_gbs else None
    if free is None or free >= max(linear_rows):
        return balance if free is None else max(balance, free // 8 * 8 or MIN_CHUNK_TOKENS)
    return int(min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, free // 8 * 8)))


# The SLO rule (Sarathi-Serve's token budget): the prompt tokens a step takes beside running
# decodes are the most whose step, by the rank's own numbers, stays within the tightest TPOT
# limit less this margin. 10 %: the decode steps' run-to-run spread on the 2-core VMs
# measured (a few %) plus the piece's cost read off the probe's 512 MiB curve rather than
# the model's own linears, and what the per-step estimate leaves out (a piece's attention,
# the context growing by the output tokens).
SLO_MARGIN = 0.10
# ... and never fewer than this (the step still moves every prompt in: progress when the
# decodes alone already take the limit), a multiple of the kernels' row padding.
MIN_SLO_CHUNK_TOKENS = 8


def linears_s(rows: int, step_weight_bytes: int, gemm_tflops: float | None, read_gbs: float | None = None,
              curve_rows=None, curve_gbs=None) -> float:
    """The step's linears at `rows` token rows, in seconds (pure), from the rank's probes:
    the decode-linears curve (weight bytes / its rate at that row count, interpolated in
    time between probed counts) and, past its end, the GEMM rate for each further row
    (2 FLOPs per weight: step_weight_bytes per row in bf16), never less than at fewer rows.
    Without a curve, the larger of
    the read floor and the rows' FLOPs at the GEMM rate."""
    w = float(step_weight_bytes)
    per_row = w / (gemm_tflops * 1e12) if gemm_tflops and gemm_tflops > 0 else None
    if curve_rows and curve_gbs:
        points = sorted((int(r), w / (g * 1e9)) for r, g in zip(curve_rows, curve_gbs, strict=True) if g > 0)
        # More rows never take less time: a point faster than one below it is noise.
        points = [(r, max(t for _, t in points[: i + 1])) for i, (r, _) in enumerate(points)]
        if points:
            if rows <= points[0][0]:
                return points[0][1]
            for (r0, t0), (r1, t1) in zip(points, points[1:], strict=False):
                if rows <= r1:
                    return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
            # Past the curve: each row at least the GEMM rate's cost, and no cheaper than
            # the curve's last segment (the kernel only gets more compute-bound).
            (r0, t0), (r1, t1) = points[max(0, len(points) - 2)], points[-1]
            last = (t1 - t0) / (r1 - r0) if r1 > r0 else 0.0
            return t1 + max(per_row or 0.0, last) * (rows - r1)
    floor = w / (read_gbs * 1e9) if read_gbs and read_gbs > 0 else 0.0
    return max(floor, rows * per_row if per_row is not None else 0.0)


@dataclass(frozen=True)
class StepCost:
    """A serving step's time by the rank's own numbers (pure): the decode step at each lane
    count as the engine measured it (TokenSlots.time_decode_steps), plus a prompt piece's
    linears, the probed curve's time at lanes + piece rows less its time at the lanes."""

    decode_s: dict[int, float]          # lane count -> measured decode step (seconds)
    step_weight_bytes: int
    gemm_tflops: float | None
    read_gbs: float | None = None
    curve_rows: tuple[int, ...] | None = None
    curve_gbs: tuple[float, ...] | None = None

    def piece_s(self, lanes: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        args = (self.step_weight_bytes, self.gemm_tflops, self.read_gbs, self.curve_rows, self.curve_gbs)
        return max(0.0, linears_s(lanes + tokens, *args) - linears_s(lanes, *args))

    def step_s(self, lanes: int, tokens: int) -> float:
        return self.decode_s[lanes] + self.piece_s(lanes, tokens)


def slo_chunk_tokens(cost: StepCost, lanes: int, tpot_limit_ms: float, *, margin: float = SLO_MARGIN,
                     most: int = MAX_CHUNK_TOKENS) -> int:
    """The prompt tokens a step at `lanes` decode lanes takes under a TPOT limit (pure): the
    largest multiple of 8 whose step estimate stays within (1 - margin) x the limit, at most
    `most`, and never below MIN_SLO_CHUNK_TOKENS (progress, even when the decodes alone
    leave no room: then the limit cannot be held at this lane count by any chunk)."""
    target = tpot_limit_ms / 1000.0 * (1.0 - margin)
    best = MIN_SLO_CHUNK_TOKENS
    for tokens in range(MIN_SLO_CHUNK_TOKENS, most + 1, 8):
        if cost.step_s(lanes, tokens) > target:
            break
        best = tokens
    return best


def slo_chunks(cost: StepCost, tpot_limit_ms: float, *, margin: float = SLO_MARGIN,
               most: int = MAX_CHUNK_TOKENS) -> dict[int, int]:
    """slo_chunk_tokens at each lane count the cost knows (pure)."""
    return {lanes: slo_chunk_tokens(cost, lanes, tpot_limit_ms, margin=margin, most=most)
            for lanes in sorted(cost.decode_s)}


def tightest_tpot_ms(limits: dict[str, dict] | None) -> float | None:
    """The tightest TPOT limit of a run's SLOs in ms (pure); None when no SLO sets one."""
    found = [float(v["tpot_ms"]) for v in (limits or {}).values() if v and v.get("tpot_ms")]
    return min(found) if found else None


def chunk_rule(tpot_limit_ms: float | None, flag_tokens: int = 0) -> str:
    """How the serving chunk is chosen, as the records say it (pure): the inventory's or
    flag's fixed count wins; else the tightest TPOT limit when an SLO sets one; else the
    kernel curve (chunk_for_probes)."""
    if flag_tokens:
        return "flag"
    return f"slo:tpot<={tpot_limit_ms:g}ms" if tpot_limit_ms else "kernel"


def decode_buckets(slots: int, growth: int = 2) -> tuple[int, ...]:
    """The lane counts a serving step compiles at (pure): 1, then powers of `growth` below
    the slot count, then the slot count. growth: the kernel plan's padding (rows fewer than
    its min_rows cost what min_rows cost, so onednn-packed's 4 gives 1, 4, 16), at least 2."""
    growth = max(2, growth)
    out, t = [], 1
    while t < slots:
        out.append(t)
        t *= growth
    return (*out, slots)


def lanes_for(highest_slot: int, slots: int, growth: int = 2) -> int:
    """The lane count a step whose highest busy slot is `highest_slot` runs at (pure)."""
    return next(b for b in decode_buckets(slots, growth) if b > highest_slot)


# ---------------------------------------------------------------- attention


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


# ------------------------------------------------------------------- serving


@dataclass
class StepOut:
    """One serving step: each decoding slot's next token, the first token of each request
    whose prompt's last piece this step took, and what the step carried."""

    decoded: dict[int, int]
    firsts: dict[int, int]    # slot -> first token, for the prompts this step completed
    tokens: int               # real tokens (decodes + prompt), not the padding
    prompt_tokens: int
    bucket: int               # the token count it ran at
    compiled: bool = True     # a primed graph (False: an eager step of several or long pieces)


class TokenSlots:
    """Serving on the engine: `slots` streams decoding together, prompts admitted in pieces
    that ride on the decode steps.

    A step takes either one piece of at most `chunk_tokens` (padded to it: a primed graph),
    or several pieces of up to `batched_tokens` prompt tokens together (an eager step of
    their exact token count; at that size the step is the pieces' GEMMs, which eager runs
    as fast). A piece writes its K/V straight into its slot's row; the slot decodes from
    the step that takes its prompt's last piece. The store has slots + 1 rows: the slots
    and a junk row (what free lanes and padding write). A slot's context is `max_context`
    (prompt plus generated tokens).
    """

    def __init__(self, engine: DecodeEngine, slots: int, max_context: int, chunk_tokens: int,
                 batched_tokens: int | None = None, *, chunks: dict[int, int] | None = None,
                 rule: str = "kernel"):
        batched_tokens = chunk_tokens if batched_tokens is None else batched_tokens
        if slots < 1 or max_context < 2 or chunk_tokens < 1:
            raise ValueError("slots and chunk_tokens must be >= 1 and max_context >= 2")
        if batched_tokens < chunk_tokens:
            raise ValueError(f"batched_tokens {batched_tokens} < chunk_tokens {chunk_tokens}")
        window = getattr(engine.model.config, "sliding_window", None)
        if window is not None and window < max_context:
            raise ValueError(f"sliding window {window} < max_context {max_context}: "
                             "the engine supports full attention only")
        self.engine, self.slots, self.max_context = engine, slots, max_context
        self.chunk_tokens, self.batched_tokens = chunk_tokens, batched_tokens
        self.junk = slots
        self.growth = max(2, engine.plan.min_rows)
        self.chunks: dict[int, int] = {}     # lane count -> its chunk (set_chunks); else chunk_tokens
        self.rule = rule
        if chunks:
            self.set_chunks(chunks, rule)
        self._length = [0] * slots           # each slot's next position (0: free)
        self._occupied = [False] * slots
        self._last = [0] * slots             # each occupied slot's last token
        self.last_logits: dict[int, torch.Tensor] = {}
        self.twin_logits: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None

    @property
    def compiles(self) -> int:
        return self.engine.compiles

    @property
    def active(self) -> list[int]:
        return [i for i, used in enumerate(self._occupied) if used]

    def free(self) -> list[int]:
        return [i for i, used in enumerate(self._occupied) if not used]

    def position(self, slot: int) -> int:
        return self._length[slot]

    def set_chunks(self, chunks: dict[int, int], rule: str) -> None:
        """A chunk per lane count (the SLO rule's: more room beside fewer decodes), before
        priming; `chunk_tokens` becomes the largest. rule: how they were chosen (records)."""
        lanes = decode_buckets(self.slots, self.growth)
        missing = [n for n in lanes if n not in chunks]
        if missing or any(v < 1 for v in chunks.values()):
            raise ValueError(f"chunks {chunks} must give every lane count {lanes} at least 1 token")
        if max(chunks.values()) > self.batched_tokens:
            raise ValueError(f"chunks {chunks} exceed batched_tokens {self.batched_tokens}")
        self.chunks = {n: int(chunks[n]) for n in lanes}
        self.chunk_tokens, self.rule = max(self.chunks.values()), rule

    def chunk_at(self, lanes: int) -> int:
        """The prompt tokens a primed step at `lanes` decode lanes takes (its graph's piece)."""
        return self.chunks.get(lanes, self.chunk_tokens)

    @property
    def capped(self) -> bool:
        """Under the SLO rule every step beside running decodes keeps to its lanes' chunk,
        a backlog's too (the scheduler's plan_pieces)."""
        return self.rule.startswith("slo:")

    def step_chunk(self) -> int:
        """The chunk of the next step (its lanes: over the highest occupied slot)."""
        active = self.active
        return self.chunk_at(lanes_for(max(active), self.slots, self.growth) if active else 1)

    @property
    def budget(self) -> int:
        """The most tokens one step carries: every slot's decode and the batched pieces."""
        return self.slots + self.batched_tokens

    def buckets(self) -> tuple[int, ...]:
        """Every token count a primed graph runs at: the decode lanes alone, and the lanes
        with one chunk (a piece shorter than the chunk is padded to it)."""
        lanes = decode_buckets(self.slots, self.growth)
        return (*lanes, *(n + self.chunk_at(n) for n in lanes))

    @torch.inference_mode()
    def step(self, pieces: Piece | list[Piece] | tuple[Piece, ...] | None = None,
             forced: dict[int, int] | None = None, *, twin: bool = False, eager: bool = False) -> StepOut:
        """One step: every occupied slot decodes a token; pieces of prompts ride along.

        forced: feed these tokens to the listed slots instead of their last ones (teacher
        forcing, for numerics checks). twin: a primed step also runs eagerly on the same
        inputs, and `twin_logits` keeps (graph, compiled, eager) logits of its real tokens
        (the busy lanes, then the pieces), for the numerics gate. Nothing runs when no slot
        is occupied and no piece is given. eager: run pieces eagerly at their exact size
        (no graph: for measuring before the piece graphs exist)."""
        pieces = [] if pieces is None else [pieces] if isinstance(pieces, Piece) else list(pieces)
        self._check_pieces(pieces)
        active = self.active
        if not pieces and not active:
            return StepOut({}, {}, 0, 0, 0)
        full = [s for s in active if self._length[s] >= self.max_context]
        if full:
            raise ValueError(f"slots {full} are at max_context {self.max_context}: evict them first")
        for slot, token in (forced or {}).items():
            if not self._occupied[slot]:
                raise ValueError(f"slot {slot} is free")
            self._last[slot] = token
        self.engine.store_for(self.slots + 1, self.max_context)
        lanes = lanes_for(max(active), self.slots, self.growth) if active else 1
        sizes = [p.stop - p.start for p in pieces]
        prompt = sum(sizes)
        chunk = self.chunk_at(lanes)
        primed = len(pieces) <= 1 and prompt <= chunk and not (eager and pieces)
        total = lanes + (0 if not pieces else chunk if primed else prompt)
        tokens = torch.zeros(1, total, dtype=torch.long)
        positions = torch.zeros(1, total, dtype=torch.long)
        rows = torch.full((total,), self.junk, dtype=torch.long)
        live = torch.zeros(lanes, dtype=torch.bool)
        for s in active:
            tokens[0, s], positions[0, s], rows[s], live[s] = self._last[s], self._length[s], s, True
        keep = list(range(lanes))
        spans, offset = [], 0
        for piece, n in zip(pieces, sizes, strict=True):
            at = lanes + offset
            tokens[0, at:at + n] = piece.prompt[piece.start:piece.stop]
            positions[0, at:at + n] = torch.arange(piece.start, piece.stop)
            rows[at:at + n] = piece.slot
            keep.append(at + n - 1)
            # A primed step's one span covers the padding too (it sees key 0 of the row).
            spans.append((offset, chunk if primed else n))
            offset += n
        flat_pieces = (PromptPieces(torch.tensor([p.slot for p in pieces], dtype=torch.long), tuple(spans))
                       if pieces else None)
        nxt, logits = self.engine.run_step(tokens, positions, rows, live, torch.tensor(keep), lanes=lanes,
                                           pieces=flat_pieces, eager=not primed)
        if twin and primed:
            # The eager twin rewrites the same K/V at the same places: the next step sees
            # one history whichever ran last.
            _, again = self.engine.run_step(tokens, positions, rows, live, torch.tensor(keep), lanes=lanes,
                                            pieces=flat_pieces, eager=True)
            real = torch.tensor([*active, *range(lanes, lanes + len(pieces))], dtype=torch.long)
            graph = (lanes, chunk if pieces else 0)
            self.twin_logits = (graph, logits[real].float().clone(), again[real].float().clone())
        values = nxt.tolist()
        decoded, firsts = {}, {}
        self.last_logits = {}
        for s in active:
            decoded[s] = self._last[s] = values[s]
            self._length[s] += 1
            self.last_logits[s] = logits[s]
        for j, piece in enumerate(pieces):
            if piece.last:
                firsts[piece.slot] = self._last[piece.slot] = values[lanes + j]
                self._occupied[piece.slot], self._length[piece.slot] = True, piece.length
                self.last_logits[piece.slot] = logits[lanes + j]
        return StepOut(decoded, firsts, len(active) + prompt, prompt, total, primed)

    def _check_pieces(self, pieces: list[Piece]) -> None:
        seen = set()
        for piece in pieces:
            self._check_piece(piece)
            if piece.slot in seen:
                raise ValueError(f"slot {piece.slot}: two pieces in one step")
            seen.add(piece.slot)
        prompt = sum(p.stop - p.start for p in pieces)
        if prompt > self.batched_tokens:
            raise ValueError(f"{len(pieces)} pieces of {prompt} tokens exceed batched_tokens {self.batched_tokens}")

    def _check_piece(self, piece: Piece) -> None:
        if not 0 <= piece.slot < self.slots:
            raise ValueError(f"slot {piece.slot} out of range 0..{self.slots - 1}")
        if self._occupied[piece.slot]:
            raise ValueError(f"slot {piece.slot} is occupied")
        length = piece.length
        if piece.prompt.dim() != 1 or length < 1 or piece.prompt.numel() != length:
            raise ValueError(f"slot {piece.slot}: prompt must be a non-empty 1-D tensor of its length")
        if length + 1 > self.max_context:
            raise ValueError(f"slot {piece.slot}: prompt of {length} tokens + 1 exceeds "
                             f"max_context {self.max_context}")
        if not 0 <= piece.start < piece.stop <= length:
            raise ValueError(f"slot {piece.slot}: piece [{piece.start}, {piece.stop}) of a {length}-token "
                             "prompt must be non-empty and inside it")

    def admit(self, slot: int, prompt: torch.Tensor) -> int:
        """Admit a whole prompt into a free slot in chunks, each riding on a step that decodes
        the occupied slots; its first greedy token. For checks and priming, not windows."""
        first, length, start = None, prompt.numel(), 0
        while start < length:
            stop = min(length, start + self.step_chunk())
            first = self.step(Piece(slot, prompt, start, stop, length)).firsts.get(slot, first)
            start = stop
        return first

    def evict(self, slot: int) -> None:
        """Free the slot; its rows are left as they are (its lane's mask hides them)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1}")
        self._occupied[slot] = False
        self._length[slot] = 0

    def reset(self) -> None:
        """All slots free; the store (same addresses) and the compiled graphs are kept."""
        self._occupied = [False] * self.slots
        self._length = [0] * self.slots

    def prime(self, prompt: torch.Tensor, forced: torch.Tensor | None = None
              ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """Compile every bucket before a window: at each lane count a decode step and a step
        with a prompt piece (one that does not finish its prompt), then all slots free.
        (Batched steps run eagerly: nothing to compile.)

        Lane count b is reached with slot b-1 alone busy, so a slot below it is free for
        the piece (with one slot, the admission's own pieces ran at one lane).

        forced: 1-D teacher-forced tokens; with them priming is also the numerics gate's
        run (the compiles the windows need, nothing more): at each lane count the busy slot
        decodes each forced token, alone and then beside a piece, and every primed step runs
        its eager twin. Returned, per graph (lanes, piece tokens: 0 or the chunk), the
        logits of its real tokens, compiled and eager, [positions, vocab] each; lane count
        1's are slot 0's forced decode, position by position. The prompt and the forced
        tokens must then fit (slot_gate_fit); without forced the prompt is cut to fit."""
        gate = forced is not None
        steps = forced.numel() if gate else 1
        room = self.max_context - 1 - 2 * steps
        if gate and (forced.dim() != 1 or steps < 1 or not 1 <= prompt.numel() <= room):
            raise ValueError(f"a {prompt.numel()}-token prompt and {steps} forced tokens do not fit "
                             f"max_context {self.max_context} (slot_gate_fit)")
        prompt = prompt[: max(1, min(prompt.numel(), room))]
        probe = prompt[:2] if prompt.numel() >= 2 else torch.cat([prompt, prompt])
        feeds = [None] if not gate else [[int(t)] for t in forced]
        pairs: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

        def run(slot: int, piece: Piece | None = None, feed: list[int] | None = None) -> None:
            out = self.step(piece, forced=None if feed is None else {slot: feed[0]}, twin=gate)
            if gate and out.compiled and out.bucket:
                graph, compiled, eager = self.twin_logits
                pairs.setdefault(graph, []).append((compiled, eager))

        for bucket in decode_buckets(self.slots, self.growth):
            self.reset()
            slot = bucket - 1
            # Nothing is occupied while slot b-1's prompt goes in: one-lane steps.
            for start in range(0, prompt.numel(), self.chunk_at(1)):
                run(slot, Piece(slot, prompt, start, min(prompt.numel(), start + self.chunk_at(1)),
                                prompt.numel()))
            for feed in feeds:
                run(slot, None, feed)
            free = self.free()
            if free:
                for feed in feeds:
                    run(slot, Piece(free[0], probe, 0, 1, 2), feed)
        self.reset()
        self.twin_logits = None
        return {graph: (torch.cat([c for c, _ in got]), torch.cat([e for _, e in got]))
                for graph, got in pairs.items()}

    def time_steps(self, prompt: torch.Tensor, *, pieces: bool = False, repeats: int = 3) -> dict[int, float]:
        """Per lane count, the median of `repeats` steps (seconds), after one untimed step
        (a decode graph not yet compiled compiles in it): decode steps, or with `pieces` a
        decode step with a primed piece of the lanes' chunk (after prime). The lane count is
        reached with slot b-1 busy, its prompt put in by eager steps; all slots free
        after. The SLO rule's decode times and the check of its estimate."""
        room = self.max_context - 2 - (repeats + 1)
        prompt = prompt[: max(1, min(prompt.numel(), room))]
        probe = prompt[:2] if prompt.numel() >= 2 else torch.cat([prompt, prompt])
        out = {}
        for lanes in decode_buckets(self.slots, self.growth):
            self.reset()
            slot = lanes - 1
            # The prompt goes in by eager steps of at most the batched budget (a workload's
            # longest prompt can be longer than one step takes).
            for start in range(0, prompt.numel(), self.batched_tokens):
                stop = min(prompt.numel(), start + self.batched_tokens)
                self.step(Piece(slot, prompt, start, stop, prompt.numel()), eager=True)
            free = self.free()
            if pieces and not free:
                continue
            times = []
            for _ in range(repeats + 1):
                piece = Piece(free[0], probe, 0, 1, 2) if pieces else None
                started = time.perf_counter()
                self.step(piece)
                times.append(time.perf_counter() - started)
            times = sorted(times[1:])
            out[lanes] = times[len(times) // 2]
        self.reset()
        return out

    def release(self) -> None:
        """Drop the store and every compiled graph (like DecodeEngine.release)."""
        self.reset()
        self.last_logits = {}
        self.engine.release()


def slot_gate_fit(prompt_tokens: int, steps: int, max_context: int) -> tuple[int, int]:
    """The (prompt tokens, forced steps) of a slot gate within `max_context` (pure): the
    gate's slot decodes `steps` tokens alone and `steps` beside a piece after its prompt,
    and keeps one position spare; steps shrink only when a 1-token prompt does not fit."""
    steps = max(0, min(steps, (max_context - 2) // 2))
    return max(1, min(prompt_tokens, max_context - 1 - 2 * steps)), steps


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
