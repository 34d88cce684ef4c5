"""What `serve up` must change on one node: the desired files and programs against what the
node has (pure), and how the supervisors report their programs.

A program is restarted only when its digest (its command line, environment and the files
it reads) differs from the one the node's manifest recorded, started when it is new or
not running, and stopped when the deployment no longer has it. A file is written only
when its content differs, and removed when the last `serve up` wrote it and this one
does not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .desired import MANIFEST, NodeService

RUNNING = "RUNNING"


@dataclass(frozen=True)
class ProgramState:
    name: str
    state: str                  # supervisord's (RUNNING, STARTING, BACKOFF, FATAL, ...) or systemd's, upper case
    pid: int | None = None

    @property
    def running(self) -> bool:
        return self.state in (RUNNING, "STARTING", "ACTIVE", "ACTIVATING", "RELOADING")


@dataclass(frozen=True)
class NodeState:
    """What a node has of the deployment."""

    digests: Mapping[str, str | None]            # path -> sha256 of its content (None: absent)
    manifest: Mapping[str, object] | None         # the last serve up's record, None: none
    supervisor_up: bool                           # supervisord answers (systemd: always)
    programs: Mapping[str, ProgramState] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeChanges:
    node: str
    write: tuple[str, ...] = ()       # files whose content differs
    remove: tuple[str, ...] = ()      # files the last serve up wrote that this one does not
    start: tuple[str, ...] = ()       # new programs
    restart: tuple[str, ...] = ()     # programs whose settings changed
    stop: tuple[str, ...] = ()        # programs the deployment no longer has
    revive: tuple[str, ...] = ()      # unchanged programs that are not running

    @property
    def empty(self) -> bool:
        return not (self.write or self.remove or self.start or self.restart or self.stop or self.revive)

    def lines(self) -> list[str]:
        """The plan in words, one line per kind of change."""
        out = []
        for verb, items in (("start", self.start), ("restart (settings changed)", self.restart),
                            ("start again (not running)", self.revive), ("stop", self.stop),
                            ("write", self.write), ("remove", self.remove)):
            if items:
                out.append(f"{self.node}: {verb} {', '.join(items)}")
        return out

    def to_dict(self) -> dict[str, list[str]]:
        return {k: list(getattr(self, k)) for k in ("write", "remove", "start", "restart", "stop", "revive")}


def manifest_programs(manifest: Mapping[str, object] | None) -> dict[str, str]:
    """program -> digest, as the last serve up recorded them."""
    programs = (manifest or {}).get("programs") or {}
    return dict(programs) if isinstance(programs, dict) else {str(p): "" for p in programs}


def node_changes(desired: NodeService, observed: NodeState) -> NodeChanges:
    before = manifest_programs(observed.manifest)
    wanted = {p.name: p.digest for p in desired.programs}
    # The manifest goes last: a serve up cut short leaves the old record, so the next one redoes it.
    files = sorted(desired.files, key=lambda f: f.path.rsplit("/", 1)[-1] == MANIFEST)
    write = tuple(f.path for f in files if observed.digests.get(f.path) != f.digest)
    desired_paths = {f.path for f in desired.files}
    old_files = (observed.manifest or {}).get("files") or []
    remove = tuple(p for p in old_files if p not in desired_paths)
    start = tuple(n for n in wanted if n not in before)
    restart = tuple(n for n in wanted if n in before and before[n] != wanted[n])
    stop = tuple(n for n in before if n not in wanted)
    revive = tuple(n for n in wanted if n in before and before[n] == wanted[n]
                   and not (observed.supervisor_up and n in observed.programs and observed.programs[n].running))
    return NodeChanges(desired.node, write, remove, start, restart, stop, revive)


_SUPERVISOR_LINE = re.compile(r"^(\S+)\s+([A-Z]+)\b(?:\s+pid (\d+))?")


def parse_supervisor_status(text: str) -> dict[str, ProgramState]:
    """`supervisorctl status` lines: `vllm-node0   RUNNING   pid 412, uptime 0:01:02`."""
    out = {}
    for line in text.splitlines():
        m = _SUPERVISOR_LINE.match(line.strip())
        if m:
            out[m.group(1)] = ProgramState(m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None)
    return out


def parse_systemd_show(text: str, unit_to_program: Mapping[str, str]) -> dict[str, ProgramState]:
    """`systemctl show -p Id,ActiveState,MainPID UNIT...`: blocks of KEY=VALUE lines."""
    out = {}
    for block in text.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        program = unit_to_program.get(fields.get("Id", ""))
        if program:
            pid = int(fields.get("MainPID") or 0) or None
            out[program] = ProgramState(program, fields.get("ActiveState", "unknown").upper(), pid)
    return out
