"""Puts a node's share of the deployment on it over SSH, reads it back, takes it down (the
thin driver; the decisions are in desired.py, changes.py and rollout.py).

Files converge the way the playbooks' do: guest/'s file facts read them (one round trip
for all), guest/'s put-if-changed (content_ops) writes what differs, guest/'s file step
removes what is no longer wanted, and every command goes out as guest/'s operations.

Supervision: where systemd runs the guest, one unit per program; elsewhere (the lab's
loopback guests, containers) supervisord from the vLLM venv, one per node, with every
program under it. Both restart a program that dies, and both stop a program's whole
process tree (vLLM's engine process included).

The key is written with the transport's file put (mode 0600 before its first byte; the
command log records the path and mode, never the content), read back into memory over
SFTP, and fed to the node's probe on stdin: it is on no command line, in no log and in
no file on this machine but the operator's key file.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ServeError, TransportError
from ..guest import facts as F
from ..guest.context import HostContext, content_ops
from ..guest.ops import Op, Shell, execute
from ..guest.steps import FileStep
from ..guest.transport import Transport
from ..serve.server_process import quote_log
from . import remote
from .changes import (
    NodeChanges,
    NodeState,
    ProgramState,
    parse_supervisor_status,
    parse_systemd_show,
)
from .confinement import owned_paths
from .desired import (
    MANIFEST,
    SUPERVISORD,
    SYSTEMD,
    UNIT_DIR,
    NodeService,
    socket_folder,
    supervisor_socket,
)
from .keys import key_of_env

q = shlex.quote
POLL_S = 1.0
STOP_WAIT_S = 60.0
# supervisord's states of a program that will not come back by itself.
GAVE_UP = ("FATAL", "EXITED", "STOPPED", "FAILED", "INACTIVE")
# systemd's ActiveState of a stopped unit.
STOPPED_UNIT = ("INACTIVE", "FAILED")


class NodeDriver:
    """One node's share of the deployment, over one transport."""

    def __init__(self, transport: Transport, *, serve_dir: str, venv_bin: str, deployment: str = "",
                 service_user: str | None = None):
        self.t = transport
        self.serve_dir = serve_dir
        self.venv_bin = venv_bin
        self.deployment = deployment
        self.login = getattr(transport, "user", "root")
        self.sudo = self.login != "root"
        # The programs' user (guest.service_user); None or the SSH user: nothing to hand over.
        self.service_user = service_user if service_user not in (None, self.login) else None

    # ------------------------------------------------------------------ reading

    @property
    def conf(self) -> str:
        return f"{self.serve_dir}/supervisord.conf"

    def supervisorctl(self, *args: str) -> str:
        return " ".join([q(f"{self.venv_bin}/supervisorctl"), "-c", q(self.conf), *map(q, args)])

    def supervisor_of_guest(self, choice: str) -> str:
        """systemd when the guest runs it (sd_booted: /run/systemd/system exists), else supervisord."""
        if choice != "auto":
            return choice
        result = self.t.run("test -d /run/systemd/system", check=False)
        return SYSTEMD if result.ok else SUPERVISORD

    def manifest(self) -> dict[str, Any] | None:
        result = self.t.run(f"cat {q(self.serve_dir + '/' + MANIFEST)} 2>/dev/null", check=False)
        if not result.ok or not result.stdout.strip():
            return None
        try:
            return json.loads(result.stdout)
        except ValueError:
            return None

    def _theirs(self, path: str) -> bool:
        """Whether `path` is in one of the service user's rooms (nginx's prefixes, the
        certificates): the SSH user, when it is another user, reaches it with sudo only."""
        return bool(self.service_user) and path.startswith(
            tuple(f"{self.serve_dir}/{room}/" for room in ("frontdoor", "proxy", "tls")))

    def _sudo_for(self, path: str) -> bool:
        """Root for the systemd units and the service user's rooms; the rest of the node's
        folder belongs to the SSH user."""
        return self.sudo and (path.startswith(UNIT_DIR) or self._theirs(path))

    def _owner_of(self, path: str) -> str | None:
        return self.service_user if self._theirs(path) else None

    def _context(self) -> HostContext:
        """guest/'s view of this node: the facts its file steps read, cached until forgotten."""
        return HostContext(None, None, {}, self.t)

    def file_digests(self, paths: Sequence[str], ctx: HostContext | None = None) -> dict[str, str | None]:
        """path -> sha256 of its content (None: absent), read as guest/'s file facts in one
        round trip."""
        ctx = ctx or self._context()
        facts = {p: F.file_state(p, sudo=self._sudo_for(p)) for p in paths}
        ctx.prefetch(list(facts.values()))
        return {p: ctx.fact(fact).sha256 for p, fact in facts.items()}

    def programs(self, supervisor: str, units: Mapping[str, str]) -> tuple[bool, dict[str, ProgramState]]:
        """(the supervisor answers, program -> state)."""
        if supervisor == SYSTEMD:
            if not units:
                return True, {}
            result = self.t.run("systemctl show -p Id,ActiveState,MainPID " +
                                " ".join(q(u) for u in units.values()), check=False)
            return True, parse_systemd_show(result.stdout, {u: p for p, u in units.items()})
        if not self._supervisord_answers():
            return False, {}
        result = self.t.run(self.supervisorctl("status"), check=False)
        return True, parse_supervisor_status(result.stdout)

    def _supervisord_answers(self) -> bool:
        result = self.t.run(self.supervisorctl("pid"), check=False)
        return result.ok and result.stdout.strip().isdigit()

    def observe(self, desired: NodeService) -> NodeState:
        manifest = self.manifest()
        paths = sorted({f.path for f in desired.files} | set((manifest or {}).get("files") or []))
        units = {p.name: p.unit(self.deployment) for p in desired.programs}
        up, programs = self.programs(desired.supervisor, units)
        return NodeState(self.file_digests(paths), manifest, up, programs)

    def read_key(self) -> str | None:
        """The deployment's key as this node holds it (None: none), read into memory over SFTP
        (no file on this machine, nothing in the command log) and checked as a key file is."""
        path = f"{self.serve_dir}/serve.env"
        if not self.t.run(f"test -f {q(path)}", check=False).ok:
            return None
        text = self.t.read_bytes(path).decode("utf-8", "replace")
        return key_of_env(text, f"{self.t.host}:{path}")

    def probe(self, python: str, gets: Sequence[Mapping[str, Any]], rss: Mapping[str, int] | None = None,
              key: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
        result = self.t.run(remote.probe_command(python), check=False, timeout=timeout,
                            input=remote.probe_input(gets, rss or {}, key))
        if not result.ok:
            raise ServeError(f"{self.t.host}: the node's probe failed: {result.stderr.strip()[-400:]}")
        return remote.parse_probe(result.stdout)

    # ------------------------------------------------------------------ changing

    def apply(self, desired: NodeService, changes: NodeChanges) -> None:
        """Write what differs, then have the supervisor start, restart and stop what changes
        says (all at once: the rolling path is rollout.py's)."""
        self.converge_files(desired, changes)
        self.run(self.program_ops(desired, changes.start, changes.restart, changes.stop, changes.revive))
        self.remove_files(changes)

    def run(self, ops: Sequence[Op]) -> None:
        for op in ops:
            execute(op, self.t, None)

    def converge_files(self, desired: NodeService, changes: NodeChanges) -> None:
        """The files changes.write names, through guest/'s put-if-changed (content_ops):
        written only where their content differs, atomically, with their mode; those of the
        service user's rooms staged and installed with sudo and handed over to it."""
        if desired.supervisor == SUPERVISORD and self.service_user and self.sudo:
            raise ServeError(f"{self.t.host}: supervisord runs as {self.login} there and cannot switch to "
                             f"guest.service_user {self.service_user}: connect as root, or set "
                             f"guest.service_user: {self.login}")
        ctx = self._context()
        # Closed to everyone else; with a service user, the hand-over opens it to that user's group
        # (closing it here first would cut the running programs off for a moment).
        sockets = socket_folder(self.serve_dir)
        ops: list[Op] = [Shell(f"mkdir -p {q(self.serve_dir + '/logs')} {q(self.serve_dir + '/frontdoor/tmp')} "
                               f"{q(self.serve_dir + '/proxy/tmp')} {q(self.serve_dir + '/tls')} {q(sockets)} && "
                               f"chmod 700 {q(sockets)}" + ("" if self.service_user else f" {q(self.serve_dir)}"))]
        files = {f.path: f for f in desired.files}
        self.file_digests(changes.write, ctx)
        for path in changes.write:
            ops += content_ops(path, files[path].content.encode(), f"{files[path].mode:04o}",
                               self._owner_of(path), self._owner_of(path), ctx, self._sudo_for(path))
        ops += self.hand_over_ops(desired)
        self.run(ops)

    def hand_over_ops(self, desired: NodeService) -> list[Shell]:
        """The service user owns what its programs write and the key files they read; the
        node's folder lets it in (group) and nobody else."""
        if not self.service_user:
            return []
        user, folder = q(self.service_user), q(self.serve_dir)
        owned = owned_paths(self.serve_dir, desired.supervisor, socket_folder(self.serve_dir))
        return [Shell(f"mkdir -p {q(owned[0])} && chown -R {user}:{user} {' '.join(q(p) for p in owned)} && "
                      f"chgrp {user} {folder} && chmod 750 {folder}", sudo=self.sudo)]

    def remove_files(self, changes: NodeChanges) -> None:
        """The files the last serve up wrote and this one does not (guest/'s file step, absent)."""
        ctx = self._context()
        self.file_digests(changes.remove, ctx)
        self.run([op for path in changes.remove
                  for op in FileStep(path=path, state="absent").plan(ctx, self._sudo_for(path))])

    def program_ops(self, desired: NodeService, start: Sequence[str] = (), restart: Sequence[str] = (),
                    stop: Sequence[str] = (), revive: Sequence[str] = ()) -> list[Shell]:
        """The supervisor's commands that start, restart, stop and start again the programs
        named (after their files are written), and no other."""
        if desired.supervisor == SYSTEMD:
            return [Shell(systemd_command(self.deployment, desired, start, restart, stop, revive), sudo=self.sudo)]
        if not self._supervisord_answers():
            # A fresh start brings up every program of the config.
            return [Shell(f"{q(self.venv_bin + '/supervisord')} -c {q(self.conf)}")]
        ops = []
        if start or restart or stop:
            # update NAME adds, removes or restarts that program when its section changed (each
            # section carries its program's digest); the programs not named are left alone.
            ops.append(Shell(self.supervisorctl("update", *start, *restart, *stop)))
        if revive:
            ops.append(Shell(self.supervisorctl("start", *revive) + " || true"))
        return ops

    def reload_ops(self, desired: NodeService, program: str) -> list[Shell]:
        """A program reads its files again without a restart (SIGHUP: nginx's graceful reload,
        its connections kept)."""
        if desired.supervisor == SYSTEMD:
            unit = desired.program(program).unit(self.deployment)
            return [Shell(f"systemctl kill --signal=HUP --kill-who=main {q(unit)}", sudo=self.sudo)]
        return [Shell(self.supervisorctl("signal", "HUP", program))]

    def prepare_ops(self, desired: NodeService) -> list[Shell]:
        """The supervisor reads the programs' new definitions without applying them."""
        if desired.supervisor == SYSTEMD:
            return [Shell("systemctl daemon-reload", sudo=self.sudo)]
        return [Shell(self.supervisorctl("reread"))] if self._supervisord_answers() else []

    def down(self) -> list[str]:
        """Stop every program serve up started on this node and remove what it wrote (its
        logs stay); the programs it stopped."""
        manifest = self.manifest()
        if manifest is None:
            return []
        programs = list(manifest_programs_of(manifest))
        units = [str(u) for u in manifest.get("units") or []] if manifest.get("supervisor") == SYSTEMD else []
        if units:
            self.t.run("systemctl disable --now " + " ".join(q(u) for u in units), sudo=self.sudo, check=False)
            self._wait_units_stopped(units)
        elif self._supervisord_answers():
            pid = self.t.run(self.supervisorctl("pid"), check=False).stdout.strip()
            self.t.run(self.supervisorctl("shutdown"), check=False)
            self._wait_gone(int(pid))
        files = [str(f) for f in manifest.get("files") or []]
        for path in files:
            self.t.run(f"rm -f {q(path)}", sudo=self._sudo_for(path))
        if manifest.get("supervisor") == SYSTEMD:
            # A unit that failed before it was stopped stays listed (not-found, failed) until reset.
            self.t.run("systemctl daemon-reload; systemctl reset-failed " + " ".join(q(u) for u in units) +
                       " 2>/dev/null; true", sudo=self.sudo, check=False)
        self.t.run(f"rm -rf {q(socket_folder(self.serve_dir))}", sudo=self.sudo and bool(self.service_user),
                   check=False)     # the servers' sockets
        self.t.run(f"rm -f {q(self.serve_dir + '/' + MANIFEST)} {q(supervisor_socket(self.serve_dir))}")
        return programs

    def _wait_units_stopped(self, units: Sequence[str], sleep: Callable[[float], None] = time.sleep) -> None:
        """Every unit inactive (or failed: stopped all the same), as systemd says; ServeError
        naming those still running after STOP_WAIT_S."""
        deadline = time.monotonic() + STOP_WAIT_S
        while True:
            _, states = self.programs(SYSTEMD, {u: u for u in units})
            running = sorted(u for u in units if u in states and states[u].state not in STOPPED_UNIT)
            unknown = sorted(u for u in units if u not in states)
            if not running and not unknown:
                return
            if time.monotonic() > deadline:
                raise ServeError(f"{self.t.host}: still running {STOP_WAIT_S:g} s after systemctl stop: "
                                 f"{', '.join(running + unknown)}")
            sleep(POLL_S)

    def _wait_gone(self, pid: int, sleep: Callable[[float], None] = time.sleep) -> None:
        deadline = time.monotonic() + STOP_WAIT_S
        while self.t.run(f"kill -0 {pid}", check=False).ok:
            if time.monotonic() > deadline:
                raise ServeError(f"{self.t.host}: supervisord (pid {pid}) still runs {STOP_WAIT_S:g} s after "
                                 f"shutdown")
            sleep(0.2)

    def log_cause(self, log: str, lines: int = 3000) -> str:
        """What an error quotes of a program's log: its first error block and a short tail
        (serve/server_process.py's rule; the recent part only, a log outlives restarts)."""
        try:
            text = self.t.run(f"tail -n {lines} {q(log)}", check=False).stdout
        except TransportError:
            return ": (log unreadable)"
        return quote_log(text)


def systemd_command(deployment: str, desired: NodeService, start: Sequence[str], restart: Sequence[str],
                    stop: Sequence[str], revive: Sequence[str]) -> str:
    unit = {p.name: p.unit(deployment) for p in desired.programs}
    old = f"vcfslm-{deployment}-"
    commands = ["systemctl daemon-reload"]
    if stop:
        commands.insert(0, "systemctl disable --now " + " ".join(q(old + n + ".service") for n in stop))
    if start:
        commands.append("systemctl enable --now " + " ".join(q(unit[n]) for n in start))
    if restart:
        commands.append("systemctl restart " + " ".join(q(unit[n]) for n in restart))
    if revive:
        commands.append("systemctl start " + " ".join(q(unit[n]) for n in revive))
    return " && ".join(commands)


def manifest_programs_of(manifest: Mapping[str, Any]) -> list[str]:
    programs = manifest.get("programs") or {}
    return list(programs)
