"""SSH to guests: the `Transport` protocol, its `Result`, and `SSHTransport` (the only paramiko import).

Host keys are always verified against the inventory's known_hosts file: an
unknown host is refused unless `trust_new_hosts` is set (then its key is
recorded and its fingerprint reported); a changed key is refused, always.
Every command and its output go to `<log_dir>/<host>.log`.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import CommandFailed, HostKeyError, TransportError
from ..progress import NullReporter, Reporter

DEFAULT_TIMEOUT_S = 600.0
# paramiko logs dropped connections from its own thread; the errors we raise say it better.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logger = logging.getLogger(__name__)
_known_hosts_lock = threading.Lock()  # parallel hosts may record keys in one file


@dataclass(frozen=True)
class Result:
    """What one remote command did."""

    cmd: str
    exit: int
    stdout: str
    stderr: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.exit == 0


class Transport(Protocol):
    """A connection to one guest (real SSH, or a scripted fake in tests)."""

    host: str
    user: str

    def run(self, cmd: str, timeout: float | None = None, sudo: bool = False, *,
            check: bool = True, input: str | bytes | None = None) -> Result:
        """Run `cmd` through the remote shell; CommandFailed on non-zero exit unless check=False.

        sudo: run as root (`sudo -n`) when the login user is not root; input: bytes fed to stdin.
        """

    def put(self, local: str | Path, remote: str, mode: int | None = None,
            progress: Callable[[int], None] | None = None) -> None:
        """Copy a local file to `remote` atomically (temp file + rename).

        progress: called with the bytes sent so far, as they go.
        """

    def put_bytes(self, data: bytes, remote: str, mode: int | None = None) -> None:
        """Write `data` to `remote` atomically (temp file + rename)."""

    def get(self, remote: str, local: str | Path) -> None:
        """Copy `remote` to a local file (written atomically)."""

    def read_bytes(self, remote: str) -> bytes:
        """`remote`'s content, into memory only (a secret read back: no local file, no log of it)."""

    def close(self) -> None:
        """Close the connection (idempotent)."""


def sudo_wrap(cmd: str, user: str, sudo: bool) -> str:
    """The command as sent: wrapped in `sudo -n sh -c` when root is needed and we are not root."""
    if not sudo or user == "root":
        return cmd
    return f"sudo -n sh -c {shlex.quote(cmd)}"


