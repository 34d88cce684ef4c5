"""The project's own wheel, built locally at most once per run, so guests run the operator's vcfslm.

Builds are cached by a hash of the sources (package, data folders, pyproject), so
an unchanged tree reuses its wheel and a re-run finds every guest unchanged.
`VCFSLM_WHEEL=<file.whl>` uses a prebuilt wheel (e.g. when vcfslm itself was
installed from a wheel and no source tree is around).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import PlaybookError

WHEEL_ENV = "VCFSLM_WHEEL"
SOURCE_PARTS = ("vcfslm", "templates", "playbooks", "inventories", "pyproject.toml", "README.md")


@dataclass(frozen=True)
class BuiltWheel:
    path: Path
    version: str
    sha256: str


def project_root() -> Path | None:
    """The source checkout this vcfslm runs from (None when installed from a wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "vcfslm").is_dir() else None


def source_hash(root: Path) -> str:
    """sha256 over the files a wheel is built from (names and contents)."""
    h = hashlib.sha256()
    for part in SOURCE_PARTS:
        top = root / part
        files = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in files:
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo"):
                continue
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def describe_wheel(path: Path) -> BuiltWheel:
    m = re.match(r"^[^-]+-([^-]+)-", path.name)
    if not m or path.suffix != ".whl":
        raise PlaybookError(f"{path} is not a wheel file")
    return BuiltWheel(path, m.group(1), hashlib.sha256(path.read_bytes()).hexdigest())


def build_wheel(root: Path, out_dir: Path) -> Path:
    """`pip wheel --no-deps` of the checkout into out_dir (no build isolation when the
    backend is importable, so no index is needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
           "-w", str(out_dir), str(root)]
    try:
        import hatchling  # noqa: F401 - only probing for the build backend
        cmd.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = sorted(out_dir.glob("vcfslm-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise PlaybookError(f"building vcfslm's wheel failed (exit {proc.returncode}):\n{tail}")
    return wheels[-1]


class ProjectWheel:
    """Lazily builds (or finds in the cache) the project's wheel; thread-safe, once per instance."""

    def __init__(self, cache_dir: str | Path | None = None, wheel: str | Path | None = None):
        self.cache_dir = Path(cache_dir or os.environ.get("VCFSLM_CACHE", "~/.cache/vcfslm")).expanduser() / "wheels"
        self.given = wheel or os.environ.get(WHEEL_ENV)
        self._lock = threading.Lock()
        self._built: BuiltWheel | None = None

    def get(self) -> BuiltWheel:
        with self._lock:
            if self._built is None:
                self._built = self._resolve()
            return self._built

    def _resolve(self) -> BuiltWheel:
        if self.given:
            path = Path(self.given).expanduser()
            if not path.is_file():
                raise PlaybookError(f"{WHEEL_ENV}={self.given}: no such wheel file")
            return describe_wheel(path)
        root = project_root()
        if root is None:
            raise PlaybookError(f"vcfslm is not running from a source checkout, so it cannot build "
                                f"its wheel; set {WHEEL_ENV} to a vcfslm wheel file")
        key = source_hash(root)[:20]
        slot = self.cache_dir / key
        cached = sorted(slot.glob("vcfslm-*.whl")) if slot.is_dir() else []
        if cached:
            return describe_wheel(cached[-1])
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.cache_dir))
        try:
            built = build_wheel(root, tmp)
            try:
                tmp.rename(slot)  # another process may have won the race: then use its wheel
            except OSError:
                pass
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return describe_wheel(slot / built.name)
