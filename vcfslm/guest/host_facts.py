"""Facts about a guest's hardware and network: its vNUMA nodes and CPUs, its interfaces,
which peers it reaches, and what verification gathers of them (guest/verify.py)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..topology import parse_cpu_list
from . import vllm
from .facts import Fact, file_content, q
from .transport import Result

# ------------------------------------------------------------------ NUMA and CPUs


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    size_mb: int | None
    free_mb: int | None = None


@dataclass(frozen=True)
class NumaHardware:
    """`numactl --hardware`: nodes with their CPUs and memory (empty when numactl is missing)."""

    nodes: tuple[NumaNode, ...]
    available: bool = True
    error: str = ""

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for n in self.nodes for c in n.cpus))


_NODE_LINE = re.compile(r"^node\s+(\d+)\s+(cpus|size|free):\s*(.*)$")


def parse_numactl_hardware(text: str) -> NumaHardware:
    """Parse `numactl --hardware` (the `node N cpus/size/free` lines)."""
    nodes: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        m = _NODE_LINE.match(line.strip())
        if not m:
            continue
        node = nodes.setdefault(int(m.group(1)), {"cpus": (), "size": None, "free": None})
        kind, value = m.group(2), m.group(3).strip()
        if kind == "cpus":
            node["cpus"] = parse_cpu_list(value)
        else:
            mb = re.match(r"(\d+)\s*MB", value)
            node[kind] = int(mb.group(1)) if mb else None
    return NumaHardware(tuple(NumaNode(i, d["cpus"], d["size"], d["free"])
                              for i, d in sorted(nodes.items())))


def _numa_result(r: Result) -> NumaHardware:
    if r.exit != 0:
        why = "numactl is not installed" if r.exit == 127 else (r.stderr.strip() or f"exit {r.exit}")
        return NumaHardware((), available=False, error=why)
    return parse_numactl_hardware(r.stdout)


NUMA_HARDWARE: Fact[NumaHardware] = Fact(
    "numa", "numactl --hardware", _numa_result,
    NumaHardware((), available=False, error="fresh guest (not inspected)"))


@dataclass(frozen=True)
class CpuInfo:
    """The parts of `lscpu -J` verification needs."""

    cpus: int
    online: tuple[int, ...]
    sockets: int | None
    cores_per_socket: int | None
    threads_per_core: int | None
    numa_nodes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    model: str = ""


def _lscpu_fields(items: list[dict[str, Any]], out: dict[str, str]) -> dict[str, str]:
    for item in items:
        name = str(item.get("field", "")).strip().rstrip(":")
        if name and item.get("data") is not None:
            out.setdefault(name, str(item["data"]).strip())
        _lscpu_fields(item.get("children", []) or [], out)  # util-linux >= 2.39 nests sections
    return out


def parse_lscpu_json(text: str) -> CpuInfo:
    """Parse `lscpu -J` (flat or nested)."""
    fields = _lscpu_fields(json.loads(text).get("lscpu", []), {})

    def num(name: str) -> int | None:
        m = re.match(r"\d+", fields.get(name, ""))
        return int(m.group(0)) if m else None

    nodes = {}
    for name, value in fields.items():
        m = re.fullmatch(r"NUMA node(\d+) CPU\(s\)", name)
        if m:
            nodes[int(m.group(1))] = parse_cpu_list(value)
    return CpuInfo(cpus=num("CPU(s)") or 0, online=parse_cpu_list(fields.get("On-line CPU(s) list", "")),
                   sockets=num("Socket(s)"), cores_per_socket=num("Core(s) per socket"),
                   threads_per_core=num("Thread(s) per core"), numa_nodes=nodes,
                   model=fields.get("Model name", ""))


def _lscpu_result(r: Result) -> CpuInfo | None:
    if r.exit != 0:
        return None
    try:
        return parse_lscpu_json(r.stdout)
    except (ValueError, AttributeError):
        return None


LSCPU: Fact[CpuInfo | None] = Fact("lscpu", "lscpu -J", _lscpu_result, None)


# ------------------------------------------------------------------ the CPUs a guest may use
#
# Inside a cpuset or under a CPU affinity (a lab guest with cores of its own, `lab up
# --cores-per-node`), numactl --hardware and lscpu still list every CPU of the machine, but
# a rank can run only on those its process is allowed. The facts verification and the
# launch scripts' checks read are narrowed to those; on a VM every CPU is allowed and
# nothing changes.


@dataclass(frozen=True)
class Allowed:
    """The CPUs and memory nodes a guest's processes may use (/proc/self/status)."""

    cpus: tuple[int, ...]
    mems: tuple[int, ...] | None = None


def parse_allowed(text: str) -> Allowed | None:
    """`Cpus_allowed_list:` and `Mems_allowed_list:` lines; None without the CPU line."""
    lists = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("Cpus_allowed_list", "Mems_allowed_list"):
            lists[key.strip()] = parse_cpu_list(value.strip())
    if not lists.get("Cpus_allowed_list"):
        return None
    return Allowed(lists["Cpus_allowed_list"], lists.get("Mems_allowed_list"))


