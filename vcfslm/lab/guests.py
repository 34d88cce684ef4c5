"""Loopback SSH guests: one real OpenSSH sshd per lab node, key-only, host keys known.

Guest i listens on 127.0.0.(11+i) with its own config, ed25519 host key, pid file
and log under `<lab>/guests/<node>/`. All guests accept one generated client key
(`<lab>/ssh/id_ed25519`) for the current user, and the lab writes
`<lab>/ssh/known_hosts` (`[127.0.0.11]:PORT ssh-ed25519 ...`) so clients keep
host-key checking on. Each sshd sets VCFSLM_LAB_NODE=<node> in its sessions, and
SHLVL=1 so bash does not run the operator's ~/.bashrc for each session (see sshd_config).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import VcfslmError
from ..progress import NullReporter, Reporter
from . import cores as cores_mod
from . import process

FIRST_HOST_OCTET = 11        # slm-01 -> 127.0.0.11
DEFAULT_PORT = 2222          # tried first by `lab up`; a free port otherwise
PRIVSEP_DIR = Path("/run/sshd")
MAX_NODES = 200              # 127.0.0.11 .. 127.0.0.210


class GuestsUnavailable(VcfslmError):
    """OpenSSH's sshd or ssh-keygen is missing, so lab guests cannot run."""


class GuestFailed(VcfslmError):
    """A guest's sshd did not come up."""


def node_name(index: int) -> str:
    """slm-01, slm-02, ... (index from 0)."""
    return f"slm-{index + 1:02d}"


def management_address(index: int) -> str:
    """Loopback address of guest `index`: 127.0.0.11, .12, ..."""
    _check_index(index)
    return f"127.0.0.{FIRST_HOST_OCTET + index}"


def bench_address(index: int) -> str:
    """Bench-network address of guest `index` (127.0.1.11, ...): also loopback, kept distinct
    from the management address so code that mixes the two networks up fails in the lab."""
    _check_index(index)
    return f"127.0.1.{FIRST_HOST_OCTET + index}"


def _check_index(index: int) -> None:
    if not 0 <= index < MAX_NODES:
        raise ValueError(f"the lab has room for {MAX_NODES} guests; got index {index}")


def current_user() -> str:
    return getpass.getuser()


