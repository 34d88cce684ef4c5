"""benchmarks/predict_brief.py's pure parts: the figure table and the within-one-load check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import predict_brief as B  # noqa: E402


def test_a_threshold_within_one_tested_load():
    assert B.within_one_load(16, "crossover", 16)
    assert B.within_one_load(32, "crossover", 16) and B.within_one_load(4, "crossover", 16)
    assert not B.within_one_load(64, "all", 16)                 # two loads above
    assert B.within_one_load(64, "all", 64) and B.within_one_load(32, "crossover", 64)
    assert B.within_one_load(None, "none", 4)                   # below the lowest: one step under 4
    assert not B.within_one_load(None, "none", 16)
    assert B.load_index(24, "crossover") == 1.5                 # between tested loads


def test_threshold_text():
    assert B.threshold_text(64, "all") == ">= 64"
    assert B.threshold_text(None, "none") == "< 4"
    assert B.threshold_text(32, "crossover") == "32"


def test_figure_rows_compare_each_published_figure_with_its_cell():
    figures = (B.Figure("tpot", 1, 128, "TPOT", 100.0), B.Figure("user", 1, 128, "tok/s/user", 10.0),
               B.Figure("ttft", 16, 1024, "TTFT", 20.0), B.Figure("missing", 8, 128, "TPOT", 1.0))
    cells = {(1, 128): {"TPOT": 110.0, "TTFT": 0.3, "tok/s": 9.0}, (16, 1024): {"TPOT": 300.0, "TTFT": 30.0}}
    rows = B.figure_rows(figures, cells)
    assert rows[0] == ["tpot", "110.0", "100.0", "+10.0%", "yes"]
    assert rows[1] == ["user", "9.09", "10.0", "-9.1%", "yes"]       # 1000 / 110 ms
    assert rows[2] == ["ttft", "30.0", "20.0", "+50.0%", "NO"]
    assert rows[3][1] == "–" and rows[3][-1] == "not predicted"


def test_threshold_rows():
    published = (B.PublishedThreshold("B", 128, 64), B.PublishedThreshold("A", 128, 16))
    rows = B.threshold_rows(published, {("B", 128): (64, "all", None), ("A", 128): (64, "all", None)})
    assert rows[0] == ["SLO-B", "128", ">= 64", "64", "yes", "–"]
    assert rows[1] == ["SLO-A", "128", ">= 64", "16", "NO", "–"]


def test_relative_error_and_targets():
    assert B.relative_error(84.2, 116.5) == pytest.approx(-0.2773, abs=1e-4)
    assert B.within_target("TPOT", -0.14) and not B.within_target("TPOT", 0.16)
    assert B.within_target("TTFT", 0.24) and B.within_target("tok/s/user", 0.1)
