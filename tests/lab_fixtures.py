"""pytest plugin: the local lab as session-scoped fixtures (real vcsim, real sshd guests).

    vcsim_server   VcsimServer: url, host, port, user, password, ca_file, hosts (4),
                   template, pid, datacenter, cluster, datastore, management_portgroup,
                   bench_portgroup, host_names, vcsim (the vcfslm.lab.vcsim.Vcsim)
    ssh_guests     list of 4 vcfslm.lab.guests.Guest: name, address, bench_address, port,
                   user, key (== key_path), known_hosts, workdir, host_public_key, pid
    lab            LabInfo: dir, vcsim (VcsimServer), guests, inventory (path of the
                   generated inventory), env (dict: VCFSLM_VCENTER_PASSWORD,
                   VCFSLM_INVENTORY), env_file, password, load_inventory()

Every process is started by the fixture and stopped at the end of the session.
Without Go + govmomi sources or OpenSSH the fixtures skip with the reason
(`make setup` installs them, so CI runs them).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vcfslm.lab import generate, guests, vcsim
from vcfslm.lab import lab as lab_mod

LAB_GUESTS = 4
LAB_HOSTS = 4


@dataclass(frozen=True)
class VcsimServer:
    """A running lab vCenter simulator and how to log in to it."""

    url: str
    host: str
    port: int
    user: str
    password: str
    ca_file: str
    hosts: int
    template: str
    pid: int
    vcsim: vcsim.Vcsim
    datacenter: str = vcsim.DATACENTER
    cluster: str = vcsim.CLUSTER
    datastore: str = vcsim.DATASTORE
    management_portgroup: str = vcsim.MANAGEMENT_PORTGROUP
    bench_portgroup: str = vcsim.BENCH_PORTGROUP

    @property
    def host_names(self) -> list[str]:
        return [vcsim.host_name(i) for i in range(self.hosts)]


@dataclass(frozen=True)
class LabInfo:
    """vcsim + guests + the generated inventory and env describing them."""

    dir: Path
    vcsim: VcsimServer
    guests: list[guests.Guest]
    inventory: Path
    env_file: Path
    password: str
    env: dict[str, str] = field(default_factory=dict)

    def load_inventory(self):
        from vcfslm.inventory_load import load_inventory

        return load_inventory(self.inventory)


@pytest.fixture(scope="session")
def vcsim_binary() -> Path:
    """The built vcsim (built once, cached in ~/.cache/vcfslm); skips without Go/govmomi."""
    try:
        return vcsim.ensure_built()
    except vcsim.VcsimUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def vcsim_server(tmp_path_factory, vcsim_binary):
    """vcsim with 4 VX650 V4-shaped hosts, TLS from a lab CA, the lab template."""
    workdir = tmp_path_factory.mktemp("vcsim")
    password = secrets.token_urlsafe(12)
    opts = vcsim.VcsimOptions(port=0, hosts=LAB_HOSTS)
    running = vcsim.start(workdir, password, opts, binary=vcsim_binary)
    try:
        yield VcsimServer(url=running.url, host=running.host, port=running.port,
                          user=running.user, password=password, ca_file=running.ca_file,
                          hosts=running.hosts, template=running.template, pid=running.pid,
                          vcsim=running)
    finally:
        vcsim.stop(running)


@pytest.fixture(scope="session")
def ssh_guests(tmp_path_factory):
    """4 loopback sshd guests (127.0.0.11-14, free ports), key-only, known host keys."""
    try:
        guests.tools()
    except guests.GuestsUnavailable as exc:
        pytest.skip(str(exc))
    base = tmp_path_factory.mktemp("guests")
    client = guests.ensure_client_keys(base / "ssh")
    started: list[guests.Guest] = []
    try:
        try:
            for i in range(LAB_GUESTS):
                started.append(guests.start_guest(i, base / "guests", client, port=0))
        except guests.GuestsUnavailable as exc:  # e.g. no /run/sshd and no right to create it
            pytest.skip(str(exc))
        guests.write_known_hosts(client.known_hosts, started)
        yield list(started)
    finally:
        for g in started:
            guests.stop_guest(g)


@pytest.fixture(scope="session")
def lab(tmp_path_factory, vcsim_server, ssh_guests) -> LabInfo:
    """The session's vcsim and guests plus a generated inventory and env describing them."""
    directory = tmp_path_factory.mktemp("lab")
    state = lab_mod.LabState(dir=directory, nodes=len(ssh_guests), vcsim=vcsim_server.vcsim,
                             guests=list(ssh_guests), inventory=directory / "inventory.yaml",
                             env_file=directory / "lab.env", bench_port=guests.port_for_later(""))
    lab_mod.write_lab_files(state, vcsim_server.password)
    env = generate.parse_env_file(state.env_file.read_text())
    return LabInfo(dir=directory, vcsim=vcsim_server, guests=list(ssh_guests),
                   inventory=state.inventory, env_file=state.env_file,
                   password=vcsim_server.password, env=env)


__all__ = ["LabInfo", "VcsimServer", "lab", "provisioned_lab", "ssh_guests", "vcsim_binary", "vcsim_server"]


@pytest.fixture(scope="session")
def provisioned_lab(lab):
    """The lab with every guest playbook applied once (venv, this project's wheel, launch
    scripts, verification): what the bench and end-to-end tests start from."""
    from vcfslm.cli.guest_stage import ssh_connector
    from vcfslm.guest.provision import GuestRun, provision_guests

    inv = lab.load_inventory()
    summary = provision_guests(inv, ssh_connector(inv, None),
                               options=GuestRun(run_dir=lab.dir / "guest-logs"))
    assert summary.ok, [(h.host, h.error) for h in summary.failed_hosts]
    return lab
