"""Process identity and stopping: only what the lab recorded, recognised by start time and marker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from vcfslm.lab import process


def test_parse_stat_copes_with_spaces_and_parentheses_in_the_name():
    fields = " ".join(["S", "42"] + ["0"] * 17 + ["123456"] + ["0"] * 10)
    assert process.parse_stat(f"77 (we ird) (name)) {fields}") == ("S", 42, 123456)
    assert process.parse_stat("garbage") is None


def test_record_round_trips_through_json():
    rec = process.ProcessRecord(12, 34, "/lab/ready.json")
    assert process.ProcessRecord.from_json(rec.to_json()) == rec


def _sleeper(tmp_path: Path, marker: str) -> subprocess.Popen:
    script = f"import time  # {marker}\ntime.sleep(60)\n"
    return process.start_detached([sys.executable, "-c", script], tmp_path / "log")


def test_is_alive_needs_pid_start_time_and_marker(tmp_path: Path):
    proc = _sleeper(tmp_path, "lab-marker-1")
    try:
        deadline = time.monotonic() + 5
        while "lab-marker-1" not in " ".join(process.read_cmdline(proc.pid)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rec = process.record(proc.pid, "lab-marker-1")
        assert process.is_alive(rec)
        assert not process.is_alive(process.ProcessRecord(proc.pid, rec.start_time, "other-marker"))
        assert not process.is_alive(process.ProcessRecord(proc.pid, rec.start_time + 1, "lab-marker-1"))
    finally:
        proc.kill()
        proc.wait()
    assert not process.is_alive(rec)


def test_terminate_stops_the_process_and_its_children_only(tmp_path: Path):
    # A parent that spawns a child; a bystander that must survive.
    parent = process.start_detached(
        ["bash", "-c", "sleep 60 & wait"], tmp_path / "parent.log")
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while not process.descendants(parent.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child = process.descendants(parent.pid)[0]
        child_rec = process.record(child, "sleep")
        rec = process.record(parent.pid, "sleep 60 & wait")
        stopped = process.terminate([rec], timeout=5)
        assert stopped == [rec]
        assert not process.is_alive(rec)
        assert not process.is_alive(child_rec)
        assert bystander.poll() is None
        assert process.terminate([rec]) == []  # already gone: nothing to do
    finally:
        bystander.kill()
        bystander.wait()
        parent.kill()
        parent.wait()


def test_start_detached_runs_in_its_own_session(tmp_path: Path):
    import os

    proc = process.start_detached(["sleep", "30"], tmp_path / "log")
    try:
        assert os.getsid(proc.pid) == proc.pid
    finally:
        proc.kill()
        proc.wait()
