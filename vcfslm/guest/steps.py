"""Playbook step types: small typed units that look at facts and yield only the commands
still needed (pyinfra's model). "changed" means at least one operation ran.

Each step type is a pydantic model of its arguments (unknown arguments are refused
when the playbook loads); `plan(ctx, sudo)` returns the operations (`Shell` or
`Upload`) that would bring the guest to the described state, [] when it is there;
`facts(ctx, sudo)` names the facts `plan` reads up front, so the runner can gather a
host's facts for all its remaining steps in one round trip (guest/batch.py).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import CommandFailed, PlaybookError
from ..guest_layout import model_kind as contract_model_kind
from ..guest_layout import model_slug, synthetic_config_on_guest
from ..presets import SyntheticSpecError, parse_synthetic
from . import batch
from . import facts as F
from .facts import q
from .templates import render_template
from .transport import Transport, sudo_wrap

Mode = Annotated[str, Field(pattern=r"^0?[0-7]{3}$",
                            description='Octal permission string, quoted: "0644".')]
MARKER_WHEEL = ".vcfslm-wheel"
MARKER_MODEL = ".vcfslm-model"


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
        iface = F.interface_of(str(self.node.bench_ip), self.fact(F.INTERFACES))
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


class PackagesStep(Step):
    """System packages via apt or dnf (whichever the guest has)."""

    kind: ClassVar[str] = "packages"
    apt: list[str] = Field(default_factory=list, description="Debian/Ubuntu package names.")
    dnf: list[str] = Field(default_factory=list, description="RHEL/Fedora package names.")
    update: bool = Field(True, description="Refresh the package index before installing.")

    @model_validator(mode="after")
    def _some(self) -> PackagesStep:
        if not self.apt and not self.dnf:
            raise ValueError("name packages for apt and/or dnf")
        return self

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        return [F.packages(self.apt, self.dnf)]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        state = ctx.fact(F.packages(self.apt, self.dnf))
        if state.manager is None:
            raise PlaybookError("the guest has neither apt nor dnf")
        wanted = self.apt if state.manager == "apt" else self.dnf
        if not wanted:
            raise PlaybookError(f"the guest uses {state.manager}, and this step names no "
                                f"{state.manager} packages")
        missing = [p for p in wanted if p not in state.installed]
        if not missing:
            return []
        names = " ".join(q(p) for p in missing)
        if state.manager == "apt":
            env = "DEBIAN_FRONTEND=noninteractive"
            cmd = (f"{env} apt-get update -qq && " if self.update else "") + \
                  f"{env} apt-get install -y -qq --no-install-recommends {names}"
        else:
            cmd = ("dnf makecache -q && " if self.update else "") + f"dnf install -y -q {names}"
        return [Shell(cmd, sudo=sudo, timeout=1800,
                      failure=missing_packages_message(state.manager, missing))]


def missing_packages_message(manager: str, missing: list[str]) -> str:
    """Why a package install failed, and how to fix it for good: the packages are not in the
    template and its package sources did not provide them (an offline guest reaches none)."""
    them = "it" if len(missing) == 1 else "them"
    names = " ".join(missing)
    install = (f"apt-get install -y {names}" if manager == "apt" else f"dnf install -y {names}")
    return (f"{manager} could not install {', '.join(missing)}: missing from the guest, and its "
            f"package sources did not provide {them} (an offline guest reaches none). Bake "
            f"{them} into the template: run `{install}` in the template VM before it is cloned "
            f"(the lab's fresh root: add {them} to TEMPLATE_PACKAGES in vcfslm/lab/fresh.py, "
            f"which debootstrap --include's).")


def _ownership_ops(path: str, state: F.FileState, mode: str | None, owner: str | None,
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
    return ops + _ownership_ops(path, state, mode, owner, group, sudo, write)


class FileStep(Step):
    """A remote file (with content from the playbook or a local file), a directory, or absence."""

    kind: ClassVar[str] = "file"
    path: str
    state: Literal["file", "directory", "absent"] = "file"
    content: str | None = Field(None, description="File content (state: file).")
    src: str | None = Field(None, description="Local file to copy, relative to the playbook.")
    mode: Mode | None = None
    owner: str | None = None
    group: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> FileStep:
        if self.state == "file" and (self.content is None) == (self.src is None):
            raise ValueError("a file needs exactly one of content or src")
        if self.state != "file" and (self.content is not None or self.src is not None):
            raise ValueError(f"state {self.state} takes no content or src")
        if not self.path.startswith("/"):
            raise ValueError("path must be absolute")
        return self

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        return [F.file_state(self.path.rstrip("/") or "/", sudo=sudo)]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        path = self.path.rstrip("/") or "/"
        if self.state == "file":
            if self.content is not None:
                data = self.content.encode()
            else:
                local = (ctx.base_dir / Path(self.src).expanduser())
                try:
                    data = local.read_bytes()
                except OSError as exc:
                    raise PlaybookError(f"cannot read {local}: {exc.strerror}") from None
            return content_ops(path, data, self.mode, self.owner, self.group, ctx, sudo)
        state = ctx.fact(F.file_state(path, sudo=sudo))
        if self.state == "absent":
            if not state.exists:
                return []
            return [Shell(f"rm -{'r' if state.kind == 'directory' else ''}f {q(path)}", sudo=sudo)]
        if state.exists and state.kind != "directory":
            raise PlaybookError(f"{path} exists and is not a directory")
        ops: list[Op] = [] if state.exists else [Shell(f"mkdir -p {q(path)}", sudo=sudo)]
        if not state.exists and self.mode:
            ops.append(Shell(f"chmod {self.mode} {q(path)}", sudo=sudo))
        return ops + _ownership_ops(path, state, self.mode if state.exists else None, self.owner,
                                    self.group, sudo, not state.exists)


class TemplateStep(Step):
    """Render a jinja2 template from templates/ to a remote file; changed only if content differs."""

    kind: ClassVar[str] = "template"
    src: str = Field(description="Template name in the templates/ folder, e.g. env.sh.j2.")
    dest: str = Field(description="Remote path.")
    mode: Mode | None = None
    owner: str | None = None
    group: str | None = None
    vars: dict[str, Any] = Field(default_factory=dict, description="Extra template variables.")

    @model_validator(mode="after")
    def _absolute(self) -> TemplateStep:
        if not self.dest.startswith("/"):
            raise ValueError("dest must be absolute")
        return self

    def render(self, ctx: HostContext) -> str:
        return render_template(self.src, ctx.template_context(self.vars), ctx.templates_dir)

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        interfaces = [] if ctx.inventory.bench.interface else [F.INTERFACES]
        return interfaces + [F.file_state(self.dest, sudo=sudo)]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        return content_ops(self.dest, self.render(ctx).encode(), self.mode, self.owner, self.group,
                           ctx, sudo)


class TemplateFile(BaseModel):
    """One file of a `templates` step: where it goes and its own template variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dest: str = Field(description="Remote path.")
    vars: dict[str, Any] = Field(default_factory=dict, description="This file's template variables.")

    @model_validator(mode="after")
    def _absolute(self) -> TemplateFile:
        if not self.dest.startswith("/"):
            raise ValueError("dest must be absolute")
        return self