ALLOWED: Fact[Allowed | None] = Fact(
    "allowed", "grep -h -E '^(Cpus|Mems)_allowed_list:' /proc/self/status",
    lambda r: parse_allowed(r.stdout) if r.exit == 0 else None, None)


def numa_within(numa: NumaHardware | None, allowed: Allowed | None) -> NumaHardware | None:
    """Each node's CPUs that are allowed. A node listing CPUs stays while any is allowed; a
    node without CPUs (memory only) while its memory is allowed."""
    if numa is None or allowed is None:
        return numa
    cpus = set(allowed.cpus)
    kept = []
    for node in numa.nodes:
        own = tuple(c for c in node.cpus if c in cpus)
        if own or (not node.cpus and (allowed.mems is None or node.id in allowed.mems)):
            kept.append(dataclasses.replace(node, cpus=own))
    return dataclasses.replace(numa, nodes=tuple(kept))


def cpu_within(cpu: CpuInfo | None, allowed: Allowed | None) -> CpuInfo | None:
    """lscpu's CPU count, online CPUs and NUMA nodes, of the allowed CPUs only."""
    if cpu is None or allowed is None:
        return cpu
    cpus = set(allowed.cpus)
    nodes = {n: own for n, listed in cpu.numa_nodes.items() if (own := tuple(c for c in listed if c in cpus))}
    return dataclasses.replace(cpu, cpus=len(cpus & set(range(cpu.cpus))),
                               online=tuple(c for c in cpu.online if c in cpus), numa_nodes=nodes)


# ------------------------------------------------------------------ network


@dataclass(frozen=True)
class Interface:
    name: str
    mtu: int
    addresses: tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, ...]
    up: bool = True


def parse_ip_addr_json(text: str) -> tuple[Interface, ...]:
    """Parse `ip -j addr`: interface name, MTU, addresses with prefixes."""
    out = []
    for link in json.loads(text or "[]"):
        addrs = []
        for a in link.get("addr_info", []):
            if "local" in a and "prefixlen" in a:
                addrs.append(ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}"))
        out.append(Interface(link.get("ifname", "?"), int(link.get("mtu", 0)), tuple(addrs),
                             "UP" in link.get("flags", [])))
    return tuple(out)


def interface_of(ip: str | ipaddress.IPv4Address, interfaces: tuple[Interface, ...]) -> Interface | None:
    """The interface an IP is on: the one holding it exactly, else the most specific prefix
    containing it (loopback lab addresses 127.0.0.x live inside lo's 127.0.0.1/8)."""
    ip = ipaddress.ip_address(str(ip))
    best: tuple[int, Interface] | None = None
    for iface in interfaces:
        for addr in iface.addresses:
            if addr.version != ip.version:
                continue
            if addr.ip == ip:
                return iface
            if ip in addr.network and (best is None or addr.network.prefixlen > best[0]):
                best = (addr.network.prefixlen, iface)
    return best[1] if best else None


def _ip_result(r: Result) -> tuple[Interface, ...]:
    if r.exit != 0:
        return ()
    return parse_ip_addr_json(r.stdout)


INTERFACES: Fact[tuple[Interface, ...]] = Fact("interfaces", "ip -j addr", _ip_result, ())


# A TCP connect answers "is this IP reachable": an accepted or refused connection both prove
# the address answers; only a timeout or unreachable route means it does not. ping may be absent.
# One interpreter connects to every peer at once (a guest of a 64-node cluster probes 63
# peers; one process per peer and a timeout each would cost it CPU and wall time).
_PROBE_PY = """\
import errno, os, select, socket, sys, time
deadline = time.monotonic() + float(TIMEOUT)
pending = {}
def why(e):
    return os.strerror(e).replace(" ", "_")
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    host = host.strip("[]")
    try:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        e = s.connect_ex((host, int(port)))
    except (OSError, ValueError) as exc:
        print(target, "fail", (getattr(exc, "strerror", None) or type(exc).__name__).replace(" ", "_"))
        continue
    if e in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
        pending[s] = target
        continue
    print(target, "ok" if e == 0 else "refused" if e == errno.ECONNREFUSED else "fail " + why(e))
    s.close()
while pending:
    left = deadline - time.monotonic()
    if left <= 0:
        break
    for s in select.select([], list(pending), [], left)[1]:
        target = pending.pop(s)
        e = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        print(target, "ok" if e == 0 else "refused" if e == errno.ECONNREFUSED else "fail " + why(e))
        s.close()
for s, target in pending.items():
    print(target, "fail", "timed_out")
    s.close()
"""

_PROBE_SH = """for t in {targets}; do
  if out=$(timeout {timeout} bash -c "exec 3<>/dev/tcp/${{t%:*}}/${{t##*:}}" 2>&1); then echo "$t ok";
  elif echo "$out" | grep -qi refused; then echo "$t refused";
  else echo "$t fail unreachable"; fi
done"""


