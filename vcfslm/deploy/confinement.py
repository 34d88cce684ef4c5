"""How each program of the service is confined (pure): the user it runs as, what it may
write, and the few sandbox settings that differ between programs. The settings every
program shares are in templates/serve-unit.service.j2; supervisord applies the user and
the environment only (it has no sandbox).

What each program needs, and so keeps:
- a vLLM server reads the model, the venv and its launch script; writes its home (HOME:
  vLLM's and torch's caches under ~/.cache; Inductor's cache goes to its private /tmp) and
  /dev/shm (its engine's shared memory: PrivateDevices keeps /dev/shm); numactl binds it
  with set_mempolicy and sched_setaffinity (in @system-service's @resources, so allowed);
  oneDNN and torch generate machine code at run time, so MemoryDenyWriteExecute stays off;
  it reads /proc/meminfo and /proc/cpuinfo, so /proc keeps more than its pids.
- the router reads the venv; it writes nothing (its log is the journal or supervisord's).
- nginx writes its prefix (pid, logs, temp files) and reads its config and key map; it
  runs as the service user from the start (its `user` directive only matters to a root
  master), so it needs no capability unless the door's port is below 1024.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

# Bump when the sandbox's meaning changes: every program restarts under the new one.
CONFINEMENT_FORMAT = 1
PRIVILEGED_PORTS = 1024


@dataclass(frozen=True)
class Confinement:
    user: str
    read_write: tuple[str, ...] = ()                     # ReadWritePaths (the rest is read-only)
    environment: Mapping[str, str] = field(default_factory=dict)
    deny_write_execute: bool = False                     # MemoryDenyWriteExecute
    proc_pids_only: bool = False                         # ProcSubset=pid
    capabilities: tuple[str, ...] = ()                   # ambient and bounding (empty: none)


def home_dir(folder: str) -> str:
    """The service's home on a node: vLLM's caches. Owned by the service user."""
    return f"{folder}/home"


def owned_paths(folder: str, supervisor: str, sockets: str) -> tuple[str, ...]:
    """What the service user owns on a node, its home first: its writable folders (the two
    nginx prefixes hold their key maps, which nginx reads itself; the servers make their
    sockets in `sockets`), the certificates its programs read, and, under supervisord, the
    servers' environment file (its programs source it as that user; systemd reads it as root)."""
    own = (home_dir(folder), f"{folder}/frontdoor", f"{folder}/proxy", f"{folder}/tls", sockets)
    return (*own, f"{folder}/serve.env") if supervisor == "supervisord" else own


def confinement(program: str, folder: str, user: str, door_port: int | None = None,
                sockets: str | None = None) -> Confinement:
    if program.startswith("vllm-node"):
        home = home_dir(folder)
        return Confinement(user, read_write=(home, *((sockets,) if sockets else ())), environment={"HOME": home})
    if program in ("frontdoor", "proxy"):
        low = program == "frontdoor" and door_port is not None and door_port < PRIVILEGED_PORTS
        return Confinement(user, read_write=(f"{folder}/{program}",), deny_write_execute=True,
                           proc_pids_only=True, capabilities=("CAP_NET_BIND_SERVICE",) if low else ())
    return Confinement(user, environment={"HOME": home_dir(folder)})


def confined_digest(digest: str, confined: Confinement) -> str:
    """A program's digest with its confinement: a new user or sandbox restarts it."""
    text = f"{digest}\0{CONFINEMENT_FORMAT}\0{confined!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_environment(program, confined: Confinement):
    """The program (a desired.Program) with the confinement's environment and digest."""
    return replace(program, environment={**program.environment, **confined.environment},
                   digest=confined_digest(program.digest, confined))
