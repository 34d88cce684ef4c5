"""benchmarks/step_call_path.py's turns and tables: each path prepared right before it runs,
the order flipping every turn, only the run timed, and each row judged turn by turn."""

from __future__ import annotations

import time

import pytest

from tests.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("step_call_path")


def test_each_path_is_prepared_right_before_it_runs_and_the_order_flips_every_turn(bench):
    calls = []

    def path(name, prepare_s=0.0):
        def prepare():
            calls.append(("prepare", name))
            time.sleep(prepare_s)

        return prepare, lambda: calls.append(("run", name))

    times = bench.turns({"a": path("a", prepare_s=0.05), "b": path("b")}, steps=3)
    runs = [name for what, name in calls if what == "run"]
    assert runs == ["a", "b", "b", "a", "a", "b"]
    assert all(calls[i] == ("prepare", calls[i + 1][1]) for i in range(0, len(calls), 2))
    # The 50 ms prepare is outside the timed run.
    assert len(times["a"]) == len(times["b"]) == 3 and max(times["a"]) < 0.05


def test_a_row_is_the_median_of_its_per_turn_ratios_with_their_quartiles(bench):
    # Turn by turn b runs at 2x, 2x, 2x, 4x a: its median time is 2 x 0.1 s, its ratio 2.
    times = {"a": [0.1, 0.2, 0.1, 0.1], "b": [0.2, 0.4, 0.2, 0.4]}
    lines = bench.table(times, "a", {"a": 1.0, "b": 12.34})
    assert lines[0] == "| path | median ms | / a (interquartile range) | first call s (its compile) |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| a | 100.00 | 1.000 (1.000-1.000) | 1.0 |"
    assert lines[3] == "| b | 300.00 | 2.000 (2.000-3.500) | 12.3 |"
    plain = bench.table(times, "b")
    assert plain[0] == "| path | median ms | / b (interquartile range) |"
    assert plain[1] == "|---|---|---|"
    assert plain[2].startswith("| a | 100.00 | 0.500 ")