def tools() -> tuple[str, str]:
    """(sshd, ssh-keygen) absolute paths, or GuestsUnavailable."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin"
    sshd = shutil.which("sshd", path=path)
    keygen = shutil.which("ssh-keygen", path=path)
    if not sshd or not keygen:
        missing = [n for n, p in (("sshd", sshd), ("ssh-keygen", keygen)) if not p]
        raise GuestsUnavailable("lab guests need OpenSSH: missing " + ", ".join(missing)
                                + " (Debian packages openssh-server, openssh-client; "
                                  "`make setup` installs them)")
    # sshd re-executes itself and refuses to run from a relative path.
    return str(Path(sshd).resolve()), str(Path(keygen).resolve())


def ensure_privsep_dir(path: Path = PRIVSEP_DIR) -> None:
    """sshd refuses to start without its privilege-separation directory."""
    if path.is_dir():
        return
    try:
        path.mkdir(mode=0o755, parents=True)
    except OSError as exc:
        raise GuestsUnavailable(f"sshd needs the directory {path} ({exc}); create it as root: "
                                f"mkdir -p {path}") from None


def ensure_key(path: Path, comment: str, keygen: str | None = None) -> str:
    """An ed25519 key pair at path (+ .pub), generated when missing; returns the public line."""
    pub = path.with_name(path.name + ".pub")
    if not (path.exists() and pub.exists()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        pub.unlink(missing_ok=True)
        keygen = keygen or tools()[1]
        result = subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment,
                                 "-f", str(path)], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise GuestFailed(f"ssh-keygen failed for {path}: {result.stderr.strip()}")
    path.chmod(0o600)
    return pub.read_text().strip()


def sshd_config(*, name: str, address: str, port: int, user: str, host_key: Path,
                authorized_keys: Path, pid_file: Path) -> str:
    """The sshd_config of one guest: key-only login for `user`, nothing from /etc/ssh."""
    return "\n".join([
        f"# vcfslm lab guest {name} (generated; edits are overwritten by `vcfslm lab up`)",
        f"ListenAddress {address}:{port}",
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        f"AllowUsers {user}",
        # Lab files live in ordinary user folders; the ownership checks would refuse them.
        "StrictModes no",
        *SSHD_POLICY,
        # SHLVL=1: bash takes the session's shell for a nested one and skips ~/.bashrc, which
        # it reads for every sshd-started shell otherwise. A VM's guest account has its own
        # dotfiles; the lab's guests share the operator's, whose rc (pyenv init, say) would
        # cost each SSH session ~0.1 CPU-s, 32 times over on one machine. (One SetEnv line:
        # sshd keeps only the first.)
        f"SetEnv VCFSLM_LAB_NODE={name} SHLVL=1",
        "",
    ])


# What every lab sshd (loopback or fresh) allows: root or the lab user by key only, no PAM
# (neither the operator's folders nor a minbase root have a session setup for it), sftp for
# pushes, and room for the fan-out tests' many connections at once.
SSHD_POLICY = (
    "PubkeyAuthentication yes",
    "PasswordAuthentication no",
    "KbdInteractiveAuthentication no",
    "PermitRootLogin prohibit-password",
    "UsePAM no",
    "Subsystem sftp internal-sftp",
    "MaxStartups 100:30:200",
    "MaxSessions 64",
    "X11Forwarding no",
    "PrintMotd no",
    "PrintLastLog no",
    "UseDNS no",
    "LogLevel INFO",
)


def known_hosts_line(address: str, port: int, public_key: str) -> str:
    """`[addr]:port type key` (plain `addr` on port 22), as OpenSSH and paramiko read it."""
    key_type, key_b64 = public_key.split()[:2]
    host = address if port == 22 else f"[{address}]:{port}"
    return f"{host} {key_type} {key_b64}"


def port_is_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_port(address: str, preferred: int = 0) -> int:
    """`preferred` when it can be bound on address, else a port the kernel picks."""
    if preferred and port_is_free(address, preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)   # Linux's default ip_local_port_range
LISTEN_FLOOR = 10000                 # below: well-known and registered services' ports


def ports_for_later(ephemeral: tuple[int, int], floor: int = LISTEN_FLOOR) -> range:
    """Where to pick a port that is bound long after it is picked (pure): outside the kernel's
    ephemeral range, from which every outgoing connection takes its local port. A port picked
    inside it (bind to 0) can be taken meanwhile by any client socket on the machine, and a
    listener on all addresses (torchrun's rendezvous store) then fails with EADDRINUSE."""
    low, high = ephemeral
    below, above = range(floor, low), range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ip_local_port_range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def port_for_later(address: str = "", tries: int = 64, rng: random.Random | None = None) -> int:
    """A port free on `address` now and outside the ephemeral range (ports_for_later), for a
    listener that binds it later; a kernel-picked one if `tries` picks were all taken."""
    rng = rng or random.Random()
    candidates = ports_for_later(ephemeral_range())
    for _ in range(tries if candidates else 0):
        port = rng.choice(candidates)
        if port_is_free(address, port):
            return port
    return free_port(address)


@dataclass(frozen=True)
class Guest:
    """A running sshd guest and everything a client needs to reach it."""

    name: str
    address: str
    bench_address: str
    port: int
    user: str
    key: str                 # client private key
    known_hosts: str
    workdir: str             # this guest's own folder (the inventory's workdir is shared)
    host_public_key: str
    config: str
    log: str
    process: process.ProcessRecord
    cores: cores_mod.GuestCores | None = None   # its own CPUs (lab up --cores-per-node), or shared

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def key_path(self) -> str:
        return self.key

    def to_json(self) -> dict:
        data = {k: getattr(self, k) for k in ("name", "address", "bench_address", "port", "user",
                                               "key", "known_hosts", "workdir", "host_public_key",
                                               "config", "log")}
        data["process"] = self.process.to_json()
        data["cores"] = self.cores.to_json() if self.cores else None
        return data

    @classmethod
    def from_json(cls, data: Mapping) -> Guest:
        fields = {k: data[k] for k in ("name", "address", "bench_address", "user", "key",
                                       "known_hosts", "workdir", "host_public_key", "config", "log")}
        # A state written before --cores-per-node has no "cores": its guests share every CPU.
        cores = cores_mod.GuestCores.from_json(data["cores"]) if data.get("cores") else None
        return cls(port=int(data["port"]), process=process.ProcessRecord.from_json(data["process"]),
                   cores=cores, **fields)


@dataclass(frozen=True)
class ClientKeys:
    """The lab's SSH client side: key pair, authorized_keys and known_hosts paths."""

    key: Path
    public_key: str
    authorized_keys: Path
    known_hosts: Path


def ensure_client_keys(ssh_dir: Path) -> ClientKeys:
    """Client key pair (kept across runs) and the authorized_keys every guest reads."""
    ssh_dir.mkdir(parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    key = ssh_dir / "id_ed25519"
    public = ensure_key(key, "vcfslm-lab-client")
    authorized = ssh_dir / "authorized_keys"
    authorized.write_text(public + "\n")
    return ClientKeys(key, public, authorized, ssh_dir / "known_hosts")


def start_guest(index: int, guests_dir: Path, client: ClientKeys, *, port: int = 0,
                user: str | None = None, timeout: float = 20.0,
                reporter: Reporter | None = None, cores: cores_mod.GuestCores | None = None) -> Guest:
    """Start guest `index` (sshd in its own session, outliving this process); wait for its banner.

    cores: the CPUs its sshd (and so every session's process) is held to; None: all of this
    machine's, shared with the other guests."""
    reporter = reporter or NullReporter()
    sshd, keygen = tools()
    ensure_privsep_dir()
    name = node_name(index)
    address = management_address(index)
    user = user or current_user()
    gdir = guests_dir / name
    workdir = gdir / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    host_key = gdir / "ssh_host_ed25519_key"
    host_public = ensure_key(host_key, f"vcfslm-lab-{name}", keygen)

    def config_for(chosen: int) -> str:
        return sshd_config(name=name, address=address, port=chosen, user=user, host_key=host_key,
                           authorized_keys=client.authorized_keys, pid_file=gdir / "sshd.pid")

    reporter.update(name, "starting sshd")
    try:
        rec, chosen = _start_sshd(sshd, config_for, gdir, address, port, timeout, cores)
    except (GuestFailed, cores_mod.ConfineFailed):
        # Nothing of this guest is recorded: leave no cpuset behind (the first error is the news).
        with contextlib.suppress(cores_mod.ConfineFailed):
            cores_mod.release(cores)
        raise
    reporter.update(name, f"sshd on {address}:{chosen}"
                    + (f", held to {cores.describe()}" if cores is not None else ""))
    return Guest(name=name, address=address, bench_address=bench_address(index), port=chosen,
                 user=user, key=str(client.key), known_hosts=str(client.known_hosts),
                 workdir=str(workdir), host_public_key=host_public, config=str(gdir / "sshd_config"),
                 log=str(gdir / "sshd.log"), process=rec, cores=cores)


def _start_sshd(sshd: str, config_for: Callable[[int], str], gdir: Path, address: str, port: int,
                timeout: float, cores: cores_mod.GuestCores | None) -> tuple[process.ProcessRecord, int]:
    """One guest's sshd (its sshd_config for a port from config_for), answering: (its record, its port)."""
    config = gdir / "sshd_config"
    last_error = ""
    for _attempt in range(3):  # a picked port can be taken before sshd binds it
        chosen = free_port(address, port)
        config.write_text(config_for(chosen))
        proc = process.start_detached([sshd, "-f", str(config), "-D", "-e"], gdir / "sshd.log")
        rec = process.record(proc.pid, marker=str(config))
        try:
            if cores is not None:
                # Before the banner wait: no session starts before its sshd is confined.
                cores_mod.confine(proc.pid, cores)
            wait_for_banner(address, chosen, proc, timeout)
        except (GuestFailed, cores_mod.ConfineFailed) as exc:
            process.terminate([rec], timeout=2)
            last_error = str(exc)
            if isinstance(exc, GuestFailed) and "already in use" in last_error:
                port = 0
                continue
            raise
        return rec, chosen
    raise GuestFailed(last_error)


def wait_for_banner(address: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until sshd answers with its `SSH-2.0-` banner (or fail with its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = _log_of(proc)
            raise GuestFailed(f"sshd for {address}:{port} exited with status {proc.returncode}"
                              + (f":\n{log}" if log else ""))
        try:
            with socket.create_connection((address, port), timeout=1) as sock:
                sock.settimeout(2)
                if sock.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise GuestFailed(f"sshd on {address}:{port} did not answer within {timeout:.0f} s")


def _log_of(proc: subprocess.Popen) -> str:
    """Last lines of the log file a detached process writes to (found through its args)."""
    args = list(proc.args) if isinstance(proc.args, (list, tuple)) else []
    try:
        config = Path(args[args.index("-f") + 1])
        lines = (config.parent / "sshd.log").read_text(errors="replace").strip().splitlines()
    except (ValueError, IndexError, OSError):
        return ""
    return "\n".join(f"  | {line}" for line in lines[-10:])


def write_known_hosts(path: Path, guests: Iterable[Guest]) -> None:
    """known_hosts for the lab's guests (replaces the file: it only ever holds lab keys)."""
    lines = [known_hosts_line(g.address, g.port, g.host_public_key) for g in guests]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def stop_guest(guest: Guest, timeout: float = 5.0, *, release: bool = True) -> bool:
    """Stop this guest's sshd and its session processes, then (release) remove its cpuset if it
    has one (ConfineFailed when it stays); True when it was running."""
    was_running = bool(process.terminate([guest.process], timeout=timeout))
    if release:
        cores_mod.release(guest.cores)
    return was_running


def is_running(guest: Guest) -> bool:
    return process.is_alive(guest.process)
