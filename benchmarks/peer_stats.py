"""Medians with 95 % intervals, and ratios of medians with theirs, by bootstrap over rounds.

A round is one child process per engine (load, warm-up, windows), so rounds are the
independent samples: windows inside one round share a load, a page layout and a
machine state. A bootstrap draw resamples rounds with replacement, pools the drawn
rounds' windows and takes their median. A ratio's draw resamples each engine's rounds
on its own. Pure functions, standard library only; the seed makes every interval
reproducible from the same samples.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

DRAWS = 2000
SEED = 20261202


@dataclass(frozen=True)
class Interval:
    median: float
    low: float
    high: float

    def spans(self, value: float) -> bool:
        return self.low <= value <= self.high


def _pooled_median(rounds: Sequence[Sequence[float]]) -> float:
    return statistics.median([x for r in rounds for x in r])


def _draws(rounds: Sequence[Sequence[float]], rng: random.Random, draws: int) -> list[float]:
    return [_pooled_median([rng.choice(rounds) for _ in rounds]) for _ in range(draws)]


def _percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[int(0.025 * (len(ordered) - 1))], ordered[int(0.975 * (len(ordered) - 1) + 0.5)]


def _check(rounds: Sequence[Sequence[float]]) -> None:
    if not rounds or any(not r for r in rounds):
        raise ValueError("every round needs at least one sample")


def median_interval(rounds: Sequence[Sequence[float]], draws: int = DRAWS, seed: int = SEED) -> Interval:
    """Median of every sample, with the 2.5-97.5 percentiles of the bootstrap over rounds."""
    _check(rounds)
    low, high = _percentiles(_draws(rounds, random.Random(seed), draws))
    return Interval(_pooled_median(rounds), low, high)


def ratio_interval(numerator: Sequence[Sequence[float]], denominator: Sequence[Sequence[float]],
                   draws: int = DRAWS, seed: int = SEED) -> Interval:
    """median(numerator) / median(denominator), each side's rounds resampled on its own."""
    _check(numerator)
    _check(denominator)
    rng = random.Random(seed)
    ratios = [a / b for a, b in zip(_draws(numerator, rng, draws), _draws(denominator, rng, draws), strict=True)]
    low, high = _percentiles(ratios)
    return Interval(_pooled_median(numerator) / _pooled_median(denominator), low, high)


def ratio_text(ratio: Interval, lower_is_faster: bool = True) -> str:
    """`0.84 (0.80-0.88) vcfslm faster`, or `even` when the interval spans 1."""
    span = f"{ratio.median:.2f} ({ratio.low:.2f}-{ratio.high:.2f})"
    if ratio.spans(1.0):
        return f"{span} even"
    faster = (ratio.median < 1) == lower_is_faster
    return f"{span} {'vcfslm faster' if faster else 'peer faster'}"
