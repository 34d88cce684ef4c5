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


# ------------------------------------------------------------------ what a dead server's error quotes

ENGINE = "(EngineCore_DP0 pid=24909) ERROR 12-06 06:19:58 [core.py:1102] "
API = "(APIServer pid=24895) ERROR 12-06 06:19:59 [async_llm.py:906] "
SITE = "/work/main/.venv-vllm/lib/python3.11/site-packages/vllm"


def sampler_crash_log(noise: int = 200) -> str:
    """A vLLM CPU server whose sampler raised: the engine's traceback (every line under the
    engine's log prefix, an access-log line of the API server in between), the API server's
    EngineDeadError pointing back at it, the shutdown, then the interpreter's nanobind leak
    report at exit."""
    lines = [
        "(APIServer pid=24895) INFO 12-06 06:11:17 [api_utils.py:347]  version 0.32.0",
        "(APIServer pid=24895) WARNING 12-06 06:11:17 [system_utils.py:255] Found ulimit of 20000 and failed to "
        "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors "
        "like `OSError: [Errno 24] Too many open files`.",
        *[f'INFO:     127.0.0.1:{40000 + i} - "POST /v1/completions HTTP/1.1" 200 OK' for i in range(30)],
        ENGINE + "EngineCore encountered a fatal error.",
        ENGINE + "Traceback (most recent call last):",
        ENGINE + f'  File "{SITE}/v1/engine/core.py", line 1093, in run_engine_core',
        ENGINE + "    engine_core.run_busy_loop()",
        'INFO:     127.0.0.1:41000 - "GET /metrics HTTP/1.1" 200 OK',
        ENGINE.replace("06:19:58", "06:19:59") + f'  File "{SITE}/v1/sample/sampler.py", line 211, in sample',
        ENGINE.replace("06:19:58", "06:19:59") + "    return logits[req_index]",
        ENGINE.replace("06:19:58", "06:19:59") + "IndexError: index 17 is out of bounds for dimension 0 with size 16",
        API + "AsyncLLM output_handler failed.",
        API + "Traceback (most recent call last):",
        API + f'  File "{SITE}/v1/engine/core_client.py", line 1235, in get_output_async',
        API + "    raise self._format_exception(outputs) from None",
        API + "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
              "for the root cause.",
        "(APIServer pid=24895) INFO 12-06 06:19:59 [launcher.py:304] [shutdown] API server: shutting down",
        "INFO:     Shutting down",
        f"nanobind: leaked {noise} instances!",
        *[f' - leaked instance 0x7f8af9a6{i:04x} of type "triton._C.libtriton.ir.attribute"' for i in range(noise)],
        "nanobind: leaked 3 instances!",
        ' - leaked function "create_icmpULE"',
        "nanobind: this is likely caused by a reference counting issue in the binding code.",
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html",
    ]
    return "\n".join(lines) + "\n"


def test_the_error_quotes_the_first_traceback_not_the_leak_report():
    text = sampler_crash_log()
    quote = server_process.quote_log(text)
    first = text.splitlines().index(ENGINE + "EngineCore encountered a fatal error.") + 1
    assert quote.startswith(f", from its first error (line {first} of {len(text.splitlines())}; "
                            f"1 more traceback(s) after it):\n{ENGINE}EngineCore encountered a fatal error.\n"
                            f"{ENGINE}Traceback (most recent call last):\n")
    assert "IndexError: index 17 is out of bounds for dimension 0 with size 16\n..." in quote
    assert "in sample" in quote and "engine_core.run_busy_loop()" in quote
    # Another process's line in the middle of the traceback, and the consequences, stay out.
    assert "GET /metrics" not in quote and "EngineDeadError" not in quote
    assert "ulimit" not in quote
    # A short tail still shows how the log ends, not the 200 lines before it.
    assert quote.endswith("See https://nanobind.readthedocs.io/en/latest/refleaks.html")
    assert quote.count("leaked instance") <= server_process.CAUSE_TAIL_LINES
    assert len(quote.splitlines()) < 25


def test_chained_exceptions_are_quoted_through_the_last():
    text = "\n".join([
        "loading", "Traceback (most recent call last):", '  File "a.py", line 1, in <module>',
        "KeyError: 'rope_scaling'", "", "During handling of the above exception, another exception occurred:", "",
        "Traceback (most recent call last):", '  File "b.py", line 2, in load', "ValueError: bad config",
        "nanobind: leaked 3 instances!"])
    quote = server_process.quote_log(text, tail=0)
    assert quote.splitlines()[1] == "Traceback (most recent call last):"
    assert quote.splitlines()[-1] == "ValueError: bad config" and "KeyError" in quote and "loading" not in quote


def test_without_a_traceback_the_first_error_line_is_the_cause():
    text = sampler_crash_log().split(ENGINE + "EngineCore encountered")[0]
    text += "(APIServer pid=1) ERROR 12-06 06:12:00 [api_server.py:90] port 8190 is in use\n" + "\n".join(
        f"nanobind: leaked {i} instances!" for i in range(40))
    quote = server_process.quote_log(text)
    assert quote.splitlines()[1] == "(APIServer pid=1) ERROR 12-06 06:12:00 [api_server.py:90] port 8190 is in use"
    assert "ulimit" not in quote                  # a warning that mentions OSError is no error
    assert quote.endswith("nanobind: leaked 39 instances!")


def test_a_log_without_an_error_is_quoted_by_its_end():
    text = "\n".join(f"line {i}" for i in range(100))
    quote = server_process.quote_log(text)
    assert quote.startswith(" ends:\nline 75\n") and quote.endswith("line 99")


def test_a_long_traceback_keeps_its_head_and_the_raise():
    frames = [f'  File "m{i}.py", line {i}, in f{i}\n    g{i}()' for i in range(60)]
    text = "start\nTraceback (most recent call last):\n" + "\n".join(frames) + "\nRecursionError: too deep\nend"
    quote = server_process.quote_log(text)
    lines = quote.splitlines()
    assert lines[1] == "Traceback (most recent call last):" and "RecursionError: too deep" in lines
    assert any(line.startswith("... (") for line in lines) and len(lines) <= server_process.MAX_CAUSE_LINES + 4


def test_a_dead_server_reports_its_cause(tmp_path):
    log = sampler_crash_log().replace("'", "")
    (tmp_path / "crash.log").write_text(log)
    proc = server_process.start(script(tmp_path, f"cat {tmp_path / 'crash.log'}; exit 1"), [], env={},
                                log_path=tmp_path / "log", label="vllm on node 0")
    with pytest.raises(BenchError) as err:
        proc.wait_healthy(lambda: False, timeout_s=30, sleep=lambda s: time.sleep(0.05))
    message = str(err.value)
    assert "exited with code 1" in message and "from its first error" in message
    assert "IndexError: index 17 is out of bounds" in message