class TemplatesStep(Step):
    """One jinja2 template rendered to several remote files, each with variables of its own
    (say one launch script per vNUMA node); each file is changed only if its content differs."""

    kind: ClassVar[str] = "templates"
    src: str = Field(description="Template name in the templates/ folder.")
    files: list[TemplateFile] = Field(min_length=1, description="The files: [{dest, vars}].")
    mode: Mode | None = None
    owner: str | None = None
    group: str | None = None
    vars: dict[str, Any] = Field(default_factory=dict, description="Template variables of every file.")

    def render(self, ctx: HostContext, file: TemplateFile) -> str:
        return render_template(self.src, ctx.template_context({**self.vars, **file.vars}),
                               ctx.templates_dir)

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        interfaces = [] if ctx.inventory.bench.interface else [F.INTERFACES]
        return interfaces + [F.file_state(f.dest, sudo=sudo) for f in self.files]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        return [op for f in self.files for op in content_ops(
            f.dest, self.render(ctx, f).encode(), self.mode, self.owner, self.group, ctx, sudo)]


class CommandStep(Step):
    """A shell command, guarded: skipped when `creates` exists or `unless` succeeds."""

    kind: ClassVar[str] = "command"
    cmd: str
    creates: str | None = Field(None, description="Skip when this remote path exists.")
    unless: str | None = Field(None, description="Skip when this command exits 0.")
    chdir: str | None = None

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        # `unless` runs only when `creates` is missing, as written: it is not batched with it.
        if self.creates:
            return [F.path_exists(self.creates, sudo=sudo)]
        return [F.command_succeeds(self.unless, sudo=sudo)] if self.unless else []

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        if self.creates and ctx.fact(F.path_exists(self.creates, sudo=sudo)):
            return []
        if self.unless and ctx.fact(F.command_succeeds(self.unless, sudo=sudo)):
            return []
        cmd = f"cd {q(self.chdir)} && {self.cmd}" if self.chdir else self.cmd
        return [Shell(cmd, sudo=sudo)]


