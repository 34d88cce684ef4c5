"""A guest booted by systemd: the operator's own root under an overlay, booted with
`systemd-nspawn -b` so that systemd is its PID 1, with an sshd of its own on a loopback
address. It is where `serve up`'s systemd path (units, Restart=, the sandbox) runs as on
a VM, on one machine and in seconds.

    <folder>/layers/     a tmpfs: upper/ and work/ of the overlay (the guest's own changes)
    <folder>/root/       the guest's root: the operator's / read-only below, its changes above
    <folder>/boot.log    what systemd-nspawn and the guest's console printed

The guest shares the operator's network namespace (its sshd and whatever it serves listen
on loopback addresses only) and boots `vcfslm-guest.target`: basic.target and its sshd,
none of the operator's own services. Files written under `root` before or after the boot
are the guest's (the overlay is mounted in the operator's namespace, so the caller writes
them as files); the operator's / is never written.

Without a systemd on the operator's side (a container whose PID 1 is something else),
systemd-nspawn needs --register=no and --keep-unit (no machined, no transient scope), and
a tmpfs on /run/systemd/nspawn (it refuses to clean up under a /run on disk): it runs in
a mount namespace of its own that has one.

Needs root, systemd-nspawn (Debian package systemd-container), overlayfs and OpenSSH.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import VcfslmError
from . import guests

TARGET = "vcfslm-guest.target"
SSHD_UNIT = "vcfslm-guest-sshd.service"
SSHD_CONFIG = "/etc/ssh/vcfslm-guest.conf"
HOST_KEY = "/etc/ssh/vcfslm-guest-host-key"
AUTHORIZED_KEYS = "/etc/ssh/vcfslm-guest-authorized-keys"
HALT_WAIT_S = 30.0


class NspawnUnavailable(VcfslmError):
    """This machine cannot boot a guest with systemd-nspawn."""


class NspawnFailed(VcfslmError):
    """The guest did not boot, or its sshd did not answer."""


@dataclass
class BootedGuest:
    name: str
    folder: Path
    address: str
    port: int
    host_public_key: str
    process: subprocess.Popen

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def log(self) -> Path:
        return self.folder / "boot.log"

    def path(self, inside: str) -> Path:
        """Where a path of the guest is, seen from the operator's side."""
        return self.root / inside.lstrip("/")


def unavailable_reason() -> str | None:
    """Why a guest cannot boot here (None: it can)."""
    if os.geteuid() != 0:
        return "booting a guest with systemd-nspawn needs root"
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is missing (Debian package systemd-container; `make setup` installs it)"
    if not Path("/usr/lib/systemd/systemd").exists() and not Path("/lib/systemd/systemd").exists():
        return "the operator's root has no systemd to boot (Debian package systemd)"
    try:
        if "overlay" not in Path("/proc/filesystems").read_text():
            return "the kernel lists no overlay filesystem"
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc}"
    try:
        guests.tools()
    except guests.GuestsUnavailable as exc:
        return str(exc)
    return None


def target_unit() -> str:
    return "\n".join([
        "[Unit]",
        "Description=vcfslm guest: the basic system and its sshd, nothing of the operator's services",
        "Requires=basic.target",
        f"Wants={SSHD_UNIT}",
        f"After=basic.target {SSHD_UNIT}",
        "AllowIsolate=yes",
        ""])


def sshd_unit() -> str:
    return "\n".join([
        "[Unit]",
        "Description=vcfslm guest: sshd",
        "After=basic.target",
        "[Service]",
        "ExecStartPre=/bin/mkdir -p /run/sshd",
        f"ExecStart=/usr/sbin/sshd -D -e -f {SSHD_CONFIG}",
        "Restart=on-failure",
        ""])


def sshd_config(name: str, address: str, port: int) -> str:
    return "\n".join([
        f"# vcfslm guest {name} booted by systemd-nspawn (generated)",
        f"ListenAddress {address}:{port}",
        f"HostKey {HOST_KEY}",
        f"AuthorizedKeysFile {AUTHORIZED_KEYS}",
        "AllowUsers root",
        "StrictModes no",
        *guests.SSHD_POLICY,
        f"SetEnv VCFSLM_LAB_NODE={name} SHLVL=1",
        ""])


