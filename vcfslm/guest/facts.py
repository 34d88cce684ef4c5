"""Facts: what a guest looks like, each as a command plus a pure parser of its output: its
files, commands, packages and Python environments here, its hardware and network in
guest/host_facts.py.

A `Fact` also names its value on a fresh guest (`absent`), so a dry run can plan
against a host that cannot be reached yet ("what would a new VM need").
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .transport import Result

T = TypeVar("T")


@dataclass(frozen=True)
class Fact(Generic[T]):
    """A read-only command and the parser of its Result.

    key: cache key (same key = same fact on one host); absent: the value on a fresh guest;
    input: stdin for the command (scripts for python3 -); sudo: needs root to read.
    """

    key: str
    command: str
    parse: Callable[[Result], T]
    absent: T
    input: str | None = None
    sudo: bool = False
    timeout: float = 60.0


def q(value: Any) -> str:
    """`value` as one shell word: every command a fact or a step sends is built with it."""
    return shlex.quote(str(value))



# ------------------------------------------------------------------ versions


_VERSIONS_PY = """\
import json, sys
from importlib import metadata
out = {"python": "%d.%d.%d" % sys.version_info[:3], "prefix": sys.prefix}
for name in ("vcfslm", "torch", "transformers"):
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Versions:
    """Interpreter and package versions inside the guest venv (None = missing)."""

    venv_exists: bool
    python: str | None = None
    vcfslm: str | None = None
    torch: str | None = None
    transformers: str | None = None


def versions(venv: str) -> Fact[Versions]:
    """Versions of python, vcfslm, torch, transformers in the guest venv (no heavy imports)."""
    py = f"{venv.rstrip('/')}/bin/python"

    def parse(r: Result) -> Versions:
        if r.exit != 0:
            return Versions(False)
        try:
            data = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return Versions(False)
        return Versions(True, data.get("python"), data.get("vcfslm"), data.get("torch"),
                        data.get("transformers"))

    return Fact(f"versions:{venv}", f"test -x {q(py)} && {q(py)} -", parse, Versions(False),
                input=_VERSIONS_PY)


def installed_version(venv: str, dist: str) -> Fact[str | None]:
    """A distribution's version in a venv, read from its `<name>-<version>.dist-info` folder
    name (the installer writes it from the wheel's name; no interpreter starts, so the check
    costs the guest no CPU to speak of). None when absent or installed twice."""
    name = re.sub(r"[-_.]+", "_", dist)
    pattern = f"{q(venv.rstrip('/'))}/lib*/python*/site-packages/{q(name)}-*.dist-info"
    cmd = (f'for d in {pattern}; do [ -f "$d/METADATA" ] && echo "${{d##*/}}"; done; true')

    def parse(r: Result) -> str | None:
        found = set()
        for line in r.stdout.split():
            m = re.fullmatch(r"[^-]+-(.+)\.dist-info", line)
            if m and m.group(0).split("-", 1)[0].lower() == name.lower():
                found.add(m.group(1))
        return found.pop() if len(found) == 1 else None

    return Fact(f"dist:{venv}:{dist}", cmd, parse, None)


# ------------------------------------------------------------------ files and commands


@dataclass(frozen=True)
class FileState:
    """A remote path: kind ('file', 'directory', 'other' or None when absent), mode, owner, sha256."""

    kind: str | None
    mode: str | None = None
    owner: str | None = None
    group: str | None = None
    sha256: str | None = None

    @property
    def exists(self) -> bool:
        return self.kind is not None


