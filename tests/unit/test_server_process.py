"""A server process started for a rank: stopped by its group, and gone when its rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vcfslm.errors import BenchError
from vcfslm.serve import server_process


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "server.sh"
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_stop_ends_the_server_and_what_it_started(tmp_path):
    # The "server" starts a child of its own, as vLLM starts its engine.
    proc = server_process.start(script(tmp_path, "sleep 300 &\necho child $!\nexec sleep 300"), [],
                                env={"X": "1"}, log_path=tmp_path / "log", label="fake")
    deadline = time.monotonic() + 5
    while "child" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "log").read_text().split()[1])
    assert alive(proc.pid) and alive(child)
    proc.stop(grace_s=5)
    assert wait_gone(proc.pid) and wait_gone(child)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    proc = server_process.start(script(tmp_path, "echo loading; echo bad config >&2; exit 7"), [],
                                env={}, log_path=tmp_path / "log", label="fake on node 0")
    with pytest.raises(BenchError) as err:
        proc.wait_healthy(lambda: False, timeout_s=30, sleep=lambda s: time.sleep(0.05))
    assert "exited with code 7" in str(err.value) and "bad config" in str(err.value)


def test_a_server_that_never_gets_healthy_is_stopped_at_the_timeout(tmp_path):
    proc = server_process.start(script(tmp_path, "exec sleep 300"), [], env={}, log_path=tmp_path / "log",
                                label="slow")
    with pytest.raises(BenchError, match="not healthy 0.3 s after launch"):
        proc.wait_healthy(lambda: False, timeout_s=0.3, sleep=lambda s: time.sleep(0.05))
    assert wait_gone(proc.pid)


def test_the_server_dies_with_its_rank_however_the_rank_dies(tmp_path):
    body = script(tmp_path, "exec sleep 300")
    rank = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from vcfslm.serve import server_process as s; "
        f"p = s.start({body!r}, [], env={{}}, log_path=Path({str(tmp_path / 'log')!r}), label='x'); "
        "print(p.pid, flush=True); time.sleep(300)")], stdout=subprocess.PIPE, text=True)
    pid = int(rank.stdout.readline())
    assert alive(pid)
    os.kill(rank.pid, signal.SIGKILL)             # no finally, no atexit: only the kernel can tell
    rank.wait()
    assert wait_gone(pid)
