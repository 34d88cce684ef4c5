"""The lab's vCenter simulator: build `vcsim/main.go` once (cached by hash), start it detached, stop it.

The Go program is compiled in GOPATH mode against Debian's govmomi 0.24.2
sources (`golang-github-vmware-govmomi-dev`) with Debian's `golang-go`. The
binary lands in `<cache>/vcsim-<hash>/vcsim`, keyed by main.go and the Go
version, so only the first run pays the ~15-30 s build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import VcfslmError
from ..progress import NullReporter, Reporter
from . import process

SOURCE = Path(__file__).resolve().parent / "vcsim" / "main.go"
DEFAULT_GOPATH = "/usr/share/gocode"
GOVMOMI = "github.com/vmware/govmomi"
BUILD_TIMEOUT_S = 900

# Object names of govmomi's VPX model (simulator/model.go) plus the lab's template.
DATACENTER = "DC0"
CLUSTER = "DC0_C0"
DATASTORE = "LocalDS_0"
MANAGEMENT_PORTGROUP = "VM Network"   # the standard network every simulated host has
BENCH_PORTGROUP = "DC0_DVPG0"         # the model's distributed port group
DEFAULT_USER = "administrator@vsphere.local"
DEFAULT_TEMPLATE = "vcfslm-template"
TEMPLATE_HARDWARE_VERSION = "vmx-13"  # esx.HardwareVersion in govmomi 0.24
DEFAULT_PORT = 8989                   # vcsim's customary port
# vSphere APIs the lab can advertise (`lab up --api`); govmomi 0.24 itself speaks 6.5.
API_CHOICES = ("6.5", "6.7", "7.0.3", "8.0.3", "9.0")
DEFAULT_API = "6.5"


class VcsimUnavailable(VcfslmError):
    """The Go toolchain or the govmomi sources are missing, so vcsim cannot be built."""


class VcsimFailed(VcfslmError):
    """vcsim did not build or did not come up."""


def host_name(index: int, cluster: int = 0) -> str:
    """Name of the index-th simulated ESXi host of a cluster (DC0_C0_H0, ...)."""
    return f"{DATACENTER}_C{cluster}_H{index}"


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """Where built binaries live: $VCFSLM_CACHE_DIR, else $XDG_CACHE_HOME/vcfslm, else ~/.cache/vcfslm."""
    env = os.environ if env is None else env
    if env.get("VCFSLM_CACHE_DIR"):
        return Path(env["VCFSLM_CACHE_DIR"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "vcfslm"


def source_hash(source: bytes, go_version: str) -> str:
    """Cache key of a build: the program text and the compiler that builds it."""
    digest = hashlib.sha256()
    digest.update(source)
    digest.update(b"\0" + go_version.encode())
    return digest.hexdigest()[:16]


def toolchain(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(go binary, GOPATH holding govmomi) or VcsimUnavailable naming what is missing."""
    env = os.environ if env is None else env
    go = shutil.which("go", path=env.get("PATH")) or (
        "/usr/lib/go/bin/go" if Path("/usr/lib/go/bin/go").exists() else None)
    gopath = env.get("VCFSLM_GOPATH", DEFAULT_GOPATH)
    missing = []
    if go is None:
        missing.append("the Go toolchain ('go'; Debian package golang-go)")
    if not (Path(gopath) / "src" / GOVMOMI / "simulator").is_dir():
        missing.append(f"govmomi sources under {gopath}/src/{GOVMOMI} "
                       "(Debian package golang-github-vmware-govmomi-dev)")
    if missing:
        raise VcsimUnavailable("cannot build the vCenter simulator: missing " + " and ".join(missing)
                               + "; `make setup` installs them")
    return go, gopath


