"""Fresh lab guests, the side effects: build and cache the root, set up namespaces, start
and stop each guest's sshd, tear everything down. The plans come from `fresh.py`.

Needs root (namespaces, mounts, chroot), iproute2, util-linux's unshare, overlayfs,
and debootstrap the first time (the root is cached as a tarball under the user's cache
folder, so later labs on the machine skip the ~1-3 minute build).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import VcfslmError
from ..progress import NullReporter, Reporter
from . import fresh, guests, process

SOURCES = (Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list"))
BUILD_TIMEOUT_S = 1800


class FreshUnavailable(VcfslmError):
    """This machine cannot run fresh guests (not root, no overlayfs, no debootstrap, ...)."""


class FreshFailed(VcfslmError):
    """A fresh guest, its network or the root build failed."""


def _run(argv: Sequence[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise FreshFailed(f"{' '.join(argv)} failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc


def unavailable_reason(need_debootstrap: bool) -> str | None:
    """Why fresh guests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "fresh guests need root (network namespaces, mounts, chroot)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("chroot", "coreutils"),
                          ("ssh-keygen", "openssh-client")):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"fresh guests need `{tool}` (Debian package {package})"
    if need_debootstrap and shutil.which("debootstrap", path="/usr/sbin:/usr/bin:/sbin") is None:
        return ("building the fresh guests' root needs debootstrap (Debian package debootstrap; "
                "`make setup` installs it)")
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "overlay" not in filesystems:
        return "fresh guests need overlayfs (the kernel lists no `overlay` in /proc/filesystems)"
    probe = f"vcfslm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def debian_mirror(sources: Sequence[Path] = SOURCES) -> str:
    """The operator's own Debian mirror (it is reachable from here), else deb.debian.org."""
    files: list[Path] = []
    for src in sources:
        if src.is_dir():
            files += sorted(src.glob("*.sources")) + sorted(src.glob("*.list"))
        elif src.is_file():
            files.append(src)
    for path in files:
        try:
            found = fresh.mirror_from_sources(path.read_text())
        except OSError:
            continue
        if found and "debian" in found:
            return found
    return fresh.DEFAULT_MIRROR


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_root_tarball(cache: Path, reporter: Reporter | None = None,
                        mirror: str | None = None) -> Path:
    """The cached root tarball, built with debootstrap when missing (one builder at a time)."""
    reporter = reporter or NullReporter()
    tarball = fresh.root_tarball(cache, fresh.root_key())
    if tarball.exists():
        return tarball
    with _locked(tarball.with_name(tarball.name + ".lock")):
        if tarball.exists():  # built by the lab that held the lock
            return tarball
        reason = unavailable_reason(need_debootstrap=True)
        if reason:
            raise FreshUnavailable(reason)
        mirror = mirror or debian_mirror()
        build = Path(tempfile.mkdtemp(prefix=".build-", dir=tarball.parent))
        try:
            target = build / "root"
            reporter.update("fresh root", f"debootstrap {fresh.SUITE} from {mirror} (once per machine)")
            proc = subprocess.run(fresh.debootstrap_argv(target, mirror), capture_output=True,
                                  text=True, timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                log = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
                raise FreshFailed("debootstrap failed:\n" + "\n".join(f"  | {line}" for line in log))
            # The downloaded .debs are not part of a template; the package lists are.
            for deb in (target / "var/cache/apt/archives").glob("*.deb"):
                deb.unlink()
            reporter.update("fresh root", f"packing {tarball.name}")
            partial = build / "root.tar"
            _run(["tar", "-C", str(target), "--numeric-owner", "-cf", str(partial), "."], timeout=600)
            os.replace(partial, tarball)
        finally:
            _remove_unmounted(build)
    return tarball


def unpack_lower(tarball: Path, lower: Path) -> None:
    """The shared read-only layer of every guest of the lab: the tarball, unpacked once."""
    marker = lower / ".vcfslm-root"
    if marker.exists() and marker.read_text().strip() == tarball.name:
        return
    _remove_unmounted(lower)
    lower.mkdir(parents=True)
    _run(["tar", "-C", str(lower), "--numeric-owner", "-xf", str(tarball)], timeout=600)
    marker.write_text(tarball.name + "\n")


def existing_netns() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def existing_links() -> list[str]:
    return [p.name for p in Path("/sys/class/net").iterdir()]


def operator_addresses() -> list[str]:
    """The IPv4 addresses of the operator's own interfaces (local ends, not their peers)."""
    proc = _run(["ip", "-j", "-4", "addr", "show"], check=False)
    try:
        links = json.loads(proc.stdout or "[]")
    except ValueError:
        return []
    return [a["local"] for link in links for a in link.get("addr_info", []) if "local" in a]


def current_mounts() -> list[str]:
    return fresh.mount_points(Path("/proc/self/mountinfo").read_text())


def ensure_copies_mount(plan: fresh.LabPlan) -> None:
    """Mount the lab's tmpfs for the guests' copies (kept while it is mounted)."""
    if plan.dir in current_mounts():
        return
    Path(plan.dir).mkdir(parents=True, exist_ok=True)
    if any(Path(plan.dir).iterdir()):
        # copies a killed lab left on disk, below where the tmpfs goes
        for child in Path(plan.dir).iterdir():
            _remove_unmounted(child)
    _run(fresh.copies_mount(plan).argv())


def ensure_bench_switch(plan: fresh.LabPlan) -> None:
    if plan.bench_netns in existing_netns():
        return
    for argv in fresh.bench_switch_commands(plan):
        _run(argv)


def start_guest(plan: fresh.LabPlan, guest: fresh.GuestPlan, client: guests.ClientKeys, *,
                timeout: float = 30.0, reporter: Reporter | None = None) -> guests.Guest:
    """Network, root layer, host key and sshd of one fresh guest; waits for its banner."""
    reporter = reporter or NullReporter()
    _, keygen = guests.tools()
    reporter.update(guest.name, f"namespace {guest.netns}")
    stop_guests(plan, [guest], whole=False)  # leftovers of a guest that died
    for argv in fresh.guest_network_commands(plan, guest):
        _run(argv)
    gdir = Path(guest.dir)
    for sub in (guest.upper, guest.work, guest.root):
        Path(sub).mkdir(parents=True, exist_ok=True)
    host_key = gdir / "ssh_host_ed25519_key"
    host_public = guests.ensure_key(host_key, f"vcfslm-fresh-{guest.name}", keygen)
    files = fresh.guest_files(guest, authorized_key=client.public_key,
                              host_key=host_key.read_text(), host_public_key=host_public)
    for path, (text, mode) in files.items():
        dest = Path(guest.upper + path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        dest.chmod(mode)
    (Path(guest.upper) / "root").chmod(0o700)
    (Path(guest.upper) / "root/.ssh").chmod(0o700)
    reporter.update(guest.name, "starting sshd")
    proc = process.start_detached(fresh.start_argv(guest, plan.lower), Path(guest.log))
    rec = process.record(proc.pid, marker=guest.sshd_config)
    try:
        guests.wait_for_banner(guest.management_ip, fresh.SSH_PORT, proc, timeout)
    except guests.GuestFailed as exc:
        process.terminate([rec], timeout=2)
        stop_guests(plan, [guest], whole=False)
        raise FreshFailed(f"{guest.name}: {exc}\n{_tail(Path(guest.log))}") from None
    reporter.update(guest.name, f"sshd on {guest.management_ip}:{fresh.SSH_PORT} (netns {guest.netns})")
    return guests.Guest(name=guest.name, address=guest.management_ip, bench_address=guest.bench_ip,
                        port=fresh.SSH_PORT, user="root", key=str(client.key),
                        known_hosts=str(client.known_hosts), workdir=fresh.GUEST_WORKDIR,
                        host_public_key=host_public,
                        config=guest.upper + guest.sshd_config, log=guest.log, process=rec)


def is_running(guest: guests.Guest, plan: fresh.GuestPlan) -> bool:
    return process.is_alive(guest.process) and plan.netns in existing_netns()


def netns_processes(names: Sequence[str]) -> list[process.ProcessRecord]:
    """Every process whose network namespace is one of these lab-made namespaces."""
    out = []
    for name in names:
        proc = _run(["ip", "netns", "pids", name], check=False)
        for word in proc.stdout.split():
            if word.isdigit():
                stat = process.read_stat(int(word))
                if stat is not None:
                    out.append(process.ProcessRecord(int(word), stat[2], ""))
    return out


def stop_guests(plan: fresh.LabPlan, selected: Sequence[fresh.GuestPlan] | None = None, *,
                recorded: Sequence[process.ProcessRecord] = (), whole: bool = True) -> list[str]:
    """Tear down guests (all of the plan's by default): their processes (the recorded sshd
    and every process in their namespaces, by pid), namespaces, operator-side links and
    folders; `whole` also the bench switch and the shared root layer. Returns the netns
    that held processes."""
    sub = fresh.LabPlan(plan.tag, plan.net, plan.dir, plan.bench_netns,
                        tuple(selected) if selected is not None else plan.guests)
    down = fresh.teardown_plan(sub, existing_netns(), existing_links(), current_mounts(),
                               whole=whole)
    victims = list(recorded) + netns_processes(down.kill_netns)
    process.terminate([r for r in victims if r.marker == "" or process.is_alive(r)], timeout=5)
    # anything a guest started in the meantime (a session closing, a late child)
    process.terminate(netns_processes(down.kill_netns), timeout=2)
    for name in down.delete_netns:
        _run(["ip", "netns", "del", name], check=False)
    for link in down.delete_links:
        _run(["ip", "link", "del", link], check=False)
    for point in down.unmount:
        _run(["umount", "-l", point], check=False)
    for folder in down.remove:
        path = Path(folder)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()   # the unmounted tmpfs's mount point
        else:
            _remove_unmounted(path)
    return [n for n in down.kill_netns if n != plan.bench_netns]


def _remove_unmounted(path: Path) -> None:
    """rm -r, refused while anything is mounted below (it would walk into /proc or /dev)."""
    if not path.exists():
        return
    prefix = str(path).rstrip("/") + "/"
    inside = [m for m in current_mounts() if m.startswith(prefix) or m == str(path)]
    if inside:
        raise FreshFailed(f"{path}: still mounted below it ({', '.join(inside[:3])}); "
                          "not removed")
    shutil.rmtree(path)


def _tail(path: Path, lines: int = 10) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(f"  | {line}" for line in text[-lines:])
