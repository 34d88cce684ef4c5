"""benchmarks/gemv_rows.py's PLAN line: whether the engine's kernel plan takes the faster
kernel at each measured row count (the check of gemv.rows_for's split on any CPU)."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmark_modules import BENCHMARKS, import_benchmark


def verdict(*args, **kwargs) -> str:
    return import_benchmark("gemv_rows").plan_verdict(*args, **kwargs)


def test_a_plan_on_the_faster_kernel_everywhere_passes():
    # beside AMX: the loop wins at 1-6 rows, oneDNN's tile kernel from 7
    line = verdict([(1, 0.7), (6, 0.98), (7, 1.8), (32, 4.0)], 6, "oneDNN")
    assert line == ("PLAN the plan runs vcfslm's GEMV at 1-6 rows, oneDNN beyond: the faster kernel, "
                    "within 5%, at every row count measured")


def test_each_wrong_choice_is_named_with_what_it_costs():
    line = verdict([(4, 1.25), (6, 1.02), (7, 0.5), (8, 0.97)], 6, "oneDNN")
    assert line == ("PLAN the plan runs vcfslm's GEMV at 1-6 rows, oneDNN beyond: the slower kernel at "
                    "4 rows (oneDNN takes 0.80 of vcfslm's time); 7 rows (vcfslm takes 0.50 of oneDNN's time)")


def test_a_plan_without_the_loop_and_one_with_it_at_every_row_count():
    assert verdict([(1, 0.6)], 0, "ATen").startswith(
        "PLAN the plan runs ATen at every row count (vcfslm's GEMV does not run here): the slower kernel at 1 row (vcfslm takes 0.60")
    assert verdict([(1, 0.6), (32, 0.7)], 32, "ATen").startswith(
        "PLAN the plan runs vcfslm's GEMV at 1-32 rows: the faster kernel")


def test_the_dense_table_names_the_kernel_the_plan_runs_per_row_count():
    # the dense-bf16 plan's AVX2 loop runs on every CPU seen here (the GEMV build is part of make test)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gemv_rows.py"), "--dense", "--layers", "1",
                          "--rows", "1,32", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "| rows | ATen TFLOP/s | vcfslm TFLOP/s | vcfslm GB/s | vcfslm / ATen time | plan runs |" in lines
    rows = [line for line in lines if line.startswith(("| 1 |", "| 32 |"))]
    assert len(rows) == 2 and all(row.endswith("| vcfslm |") for row in rows), lines
    assert lines[-1].startswith("PLAN the plan runs vcfslm's GEMV at 1-32 rows: the "), lines