def go_version(go: str) -> str:
    out = subprocess.run([go, "version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def binary_path(cache: Path, key: str) -> Path:
    return cache / f"vcsim-{key}" / "vcsim"


def ensure_built(reporter: Reporter | None = None, cache: Path | None = None,
                 source: Path = SOURCE) -> Path:
    """The vcsim binary for the current main.go, built on first use (concurrent callers wait)."""
    reporter = reporter or NullReporter()
    go, gopath = toolchain()
    cache = cache or cache_root()
    key = source_hash(source.read_bytes(), go_version(go))
    binary = binary_path(cache, key)
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f"vcsim-{key}.lock"):
        if binary.exists():  # another process built it while we waited
            return binary
        reporter.update("vcsim", "building (first run only)")
        started = time.monotonic()
        _build(go, gopath, source, binary, cache)
        reporter.log(f"vcsim built in {time.monotonic() - started:.0f} s: {binary}")
    return binary


def _build(go: str, gopath: str, source: Path, binary: Path, cache: Path) -> None:
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=cache) as tmp:
        pkg = Path(tmp) / "src" / "vcfslm-vcsim"
        pkg.mkdir(parents=True)
        shutil.copy(source, pkg / "main.go")
        env = dict(os.environ)
        env.update(GO111MODULE="off", GOPATH=f"{tmp}:{gopath}", CGO_ENABLED="0", GOFLAGS="")
        env.setdefault("GOCACHE", str(cache / "go-build"))
        out = Path(tmp) / "vcsim"
        result = subprocess.run([go, "build", "-o", str(out), "."], cwd=pkg, env=env,
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise VcsimFailed("building vcsim failed:\n" + _tail(result.stderr or result.stdout))
        os.replace(out, binary)  # atomic: readers see the old state or a complete binary


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class VcsimOptions:
    """How to start the simulator."""

    host: str = "127.0.0.1"
    port: int = 0                      # 0 = a free port
    hosts: int = 4                     # ESXi hosts per cluster
    clusters: int = 1
    user: str = DEFAULT_USER
    template: str = DEFAULT_TEMPLATE   # "" = none
    delay_ms: int = 0                  # added to every SOAP call
    method_delay: Mapping[str, int] = field(default_factory=dict)  # e.g. {"CloneVM_Task": 1000}
    host_hardware: str = "vx650v4"     # vx650v4 | vcsim
    api: str = DEFAULT_API             # the vSphere API advertised (one of API_CHOICES)
    # {"CloneVM_Task": 2}: answer HTTP 503 to a clone while 2 are being served (0: always),
    # as vCenter's reverse proxy sheds load; the refusals are logged in vcsim.log.
    throttle: Mapping[str, int] = field(default_factory=dict)


def format_method_delay(delays: Mapping[str, int]) -> str:
    """{"CloneVM_Task": 1000} -> "CloneVM_Task=1000" (the -method-delay flag)."""
    return ",".join(f"{name}={int(ms)}" for name, ms in sorted(delays.items()))


def parse_method_delay(text: str) -> dict[str, int]:
    """"CloneVM_Task=1000,PowerOnVM_Task=500" -> {...}; ValueError on a malformed item."""
    delays: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, ms = item.partition("=")
        if not sep or not name.strip() or not ms.strip().isdigit():
            raise ValueError(f"{item!r} is not METHOD=MILLISECONDS")
        delays[name.strip()] = int(ms)
    return delays


def command_line(binary: Path, workdir: Path, opts: VcsimOptions) -> list[str]:
    """The vcsim argv; the password travels in $VCSIM_PASSWORD, never on the command line."""
    argv = [str(binary),
            "-listen", f"{opts.host}:{opts.port}",
            "-host", str(opts.hosts),
            "-cluster", str(opts.clusters),
            "-username", opts.user,
            "-tls-dir", str(workdir / "tls"),
            "-template", opts.template,
            "-host-hardware", opts.host_hardware,
            "-ready-file", str(ready_file(workdir)),
            "-api", opts.api,
            "-record-file", str(record_file(workdir))]
    if opts.delay_ms:
        argv += ["-delay", str(int(opts.delay_ms))]
    if opts.method_delay:
        argv += ["-method-delay", format_method_delay(opts.method_delay)]
    if opts.throttle:
        argv += ["-throttle", format_method_delay(opts.throttle)]  # the same METHOD=N list
    return argv


def ready_file(workdir: Path) -> Path:
    return workdir / "ready.json"


def record_file(workdir: Path) -> Path:
    """Where vcsim appends each vNUMA-carrying ReconfigVM_Task / CloneVM_Task it received."""
    return workdir / "soap-records.jsonl"


@dataclass(frozen=True)
class Vcsim:
    """A running simulator."""

    url: str
    host: str
    port: int
    user: str
    ca_file: str
    hosts: int
    template: str
    api_version: str
    log: str
    process: process.ProcessRecord
    delay_ms: int = 0
    method_delay: Mapping[str, int] = field(default_factory=dict)
    api: str = DEFAULT_API        # what was asked for (api_version is what it reports)
    hardware_version: str = TEMPLATE_HARDWARE_VERSION
    record_file: str = ""
    throttle: Mapping[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def same_latency(self, opts: VcsimOptions) -> bool:
        """True when this simulator was started with the latency `opts` asks for."""
        return self.delay_ms == opts.delay_ms and dict(self.method_delay) == dict(opts.method_delay)

    def same_api(self, opts: VcsimOptions) -> bool:
        """True when this simulator advertises the API `opts` asks for."""
        return self.api == opts.api

    def to_json(self) -> dict:
        data = {k: getattr(self, k) for k in ("url", "host", "port", "user", "ca_file", "hosts",
                                               "template", "api_version", "log", "delay_ms", "api",
                                               "hardware_version", "record_file")}
        data["method_delay"] = dict(self.method_delay)
        data["throttle"] = dict(self.throttle)
        data["process"] = self.process.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping) -> Vcsim:
        return cls(url=data["url"], host=data["host"], port=int(data["port"]), user=data["user"],
                   ca_file=data["ca_file"], hosts=int(data["hosts"]), template=data["template"],
                   api_version=data.get("api_version", ""), log=data.get("log", ""),
                   process=process.ProcessRecord.from_json(data["process"]),
                   delay_ms=int(data.get("delay_ms", 0)),
                   method_delay={k: int(v) for k, v in (data.get("method_delay") or {}).items()},
                   api=data.get("api", DEFAULT_API),
                   hardware_version=data.get("hardware_version", TEMPLATE_HARDWARE_VERSION),
                   record_file=data.get("record_file", ""),
                   throttle={k: int(v) for k, v in (data.get("throttle") or {}).items()})


def start(workdir: Path, password: str, opts: VcsimOptions = VcsimOptions(),
          binary: Path | None = None, timeout: float = 60.0,
          reporter: Reporter | None = None) -> Vcsim:
    """Start vcsim detached (it outlives this process) and wait until it serves."""
    reporter = reporter or NullReporter()
    binary = binary or ensure_built(reporter)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / "tmp"  # the simulator's datastore folders live here, not in /tmp
    tmp.mkdir(exist_ok=True)
    ready = ready_file(workdir)
    ready.unlink(missing_ok=True)
    record_file(workdir).unlink(missing_ok=True)  # records describe this run only
    log = workdir / "vcsim.log"
    env = dict(os.environ, VCSIM_PASSWORD=password, TMPDIR=str(tmp))
    reporter.update("vcsim", "starting")
    proc = process.start_detached(command_line(binary, workdir, opts), log, env=env, cwd=workdir)
    rec = process.record(proc.pid, marker=str(ready))
    info = _wait_ready(proc, ready, log, timeout)
    reporter.update("vcsim", f"ready at {info['url']}")
    return Vcsim(url=info["url"], host=info["host"], port=int(info["port"]), user=opts.user,
                 ca_file=info["ca_file"], hosts=opts.hosts, template=opts.template,
                 api_version=info.get("api_version", ""), log=str(log), process=rec,
                 delay_ms=opts.delay_ms, method_delay=dict(opts.method_delay), api=opts.api,
                 hardware_version=info.get("hardware_version", TEMPLATE_HARDWARE_VERSION),
                 record_file=info.get("record_file", ""), throttle=dict(opts.throttle))


def throttled(vcsim: Vcsim) -> dict[str, int]:
    """How many calls of each method the simulator refused with 503 so far (from its log)."""
    counts: dict[str, int] = {}
    for line in _read(Path(vcsim.log)).splitlines():
        _, sep, rest = line.partition("vcsim: throttled ")
        if sep:
            method = rest.split(" ", 1)[0]
            counts[method] = counts.get(method, 0) + 1
    return counts


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            try:
                info = json.loads(ready.read_text())
            except ValueError:
                info = None
            if info and info.get("pid") == proc.pid:
                return info
        if proc.poll() is not None:
            raise VcsimFailed(f"vcsim exited with status {proc.returncode} before it was ready:\n"
                              + _tail(_read(log)))
        time.sleep(0.05)
    process.terminate([process.record(proc.pid, marker=str(ready))], timeout=2)
    raise VcsimFailed(f"vcsim was not ready within {timeout:.0f} s:\n" + _tail(_read(log)))


def soap_records(vcsim: Vcsim) -> list[dict]:
    """What vcsim recorded, oldest first: per call its method, VM moref (the clone's name),
    SOAPAction, the `virtualNuma` element as it arrived and the numa.* extraConfig keys."""
    if not vcsim.record_file:
        return []
    try:
        text = Path(vcsim.record_file).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def stop(vcsim: Vcsim, timeout: float = 10.0) -> bool:
    """Stop this simulator (SIGTERM, then SIGKILL); True when it was running."""
    return bool(process.terminate([vcsim.process], timeout=timeout))


def is_running(vcsim: Vcsim) -> bool:
    return process.is_alive(vcsim.process)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(f"  | {line}" for line in text.strip().splitlines()[-lines:])
