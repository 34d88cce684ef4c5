"""templates/vllm-entry.py's supervision: vLLM runs in a child; when that child dies, by
SIGKILL too, nothing of its tree outlives it (orphans come back to the entry, a child
subreaper, which ends them), and a supervisor's SIGTERM reaches vLLM. Real processes:
a stand-in for vLLM's API process starts an 'engine' child and a daemonized grandchild."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "templates" / "vllm-entry.py"

API = r'''
import importlib.util, os, subprocess, sys, time
spec = importlib.util.spec_from_file_location("entry", sys.argv[1])
entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entry)
marker, ready = sys.argv[2], sys.argv[3]

def api():
    # The engine (a child) and a worker it leaves behind as an orphan (double fork).
    subprocess.Popen(["bash", "-c", f"exec -a {marker}-engine sleep 1000"])
    subprocess.Popen(["bash", "-c", f"(exec -a {marker}-worker sleep 1000) & exit 0"]).wait()
    with open(ready, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(1000)

sys.exit(entry.supervise(api))
'''


def tree_of(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith(marker):
                out.append(int(entry))
    return out


@contextlib.contextmanager
def started(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, str]]:
    """(the entry, its API child's pid, the tree's marker); on the way out, even when the start
    itself fails, the entry and whatever of its tree is left are SIGKILLed by pid."""
    marker = f"vcfslm-test-{uuid.uuid4().hex[:8]}"
    ready = tmp_path / "api.pid"
    proc = subprocess.Popen([sys.executable, "-c", API, str(ENTRY), marker, str(ready)])
    try:
        while not ready.exists() or not ready.read_text():
            assert proc.poll() is None, "the entry exited before its child was ready"
            time.sleep(0.05)
        assert len(tree_of(marker)) == 2
        yield proc, int(ready.read_text()), marker
    finally:
        proc.kill()
        for pid in tree_of(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_api_process_takes_its_whole_tree_with_it(tmp_path):
    with started(tmp_path) as (proc, api, marker):
        assert api != proc.pid
        os.kill(api, signal.SIGKILL)
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
        assert tree_of(marker) == []


def test_a_supervisors_sigterm_reaches_the_api_process_and_ends_the_tree(tmp_path):
    with started(tmp_path) as (proc, _, marker):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert tree_of(marker) == []