def fingerprint(key_blob: bytes) -> str:
    """OpenSSH-style SHA256 fingerprint of a public key blob."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key_blob).digest()).decode().rstrip("=")


def known_hosts_name(address: str, port: int) -> str:
    """How known_hosts names a host: `addr` on port 22, else `[addr]:port`."""
    return address if port == 22 else f"[{address}]:{port}"


class CommandLog:
    """Appends every command with its exit code, duration and output to one file per host."""

    def __init__(self, folder: str | Path | None, host: str):
        self.path = Path(folder) / f"{host}.log" if folder else None
        self._lock = threading.Lock()
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def command(self, result: Result) -> None:
        self.write(f"$ {result.cmd}\n# exit {result.exit} in {result.duration:.3f}s\n"
                   + _section("stdout", result.stdout) + _section("stderr", result.stderr))

    def write(self, text: str) -> None:
        if not self.path:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(f"[{stamp}] {text}" + ("" if text.endswith("\n") else "\n"))


def _section(name: str, text: str) -> str:
    if not text:
        return ""
    return f"--- {name}\n{text}" + ("" if text.endswith("\n") else "\n")


@dataclass(frozen=True)
class SshLogin:
    """Where a guest's sshd listens, who logs in, and which host keys are trusted.

    address/port: where sshd listens; key_file: private key path (None: the SSH agent);
    known_hosts: the file host keys are checked against; trust_new_hosts: record an
    unknown host's key instead of refusing it (a changed key is refused, always).
    """

    address: str
    known_hosts: str | Path
    port: int = 22
    user: str = "root"
    key_file: str | None = None
    trust_new_hosts: bool = False


@dataclass(frozen=True)
class ConnectRetry:
    """How long connecting to a guest may take: timeout (s) of one attempt (and of opening
    a channel); wait_s: how long to keep retrying refused or timed-out connections (a
    booting VM), with a doubling pause from backoff_s up to max_backoff_s; 0 = one attempt."""

    timeout: float = 10.0
    wait_s: float = 30.0
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0


class SSHTransport:
    """A paramiko connection to one guest, opened by `connect()` (retried for a bounded time)."""

    def __init__(self, host: str, login: SshLogin, *, retry: ConnectRetry | None = None,
                 log_dir: str | Path | None = None, default_timeout: float = DEFAULT_TIMEOUT_S,
                 reporter: Reporter | None = None, persistent_shell: bool = True):
        """host: name used in messages and the log; login: address, port, user, key and host
        keys (SshLogin); retry: how connecting is retried (ConnectRetry; None: its defaults).

        persistent_shell: run commands through one remote shell per connection instead of
        one SSH channel each (no login-shell start-up per command); falls back by itself.
        """
        retry = retry or ConnectRetry()
        self.host = host
        self.address = login.address
        self.port = login.port
        self.user = login.user
        self.key_file = str(Path(login.key_file).expanduser()) if login.key_file else None
        self.known_hosts = Path(login.known_hosts).expanduser()
        self.trust_new_hosts = login.trust_new_hosts
        self.connect_timeout = retry.timeout
        self.wait_s = retry.wait_s
        self.backoff_s = retry.backoff_s
        self.max_backoff_s = retry.max_backoff_s
        self.default_timeout = default_timeout
        self.reporter = reporter or NullReporter()
        self.log = CommandLog(log_dir, host)
        self.new_host_fingerprint: str | None = None  # set when trust_new_hosts recorded a key
        self.persistent_shell = persistent_shell
        self._shell_usable = True
        self._shell: _ShellSession | None = None
        self._run_lock = threading.Lock()
        self._client = None
        self._sftp = None

    # ------------------------------------------------------------ connecting

    def connect(self) -> SSHTransport:
        """Open the connection, retrying refused/timed-out attempts; HostKeyError is never retried."""
        import paramiko

        delay = self.backoff_s
        started = time.monotonic()
        last: Exception | None = None
        last_text = ""
        attempt = 0
        while True:
            if attempt:
                self.reporter.update(self.host, f"connect retry {attempt} in {delay:.1f}s ({last_text})")
                logger.debug("%s: SSH connect retry %d to %s:%d in %.1f s (%s)", self.host, attempt,
                             self.address, self.port, delay, last_text)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            attempt += 1
            try:
                self._client = self._open(paramiko)
                self.log.write(f"connected to {self.user}@{self.address}:{self.port}")
                logger.debug("%s: SSH connected to %s@%s:%d (attempt %d)", self.host, self.user,
                             self.address, self.port, attempt)
                return self
            except HostKeyError:
                raise
            except paramiko.BadHostKeyException as exc:
                raise HostKeyError(
                    f"{self.host}: host key of {self.address}:{self.port} CHANGED: server offers "
                    f"{exc.key.get_name()} {fingerprint(exc.key.asbytes())}, {self.known_hosts} has "
                    f"{fingerprint(exc.expected_key.asbytes())}; refusing to connect (if the VM was "
                    f"rebuilt, remove its old line from {self.known_hosts})") from None
            except paramiko.AuthenticationException as exc:
                raise TransportError(f"{self.host}: SSH authentication as {self.user!r} failed at "
                                     f"{self.address}:{self.port} ({exc}); key: "
                                     f"{self.key_file or 'SSH agent'}") from None
            except (OSError, paramiko.SSHException, EOFError) as exc:
                last = exc
                last_text = _describe(exc)
            if time.monotonic() - started + delay > self.wait_s:
                break
        raise TransportError(f"{self.host}: cannot connect to {self.address}:{self.port} after "
                             f"{attempt} attempt(s) over {time.monotonic() - started:.0f}s: "
                             f"{_describe(last)}")

    def _open(self, paramiko):
        client = paramiko.SSHClient()
        if self.known_hosts.exists():
            client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(_policy(paramiko, self))
        try:
            client.connect(self.address, port=self.port, username=self.user,
                           key_filename=self.key_file, allow_agent=self.key_file is None,
                           look_for_keys=False, timeout=self.connect_timeout,
                           banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout)
        except BaseException:
            client.close()
            raise
        transport = client.get_transport()
        transport.set_keepalive(15)
        # Small request/reply packets: without TCP_NODELAY, Nagle + delayed ACK add ~40 ms
        # to every channel open.
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client

    def _missing_key(self, name: str, key) -> None:
        """Unknown host: refuse, or record the key when trusting new hosts."""
        fp = f"{key.get_name()} {fingerprint(key.asbytes())}"
        if not self.trust_new_hosts:
            raise HostKeyError(f"{self.host}: host key of {self.address}:{self.port} is unknown "
                               f"({fp}); it is not in {self.known_hosts}. Check the fingerprint, "
                               "then re-run with --trust-new-hosts to record it")
        with _known_hosts_lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
            with open(self.known_hosts, "a", encoding="utf-8") as f:
                f.write(f"{name} {key.get_name()} {key.get_base64()}\n")
        self.new_host_fingerprint = fp
        self.reporter.log(f"{self.host}: recorded new host key {fp} in {self.known_hosts}")
        self.log.write(f"recorded new host key {fp}")

    def _connection(self):
        if self._client is None:
            self.connect()
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise TransportError(f"{self.host}: the SSH connection to {self.address}:{self.port} is lost")
        return transport

    # ------------------------------------------------------------ commands

    def run(self, cmd: str, timeout: float | None = None, sudo: bool = False, *,
            check: bool = True, input: str | bytes | None = None) -> Result:
        """Run `cmd` remotely; CommandFailed on non-zero exit unless check=False."""
        full = sudo_wrap(cmd, self.user, sudo)
        timeout = self.default_timeout if timeout is None else timeout
        data = input.encode() if isinstance(input, str) else input
        started = time.monotonic()
        try:
            with self._run_lock:
                if self.persistent_shell and self._shell_usable:
                    exit_code, out, err = self._shell_exec(full, timeout, data)
                else:
                    exit_code, out, err = self._exec(full, timeout, data)
        except TransportError as exc:
            self.log.write(f"$ {full}\n# {exc}")
            logger.debug("%s: connection lost during a command: %s", self.host, exc)
            raise
        result = Result(full, exit_code, out, err, time.monotonic() - started)
        self.log.command(result)
        if check and exit_code != 0:
            raise CommandFailed(result, self.host)
        return result

    def _shell_exec(self, cmd: str, timeout: float, data: bytes | None) -> tuple[int, str, str]:
        if self._shell is None or self._shell.dead:
            try:
                self._shell = _ShellSession(self._connection(), self.connect_timeout, self.host)
            except _NoShell as exc:
                # No usable /bin/sh session (restricted shell?): one exec channel per command.
                self.log.write(f"persistent shell unavailable ({exc}); one channel per command")
                self._shell_usable = False
                return self._exec(cmd, timeout, data)
        return self._shell.run(cmd, timeout, data, self.host)

    def _exec(self, cmd: str, timeout: float, data: bytes | None) -> tuple[int, str, str]:
        """One SSH exec channel for one command (the fallback; waits for the channel's EOF)."""
        import select

        import paramiko

        try:
            chan = self._connection().open_session(timeout=self.connect_timeout)
            chan.exec_command(cmd)
            if data is not None:
                chan.sendall(data)
            chan.shutdown_write()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise TransportError(f"{self.host}: the SSH connection is lost ({_describe(exc)})") from None
        out: list[bytes] = []
        err: list[bytes] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                busy = False
                while chan.recv_ready():
                    out.append(chan.recv(65536))
                    busy = True
                while chan.recv_stderr_ready():
                    err.append(chan.recv_stderr(65536))
                    busy = True
                if chan.exit_status_ready() and chan.eof_received and not (
                        chan.recv_ready() or chan.recv_stderr_ready()):
                    break
                if chan.closed and not chan.exit_status_ready():
                    raise TransportError(f"{self.host}: the SSH connection dropped while running: {cmd}")
                if time.monotonic() > deadline:
                    raise TransportError(f"{self.host}: command timed out after {timeout:g}s: {cmd}")
                if not busy:
                    # The channel's pipe wakes us for stdout and close; stderr-only output
                    # is picked up by the short timeout.
                    select.select([chan], [], [], 0.02)
            return chan.recv_exit_status(), _text(out), _text(err)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise TransportError(f"{self.host}: the SSH connection dropped while running {cmd} "
                                 f"({_describe(exc)})") from None
        finally:
            chan.close()

    # ------------------------------------------------------------ files

    def _sftp_client(self):
        if self._sftp is None or self._sftp.sock.closed:
            import paramiko

            try:
                self._sftp = paramiko.SFTPClient.from_transport(self._connection())
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise TransportError(f"{self.host}: cannot open SFTP ({_describe(exc)})") from None
        return self._sftp

    def put(self, local: str | Path, remote: str, mode: int | None = None,
            progress: Callable[[int], None] | None = None) -> None:
        """Upload a local file atomically: write `<remote>.tmp-<id>`, then rename over `remote`."""
        with open(local, "rb") as f:
            self._put_fileobj(f, remote, mode, f"put {local} -> {remote}", progress,
                              os.fstat(f.fileno()).st_size)

    def put_bytes(self, data: bytes, remote: str, mode: int | None = None) -> None:
        import io

        self._put_fileobj(io.BytesIO(data), remote, mode, f"put <{len(data)} bytes> -> {remote}")

    def _put_fileobj(self, fileobj, remote: str, mode: int | None, what: str,
                     progress: Callable[[int], None] | None = None, size: int = 0) -> None:
        import paramiko

        started = time.monotonic()
        sftp = self._sftp_client()
        tmp = f"{remote}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            # paramiko calls back after each chunk with (bytes so far, size)
            callback = (lambda sent, _total: progress(sent)) if progress is not None else None
            if mode is not None:
                # The mode before the first byte (a key is never readable by others, even
                # for a moment); putfo's open truncates the file and keeps its mode.
                sftp.open(tmp, "wb").close()
                sftp.chmod(tmp, mode)
            sftp.putfo(fileobj, tmp, file_size=size, callback=callback)
            sftp.posix_rename(tmp, remote)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            try:
                sftp.remove(tmp)
            except (OSError, paramiko.SSHException, EOFError):
                pass
            self.log.write(f"{what}: FAILED {_describe(exc)}")
            raise TransportError(f"{self.host}: {what} failed: {_describe(exc)}") from None
        self.log.write(f"{what} (mode {oct(mode) if mode is not None else 'default'}) "
                       f"in {time.monotonic() - started:.3f}s")

    def get(self, remote: str, local: str | Path) -> None:
        """Download `remote` to `local` (temp file + rename on the local side)."""
        import paramiko

        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self._sftp_client().get(remote, str(tmp))
            os.replace(tmp, local)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            tmp.unlink(missing_ok=True)
            raise TransportError(f"{self.host}: get {remote} failed: {_describe(exc)}") from None
        self.log.write(f"get {remote} -> {local}")

    def read_bytes(self, remote: str) -> bytes:
        import paramiko

        try:
            with self._sftp_client().open(remote, "rb") as fh:
                data = fh.read()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise TransportError(f"{self.host}: read {remote} failed: {_describe(exc)}") from None
        self.log.write(f"read {remote} ({len(data)} bytes, not logged)")
        return data

    def close(self) -> None:
        for thing in (self._shell, self._sftp, self._client):
            if thing is not None:
                try:
                    thing.close()
                except Exception:  # noqa: BLE001 - closing a dead connection may fail any way
                    pass
        self._shell = self._sftp = self._client = None

    def __enter__(self) -> SSHTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _NoShell(Exception):
    """The remote side gave no usable shell session."""


class _ShellSession:
    """One remote `sh` reading commands from the channel; each command runs in the login
    shell (`$SHELL -c`) with its own stdin, and ends with a marker line carrying its exit
    code and the size of its captured stderr."""

    def __init__(self, transport, timeout: float, host: str):
        import paramiko

        self.token = f"__VCFSLM_{uuid.uuid4().hex}"
        self.marker = f"\n{self.token} ".encode()
        self.dead = False
        self.buf = bytearray()
        try:
            self.chan = transport.open_session(timeout=timeout)
            self.chan.exec_command("exec /bin/sh")
            self.chan.sendall((
                'D=$(mktemp -d "${TMPDIR:-/tmp}/.vcfslm-sh-XXXXXX") || exit 97\n'
                'trap \'rm -rf "$D"\' EXIT\n'
                # The login shell already ran its rc files once for this session; commands
                # run as nested shells (bash would otherwise source ~/.bashrc for each).
                'SHLVL=$((${SHLVL:-0} + 1)); export SHLVL\n'
                f"printf '\\n%s %s\\n' {self.token} ready\n").encode())
            line = self._until_marker(time.monotonic() + timeout)
        except (OSError, paramiko.SSHException, EOFError, _Closed) as exc:
            self.close()
            if not transport.is_active():
                raise TransportError(f"{host}: the SSH connection is lost ({_describe(exc)})") from None
            raise _NoShell(_describe(exc) if not isinstance(exc, _Closed) else "the shell exited") from None
        if line != "ready":
            self.close()
            raise _NoShell(f"unexpected answer {line!r}")

    def run(self, cmd: str, timeout: float, data: bytes | None, host: str) -> tuple[int, str, str]:
        import paramiko

        stdin = "/dev/null"
        script = ""
        if data is not None:
            script = f"printf %s {base64.b64encode(data).decode()} | base64 -d > \"$D/in\"\n"
            stdin = '"$D/in"'
        # No stderr (the usual case): no wc and cat to start on the guest.
        script += (f'"${{SHELL:-/bin/sh}}" -c {shlex.quote(cmd)} < {stdin} 2> "$D/err"\n'
                   'r=$?; if [ -s "$D/err" ]; then '
                   f"printf '\\n%s %s %s\\n' {self.token} $r $(wc -c < \"$D/err\"); cat \"$D/err\"; "
                   f"else printf '\\n%s %s 0\\n' {self.token} $r; fi\n")
        deadline = time.monotonic() + timeout
        try:
            self.chan.sendall(script.encode())
            stdout, line = self._until_marker(deadline, keep_output=True)
            exit_code, err_len = (int(x) for x in line.split())
            err = self._read_exactly(err_len, deadline)
        except TimeoutError:
            self.close()
            raise TransportError(f"{host}: command timed out after {timeout:g}s: {cmd}") from None
        except (OSError, paramiko.SSHException, EOFError, ValueError) as exc:
            self.close()
            raise TransportError(f"{host}: the SSH connection dropped while running {cmd} "
                                 f"({_describe(exc)})") from None
        except _Closed:
            self.close()
            raise TransportError(f"{host}: the SSH connection dropped while running: {cmd}") from None
        return exit_code, stdout.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace")

    def _fill(self, deadline: float) -> None:
        import select

        while True:
            if self.chan.recv_ready():
                chunk = self.chan.recv(262144)
                if not chunk:
                    raise _Closed()
                self.buf += chunk
                return
            if self.chan.closed or self.chan.eof_received:
                raise _Closed()
            if time.monotonic() > deadline:
                raise TimeoutError()
            select.select([self.chan], [], [], 0.05)

    def _until_marker(self, deadline: float, keep_output: bool = False):
        """Read to the marker line; return its rest (and the output before it)."""
        searched = 0
        while True:
            at = self.buf.find(self.marker, max(0, searched - len(self.marker)))
            if at >= 0:
                end = self.buf.find(b"\n", at + len(self.marker))
                if end >= 0:
                    before = bytes(self.buf[:at])
                    line = self.buf[at + len(self.marker):end].decode()
                    del self.buf[:end + 1]
                    return (before, line) if keep_output else line
            searched = len(self.buf)
            self._fill(deadline)

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self) -> None:
        self.dead = True
        chan = getattr(self, "chan", None)
        if chan is not None:
            try:
                chan.close()
            except Exception:  # noqa: BLE001 - closing a dead channel may fail any way
                pass


class _Closed(Exception):
    """The shell's channel closed."""


def _policy(paramiko, transport: SSHTransport):
    class _Policy(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            transport._missing_key(hostname, key)

    return _Policy()


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", errors="replace")


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no attempt made"
    if isinstance(exc, socket.timeout):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text


def open_node(inventory, node, *, log_dir: str | Path | None = None, trust_new_hosts: bool = False,
              reporter: Reporter | None = None, wait_s: float = 30.0) -> SSHTransport:
    """Connect to an inventory node's management IP as the inventory's guest user."""
    g = inventory.guest
    login = SshLogin(str(node.management_ip), g.known_hosts, port=node.ssh_port, user=g.user,
                     key_file=g.ssh_key, trust_new_hosts=trust_new_hosts)
    return SSHTransport(node.name, login, retry=ConnectRetry(wait_s=wait_s), log_dir=log_dir,
                        reporter=reporter).connect()