@dataclass(frozen=True)
class Reach:
    ok: bool
    detail: str


def parse_probe(text: str) -> dict[str, Reach]:
    """`ip:port ok|refused|fail why` lines -> {ip:port: Reach}."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            status = parts[1]
            detail = " ".join(parts[2:]).replace("_", " ") or status
            out[parts[0]] = Reach(status in ("ok", "refused"), detail)
    return out


def reach_probe(targets: list[str], timeout: float = 3.0) -> Fact[dict[str, Reach]]:
    """TCP probe of `ip:port` targets from the guest: one python3 (no site, isolated) connecting
    to all at once, else bash's /dev/tcp one target after the other."""
    args = " ".join(q(t) for t in targets)
    cmd = (f"if command -v python3 >/dev/null 2>&1; then python3 -I -S -c {q(probe_python(timeout))} {args}; "
           f"elif command -v bash >/dev/null 2>&1 && command -v timeout >/dev/null 2>&1; then "
           f"{_PROBE_SH.format(targets=args, timeout=int(max(1, timeout)))}; "
           f"else echo 'no python3 or bash to probe with' >&2; fi")

    def parse(r: Result) -> dict[str, Reach]:
        found = parse_probe(r.stdout)
        return {t: found.get(t, Reach(False, r.stderr.strip() or "no answer from probe"))
                for t in targets}

    return Fact(f"reach:{','.join(targets)}", cmd, parse,
                {t: Reach(False, "fresh guest (not probed)") for t in targets},
                timeout=timeout * max(1, len(targets)) + 30)


def probe_python(timeout: float) -> str:
    """The python3 probe: `python3 -c CODE ip:port ...`."""
    return _PROBE_PY.replace("TIMEOUT", repr(timeout))



# ------------------------------------------------------------------ verification facts


@dataclass(frozen=True)
class GuestFacts:
    """What verification looks at; parts left None were not gathered and are not checked."""

    numa: NumaHardware | None = None
    cpu: CpuInfo | None = None
    interfaces: tuple[Interface, ...] | None = None
    reach: dict[str, Reach] | None = None  # "ip:port" of peers -> answer
    peers: dict[str, str] = field(default_factory=dict)  # "ip:port" -> peer node name
    # bench.serve.server: vllm: vNUMA node -> its rendered launch script (None: missing)
    server_scripts: dict[int, str | None] | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data for run metadata (meta.json)."""
        out: dict[str, Any] = {}
        if self.numa is not None:
            out["numa_nodes"] = [{"id": n.id, "cpus": list(n.cpus), "size_mb": n.size_mb,
                                  "free_mb": n.free_mb} for n in self.numa.nodes]
        if self.cpu is not None:
            out["cpu"] = {"cpus": self.cpu.cpus, "sockets": self.cpu.sockets,
                          "cores_per_socket": self.cpu.cores_per_socket,
                          "threads_per_core": self.cpu.threads_per_core, "model": self.cpu.model}
        if self.interfaces is not None:
            out["interfaces"] = [{"name": i.name, "mtu": i.mtu, "up": i.up,
                                  "addresses": [str(a) for a in i.addresses]} for i in self.interfaces]
        if self.reach is not None:
            out["reach"] = {t: {"ok": r.ok, "detail": r.detail, "node": self.peers.get(t)}
                            for t, r in self.reach.items()}
        return out


def peer_targets(inventory, node_name: str) -> dict[str, str]:
    """Other nodes' bench IPs with their SSH port, as probe targets: {"ip:port": name}."""
    return {f"{n.bench_ip}:{n.ssh_port}": n.name for n in inventory.nodes if n.name != node_name}


def server_script_paths(inventory) -> dict[int, str]:
    """vNUMA node -> the launch script of its HTTP server ({} when vcfslm serves in-process)."""
    if inventory.bench.serve.server != vllm.VLLM.name:
        return {}
    return {node: vllm.script_path(inventory, node) for node in vllm.node_cpus(inventory)}


def gather_guest_facts(get: Callable[[Fact], Any], inventory, node_name: str, *, numa: bool = True,
                       network: bool = True, reachability: bool = True,
                       server: bool = True) -> GuestFacts:
    """Collect what verification needs through `get` (e.g. a host context's cached fact getter).
    server: also the HTTP server's launch scripts, when the inventory serves with one."""
    peers = peer_targets(inventory, node_name) if reachability else {}
    scripts = server_script_paths(inventory) if server else {}
    allowed = get(ALLOWED) if numa else None
    return GuestFacts(
        numa=numa_within(get(NUMA_HARDWARE), allowed) if numa else None,
        cpu=cpu_within(get(LSCPU), allowed) if numa else None,
        interfaces=get(INTERFACES) if network else None,
        reach=(get(reach_probe(list(peers))) if peers else {}) if reachability else None,
        peers=peers,
        server_scripts={node: get(file_content(path)) for node, path in scripts.items()} or None)
