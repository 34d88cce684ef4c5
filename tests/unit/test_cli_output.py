"""The commands' output off a terminal, asserted on whole lines: a long path or a narrow
$COLUMNS must never break a line or cut a figure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vcfslm.cli import main

LAB_INVENTORY = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"


@pytest.fixture
def long_inventory(tmp_path) -> Path:
    """The lab inventory at a path longer than any terminal line."""
    folder = tmp_path.joinpath(*["a-long-folder-name-for-the-inventory"] * 4)
    folder.mkdir(parents=True)
    return Path(shutil.copy(LAB_INVENTORY, folder / "cluster.yaml"))


@pytest.mark.parametrize("columns", ["40", "200", None])
def test_validate_lines_are_whole(long_inventory, columns):
    env = {"COLUMNS": columns} if columns else {}
    result = CliRunner().invoke(main, ["validate", str(long_inventory)], env=env)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"valid {long_inventory}: cluster lab, 4 VM(s), vCenter 127.0.0.1:8989" in lines
    assert "| slm-01 | DC0_C0_H0 | 127.0.0.11    | 127.0.1.11 |" in lines
    assert any(line.startswith("bench: model synthetic:tiny, batch/rank [1, 2] (= [2, 4] streams/VM)")
               and line.endswith("4 scenarios") for line in lines)
    assert "…" not in result.output


def test_validate_json_is_machine_checked(long_inventory):
    result = CliRunner().invoke(main, ["validate", str(long_inventory), "--output", "json"],
                                env={"COLUMNS": "40"})
    data = json.loads(result.output)
    assert data["valid"] and data["inventory"] == str(long_inventory)
    assert data["vcenter"] == "127.0.0.1:8989"


def test_validate_through_a_pipe(long_inventory):
    # as `vcfslm validate ... | cat`: stdout a pipe, whatever stderr is
    done = subprocess.run([sys.executable, "-m", "vcfslm.cli", "validate", str(long_inventory)],
                          stdout=subprocess.PIPE, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "40"})
    assert done.returncode == 0
    assert "vCenter 127.0.0.1:8989" in done.stdout.splitlines()[0]
    assert done.stdout.splitlines()[0].startswith(f"valid {long_inventory}: cluster lab")


def test_lab_status_without_a_lab_names_the_folder_on_one_line(tmp_path):
    folder = tmp_path.joinpath(*["a-long-folder-name-for-the-lab"] * 4)
    result = CliRunner().invoke(main, ["lab", "status", "--dir", str(folder)], env={"COLUMNS": "40"})
    assert result.exit_code == 0
    assert result.output.splitlines() == [f"no lab in {folder} (start one with: vcfslm lab up)"]
    as_json = CliRunner().invoke(main, ["lab", "status", "--dir", str(folder), "-o", "json"])
    assert json.loads(as_json.output) == {"dir": str(folder), "services": []}


def test_an_error_is_one_line_on_stderr(tmp_path):
    missing = tmp_path.joinpath(*["a-long-folder-name"] * 6, "missing.yaml")
    result = CliRunner().invoke(main, ["validate", str(missing)], env={"COLUMNS": "40"})
    assert result.exit_code == 2
    assert str(missing) in result.output.splitlines()[0]
