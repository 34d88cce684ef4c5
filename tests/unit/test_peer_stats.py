"""benchmarks/peer_stats.py: medians and ratios with bootstrap intervals over rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from peer_stats import Interval, median_interval, ratio_interval, ratio_text  # noqa: E402


def test_the_median_pools_every_window_and_its_interval_brackets_it():
    rounds = [[10.0, 11.0], [12.0, 13.0], [11.5, 10.5], [12.5, 9.5], [11.0, 12.0]]
    got = median_interval(rounds)
    assert got.median == 11.25
    assert 9.5 <= got.low <= got.median <= got.high <= 13.0
    assert median_interval(rounds) == got, "the seed makes the interval reproducible"


def test_one_round_repeated_has_no_spread():
    assert median_interval([[5.0, 7.0]] * 5) == Interval(6.0, 6.0, 6.0)


def test_separated_engines_are_ranked_and_the_direction_is_named():
    fast = [[100.0 + i] for i in range(5)]
    slow = [[200.0 + 2 * i] for i in range(5)]
    ratio = ratio_interval(fast, slow)
    assert ratio.median == pytest.approx(102 / 204)
    assert ratio.high < 1
    assert ratio_text(ratio).endswith("vcfslm faster")
    assert ratio_text(ratio_interval(slow, fast)).endswith("peer faster")


def test_overlapping_engines_are_even():
    a = [[100.0], [120.0], [90.0], [115.0], [105.0]]
    b = [[110.0], [95.0], [118.0], [100.0], [108.0]]
    ratio = ratio_interval(a, b)
    assert ratio.spans(1.0)
    assert ratio_text(ratio).endswith(" even")
    assert ratio_text(ratio).startswith(f"{ratio.median:.2f} ({ratio.low:.2f}-{ratio.high:.2f})")


def test_a_round_without_samples_is_refused():
    with pytest.raises(ValueError):
        median_interval([[1.0], []])
    with pytest.raises(ValueError):
        ratio_interval([[1.0]], [])