def file_state(path: str, sudo: bool = False) -> Fact[FileState]:
    """stat + sha256 of one remote path."""
    p = q(path)
    cmd = (f"if [ -e {p} ]; then stat -L -c '%F|%a|%U|%G' {p}; "
           f"if [ -f {p} ]; then sha256sum {p}; fi; else echo absent; fi")

    def parse(r: Result) -> FileState:
        lines = r.stdout.strip().splitlines()
        if r.exit != 0 or not lines or lines[0] == "absent":
            return FileState(None)
        kind, mode, owner, group = (lines[0].split("|") + ["", "", "", ""])[:4]
        kind = {"regular file": "file", "regular empty file": "file", "directory": "directory"}.get(
            kind, "other")
        digest = lines[1].split()[0] if len(lines) > 1 and lines[1].split() else None
        return FileState(kind, mode.zfill(4), owner, group, digest)

    return Fact(f"file:{path}", cmd, parse, FileState(None), sudo=sudo)


def file_content(path: str, sudo: bool = False) -> Fact[str | None]:
    """A small remote text file's content (None when absent)."""
    return Fact(f"content:{path}", f"cat {q(path)} 2>/dev/null || true",
                lambda r: r.stdout if r.stdout else None, None, sudo=sudo)


def command_succeeds(cmd: str, sudo: bool = False) -> Fact[bool]:
    """Whether `cmd` exits 0 (the `unless` guard)."""
    return Fact(f"ok:{cmd}", f"{{ {cmd}\n}} >/dev/null 2>&1 && echo yes || echo no",
                lambda r: r.stdout.strip().endswith("yes"), False, sudo=sudo)


def path_exists(path: str, sudo: bool = False) -> Fact[bool]:
    return Fact(f"exists:{path}", f"test -e {q(path)} && echo yes || echo no",
                lambda r: r.stdout.strip() == "yes", False, sudo=sudo)


def dir_listing(path: str) -> Fact[dict[str, int]]:
    """Regular files directly in a remote folder: {name: size}."""
    cmd = f"find {q(path)} -maxdepth 1 -type f -printf '%s %f\\n' 2>/dev/null || true"

    def parse(r: Result) -> dict[str, int]:
        out = {}
        for line in r.stdout.splitlines():
            size, _, name = line.partition(" ")
            if size.isdigit() and name:
                out[name] = int(size)
        return out

    return Fact(f"ls:{path}", cmd, parse, {})


# ------------------------------------------------------------------ packages


@dataclass(frozen=True)
class Packages:
    """The guest's package manager and which of the asked packages are installed."""

    manager: str | None  # "apt", "dnf" or None
    installed: frozenset[str]


def packages(apt: list[str], dnf: list[str]) -> Fact[Packages]:
    """Which package manager the guest has and which of the named packages are installed."""
    apt_q = " ".join(q(p) for p in apt) or "''"
    dnf_q = " ".join(q(p) for p in dnf) or "''"
    cmd = ("if command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then "
           "echo manager=apt; "
           f"dpkg-query -W -f='${{Package}} ${{db:Status-Status}}\\n' {apt_q} 2>/dev/null; "
           "elif command -v rpm >/dev/null 2>&1 && command -v dnf >/dev/null 2>&1; then "
           "echo manager=dnf; "
           f"rpm -q --qf '%{{NAME}} installed\\n' {dnf_q} 2>/dev/null; "
           "else echo manager=none; fi; true")

    def parse(r: Result) -> Packages:
        manager = None
        installed = set()
        for line in r.stdout.splitlines():
            if line.startswith("manager="):
                manager = line.split("=", 1)[1] if line != "manager=none" else None
                continue
            parts = line.split()
            if len(parts) == 2 and parts[1] == "installed":
                installed.add(parts[0].split(":")[0])  # dpkg may print name:arch
        return Packages(manager, frozenset(installed))

    return Fact(f"packages:{apt_q}|{dnf_q}", cmd, parse, Packages("apt" if apt else "dnf", frozenset()))


# ------------------------------------------------------------------ python environments


