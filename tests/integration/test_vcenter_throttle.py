"""provision against a vcsim that throttles: clones over its limit are answered HTTP 503
Service Unavailable, as vCenter's reverse proxy answers when it sheds load.

With more VMs at once than the simulator admits, provision backs off and converges; when
every clone is refused, each VM fails and the run says vCenter is throttling and asks for a
lower --parallel. The backoff is shortened for the tests (the default gives vCenter about
half a minute); nothing here is timed.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_vcenter_vcsim import PASSWORD_ENV, brief_inventory, write

from vcfslm.cli import main
from vcfslm.lab import vcsim
from vcfslm.vsphere import session as vsphere_session
from vcfslm.vsphere.throttle import Backoff

pytestmark = pytest.mark.integration

FAST = Backoff(first=0.2, cap=1.0, attempts=12, budget=60.0)
CLONE_MS = 500  # a clone is being served this long, so workers started together overlap


def start(tmp_path_factory, vcsim_binary, password: str, name: str, hosts: int, limit: int):
    workdir = tmp_path_factory.mktemp(name)
    opts = vcsim.VcsimOptions(hosts=hosts, method_delay={"CloneVM_Task": CLONE_MS},
                              throttle={"CloneVM_Task": limit})
    return vcsim.start(workdir, password, opts, binary=vcsim_binary)


def server_view(running, password: str):
    from tests.lab_fixtures import VcsimServer

    return VcsimServer(url=running.url, host=running.host, port=running.port, user=running.user,
                       password=password, ca_file=running.ca_file, hosts=running.hosts,
                       template=running.template, pid=running.pid, vcsim=running)


@pytest.fixture
def cli(vcsim_server, tmp_path, monkeypatch):
    monkeypatch.setattr(vsphere_session, "DEFAULT_BACKOFF", FAST)
    env = {PASSWORD_ENV: vcsim_server.password, "VCFSLM_STATE": str(tmp_path / "state.json"),
           "VCFSLM_INVENTORY": ""}
    runner = CliRunner()
    return lambda *args: runner.invoke(main, list(args), env=env, catch_exceptions=False)


def test_more_vms_at_once_than_vcenter_admits_back_off_and_converge(
        vcsim_server, vcsim_binary, tmp_path_factory, tmp_path, cli):
    running = start(tmp_path_factory, vcsim_binary, vcsim_server.password, "vcsim-throttle-1", 4, 1)
    try:
        server = server_view(running, vcsim_server.password)
        nodes = [(f"itth-0{i + 1}", vcsim.host_name(i)) for i in range(4)]
        path = write(tmp_path, brief_inventory(server, "itth", nodes))
        res = cli("provision", path, "--stage", "vms", "--parallel", "4")
        assert res.exit_code == 0, res.output
        assert vcsim.throttled(running).get("CloneVM_Task", 0) >= 1  # it did refuse some
        again = cli("provision", path, "--stage", "vms", "--parallel", "4")
        assert again.exit_code == 0, again.output
        assert "in sync" in again.output
        gone = cli("destroy", path, "--yes", "--parallel", "4")
        assert gone.exit_code == 0, gone.output
    finally:
        vcsim.stop(running)


def test_persistent_throttling_fails_with_a_message_naming_it(
        vcsim_server, vcsim_binary, tmp_path_factory, tmp_path, cli, monkeypatch):
    monkeypatch.setattr(vsphere_session, "DEFAULT_BACKOFF", Backoff(first=0.05, cap=0.1, attempts=3))
    running = start(tmp_path_factory, vcsim_binary, vcsim_server.password, "vcsim-throttle-0", 2, 0)
    try:
        server = server_view(running, vcsim_server.password)
        nodes = [(f"itth0-0{i + 1}", vcsim.host_name(i)) for i in range(2)]
        path = write(tmp_path, brief_inventory(server, "itth0", nodes))
        res = cli("provision", path, "--stage", "vms")
        assert res.exit_code == 1, res.output
        lines = res.output.splitlines()
        assert "error: 2 of 2 VM(s) failed: itth0-01, itth0-02" in lines
        assert ("vCenter is throttling: it kept refusing calls for 2 VM(s) (itth0-01, itth0-02) "
                "with 2 at once") in lines
        assert "retry with a lower --parallel, e.g. --parallel 1" in lines
        # each VM's clone: the first call and 3 retries, every one refused
        assert vcsim.throttled(running) == {"CloneVM_Task": 8}
        doc = cli("provision", path, "--stage", "vms", "--output", "json", "--parallel", "1")
        assert doc.exit_code == 1
        report = json.loads(doc.stdout)
        assert [v["message"] for v in report["vms"]] == [
            "clone: vCenter is throttling: CloneVM_Task refused 4 time(s) over 0 s "
            "(HTTP 503 Service Unavailable); retry with a lower --parallel (this run: 1 at once)"] * 2
        assert all(v["throttled"] for v in report["vms"])
    finally:
        vcsim.stop(running)