class VenvStep(Step):
    """A Python virtual environment (left alone when it already exists)."""

    kind: ClassVar[str] = "venv"
    path: str
    python: str = "python3"
    system_site_packages: bool = False

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        return [F.venv_state(self.path)]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        if ctx.fact(F.venv_state(self.path)).exists:
            return []
        parent = self.path.rstrip("/").rsplit("/", 1)[0] or "/"
        flag = " --system-site-packages" if self.system_site_packages else ""
        return [Shell(f"mkdir -p {q(parent)} && "
                      + locked(self.path, f"{self.python} -m venv{flag} {q(self.path)}"),
                      sudo=sudo, timeout=600)]


def pip_install(py: str, requirements: list[str], *, index_url: str | None = None,
                extra_index_urls: list[str] = (), find_links: list[str] = (), no_index: bool = False,
                constraints: str | None = None, options: list[str] = ()) -> str:
    """The `python -m pip install` command line.

    --no-compile: pip would byte-compile every module of every wheel (torch's thousands) at
    install, tripling the install's time on a fresh guest; Python compiles what it imports
    on first use and keeps the .pyc files in the venv.
    """
    parts = [q(py), "-m pip install --disable-pip-version-check --no-input --no-compile -q"]
    if no_index:
        parts.append("--no-index")
    elif index_url:
        parts.append(f"--index-url {q(index_url)}")
    parts += [f"--extra-index-url {q(u)}" for u in extra_index_urls if not no_index]
    parts += [f"--find-links {q(d)}" for d in find_links]
    if constraints:
        parts.append(f"-c {q(constraints)}")
    parts += list(options)
    parts += [q(r) for r in requirements]
    return " ".join(parts)


class PipStep(Step):
    """Requirements in a venv, installed only when not already satisfied (with dependencies)."""

    kind: ClassVar[str] = "pip"
    venv: str
    packages: list[str] = Field(min_length=1, description="Requirement specifiers.")
    index_url: str | None = None
    extra_index_urls: list[str] = Field(default_factory=list)
    wheelhouse: str | None = Field(None, description="Local folder of wheels (relative: to the "
                                                     "playbook) pushed to the guest and installed "
                                                     "from with --no-index.")
    remote_wheelhouse: str | None = Field(None, description="Where the wheelhouse goes on the guest.")
    constraints: list[str] = Field(default_factory=list, description="Lines of a pip -c file.")
    without: list[str] = Field(default_factory=list, description=(
        "Dependencies the satisfied-check leaves out: ones a later step removes on purpose "
        "(pip_uninstall), which would otherwise bring the install back on every run."))

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        return [F.pip_state(self.venv, self.packages, self.without)]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        state = ctx.fact(F.pip_state(self.venv, self.packages, self.without))
        if state.satisfied:
            return []
        venv = self.venv.rstrip("/")
        ops: list[Op] = []
        find_links: list[str] = []
        if self.wheelhouse:
            remote = self.remote_wheelhouse or f"{venv}.wheelhouse"
            ops += push_folder(ctx, ctx.base_dir / Path(self.wheelhouse).expanduser(), remote, sudo)
            find_links.append(remote)
        constraints = None
        if self.constraints:
            constraints = f"{venv}/vcfslm-constraints.txt"
            ops.append(Upload(constraints, data=("\n".join(self.constraints) + "\n").encode(),
                              sudo=sudo))
        ops.append(Shell(locked(venv, pip_install(
            f"{venv}/bin/python", self.packages, index_url=self.index_url,
            extra_index_urls=self.extra_index_urls, find_links=find_links,
            no_index=bool(self.wheelhouse), constraints=constraints)), sudo=sudo, timeout=3600))
        return ops


