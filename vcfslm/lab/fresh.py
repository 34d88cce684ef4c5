"""Fresh lab guests, as pure plans: the root they boot from, their network, mounts and teardown.

A fresh guest is a Debian minbase root (built once with debootstrap, cached as a
tarball) that vcfslm has never touched, so the guest playbooks meet what a real
template VM gives them: no operator venv, no operator packages, no internet.

    <lab>/fresh/                  a tmpfs of the lab's (each guest fills ~1.3 GB of it)
    <lab>/fresh/lower/            the cached root, unpacked once per `lab up`
    <lab>/fresh/<node>/upper/     the guest's own changes (overlayfs upper layer)
    <lab>/fresh/<node>/work/      overlayfs work folder
    <lab>/fresh/<node>/root/      mount point of the guest's root (empty outside the guest)
    <lab>/fresh/<node>/sshd.log   the guest's sshd, started chrooted in its namespaces

Networks (RFC 2544's benchmarking range 198.18.0.0/15: never routed, rarely in use):

    management  198.18.<net>.1 on the operator end of one veth pair per guest,
                198.18.<net>.(11+i) on the guest's eth0: point-to-point, nothing else
                reachable (no default route: the guest has no way out)
    bench       198.19.<net>.(11+i)/24 on the guest's eth1, whose peer sits in a bridge
                inside a namespace of the lab's own: guests see each other, and nothing
                of the bench network lives in the operator's namespace

The copies live in memory because a guest's venv is ~60,000 files: deleting them from a
disk mounted with `discard` took minutes, unmounting the tmpfs takes no time.

Every function here returns data (argv lists, scripts, names); `freshroot.py` runs them.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .guests import SSHD_POLICY

# What a real template VM must carry before vcfslm runs on it, offline: an SSH server and
# Python, plus the system packages the base playbook asks for (an offline guest cannot
# fetch them; tests check this list covers playbooks/base.yaml). Everything else (venv,
# torch, vcfslm, the model) is the playbooks' job.
TEMPLATE_PACKAGES = ("openssh-server", "python3", "python3-venv", "numactl", "iproute2",
                     "procps", "util-linux")
SUITE = "bookworm"
VARIANT = "minbase"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
ROOT_FORMAT = 1                 # bump when the cached root's recipe changes meaning
MANAGEMENT_PREFIX = "198.18"
BENCH_PREFIX = "198.19"
OPERATOR_OCTET = 1
FIRST_GUEST_OCTET = 11
MAX_FRESH_NODES = 16            # each fresh guest is a full OS root; the lab is one machine
MANAGEMENT_MTU = 1500
BENCH_MTU = 9000                # a jumbo-frame bench network, as the brief's clusters use
BENCH_NETMASK = "255.255.255.0"
GUEST_WORKDIR = "/opt/vcfslm"
SSH_PORT = 22
SSHD = "/usr/sbin/sshd"
# Device nodes bound from the operator's /dev into the guest's own (tmpfs) /dev: what
# sshd, Python and torch open. The operator's disks and consoles stay out of reach.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def root_key(packages: Sequence[str] = TEMPLATE_PACKAGES, suite: str = SUITE,
             variant: str = VARIANT, arch: str = "amd64") -> str:
    """Cache key of a root: what it is built from (the mirror does not change its meaning)."""
    text = f"{ROOT_FORMAT}\0{suite}\0{variant}\0{arch}\0" + ",".join(sorted(packages))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def root_tarball(cache: Path, key: str) -> Path:
    return cache / "fresh-roots" / f"debian-{SUITE}-{VARIANT}-{key}.tar"


def debootstrap_argv(target: Path, mirror: str, packages: Sequence[str] = TEMPLATE_PACKAGES,
                     suite: str = SUITE, variant: str = VARIANT) -> list[str]:
    """debootstrap in a private mount namespace: the /proc and /sys it mounts into the
    target vanish with it, even when it is interrupted (a later `rm -r` of the target
    never walks into the operator's /proc)."""
    return ["unshare", "--mount", "--propagation", "private", "debootstrap",
            f"--variant={variant}", f"--include={','.join(packages)}", suite, str(target), mirror]


def mirror_from_sources(text: str) -> str | None:
    """The first Debian mirror of a deb822 .sources file or a one-line sources.list."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("URIs:"):
            for uri in line.split()[1:]:
                if "security" not in uri:
                    return uri
        elif line.startswith("deb ") and "security" not in line:
            words = [w for w in line.split()[1:] if not w.startswith("[")]
            if words:
                return words[0]
    return None


def lab_tag(directory: Path) -> str:
    """Six hex digits naming one lab folder in namespace and interface names (two labs on
    one machine never share one)."""
    return hashlib.sha256(str(directory).encode()).hexdigest()[:6]


def pick_net(used_octets: Iterable[int], preferred: int | None = None) -> int:
    """The third octet of this lab's networks: `preferred` (the recorded one) when free,
    else the lowest not taken by another lab's operator address."""
    used = set(used_octets)
    if preferred is not None and preferred not in used:
        return preferred
    for octet in range(1, 255):
        if octet not in used:
            return octet
    raise ValueError("every 198.18.X.0/24 network is in use on this machine")


def used_nets(addresses: Iterable[str]) -> set[int]:
    """Third octets of the 198.18.X.1 addresses already on the operator's interfaces."""
    out = set()
    for addr in addresses:
        parts = addr.split("/")[0].split(".")
        if len(parts) == 4 and ".".join(parts[:2]) == MANAGEMENT_PREFIX \
                and parts[3] == str(OPERATOR_OCTET):
            out.add(int(parts[2]))
    return out


@dataclass(frozen=True)
class GuestPlan:
    """One fresh guest: its names, addresses and folders."""

    index: int
    name: str
    netns: str
    host_veth: str          # operator end of the management pair
    bench_veth: str         # bench-switch end of the bench pair
    operator_ip: str
    management_ip: str
    bench_ip: str
    dir: str

    @property
    def upper(self) -> str:
        return f"{self.dir}/upper"

    @property
    def work(self) -> str:
        return f"{self.dir}/work"

    @property
    def root(self) -> str:
        return f"{self.dir}/root"

    @property
    def log(self) -> str:
        return f"{self.dir}/sshd.log"

    @property
    def sshd_config(self) -> str:
        """Path inside the guest; unique per lab and node, so it marks the sshd's command line."""
        return f"/etc/ssh/vcfslm-{self.netns}.conf"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GuestPlan:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class LabPlan:
    """Every fresh guest of one lab and the namespace of its bench switch."""

    tag: str
    net: int
    dir: str
    bench_netns: str
    guests: tuple[GuestPlan, ...]

    @property
    def lower(self) -> str:
        return f"{self.dir}/lower"

    def to_json(self) -> dict:
        return {"tag": self.tag, "net": self.net, "dir": self.dir, "bench_netns": self.bench_netns,
                "guests": [g.to_json() for g in self.guests]}

    @classmethod
    def from_json(cls, data: dict) -> LabPlan:
        return cls(tag=data["tag"], net=int(data["net"]), dir=data["dir"],
                   bench_netns=data["bench_netns"],
                   guests=tuple(GuestPlan.from_json(g) for g in data["guests"]))


def node_name(index: int) -> str:
    return f"slm-{index + 1:02d}"


def lab_plan(directory: Path, nodes: int, net: int) -> LabPlan:
    """Names and addresses of `nodes` fresh guests of the lab in `directory`."""
    if not 1 <= nodes <= MAX_FRESH_NODES:
        raise ValueError(f"fresh guests: between 1 and {MAX_FRESH_NODES}; got {nodes}")
    tag = lab_tag(directory)
    base = f"{directory}/fresh"
    guests = tuple(GuestPlan(
        index=i, name=node_name(i), netns=f"vcfslm-{tag}-{node_name(i)}",
        # Interface names hold 15 characters: "vf" + tag + m/b + two digits = 11.
        host_veth=f"vf{tag}m{i + 1:02d}", bench_veth=f"vf{tag}b{i + 1:02d}",
        operator_ip=f"{MANAGEMENT_PREFIX}.{net}.{OPERATOR_OCTET}",
        management_ip=f"{MANAGEMENT_PREFIX}.{net}.{FIRST_GUEST_OCTET + i}",
        bench_ip=f"{BENCH_PREFIX}.{net}.{FIRST_GUEST_OCTET + i}",
        dir=f"{base}/{node_name(i)}") for i in range(nodes))
    return LabPlan(tag=tag, net=net, dir=base, bench_netns=f"vcfslm-{tag}-bench", guests=guests)


# ------------------------------------------------------------------ network


def bench_switch_commands(plan: LabPlan) -> list[list[str]]:
    """The bench switch: a namespace with one bridge, no address, no route."""
    ns = plan.bench_netns
    return [["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "add", "br0", "mtu", str(BENCH_MTU), "type", "bridge"],
            ["ip", "-n", ns, "link", "set", "br0", "up"]]


def guest_network_commands(plan: LabPlan, guest: GuestPlan) -> list[list[str]]:
    """A guest's namespace: lo, eth0 (management, point-to-point to the operator) and eth1
    (bench, into the bench switch). No default route: nothing outside is reachable."""
    ns = guest.netns
    mgmt = f"{guest.host_veth}g"     # temporary names until each end is in its namespace
    bench = f"{guest.bench_veth}g"
    return [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        # management: operator end stays here with the operator's point-to-point address
        ["ip", "link", "add", guest.host_veth, "mtu", str(MANAGEMENT_MTU), "type", "veth",
         "peer", "name", mgmt, "mtu", str(MANAGEMENT_MTU)],
        ["ip", "link", "set", mgmt, "netns", ns],
        ["ip", "-n", ns, "link", "set", mgmt, "name", "eth0"],
        ["ip", "addr", "add", guest.operator_ip, "peer", f"{guest.management_ip}/32",
         "dev", guest.host_veth],
        ["ip", "link", "set", guest.host_veth, "up"],
        ["ip", "-n", ns, "addr", "add", guest.management_ip, "peer", f"{guest.operator_ip}/32",
         "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
        # bench: both ends leave the operator's namespace
        ["ip", "link", "add", guest.bench_veth, "mtu", str(BENCH_MTU), "type", "veth",
         "peer", "name", bench, "mtu", str(BENCH_MTU)],
        ["ip", "link", "set", guest.bench_veth, "netns", plan.bench_netns],
        ["ip", "link", "set", bench, "netns", ns],
        ["ip", "-n", plan.bench_netns, "link", "set", guest.bench_veth, "master", "br0"],
        ["ip", "-n", plan.bench_netns, "link", "set", guest.bench_veth, "up"],
        ["ip", "-n", ns, "link", "set", bench, "name", "eth1"],
        ["ip", "-n", ns, "addr", "add", f"{guest.bench_ip}/24", "dev", "eth1"],
        ["ip", "-n", ns, "link", "set", "eth1", "up"],
    ]


# ------------------------------------------------------------------ the guest's root and sshd


def guest_files(guest: GuestPlan, *, authorized_key: str, host_key: str,
                host_public_key: str) -> dict[str, tuple[str, int]]:
    """Files written into the guest's upper layer before it starts: path -> (text, mode).

    A debootstrapped root carries the operator's /etc/resolv.conf and /etc/hostname; an
    offline guest names itself and resolves nothing (glibc then fails fast on 127.0.0.1).
    """
    return {
        "/etc/hostname": (guest.name + "\n", 0o644),
        "/etc/hosts": (f"127.0.0.1\tlocalhost\n127.0.1.1\t{guest.name}\n"
                       "::1\tlocalhost ip6-localhost ip6-loopback\n", 0o644),
        "/etc/resolv.conf": ("# offline lab guest: no name server\n", 0o644),
        "/etc/ssh/ssh_host_ed25519_key": (host_key, 0o600),
        "/etc/ssh/ssh_host_ed25519_key.pub": (host_public_key + "\n", 0o644),
        guest.sshd_config: (sshd_config(guest), 0o644),
        "/root/.ssh/authorized_keys": (authorized_key + "\n", 0o600),
    }


def sshd_config(guest: GuestPlan) -> str:
    """The guest's own sshd: root by key only, on its management address."""
    return "\n".join([
        f"# vcfslm fresh lab guest {guest.name} (generated by `vcfslm lab up --fresh-guests`)",
        f"ListenAddress {guest.management_ip}:{SSH_PORT}",
        "HostKey /etc/ssh/ssh_host_ed25519_key",
        "PidFile none",
        *SSHD_POLICY,
        f"SetEnv VCFSLM_LAB_NODE={guest.name}",
        "",
    ])


@dataclass(frozen=True)
class Mount:
    """One mount of the guest's start script (in the guest's own mount namespace)."""

    target: str
    fstype: str | None = None      # None: a bind mount of `source`
    source: str = "none"
    options: str = ""

    def argv(self) -> list[str]:
        if self.fstype is None:
            argv = ["mount", "--bind", self.source, self.target]
            return argv + (["-o", self.options] if self.options else [])
        argv = ["mount", "-t", self.fstype]
        return argv + (["-o", self.options] if self.options else []) + [self.source, self.target]


def mount_plan(guest: GuestPlan, lower: str) -> list[Mount]:
    """The guest's root (overlay of the shared root and its own layer), then /proc, /sys
    (read-only: a fresh sysfs of the guest's network namespace, so /sys/class/net shows
    its own interfaces and /sys/devices/system/node the machine's NUMA nodes), a small
    /dev of its own, /dev/pts, /dev/shm and /run."""
    root = guest.root
    mounts = [Mount(root, "overlay", "overlay",
                    f"lowerdir={lower},upperdir={guest.upper},workdir={guest.work}"),
              Mount(f"{root}/proc", "proc", "proc", "nosuid,nodev,noexec"),
              Mount(f"{root}/sys", "sysfs", "sysfs", "ro,nosuid,nodev,noexec"),
              Mount(f"{root}/dev", "tmpfs", "tmpfs", "nosuid,mode=0755,size=1m")]
    mounts += [Mount(f"{root}/dev/{d}", None, f"/dev/{d}") for d in DEVICES]
    mounts += [Mount(f"{root}/dev/pts", "devpts", "devpts", "newinstance,ptmxmode=0666,mode=0620"),
               Mount(f"{root}/dev/shm", "tmpfs", "tmpfs", "nosuid,nodev,mode=1777"),
               Mount(f"{root}/run", "tmpfs", "tmpfs", "nosuid,nodev,mode=0755")]
    return mounts


def copies_mount(plan: LabPlan) -> Mount:
    """The tmpfs that holds the shared root layer and every guest's own layer."""
    return Mount(plan.dir, "tmpfs", "vcfslm-fresh", "mode=0755")


def start_script(guest: GuestPlan, lower: str) -> str:
    """What runs in the guest's namespaces (network via `ip netns exec`, which also gives it
    a mount namespace of its own; UTS via unshare): mount, name the host, exec sshd
    chrooted. The mounts live and die with the guest's processes: the operator's
    namespace never sees them."""
    lines = ["set -e"]
    for m in mount_plan(guest, lower):
        if m.target.startswith(f"{guest.root}/dev/") and m.fstype is None:
            lines.append(f"touch {shlex.quote(m.target)}")
        elif m.target.startswith(f"{guest.root}/dev/"):
            lines.append(f"mkdir -p {shlex.quote(m.target)}")
        lines.append(shlex.join(m.argv()))
    root = shlex.quote(guest.root)
    lines += [f"ln -s /proc/self/fd {root}/dev/fd",
              f"ln -s pts/ptmx {root}/dev/ptmx",
              f"mkdir -p -m 0755 {root}/run/sshd",
              f"hostname {shlex.quote(guest.name)}",
              f"exec chroot {root} {SSHD} -D -e -f {shlex.quote(guest.sshd_config)}"]
    return "\n".join(lines) + "\n"


def start_argv(guest: GuestPlan, lower: str) -> list[str]:
    return ["ip", "netns", "exec", guest.netns, "unshare", "--uts", "sh", "-c",
            start_script(guest, lower)]


# ------------------------------------------------------------------ teardown


@dataclass(frozen=True)
class Teardown:
    """What `lab down` removes, in order."""

    kill_netns: tuple[str, ...]          # every process in these namespaces is the lab's
    delete_netns: tuple[str, ...]
    delete_links: tuple[str, ...]        # operator-side veth ends still there
    unmount: tuple[str, ...]             # mounts under the lab's fresh folder, deepest first
    remove: tuple[str, ...]              # folders removed once nothing is mounted under them


def teardown_plan(plan: LabPlan, existing_netns: Iterable[str], existing_links: Iterable[str],
                  mount_points: Iterable[str], whole: bool = True) -> Teardown:
    """Teardown of a fresh lab's guests from what exists now (namespaces, links, mount points
    as /proc/self/mountinfo lists them). Only names the plan itself made are touched.

    whole: the lab goes (the bench switch and the shared root layer too); False: only the
    plan's guests (one that died and is started again)."""
    netns = set(existing_netns)
    links = set(existing_links)
    ours = [g.netns for g in plan.guests] + ([plan.bench_netns] if whole else [])
    roots = [g.dir.rstrip("/") for g in plan.guests] + ([plan.dir.rstrip("/")] if whole else [])
    mounted = sorted({m for m in mount_points for r in roots if m == r or m.startswith(r + "/")},
                     key=lambda m: (-m.count("/"), m))
    return Teardown(
        kill_netns=tuple(n for n in ours if n in netns),
        delete_netns=tuple(n for n in ours if n in netns),
        delete_links=tuple(g.host_veth for g in plan.guests if g.host_veth in links),
        unmount=tuple(mounted),
        remove=tuple([g.dir for g in plan.guests] + ([plan.lower, plan.dir] if whole else [])))


def mount_points(mountinfo: str) -> list[str]:
    """Mount points of a /proc/<pid>/mountinfo text (octal escapes decoded)."""
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            out.append(fields[4].encode().decode("unicode_escape"))
    return out
