"""The serving step's cost by the rank's own numbers, and the chunk a step's prompt piece
may take (pure, no torch): the FLOP balance and the measured decode-linears curve
(`chunk_for_probes`), the time of a step's linears at a row count (`linears_s`), a step's
time (`StepCost`) and the SLO rule's chunk under a TPOT limit (Sarathi-Serve's token
budget), and the lane counts a serving step runs at (`decode_buckets`).

The engine's slots (`vcfslm.engine.slots`) and the serving rank read these; so does anything
that simulates a rank without running one."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The chunk when no probe says better: a prompt piece this long costs a few decode steps'
# FLOPs on the CPUs measured (AMX: about the floor; AVX2: a few floors).
DEFAULT_CHUNK_TOKENS = 64
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 16, 512


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
