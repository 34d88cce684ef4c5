"""Playbook step types: small typed units that look at facts and yield only the commands
still needed (pyinfra's model). "changed" means at least one operation ran.

Each step type is a pydantic model of its arguments (unknown arguments are refused
when the playbook loads); `plan(ctx, sudo)` returns the operations (`Shell` or
`Upload`, guest/ops.py) that would bring the guest to the described state, [] when it is there;
`facts(ctx, sudo)` names the facts `plan` reads up front, so the runner can gather a
host's facts for all its remaining steps in one round trip (guest/batch.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import PlaybookError
from . import facts as F
from . import host_facts as H
from .context import HostContext, Mode, Step, content_ops, ownership_ops
from .facts import q
from .ops import Op, Shell
from .software_steps import ModelStep, PackagesStep, PipStep, PipUninstallStep, VenvStep, WheelStep
from .templates import render_template


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
        return ops + ownership_ops(path, state, self.mode if state.exists else None, self.owner,
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
        interfaces = [] if ctx.inventory.bench.interface else [H.INTERFACES]
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
        interfaces = [] if ctx.inventory.bench.interface else [H.INTERFACES]
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
        H.gather_guest_facts(lambda f: wanted.append(f), ctx.inventory, ctx.node.name, numa=self.numa,
                             network=self.network, reachability=self.reachability, server=self.server)
        return wanted

    def plan(self, ctx: HostContext, sudo: bool) -> list[Op]:
        from .verify import verify_guest

        if ctx.offline:
            return []
        facts = H.gather_guest_facts(ctx.fact, ctx.inventory, ctx.node.name, numa=self.numa,
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
