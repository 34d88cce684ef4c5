"""What a playbook step does to a guest: operations (a command, an atomic file write) and
how one is run over a transport. Steps (guest/steps.py, guest/software_steps.py) return
them; the playbook runner and `serve up` (deploy/driver.py) run them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CommandFailed, PlaybookError
from .facts import q
from .transport import Transport, sudo_wrap

# --------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class Shell:
    """A command to run on the guest.

    failure: what a non-zero exit means, in words (shown above the command and its output).
    """

    cmd: str
    sudo: bool = False
    timeout: float | None = None
    failure: str | None = None


@dataclass(frozen=True)
class Upload:
    """A file to write on the guest (atomically): `data`, or the local file `local`."""

    remote: str
    data: bytes | None = None
    local: str | None = None
    mode: int | None = None
    sudo: bool = False

    @property
    def label(self) -> str:
        return self.local if self.local else f"<{len(self.data or b'')} bytes>"


Op = Shell | Upload


def describe(op: Op, user: str) -> str:
    """One line per operation, as a dry run prints it."""
    if isinstance(op, Shell):
        return sudo_wrap(op.cmd, user, op.sudo)
    mode = f" (mode {op.mode:04o})" if op.mode is not None else ""
    return f"put {op.label} -> {op.remote}{mode}"


def execute(op: Op, transport: Transport, default_timeout: float | None,
            progress: Callable[[int], None] | None = None) -> None:
    """Run one operation; an upload needing root goes through a temp file and `sudo install`.

    progress: for an upload of a local file, called with the bytes sent so far.
    """
    if isinstance(op, Shell):
        try:
            transport.run(op.cmd, timeout=op.timeout or default_timeout, sudo=op.sudo)
        except CommandFailed as exc:
            if op.failure is None:
                raise
            raise PlaybookError(f"{op.failure}\n{exc}") from None
        return
    if op.sudo and transport.user != "root":
        tmp = f"/tmp/.vcfslm-upload-{uuid.uuid4().hex[:12]}"
        _put(op, transport, tmp, 0o600, progress)
        mode = f"{op.mode:04o}" if op.mode is not None else "0644"
        transport.run(f"install -m {mode} {q(tmp)} {q(op.remote)}.vcfslm-tmp && "
                      f"mv -f {q(op.remote)}.vcfslm-tmp {q(op.remote)}; rm -f {q(tmp)}",
                      timeout=default_timeout, sudo=True)
        return
    _put(op, transport, op.remote, op.mode, progress)


def _put(op: Upload, transport: Transport, remote: str, mode: int | None,
         progress: Callable[[int], None] | None) -> None:
    if op.local is not None:
        if progress is None:
            transport.put(op.local, remote, mode)
        else:
            transport.put(op.local, remote, mode, progress=progress)
    else:
        transport.put_bytes(op.data or b"", remote, mode)