_PIP_CHECK_PY = """\
import json, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
missing, seen = [], set()
WITHOUT = "--without="
skipped = {canonicalize_name(a[len(WITHOUT):]) for a in sys.argv[1:] if a.startswith(WITHOUT)}

def check(text, extras=("",)):
    req = Requirement(text)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras):
        return
    if canonicalize_name(req.name) in skipped:
        return
    try:
        dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        missing.append(f"{req.name} (not installed)")
        return
    if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
        missing.append(f"{req.name}{req.specifier} (have {dist.version})")
        return
    key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
    if key in seen:
        return
    seen.add(key)
    for dep in dist.requires or []:
        check(dep, ("",) + tuple(sorted(req.extras)))

for text in sys.argv[1:]:
    if not text.startswith(WITHOUT):
        check(text)
print(json.dumps(missing))
"""


@dataclass(frozen=True)
class PipState:
    """Whether requirements are satisfied in a venv (with their dependencies)."""

    venv_exists: bool
    missing: tuple[str, ...]

    @property
    def satisfied(self) -> bool:
        return self.venv_exists and not self.missing


# The venv's package folders as its interpreter finds them: lib*/python*/site-packages and
# the folders their .pth files add (relative to the site folder; `import` lines add none).
# Their names with mtime and ctime, with pyvenv.cfg's and the interpreter's, change whenever
# a distribution is installed, upgraded or removed: the "fingerprint" of what is installed.
# A venv that also sees the system's site-packages has no fingerprint (always checked).
_PIP_FINGERPRINT_SH = """v={venv}; rec={record}
test -x "$v/bin/python" || {{ echo novenv; exit 0; }}
own=unknown
if [ -f "$v/pyvenv.cfg" ]; then
  while IFS='=' read -r k val || [ -n "$k" ]; do
    case "$k" in include-system-site-packages*) case "$val" in *[Ff]alse*) own=yes;; *) own=no;; esac;; esac
  done < "$v/pyvenv.cfg"
fi
set --
for s in "$v"/lib*/python*/site-packages; do
  [ -d "$s" ] || continue
  set -- "$@" "$s"
  for p in "$s"/*.pth; do
    [ -f "$p" ] || continue
    while IFS= read -r l || [ -n "$l" ]; do
      case "$l" in ''|'#'*|'import '*|'import	'*) ;;
        /*) [ -d "$l" ] && set -- "$@" "$l";;
        *) [ -d "$s/$l" ] && set -- "$@" "$s/$l";;
      esac
    done < "$p"
  done
done
fp=
if [ "$own" = yes ] && [ $# -gt 0 ]; then
  fp=$(stat -L --printf '%n %y %z|' "$v/pyvenv.cfg" "$v/bin/python" "$@" 2>/dev/null) || fp=
fi
if [ -n "$fp" ] && [ -f "$rec" ] && IFS= read -r have < "$rec" && [ "$have" = "$fp" ]; then
  echo '[]'; exit 0
fi
out=$("$v/bin/python" - {requirements}); rc=$?
printf '%s\\n' "$out"
if [ $rc -eq 0 ] && [ -n "$fp" ] && [ "$out" = '[]' ]; then
  {{ printf '%s\\n' "$fp" > "$rec.tmp$$" && mv -f "$rec.tmp$$" "$rec" || rm -f "$rec.tmp$$"; }} 2>/dev/null
fi
exit $rc
"""


def pip_record(venv: str, requirements: list[str]) -> str:
    """Where a venv records the fingerprint its requirements were last found satisfied at."""
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:16]
    return f"{venv.rstrip('/')}/.vcfslm-pip-{key}"


