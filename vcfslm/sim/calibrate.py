"""The step model checked against the steps a server really took, and scaled to them (pure).

The static fit (`predict`) sees whole windows of one batch: a decode step, a whole prompt.
A serving step is the scheduler's: decode lanes beside a prompt piece, a Python loop around
it, a lane bucket over the highest busy slot. Serving runs keep their steps by what they
carried (`ServeRecord.step_costs`, serving/step_log.py); this module compares each group's
measured mean with what `StepModel` says the same step costs, and returns three ratios,
each the steps' measured seconds over the modelled ones:

- `decode`: plain decode steps (lanes >= 1, no prompt tokens), what every TPOT is made of;
- `piece`: the prompt piece's part of a step beside decodes (what a step with a piece costs
  beyond the same step without one): what a running stream pays for an arrival;
- `idle`: a step with nothing decoding (lanes 0: a prompt going in alone), its own part
  and its pieces: the TTFT of a lone request. A whole prompt goes through the linears at
  another rate than a chunk of a few tokens beside decodes, so the two have ratios of
  their own.

The ratios multiply the step model's matching terms (`apply`). Ratios, not added seconds,
so a calibration made on the measured machine carries to a platform whose step costs are
the fit's transfer: what it says is "this server's serving steps cost x times what the
static fit gives", a property of the engine and its loop, not of one CPU's clock.

A ratio with no steps behind it stays 1 (nothing measured: the static fit stands).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..serving.step_log import StepGroup, groups_of
from .cost import StepModel


@dataclass(frozen=True)
class Calibration:
    """Measured over modelled seconds per kind of step, and the steps each rests on."""

    decode: float = 1.0
    piece: float = 1.0
    idle: float = 1.0
    decode_steps: int = 0
    piece_steps: int = 0
    idle_steps: int = 0

    @property
    def steps(self) -> int:
        return self.decode_steps + self.piece_steps + self.idle_steps

    def statement(self) -> str:
        parts = [f"{name} steps x{ratio:.2f} ({n} steps)" for name, ratio, n in
                 (("decode", self.decode, self.decode_steps), ("piece", self.piece, self.piece_steps),
                  ("idle prompt", self.idle, self.idle_steps)) if n]
        return "calibrated on measured serving steps: " + ", ".join(parts) if parts else "no serving steps to calibrate on"

    def to_dict(self) -> dict[str, float | int]:
        return {"decode": self.decode, "piece": self.piece, "idle": self.idle, "decode_steps": self.decode_steps,
                "piece_steps": self.piece_steps, "idle_steps": self.idle_steps}


@dataclass(frozen=True)
class MeasuredSteps:
    """One window's step groups and the chunk each lane count's primed graph ran a piece at
    (a piece no longer than its chunk runs padded to it)."""

    groups: tuple[StepGroup, ...]
    chunks: Mapping[int, int]

    def padded(self, lanes: int, tokens: int) -> int:
        # A step with nothing decoding runs at one lane's graph (engine/slots.py).
        chunk = self.chunks.get(lanes or 1, 0)
        return chunk if 0 < tokens <= chunk else tokens


def _pieces_s(m: StepModel, g: StepGroup, padded: int) -> float:
    """What the model gives a group's mean step for its pieces: the linears at the tokens the
    step ran (`padded`), the pieces' causal attention and their last pieces' lm_head rows
    (`StepModel.piece_s`, term by term, on the group's means)."""
    return (padded * m.prompt_token_s + m.attention_pair * g.mean_attention_pairs * m.attention_s
            + g.mean_last_pieces * m.prompt_head_s)


def calibrate(windows: Iterable[tuple[StepModel, MeasuredSteps]]) -> Calibration:
    """The three ratios over every window's groups (each group weighted by its steps), each
    window against the step model of the machine and model it ran on."""
    sums = {"decode": [0.0, 0.0, 0], "piece": [0.0, 0.0, 0], "idle": [0.0, 0.0, 0]}
    windows = list(windows)
    for m, w in windows:
        for g in w.groups:
            if g.lanes >= 1 and g.prompt_tokens == 0:
                _add(sums["decode"], g, m.decode_s(g.lanes, round(g.mean_context)))
    decode = _ratio(sums["decode"])
    for m, w in windows:
        for g in w.groups:
            if g.lanes >= 1 and g.prompt_tokens > 0:
                # What the piece added: the step less the same lanes' decode, as calibrated.
                plain = m.decode_s(g.lanes, round(g.mean_context)) * decode
                _add(sums["piece"], g, _pieces_s(m, g, w.padded(g.lanes, g.prompt_tokens)), less=plain)
    for m, w in windows:
        for g in w.groups:
            if g.lanes == 0 and g.prompt_tokens > 0:
                _add(sums["idle"], g, m.idle_lane_s + _pieces_s(m, g, w.padded(0, g.prompt_tokens)))
    return Calibration(decode, _ratio(sums["piece"]), _ratio(sums["idle"]),
                       sums["decode"][2], sums["piece"][2], sums["idle"][2])


def _add(acc: list, g: StepGroup, modelled: float, less: float = 0.0) -> None:
    if modelled <= 0:
        return
    acc[0] += max(g.seconds - less * g.steps, 0.0)
    acc[1] += modelled * g.steps
    acc[2] += g.steps


def _ratio(acc: list) -> float:
    return acc[0] / acc[1] if acc[2] and acc[1] > 0 else 1.0


def apply(m: StepModel, c: Calibration) -> StepModel:
    """The step model with each kind of step scaled by its measured ratio: the decode lanes
    and their context by `decode`, every prompt piece beside decodes by `piece`, and a step
    without decodes, its own part and its pieces alike, by `idle`."""
    lane_s = tuple(v * c.decode if i else 0.0 for i, v in enumerate(m.lane_s))
    return replace(m, lane_s=lane_s, kv_token_s=m.kv_token_s * c.decode,
                   prompt_token_s=m.prompt_token_s * c.piece, prompt_head_s=m.prompt_head_s * c.piece,
                   attention_s=m.attention_s * c.piece, idle_lane_s=m.idle_lane_s * c.idle,
                   idle_piece_scale=m.idle_piece_scale * c.idle / c.piece)


def measured_steps(records: Sequence) -> list[MeasuredSteps]:
    """The windows of serving records (ServeRecord) that kept their steps (an HTTP server's
    and records written before steps were kept have none)."""
    out = []
    for r in records:
        groups = tuple(groups_of(r.step_costs or {}))
        if groups:
            out.append(MeasuredSteps(groups, {int(k): int(v) for k, v in (r.chunk_by_lanes or {}).items()}))
    return out
