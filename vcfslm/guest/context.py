"""What a step sees of a host (its facts, cached), the base of every step type, and the
one put-if-changed of a file that every file a step or `serve up` writes goes through."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from ..errors import PlaybookError
from . import batch
from . import facts as F
from . import host_facts as H
from .facts import q
from .ops import Op, Shell, Upload
from .transport import Transport

Mode = Annotated[str, Field(pattern=r"^0?[0-7]{3}$",
                            description='Octal permission string, quoted: "0644".')]

# --------------------------------------------------------------------------- host context


@dataclass
class HostContext:
    """What steps see of one host: its facts (cached), the variables, shared run resources.

    transport None = the host cannot be reached (dry run): facts take their fresh-guest value.
    """

    inventory: Any
    node: Any
    variables: dict[str, Any]
    transport: Transport | None = None
    wheel: Any = None  # ProjectWheel shared by every host of a run
    base_dir: Path = Path(".")
    templates_dir: Path | None = None
    records: dict[str, Any] = field(default_factory=dict)
    reporter: Any = None  # vcfslm.progress.Reporter for long operations (None: not reported)
    _facts: dict[str, Any] = field(default_factory=dict)

    @property
    def user(self) -> str:
        return self.transport.user if self.transport is not None else self.inventory.guest.user

    @property
    def offline(self) -> bool:
        return self.transport is None

    def fact(self, fact: F.Fact):
        """The fact's value on this host (gathered once until `forget`)."""
        if fact.key not in self._facts:
            if self.transport is None:
                self._facts[fact.key] = fact.absent
            else:
                self._facts[fact.key] = batch.run_one(self.transport, fact)
        return self._facts[fact.key]

    def has_fact(self, fact: F.Fact) -> bool:
        return fact.key in self._facts

    def prefetch(self, facts: list[F.Fact]) -> int:
        """Gather the facts not cached yet, together in one round trip (batch.gather).
        Returns the round trips made."""
        if self.transport is None:
            return 0
        values, trips = batch.gather(self.transport, [f for f in facts if f.key not in self._facts])
        self._facts.update(values)
        return trips

    def forget(self) -> None:
        """Drop cached facts (after a step changed the host)."""
        self._facts.clear()

    def bench_interface(self) -> str:
        """The guest interface holding the node's bench IP (bench.interface when set)."""
        if self.inventory.bench.interface:
            return self.inventory.bench.interface
        iface = H.interface_of(str(self.node.bench_ip), self.fact(H.INTERFACES))
        if iface is not None:
            return iface.name
        if self.offline:
            return "<bench-interface>"
        raise PlaybookError(f"{self.node.name}: bench IP {self.node.bench_ip} is on no interface of "
                            "the guest; set bench.interface or fix the guest network")

    def template_context(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {**self.variables, "bench_interface": self.bench_interface(), **extra}


def locked(venv: str, cmd: str) -> str:
    """`cmd` (one program and its arguments, no shell syntax) under an exclusive lock on the
    venv: guests sharing one venv (a shared filesystem, the lab) install one at a time.
    flock comes with util-linux (base.yaml)."""
    return f"flock -w 3600 {q(venv.rstrip('/') + '.lock')} {cmd}"


def _mode(mode: str | None) -> int | None:
    return int(mode, 8) if mode is not None else None


# --------------------------------------------------------------------------- step types


class Step(BaseModel):
    """Base of every step type: its arguments, validated strictly."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: ClassVar[str] = ""

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        raise NotImplementedError

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        """The facts `plan` reads on a converged host, known before any of them is read: the
        runner gathers them (with the following steps') in one round trip. A fact `plan`
        reads only after another's answer is left out and read on its own when needed."""
        return []



def ownership_ops(path: str, state: F.FileState, mode: str | None, owner: str | None,
                   group: str | None, sudo: bool, fresh: bool) -> list[Op]:
    """chmod/chown still needed; `fresh`: the file was just written (its mode is set already)."""
    ops: list[Op] = []
    if mode is not None and not fresh and state.mode and int(state.mode, 8) != int(mode, 8):
        ops.append(Shell(f"chmod {mode} {q(path)}", sudo=sudo))
    if (owner and (fresh or owner != state.owner)) or (group and (fresh or group != state.group)):
        spec = (owner or "") + (f":{group}" if group else "")
        ops.append(Shell(f"chown {q(spec)} {q(path)}", sudo=sudo))
    return ops


def content_ops(path: str, data: bytes, mode: str | None, owner: str | None, group: str | None,
                ctx: HostContext, sudo: bool) -> list[Op]:
    """Write `data` to `path` only if its sha256 differs; then fix mode/owner if needed."""
    state = ctx.fact(F.file_state(path, sudo=sudo))
    if state.kind == "directory":
        raise PlaybookError(f"{path} is a directory, expected a file")
    ops: list[Op] = []
    write = state.sha256 != hashlib.sha256(data).hexdigest()
    if write:
        parent = path.rsplit("/", 1)[0] or "/"
        ops.append(Shell(f"mkdir -p {q(parent)}", sudo=sudo))
        # A new file gets the asked mode, else keeps the current one (put would reset it).
        keep = int(state.mode, 8) if state.mode else None
        ops.append(Upload(path, data=data, mode=_mode(mode) if mode else keep, sudo=sudo))
    return ops + ownership_ops(path, state, mode, owner, group, sudo, write)

