"""`FakeTransport`: scripted command results for unit tests; anything unscripted raises."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import CommandFailed, TransportError
from . import batch
from .transport import Result, sudo_wrap

PUT_CHUNK = 32768  # paramiko's SFTP chunk: how often put reports progress
Response = Result | tuple[int, str, str] | tuple[int, str] | str | Callable[[str, bytes | None], object]


class UnscriptedCommand(AssertionError):
    """A command (or file) the test did not script."""


class FakeTransport:
    """A Transport whose commands answer from a script.

    script: {command or re.Pattern: response}; a response is a Result, (exit, stdout[, stderr]),
    a stdout string (exit 0), a callable (cmd, input) -> response, or a list of responses
    consumed in order. files: remote path -> bytes (put/put_bytes write here, get reads).
    Exact commands match first, then patterns (fullmatch). A batch of facts (guest/batch.py)
    is answered fact by fact from the same script.
    """

    def __init__(self, host: str = "fake", script: dict | None = None, *, user: str = "root",
                 files: dict[str, bytes] | None = None):
        self.host = host
        self.user = user
        self.script: dict = dict(script or {})
        self.files: dict[str, bytes] = dict(files or {})
        self.modes: dict[str, int | None] = {}
        self.calls: list[str] = []  # every command run, as sent (after sudo wrapping)
        self.puts: list[str] = []
        self.batches: list[list[str]] = []  # each batch of facts: the commands it carried
        self.closed = False
        self.drop_after: int | None = None  # commands allowed before the "connection" drops
        self._lock = threading.Lock()

    def add(self, cmd: str | re.Pattern, response: Response) -> FakeTransport:
        self.script[cmd] = response
        return self

    def run(self, cmd: str, timeout: float | None = None, sudo: bool = False, *,
            check: bool = True, input: str | bytes | None = None) -> Result:
        full = sudo_wrap(cmd, self.user, sudo)
        decoded = batch.decode(full) if not sudo else None
        if decoded is not None:
            return self._run_batch(full, *decoded)
        with self._lock:
            self._check_alive(full)
            self.calls.append(full)
            response = self._lookup(full)
        if callable(response) and not isinstance(response, Result):
            data = input.encode() if isinstance(input, str) else input
            response = response(full, data)
        result = _as_result(full, response)
        if check and result.exit != 0:
            raise CommandFailed(result, self.host)
        return result

    def _run_batch(self, script: str, token: str, facts: list[tuple[str, str | None]]) -> Result:
        """A batch of facts: each command answers from the script (and is recorded in `calls`)
        as if it had run alone; the batch counts as one round trip in `batches`."""
        with self._lock:
            self._check_alive("a batch of facts")
            self.batches.append([cmd for cmd, _ in facts])
        answers = []
        for cmd, data in facts:
            with self._lock:
                self._check_alive(cmd)
                self.calls.append(cmd)
                response = self._lookup(cmd)
            if callable(response) and not isinstance(response, Result):
                response = response(cmd, data.encode() if data is not None else None)
            r = _as_result(cmd, response)
            answers.append((r.exit, r.stdout, r.stderr))
        out, err = batch.encode(token, answers)
        return Result(script, 0, out, err, 0.0)

    def _check_alive(self, what: str) -> None:
        if self.closed:
            raise TransportError(f"{self.host}: the transport is closed")
        if self.drop_after is not None and len(self.calls) + len(self.puts) >= self.drop_after:
            raise TransportError(f"{self.host}: the SSH connection dropped while running: {what}")

    def _lookup(self, cmd: str):
        if cmd in self.script:
            return self._take(cmd)
        for key in self.script:
            if isinstance(key, re.Pattern) and key.fullmatch(cmd):
                return self._take(key)
        raise UnscriptedCommand(f"{self.host}: unscripted command: {cmd}")

    def _take(self, key):
        response = self.script[key]
        if isinstance(response, list):
            if not response:
                raise UnscriptedCommand(f"{self.host}: no responses left for: {key}")
            return response.pop(0) if len(response) > 1 else response[0]
        return response

    def put(self, local: str | Path, remote: str, mode: int | None = None,
            progress=None) -> None:
        data = Path(local).read_bytes()
        if progress is not None:  # as SFTP does: after each chunk, and once at the end
            for sent in range(PUT_CHUNK, len(data), PUT_CHUNK):
                progress(sent)
            progress(len(data))
        self.put_bytes(data, remote, mode)

    def put_bytes(self, data: bytes, remote: str, mode: int | None = None) -> None:
        with self._lock:
            self._check_alive(f"put {remote}")
            self.puts.append(remote)
            self.files[remote] = bytes(data)
            self.modes[remote] = mode

    def get(self, remote: str, local: str | Path) -> None:
        with self._lock:
            self._check_alive(f"get {remote}")
            if remote not in self.files:
                raise UnscriptedCommand(f"{self.host}: no such scripted file: {remote}")
            Path(local).write_bytes(self.files[remote])

    def read_bytes(self, remote: str) -> bytes:
        with self._lock:
            self._check_alive(f"read {remote}")
            if remote not in self.files:
                raise UnscriptedCommand(f"{self.host}: no such scripted file: {remote}")
            return bytes(self.files[remote])

    def close(self) -> None:
        self.closed = True


def _as_result(cmd: str, response) -> Result:
    if isinstance(response, Result):
        return response
    if isinstance(response, str):
        return Result(cmd, 0, response, "", 0.0)
    if isinstance(response, tuple):
        exit_code, out, *rest = response
        return Result(cmd, int(exit_code), out, rest[0] if rest else "", 0.0)
    raise TypeError(f"bad scripted response for {cmd!r}: {response!r}")
