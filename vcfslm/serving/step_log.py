"""The serving steps a window ran, by what they carried: the in-process engine's own step
timings, kept in the window's record (`ServeRecord.step_costs`) so the serving simulator
can be checked and calibrated against the steps a server really took, not only against the
static cells (vcfslm/sim/calibrate.py reads them back).

A step is grouped by its decode lanes and the prompt tokens beside them; each group keeps,
summed over its steps: the count, the seconds, the context tokens its decoding streams
attended over, its pieces' causal attention (in token pairs: a piece [a, b) attends
b(b+1) - a(a+1) of them, as `roofline.prefill_attention_flops` counts) and how many of its
pieces were a prompt's last (each adds the first token's lm_head row). A window of a few
thousand steps is a few dozen groups.
"""

from __future__ import annotations

from dataclasses import dataclass

# The sums one group keeps, in the order the record holds them.
FIELDS = ("steps", "seconds", "context_tokens", "attention_pairs", "last_pieces")


@dataclass(frozen=True)
class StepGroup:
    """Steps at `lanes` decode lanes beside `prompt_tokens` prompt tokens."""

    lanes: int
    prompt_tokens: int
    steps: int
    seconds: float
    context_tokens: int
    attention_pairs: int = 0
    last_pieces: int = 0

    @property
    def mean_s(self) -> float:
        return self.seconds / self.steps

    @property
    def mean_context(self) -> float:
        return self.context_tokens / self.steps

    @property
    def mean_attention_pairs(self) -> float:
        return self.attention_pairs / self.steps

    @property
    def mean_last_pieces(self) -> float:
        return self.last_pieces / self.steps


def attention_pairs(start: int, stop: int) -> int:
    """The causal attention of a prompt piece [start, stop), in token pairs."""
    return stop * (stop + 1) - start * (start + 1)


def key(lanes: int, prompt_tokens: int) -> str:
    return f"{lanes}+{prompt_tokens}"


class StepLog:
    """Sums of a window's steps, by (lanes, prompt tokens)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, int], list[float]] = {}

    def add(self, lanes: int, pieces: list[tuple[int, int, bool]], context_tokens: int, seconds: float) -> None:
        """One step: its decode lanes, its pieces as (start, stop, last), the context tokens of
        its decoding streams and its seconds."""
        prompt = sum(stop - start for start, stop, _ in pieces)
        g = self._groups.setdefault((int(lanes), prompt), [0, 0.0, 0, 0, 0])
        g[0] += 1
        g[1] += seconds
        g[2] += int(context_tokens)
        g[3] += sum(attention_pairs(start, stop) for start, stop, _ in pieces)
        g[4] += sum(1 for *_, last in pieces if last)

    def to_json(self) -> dict[str, list[float]]:
        return {key(lanes, prompt): [g[0], round(g[1], 6), *g[2:]]
                for (lanes, prompt), g in sorted(self._groups.items())}


def groups_of(step_costs: dict) -> list[StepGroup]:
    """The groups a record's `step_costs` holds (ValueError on a malformed entry)."""
    out = []
    for text, sums in (step_costs or {}).items():
        lanes, sep, prompt = str(text).partition("+")
        if not sep or not lanes.isdigit() or not prompt.isdigit():
            raise ValueError(f"step_costs key {text!r} is not '<lanes>+<prompt tokens>'")
        if not isinstance(sums, list | tuple) or len(sums) != len(FIELDS):
            raise ValueError(f"step_costs[{text!r}] must be [{', '.join(FIELDS)}]")
        steps, seconds, context, pairs, lasts = sums
        if int(steps) < 1 or min(float(seconds), int(context), int(pairs), int(lasts)) < 0:
            raise ValueError(f"step_costs[{text!r}] = {sums}: counts and seconds must be positive")
        out.append(StepGroup(int(lanes), int(prompt), int(steps), float(seconds), int(context), int(pairs), int(lasts)))
    return out