def push_folder(ctx: HostContext, local: Path, remote: str, sudo: bool) -> list[Op]:
    """Upload the files of a local folder whose name or size differs on the guest."""
    if not local.is_dir():
        raise PlaybookError(f"wheelhouse {local} is not a folder")
    have = ctx.fact(F.dir_listing(remote))
    ops: list[Op] = []
    for path in sorted(p for p in local.iterdir() if p.is_file()):
        if have.get(path.name) != path.stat().st_size:
            ops.append(Upload(f"{remote}/{path.name}", local=str(path), sudo=sudo))
    if ops:
        ops.insert(0, Shell(f"mkdir -p {q(remote)}", sudo=sudo))
    return ops


class PipUninstallStep(Step):
    """Distributions removed from a venv; pip runs only when one of them is installed."""

    kind: ClassVar[str] = "pip_uninstall"
    venv: str
    packages: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]] = Field(
        min_length=1, description="Distribution names.")

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        return [F.dists_present(self.venv, self.packages)]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        present = ctx.fact(F.dists_present(self.venv, self.packages))
        names = [p for p in self.packages if p in present]
        if not names:
            return []
        venv = self.venv.rstrip("/")
        return [Shell(locked(venv, f"{q(venv + '/bin/python')} -m pip uninstall --disable-pip-version-check "
                                   f"--no-input -y -q " + " ".join(q(n) for n in names)),
                      sudo=sudo, timeout=600)]


class CheckStep(Step):
    """A read-only check: `argv` must exit 0 and print `expect`. Changes nothing; when the
    check does not pass it is run again as the step's command, which fails the host with
    `failure`, the command and its output (a dry run lists it instead).

    Its answer is read at the step itself, never gathered ahead with the facts of the steps
    before it: a check that starts a program would run again after each of them that changes
    the host."""

    kind: ClassVar[str] = "check"
    argv: list[str] = Field(min_length=1, description="The command and its arguments (each quoted).")
    expect: str = Field(min_length=1, description="Text the command's output must contain.")
    failure: str | None = Field(None, description="What a failed check means, and what to do.")

    def _fact(self, sudo: bool) -> F.Fact:
        return F.command_output(self.argv, sudo=sudo)

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        seen = ctx.fact(self._fact(sudo))
        if seen.exit == 0 and self.expect in seen.output:
            return []
        cmd = " ".join(q(a) for a in self.argv)
        rerun = (f"out=$({cmd} 2>&1); rc=$?; printf '%s\\n' \"$out\"; "
                 f"[ $rc -eq 0 ] && printf '%s' \"$out\" | grep -qF -- {q(self.expect)}")
        why = self.failure or "the check failed"
        return [Shell(rerun, sudo=sudo, timeout=600,
                      failure=f"{why} (expected {self.expect!r} in the output of: {cmd})")]