def boot_script(folder: Path, name: str, binds: Sequence[tuple[str, str]] = ()) -> str:
    """What runs in the boot's own mount namespace: a tmpfs for nspawn's bookkeeping, then
    systemd-nspawn booting the guest's root into vcfslm-guest.target, with `binds`
    (operator's path, guest's path) mounted read-only."""
    nspawn = ["systemd-nspawn", "--quiet", "-D", str(folder / "root"), f"--machine={name}", "--register=no",
              "--keep-unit", "--link-journal=no", "--console=pipe",
              *(f"--bind-ro={src}:{dest}" for src, dest in binds), "-b", "--", f"systemd.unit={TARGET}"]
    return ("mkdir -p /run/systemd/nspawn && mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn && exec "
            + shlex.join(nspawn))


def _run(argv: list[str], timeout: float = 60) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise NspawnFailed(f"{shlex.join(argv)} failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-600:]}")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def mount_root(folder: Path) -> None:
    """The guest's root: an overlay of the operator's / with its changes in a tmpfs."""
    layers, root = folder / "layers", folder / "root"
    layers.mkdir(parents=True, exist_ok=True)
    root.mkdir(exist_ok=True)
    _run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(layers)])
    (layers / "upper").mkdir()
    (layers / "work").mkdir()
    _run(["mount", "-t", "overlay", "overlay", "-o",
          f"lowerdir=/,upperdir={layers / 'upper'},workdir={layers / 'work'}", str(root)])


def prepare(folder: Path, name: str, address: str, port: int, client_public_key: str) -> str:
    """The guest's own machine id, hostname, sshd (host key, config, unit) and target;
    returns its host public key."""
    root = folder / "root"
    _write(root / "etc/machine-id", uuid.uuid4().hex + "\n", 0o444)
    _write(root / "etc/hostname", name + "\n")
    host_key = root / HOST_KEY.lstrip("/")
    for old in (host_key, host_key.with_name(host_key.name + ".pub")):
        old.unlink(missing_ok=True)
    public = guests.ensure_key(host_key, f"vcfslm-guest-{name}")
    _write(root / AUTHORIZED_KEYS.lstrip("/"), client_public_key.strip() + "\n", 0o600)
    _write(root / SSHD_CONFIG.lstrip("/"), sshd_config(name, address, port), 0o600)
    _write(root / "etc/systemd/system" / SSHD_UNIT, sshd_unit())
    _write(root / "etc/systemd/system" / TARGET, target_unit())
    return public


def boot(folder: Path, *, name: str, address: str, client_public_key: str, port: int = 0,
         binds: Sequence[tuple[str, str]] = (), timeout: float = 120.0) -> BootedGuest:
    """Mount, prepare and boot the guest; return once its sshd answers. `binds`: folders of
    the operator's mounted read-only in the guest (operator's path, guest's path), for
    what must not sit under a home (a service with ProtectHome sees no /root or /home)."""
    reason = unavailable_reason()
    if reason:
        raise NspawnUnavailable(reason)
    folder.mkdir(parents=True, exist_ok=True)
    port = port or guests.free_port(address)
    mount_root(folder)
    try:
        public = prepare(folder, name, address, port, client_public_key)
        with open(folder / "boot.log", "ab", buffering=0) as log:
            proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                     boot_script(folder, name, binds)], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=log, start_new_session=True)
        guest = BootedGuest(name, folder, address, port, public, proc)
        try:
            guests.wait_for_banner(address, port, proc, timeout)
        except guests.GuestFailed as exc:
            raise NspawnFailed(f"{exc}; boot log {guest.log}:\n{_tail(guest.log)}") from None
        return guest
    except BaseException:
        halt_folder(folder, None)
        raise


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def halt(guest: BootedGuest) -> None:
    """Power the guest off (systemd stops its units), then unmount and remove its folder."""
    halt_folder(guest.folder, guest.process)


def halt_folder(folder: Path, proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        # nspawn asks the guest's systemd to power off on SIGTERM; a second signal would cut it short.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=HALT_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    for mount in (folder / "root", folder / "layers"):
        for _ in range(20):
            if subprocess.run(["mountpoint", "-q", str(mount)]).returncode != 0:
                break
            if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
                time.sleep(0.25)
        else:
            subprocess.run(["umount", "--lazy", str(mount)], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)