def pip_state(venv: str, requirements: list[str], without: Sequence[str] = ()) -> Fact[PipState]:
    """Check requirements (and their dependencies, extras included) against a guest venv.

    without: distributions the check never asks for, even as a dependency (ones a later
    step removes on purpose). The interpreter only starts when the venv's fingerprint (see
    _PIP_FINGERPRINT_SH) differs from the one recorded when these requirements were last
    found satisfied: a converged check reads a few folder timestamps instead of importing
    packaging in the guest. The record is a cache of this check's own answer, written only
    by a full check that passed.
    """
    args = list(requirements) + [f"--without={name}" for name in without]
    cmd = _PIP_FINGERPRINT_SH.format(venv=q(venv.rstrip("/")), record=q(pip_record(venv, args)),
                                     requirements=" ".join(q(r) for r in args))

    def parse(r: Result) -> PipState:
        text = r.stdout.strip()
        if text == "novenv":
            return PipState(False, tuple(requirements))
        if r.exit != 0:
            return PipState(True, (f"cannot check ({(r.stderr.strip().splitlines() or ['?'])[-1]})",))
        try:
            return PipState(True, tuple(json.loads(text.splitlines()[-1])))
        except (ValueError, IndexError):
            return PipState(True, ("cannot check (unreadable output)",))

    key = f"pip:{venv}:{' '.join(requirements)}" + (f" without {' '.join(without)}" if without else "")
    return Fact(key, cmd, parse, PipState(False, tuple(requirements)), input=_PIP_CHECK_PY)


def dists_present(venv: str, names: Sequence[str]) -> Fact[frozenset[str]]:
    """Which of the named distributions a venv has, from their `<name>-<version>.dist-info`
    folders (as installed_version reads them: no interpreter starts). Names as given."""
    norm = {re.sub(r"[-_.]+", "_", n).lower(): n for n in names}
    site = f"{q(venv.rstrip('/'))}/lib*/python*/site-packages"
    globs = " ".join(f"{site}/{q(re.sub(r'[-_.]+', '_', n))}-*.dist-info" for n in names)
    cmd = f'for d in {globs}; do [ -f "$d/METADATA" ] && echo "${{d##*/}}"; done; true'

    def parse(r: Result) -> frozenset[str]:
        found = set()
        for line in r.stdout.split():
            dist = line.split("-", 1)[0].lower()
            if line.endswith(".dist-info") and dist in norm:
                found.add(norm[dist])
        return frozenset(found)

    return Fact(f"dists:{venv}:{' '.join(names)}", cmd, parse, frozenset())


@dataclass(frozen=True)
class CommandOutput:
    """A command's exit status and its output (stdout, then stderr)."""

    exit: int
    output: str


def command_output(argv: Sequence[str], sudo: bool = False, timeout: float = 600.0) -> Fact[CommandOutput]:
    """Run a read-only command (its arguments quoted) and keep its exit status and output."""
    cmd = " ".join(q(a) for a in argv)

    def parse(r: Result) -> CommandOutput:
        return CommandOutput(r.exit, r.stdout + (r.stderr or ""))

    return Fact(f"output:{cmd}", cmd, parse, CommandOutput(127, "fresh guest (not run)"), sudo=sudo,
                timeout=timeout)


@dataclass(frozen=True)
class VenvState:
    exists: bool
    system_site_packages: bool | None = None
    python_version: str | None = None


def venv_state(path: str) -> Fact[VenvState]:
    """Whether a venv exists at `path` (bin/python runs) and its pyvenv.cfg settings."""
    p = path.rstrip("/")
    cmd = (f"if [ -x {q(p + '/bin/python')} ] && [ -f {q(p + '/pyvenv.cfg')} ]; then "
           f"cat {q(p + '/pyvenv.cfg')}; else echo absent; fi")

    def parse(r: Result) -> VenvState:
        if r.exit != 0 or r.stdout.strip() == "absent":
            return VenvState(False)
        cfg = {}
        for line in r.stdout.splitlines():
            k, sep, v = line.partition("=")
            if sep:
                cfg[k.strip()] = v.strip()
        ssp = cfg.get("include-system-site-packages")
        return VenvState(True, None if ssp is None else ssp.lower() == "true",
                         cfg.get("version") or cfg.get("version_info"))

    return Fact(f"venv:{path}", cmd, parse, VenvState(False))