class WheelStep(Step):
    """The project's own wheel (built locally once per run), pushed and installed in a venv.

    Unchanged when the same version and wheel hash are installed (a marker in the venv).
    """

    kind: ClassVar[str] = "wheel"
    venv: str
    dest: str = Field(description="Remote folder the wheel is copied to.")
    extras: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$")]] = Field(
        default_factory=list, description='Extras to install, e.g. ["bench"].')
    index_url: str | None = None
    find_links: list[str] = Field(default_factory=list, description="Remote folders of wheels.")
    no_index: bool = False

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        venv = self.venv.rstrip("/")
        return [F.installed_version(venv, "vcfslm"), F.file_content(f"{venv}/{MARKER_WHEEL}")]

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        if ctx.wheel is None:
            raise PlaybookError("no project wheel is available to this run")
        wheel = ctx.wheel.get()
        venv = self.venv.rstrip("/")
        marker = "+".join([wheel.sha256, *sorted(self.extras)])  # one shell word
        installed = ctx.fact(F.installed_version(venv, "vcfslm"))
        recorded = ctx.fact(F.file_content(f"{venv}/{MARKER_WHEEL}"))
        if installed == wheel.version and (recorded or "").strip() == marker:
            return []
        remote = f"{self.dest.rstrip('/')}/{wheel.path.name}"
        py = f"{venv}/bin/python"
        target = remote + (f"[{','.join(self.extras)}]" if self.extras else "")
        opts = dict(index_url=self.index_url, find_links=self.find_links, no_index=self.no_index)
        marker_file = q(f"{venv}/{MARKER_WHEEL}")
        # Same version, new build: --force-reinstall --no-deps replaces vcfslm alone; the second
        # install only resolves the extras' dependencies. Under the venv's lock the marker is
        # checked again: a guest sharing this venv may have installed the same build meanwhile.
        install = (f"grep -qsx {q(marker)} {marker_file} || {{ "
                   + pip_install(py, [remote], options=["--no-deps", "--force-reinstall"], **opts)
                   + " && " + pip_install(py, [target], **opts)
                   + f" && echo {marker} > {marker_file}; }}")
        return [Shell(f"mkdir -p {q(self.dest)}", sudo=sudo),
                Upload(remote, local=str(wheel.path), sudo=sudo),
                Shell(locked(venv, f"sh -c {q(install)}"), sudo=sudo, timeout=3600)]


def model_kind(model: str) -> str:
    """'synthetic', 'dir' (a local folder pushed to the guest) or 'hub' (guest_layout.model_kind)."""
    kind = contract_model_kind(model)
    if kind is None:
        raise PlaybookError(f"model {model!r} is neither synthetic:*, a local folder, nor a hub id")
    return kind


class ModelStep(Step):
    """Stage the model: a hub id downloaded on the guest, a local folder pushed, or a
    synthetic:* spec recorded for the worker (which builds it at start)."""

    kind: ClassVar[str] = "model"
    model: str
    models_dir: str = Field(description="Remote folder of staged models.")
    python: str = Field(description="Guest python with huggingface_hub (the venv's).")

    def _config_file(self) -> Path | None:
        """The local config.json of a synthetic:config=PATH source (None for a preset)."""
        try:
            spec = parse_synthetic(self.model)
        except SyntheticSpecError as exc:
            raise PlaybookError(str(exc)) from None
        if spec.config_path is None:
            return None
        path = Path(spec.config_path).expanduser()
        if not path.is_file():
            raise PlaybookError(f"model config {path} does not exist on this machine")
        return path

    def _hub_probe(self) -> tuple[str, str]:
        code = ("import sys; from huggingface_hub import snapshot_download as s; "
                "s(sys.argv[1], local_files_only=len(sys.argv) > 2)")
        return code, f"HF_HUB_OFFLINE=1 {q(self.python)} -c {q(code)} {q(self.model)} cached"

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        kind = contract_model_kind(self.model)
        root = self.models_dir.rstrip("/")
        if kind == "synthetic":
            facts = [F.file_state(f"{root}/{model_slug(self.model)}/{MARKER_MODEL}", sudo=sudo)]
            if self._config_file() is not None:
                facts.append(F.file_state(synthetic_config_on_guest(root, self.model), sudo=sudo))
            return facts
        if kind == "hub":
            return [F.command_succeeds(self._hub_probe()[1])]
        if kind == "dir":
            return [F.file_content(f"{root}/{Path(self.model).expanduser().name}/{MARKER_MODEL}")]
        return []

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        kind = model_kind(self.model)
        root = self.models_dir.rstrip("/")
        if kind == "synthetic":
            marker = f"{root}/{model_slug(self.model)}/{MARKER_MODEL}"
            ops = content_ops(marker, (self.model + "\n").encode(), None, None, None, ctx, sudo)
            config = self._config_file()
            if config is not None:
                # The worker builds the shape from the config, so the guest needs the file.
                ops += content_ops(synthetic_config_on_guest(root, self.model), config.read_bytes(),
                                   None, None, None, ctx, sudo)
            return ops
        if kind == "hub":
            code, probe = self._hub_probe()
            if ctx.fact(F.command_succeeds(probe)):
                return []
            return [Shell(f"{q(self.python)} -c {q(code)} {q(self.model)}", sudo=sudo, timeout=7200)]
        local = Path(self.model).expanduser()
        if not local.is_dir():
            raise PlaybookError(f"model folder {local} does not exist on this machine")
        return push_tree(ctx, local, f"{root}/{local.name}", sudo)


