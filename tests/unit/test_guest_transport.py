"""Transport pieces that need no server: sudo wrapping, fingerprints, logs, the fake, errors.
The SSH side itself is tested against real sshd guests in tests/integration/test_guests_sshd.py."""

from __future__ import annotations

import base64
import hashlib

import pytest

from vcfslm.errors import CommandFailed, TransportError
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.transport import CommandLog, Result, fingerprint, known_hosts_name, sudo_wrap


def test_sudo_wrap():
    assert sudo_wrap("apt-get install -y x", "root", True) == "apt-get install -y x"
    assert sudo_wrap("a && b", "slm", True) == "sudo -n sh -c 'a && b'"
    assert sudo_wrap("a", "slm", False) == "a"


def test_fingerprint_is_openssh_style():
    blob = b"\x00\x00\x00\x0bssh-ed25519" + bytes(range(36))
    expected = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    assert fingerprint(blob) == "SHA256:" + expected


def test_known_hosts_name():
    assert known_hosts_name("10.0.0.5", 22) == "10.0.0.5"
    assert known_hosts_name("127.0.0.11", 2222) == "[127.0.0.11]:2222"


def test_command_log(tmp_path):
    log = CommandLog(tmp_path / "logs", "slm-01")
    log.command(Result("numactl --hardware", 0, "available: 1 nodes (0)\n", "", 0.01))
    log.command(Result("false", 1, "", "boom", 0.0))
    text = (tmp_path / "logs" / "slm-01.log").read_text()
    assert "$ numactl --hardware\n# exit 0 in 0.010s\n--- stdout\navailable: 1 nodes (0)\n" in text
    assert "$ false\n# exit 1" in text and "--- stderr\nboom\n" in text
    CommandLog(None, "x").command(Result("true", 0, "", "", 0))  # no folder: nothing written


def test_command_failed_shows_command_exit_and_tail():
    out = "\n".join(f"line {i}" for i in range(40))
    exc = CommandFailed(Result("pip install torch", 1, "", out, 1.0), "slm-02")
    text = str(exc)
    assert text.startswith("slm-02: command failed (exit 1): pip install torch")
    assert "line 39" in text and "line 19" not in text
    assert isinstance(exc, TransportError)


def test_fake_transport_script_forms(tmp_path):
    import re

    t = FakeTransport("h", {
        "a": Result("a", 0, "A", "", 0),
        "b": (2, "", "bad"),
        re.compile(r"echo .*"): lambda cmd, data: cmd[5:],
        "seq": [(0, "1"), (0, "2")],
        "py -": lambda cmd, data: data.decode(),
    }, user="slm")
    assert t.run("a").stdout == "A"
    with pytest.raises(CommandFailed):
        t.run("b")
    assert t.run("b", check=False).exit == 2
    assert t.run("echo hi").stdout == "hi"
    assert [t.run("seq").stdout for _ in range(3)] == ["1", "2", "2"]
    assert t.run("py -", input="print(1)").stdout == "print(1)"
    t.add("sudo -n sh -c 'x y'", "ok")
    assert t.run("x y", sudo=True).stdout == "ok"
    t.put_bytes(b"data", "/r/f", 0o600)
    t.get("/r/f", tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"data" and t.modes["/r/f"] == 0o600
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.run("a")


def test_connect_retries_for_a_bounded_time(tmp_path):
    import socket

    from vcfslm.guest.transport import ConnectRetry, SshLogin, SSHTransport
    from vcfslm.progress import RecordingReporter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    reporter = RecordingReporter()
    t = SSHTransport("slm-01", SshLogin("127.0.0.1", tmp_path / "kh", port=port),
                     retry=ConnectRetry(wait_s=0.6, backoff_s=0.1), reporter=reporter)
    with pytest.raises(TransportError, match=rf"slm-01: cannot connect to 127.0.0.1:{port} after [3-9] attempt"):
        t.connect()
    assert reporter.updates[0][1].startswith("connect retry 1 in 0.1s")
    once = SSHTransport("slm-01", SshLogin("127.0.0.1", tmp_path / "kh", port=port),
                        retry=ConnectRetry(wait_s=0))
    with pytest.raises(TransportError, match="after 1 attempt"):
        once.connect()
