"""Step types that install software on a guest: system packages, venvs, pip requirements,
the project's wheel and the model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from ..errors import PlaybookError
from ..guest_layout import model_kind as contract_model_kind
from ..guest_layout import model_slug, synthetic_config_on_guest
from ..presets import SyntheticSpecError, parse_synthetic
from . import facts as F
from .context import HostContext, Step, content_ops, locked
from .facts import q
from .ops import Op, Shell, Upload

MARKER_WHEEL = ".vcfslm-wheel"
MARKER_MODEL = ".vcfslm-model"


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
    """'synthetic', 'dir' (a local folder pushed to the guest) or 'hub' (contract.model_kind)."""
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