def push_tree(ctx: HostContext, local: Path, remote: str, sudo: bool) -> list[Op]:
    """Upload a local folder tree, file by file, when the guest's manifest differs."""
    manifest = "".join(f"{p.relative_to(local).as_posix()} {p.stat().st_size} {p.stat().st_mtime_ns}\n"
                       for p in sorted(local.rglob("*")) if p.is_file())
    marker = f"{remote}/{MARKER_MODEL}"
    if (ctx.fact(F.file_content(marker)) or "") == manifest:
        return []
    dirs = sorted({f"{remote}/{p.relative_to(local).as_posix()}".rsplit("/", 1)[0]
                   for p in local.rglob("*") if p.is_file()} | {remote})
    ops: list[Op] = [Shell("mkdir -p " + " ".join(q(d) for d in dirs), sudo=sudo)]
    ops += [Upload(f"{remote}/{p.relative_to(local).as_posix()}", local=str(p), sudo=sudo)
            for p in sorted(local.rglob("*")) if p.is_file()]
    ops.append(Upload(marker, data=manifest.encode(), sudo=sudo))
    return ops


class VerifyStep(Step):
    """In-guest verification (facts vs inventory); fails the host with expected vs seen."""

    kind: ClassVar[str] = "verify"
    numa: bool = Field(True, description="vNUMA nodes, CPUs per node, contiguity, memory balance.")
    network: bool = Field(True, description="Bench IP on an interface with the expected MTU.")
    reachability: bool = Field(True, description="Other nodes' bench IPs answer.")
    server: bool = Field(True, description="bench.serve.server: vllm: each vNUMA node's launch "
                                           "script binds that node's CPUs and memory.")

    def facts(self, ctx: HostContext, sudo: bool) -> list[F.Fact]:
        wanted: list[F.Fact] = []
        F.gather_guest_facts(lambda f: wanted.append(f), ctx.inventory, ctx.node.name, numa=self.numa,
                             network=self.network, reachability=self.reachability, server=self.server)
        return wanted

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        from .verify import verify_guest

        if ctx.offline:
            return []
        facts = F.gather_guest_facts(ctx.fact, ctx.inventory, ctx.node.name, numa=self.numa,
                                     network=self.network, reachability=self.reachability,
                                     server=self.server)
        ctx.records["facts"] = facts
        problems = verify_guest(ctx.inventory, ctx.node.name, facts)
        if problems:
            raise PlaybookError("verification failed:\n" + "\n".join(f"  - {p}" for p in problems))
        return []


STEP_TYPES: dict[str, type[Step]] = {cls.kind: cls for cls in (
    PackagesStep, FileStep, TemplateStep, TemplatesStep, CommandStep, VenvStep, PipStep,
    PipUninstallStep, WheelStep, ModelStep, CheckStep, VerifyStep)}
