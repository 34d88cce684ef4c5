"""A serving step's time from the fitted performance model (pure).

The fit `vcfslm predict` makes (analysis/perfmodel.py) has two parts: the decode step at a
batch and mean context, and the prefill of a prompt. A serving step is both at once: the
running streams' decode lanes and prompt pieces beside them. Its time here is

    step = c_w x linears(lanes) + overhead_d + c_kv x KV bytes of the streams' contexts / bandwidth
           + sum over pieces: c_p x piece linear FLOPs / GEMM rate + c_pa x piece attention FLOPs / GEMM rate

and a step with no stream decoding pays the prefill's own fixed part instead of the decode
lanes (c_w x weights / bandwidth + overhead_p), so a lone prompt costs the TTFT the fit
predicts and a step without pieces the TPOT it predicts. A piece's attention is its share
of the prompt's causal attention (the FLOPs from its offset to its end), and the lm_head
row of a prompt's first token goes with its last piece.

Every part is linear in the tokens, so a run of plain decode steps (the same lanes, every
stream one token longer each step) sums in closed form, and so does a run of equal prompt
pieces beside them: `LinearRun`.

`scaled` gives the ends of the fit's prediction interval: every decode term scaled by the
decode fit's relative half-width, every prefill term by the prefill fit's, as the static
prediction's interval ends are (analysis/predict.py's optimistic and pessimistic cells).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..analysis.perfmodel import PerfModel, RankRates, Scenario, terms
from ..roofline import ModelDims, prefill_attention_flops, prefill_linear_flops


@dataclass(frozen=True)
class StepModel:
    """One rank's serving step costs (seconds), read off a fitted model at the rank's rates."""

    lane_s: tuple[float, ...]       # index b: c_w x linears(b) + decode overhead (b >= 1; [0] unused)
    kv_token_s: float               # per token of context a decoding stream attends over
    prompt_token_s: float           # per prompt token through the linears
    prompt_head_s: float            # a prompt's lm_head row (on its last piece)
    attention_s: float              # per unit of prefill_attention_flops / its FLOPs at batch 1, 1 token
    idle_lane_s: float              # a step without decoding streams: weights read + prefill overhead
    dims: ModelDims
    max_lanes: int
    attention_pair: float = 0.0     # prefill_attention_flops(T) = attention_pair x T x (T + 1)
    # A step with no stream decoding (a prompt going in alone) runs its pieces at this multiple
    # of `piece_s`: 1 from a fit, another from a calibration on measured steps (a whole
    # 128-token prompt goes through the linears at another rate than a chunk beside decodes).
    idle_piece_scale: float = 1.0

    def lanes_s(self, lanes: int) -> float:
        if lanes <= 0:
            return self.idle_lane_s
        if lanes < len(self.lane_s):
            return self.lane_s[lanes]
        # Past the table: the last lane's cost grown linearly (never cheaper per lane).
        last = len(self.lane_s) - 1
        slope = self.lane_s[last] - self.lane_s[last - 1] if last >= 2 else 0.0
        return self.lane_s[last] + max(slope, 0.0) * (lanes - last)

    def piece_s(self, start: int, stop: int, length: int, padded: int = 0) -> float:
        """A prompt piece [start, stop) of a `length`-token prompt; `padded`: the tokens the
        step runs it at (a primed graph pads a short piece to its chunk)."""
        tokens = max(stop - start, padded)
        attention = self.attention_pair * (stop * (stop + 1) - start * (start + 1))
        head = self.prompt_head_s if stop >= length else 0.0
        return tokens * self.prompt_token_s + attention * self.attention_s + head

    def decode_s(self, lanes: int, context_tokens: int) -> float:
        """One step of plain decode at `lanes` lanes over `context_tokens` of KV in all."""
        return self.lanes_s(lanes) + context_tokens * self.kv_token_s


def step_model(model: PerfModel, dims: ModelDims, rates: RankRates, max_lanes: int,
               decode_scale: float = 1.0, prefill_scale: float = 1.0) -> StepModel:
    """The step costs of a rank with `rates` running `dims`, from the fitted `model`."""
    c_w, c_kv, ovh_d = model.decode.coef
    c_p, c_pa, ovh_p = model.prefill.coef
    bw, rate = rates.read_gbs * 1e9, rates.gemm_tflops * 1e12
    lane_s = [0.0]
    for b in range(1, max_lanes + 1):
        x = terms(dims, rates, Scenario(b, 1, 2))
        lane_s.append((c_w * x.linears_s + ovh_d) * decode_scale)
    per_token = prefill_linear_flops(dims, 1, 2) - prefill_linear_flops(dims, 1, 1)
    head = prefill_linear_flops(dims, 1, 1) - per_token
    unit_attention = 1.0 / rate
    weights_s = dims.step_weight_bytes / bw
    return StepModel(
        lane_s=tuple(lane_s), kv_token_s=c_kv * dims.kv_bytes_per_token / bw * decode_scale,
        prompt_token_s=c_p * per_token / rate * prefill_scale, prompt_head_s=c_p * head / rate * prefill_scale,
        attention_s=c_pa * unit_attention * prefill_scale,
        idle_lane_s=(c_w * weights_s * decode_scale + ovh_p * prefill_scale), dims=dims, max_lanes=max_lanes,
        attention_pair=prefill_attention_flops(dims, 1, 1) / 2.0)


def relative_half_widths(model: PerfModel, dims: ModelDims, rates: RankRates, batch: int,
                         input_tokens: int, output_tokens: int) -> tuple[float | None, float | None]:
    """The fit's 95 % relative half-widths of the decode step and the prefill at one scenario
    (the serving load's slots and prompt): what `scaled` moves the step costs by."""
    x = terms(dims, rates, Scenario(batch, input_tokens, output_tokens))
    step = model.decode.value(x.decode)
    hw_d = model.decode.half_width(x.decode)
    offset = x.weights_s * model.inv_eta_w
    ttft = model.prefill.value(x.prefill) + offset
    hw_p = model.prefill.half_width(x.prefill, offset)
    return (hw_d / step if hw_d is not None and step > 0 else None,
            hw_p / ttft if hw_p is not None and ttft > 0 else None)


def scaled(model: PerfModel, dims: ModelDims, rates: RankRates, max_lanes: int, decode_rel: float | None,
           prefill_rel: float | None, end: str) -> StepModel | None:
    """The step model at one end of the interval ("optimistic": every cost at its lower
    bound, "pessimistic": at its upper); None when an interval is unknown."""
    if decode_rel is None or prefill_rel is None:
        return None
    sign = -1.0 if end == "optimistic" else 1.0
    return step_model(model, dims, rates, max_lanes, max(1.0 + sign * decode_rel, 0.05),
                      max(1.0 + sign * prefill_rel, 0.05))


@dataclass(frozen=True)
class LinearRun:
    """Steps whose time grows by the same amount each step: step k (from 0) takes
    first + slope x k. A run of plain decode steps is one (every stream's context one token
    longer per step), and so is a run of equal prompt pieces beside them (a piece's causal
    attention grows linearly with its offset)."""

    first: float
    slope: float

    def elapsed(self, n: int) -> float:
        """The time n steps take."""
        return n * self.first + self.slope * n * (n - 1) / 2.0

    def steps_within(self, budget: float) -> int:
        """The most steps whose total time is at most `budget`."""
        if budget < self.first:
            return 0
        if math.isinf(budget):
            return 1 << 40
        q = self.slope / 2.0
        lin = self.first - q
        if q <= 0:
            n = int(budget / lin) if lin > 0 else 1 << 40
        else:
            n = int((-lin + math.sqrt(lin * lin + 4 * q * budget)) / (2 * q))
        while n > 0 and self.elapsed(n) > budget:
            n -= 1
        while self.elapsed(n + 1) <= budget:
            n += 1
        return n

    def steps_to_reach(self, at_least: float) -> int:
        """The fewest steps (>= 1) whose total time is at least `at_least`."""
        if at_least <= 0:
            return 1
        n = self.steps_within(at_least)
        return n if n >= 1 and self.elapsed(n) >= at_least else n + 1


def with_overhead(m: StepModel, seconds: float) -> StepModel:
    """The same steps with `seconds` more per step (a server's own per-step cost beside the engine's)."""
    return replace(m, lane_s=tuple(v + seconds if i else 0.0 for i, v in enumerate(m.lane_s)),
                   idle_lane_s=m.idle_lane_s + seconds)
