"""The local lab against real servers: vcsim over verified TLS, sshd guests with checked host keys,
and the `vcfslm lab` commands' process bookkeeping."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vcfslm.lab import generate, process

pytestmark = pytest.mark.integration

TIB = 1024**4


# ------------------------------------------------------------------ vcsim


@pytest.fixture(scope="module")
def si(vcsim_server):
    """A pyVmomi session verified against the lab CA."""
    from pyVim.connect import Disconnect, SmartConnect

    ctx = ssl.create_default_context(cafile=vcsim_server.ca_file)
    service = SmartConnect(host=vcsim_server.host, port=vcsim_server.port, user=vcsim_server.user,
                           pwd=vcsim_server.password, sslContext=ctx)
    yield service
    Disconnect(service)


def _objects(si, kind):
    content = si.RetrieveContent()
    view = content.viewManager.CreateContainerView(content.rootFolder, [kind], True)
    try:
        return list(view.view)
    finally:
        view.Destroy()


def _wait(task, timeout=30):
    deadline = time.monotonic() + timeout
    while task.info.state not in ("success", "error"):
        assert time.monotonic() < deadline, "task did not finish"
        time.sleep(0.05)
    assert task.info.state == "success", task.info.error
    return task.info.result


def test_pyvmomi_connects_over_tls_with_the_lab_ca(si, vcsim_server):
    about = si.RetrieveContent().about
    assert about.apiType == "VirtualCenter"
    assert about.apiVersion == "6.5"
    assert vcsim_server.url == f"https://{vcsim_server.host}:{vcsim_server.port}/sdk"


def test_pyvmomi_refuses_the_lab_without_its_ca(vcsim_server):
    from pyVim.connect import SmartConnect

    with pytest.raises(ssl.SSLCertVerificationError):
        SmartConnect(host=vcsim_server.host, port=vcsim_server.port, user=vcsim_server.user,
                     pwd=vcsim_server.password, sslContext=ssl.create_default_context())


def test_wrong_password_is_refused(vcsim_server):
    from pyVim.connect import SmartConnect
    from pyVmomi import vim

    ctx = ssl.create_default_context(cafile=vcsim_server.ca_file)
    with pytest.raises(vim.fault.InvalidLogin):
        SmartConnect(host=vcsim_server.host, port=vcsim_server.port, user=vcsim_server.user,
                     pwd=vcsim_server.password + "x", sslContext=ctx)


def test_inventory_names_exist_in_the_simulator(si, vcsim_server):
    from pyVmomi import vim

    assert [d.name for d in _objects(si, vim.Datacenter)] == [vcsim_server.datacenter]
    assert [c.name for c in _objects(si, vim.ClusterComputeResource)] == [vcsim_server.cluster]
    assert sorted(h.name for h in _objects(si, vim.HostSystem)) == vcsim_server.host_names
    assert vcsim_server.datastore in {d.name for d in _objects(si, vim.Datastore)}
    networks = {n.name for n in _objects(si, vim.Network)}
    assert {vcsim_server.management_portgroup, vcsim_server.bench_portgroup} <= networks


def test_simulated_hosts_are_vx650v4(si):
    from pyVmomi import vim

    hosts = _objects(si, vim.HostSystem)
    assert len(hosts) == 4
    for host in hosts:
        hw = host.hardware
        assert hw.systemInfo.model == "ThinkAgile VX650 V4"
        assert (hw.cpuInfo.numCpuPackages, hw.cpuInfo.numCpuCores, hw.cpuInfo.numCpuThreads) == (2, 96, 192)
        assert hw.memorySize == 1536 * 1024**3 == 1.5 * TIB
        assert hw.numaInfo.numNodes == 4
        cpu_sets = [set(node.cpuID) for node in hw.numaInfo.numaNode]
        assert [len(s) for s in cpu_sets] == [48, 48, 48, 48]
        assert set().union(*cpu_sets) == set(range(192))
        assert sum(node.memoryRangeLength for node in hw.numaInfo.numaNode) == hw.memorySize
        summary = host.summary.hardware
        assert (summary.numCpuPkgs, summary.numCpuCores, summary.numCpuThreads) == (2, 96, 192)
        assert summary.memorySize == hw.memorySize
        assert "6747P" in summary.cpuModel


def test_clone_of_the_lab_template(si, vcsim_server):
    from pyVmomi import vim

    vms = {vm.name: vm for vm in _objects(si, vim.VirtualMachine)}
    template = vms[vcsim_server.template]
    assert template.config.template is True
    cluster = _objects(si, vim.ClusterComputeResource)[0]
    datacenter = _objects(si, vim.Datacenter)[0]
    spec = vim.vm.CloneSpec(
        location=vim.vm.RelocateSpec(pool=cluster.resourcePool),
        config=vim.vm.ConfigSpec(extraConfig=[
            vim.option.OptionValue(key="SET.guest.ipAddress", value="127.0.0.11"),
            vim.option.OptionValue(key="vcfslm.owner", value="lab-test"),
        ]))
    clone = _wait(template.Clone(folder=datacenter.vmFolder, name="lab-test-clone", spec=spec))
    try:
        assert clone.name == "lab-test-clone"
        assert clone.config.template is False
        assert clone.config.hardware.numCPU == template.config.hardware.numCPU
        assert clone.config.version == template.config.version
        extra = {o.key: o.value for o in clone.config.extraConfig}
        assert extra["vcfslm.owner"] == "lab-test"
        assert clone.guest.ipAddress == "127.0.0.11"   # vcsim's SET.guest.ipAddress
        _wait(clone.PowerOnVM_Task())
        assert clone.runtime.powerState == "poweredOn"
    finally:
        if clone.runtime.powerState == "poweredOn":
            _wait(clone.PowerOffVM_Task())
        _wait(clone.Destroy_Task())


def test_a_lab_advertising_90_is_negotiated_and_lists_older_releases(vcsim_binary, tmp_path):
    import xml.etree.ElementTree as ET

    from pyVim.connect import Disconnect, SmartConnect
    from pyVmomi import vim

    from vcfslm.lab import vcsim

    running = vcsim.start(tmp_path, "pw", vcsim.VcsimOptions(port=0, hosts=1, api="9.0", template=""),
                          binary=vcsim_binary)
    try:
        assert (running.api_version, running.hardware_version) == ("9.0.0.0", "vmx-22")
        ctx = ssl.create_default_context(cafile=running.ca_file)
        with urllib.request.urlopen(f"{running.url}/vimServiceVersions.xml", context=ctx, timeout=10) as r:
            doc = ET.fromstring(r.read())
        assert doc.findtext("namespace/version") == "9.0.0.0"
        prior = [v.text for v in doc.findall("namespace/priorVersions/version")]
        assert {"8.0.3.0", "8.0.0.1", "7.0.3.0", "6.7", "6.5"} <= set(prior)
        si = SmartConnect(host=running.host, port=running.port, user=running.user, pwd="pw", sslContext=ctx)
        try:
            assert si._stub.version == "vim.version.v9_0_0_0"
            assert si.RetrieveContent().about.apiVersion == "9.0.0.0"
            [host] = _objects(si, vim.HostSystem)
            assert host.config.product.apiVersion == "9.0.0.0"
        finally:
            Disconnect(si)
    finally:
        vcsim.stop(running)


def test_rest_endpoint_serves_sessions(vcsim_server):
    ctx = ssl.create_default_context(cafile=vcsim_server.ca_file)
    token = base64.b64encode(f"{vcsim_server.user}:{vcsim_server.password}".encode()).decode()
    request = urllib.request.Request(
        f"https://{vcsim_server.host}:{vcsim_server.port}/rest/com/vmware/cis/session",
        method="POST", headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(request, context=ctx, timeout=10) as response:
        assert json.load(response)["value"]


# ------------------------------------------------------------------ guests


def _client(guest, known_hosts):
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(guest.address, port=guest.port, username=guest.user, key_filename=guest.key,
                   allow_agent=False, look_for_keys=False, timeout=10)
    return client


def test_paramiko_reaches_each_guest_with_host_key_checking(ssh_guests):
    assert [g.address for g in ssh_guests] == ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"]
    for guest in ssh_guests:
        client = _client(guest, guest.known_hosts)
        try:
            _, stdout, _ = client.exec_command('echo "$VCFSLM_LAB_NODE $(id -un)"')
            assert stdout.read().decode().split() == [guest.name, guest.user]
            assert stdout.channel.recv_exit_status() == 0
            with client.open_sftp() as sftp:
                remote = f"{guest.workdir}/hello.txt"
                with sftp.open(remote, "w") as fh:
                    fh.write(guest.name)
            assert Path(remote).read_text() == guest.name
        finally:
            client.close()


def test_a_wrong_host_key_is_refused(ssh_guests, tmp_path):
    import paramiko

    first, second = ssh_guests[0], ssh_guests[1]
    # The second guest's key recorded under the first guest's address: a changed host key.
    wrong = tmp_path / "known_hosts"
    key_type, key_b64 = second.host_public_key.split()[:2]
    wrong.write_text(f"[{first.address}]:{first.port} {key_type} {key_b64}\n")
    with pytest.raises(paramiko.BadHostKeyException):
        _client(first, str(wrong))


def test_an_unknown_host_is_refused(ssh_guests, tmp_path):
    import paramiko

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        _client(ssh_guests[0], str(empty))


def test_the_lab_fixture_inventory_validates(lab):
    inventory = lab.load_inventory()
    assert inventory.name == "lab"
    assert inventory.vcenter.port == lab.vcsim.port
    assert inventory.vcenter.ca_bundle == lab.vcsim.ca_file
    assert inventory.vcenter.insecure is False
    assert [(n.name, str(n.management_ip), n.ssh_port) for n in inventory.nodes] == \
        [(g.name, g.address, g.port) for g in lab.guests]
    assert [n.host for n in inventory.nodes] == lab.vcsim.host_names[:len(lab.guests)]
    assert lab.env == {"VCFSLM_VCENTER_PASSWORD": lab.password,
                       "VCFSLM_INVENTORY": str(lab.inventory)}


# ------------------------------------------------------------------ `vcfslm lab` commands


def _cli(*args: str, merged: bool = False) -> subprocess.CompletedProcess:
    """`vcfslm lab ...` with pipes for stdout and stderr (merged: one pipe, as `2>&1 | cat`), in a
    40-column environment: its lines must come out whole whatever the width and the paths."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT if merged else subprocess.PIPE}
    return subprocess.run([sys.executable, "-m", "vcfslm.cli", "lab", *args], **streams, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "40"})


def _recorded(directory: Path) -> list[process.ProcessRecord]:
    state = json.loads((directory / "state.json").read_text())
    records = [process.ProcessRecord.from_json(state["vcsim"]["process"])]
    records += [process.ProcessRecord.from_json(g["process"]) for g in state["guests"]]
    return records


def test_lab_up_is_idempotent_and_down_leaves_no_process(tmp_path, vcsim_binary):
    from vcfslm.lab import guests

    try:
        guests.tools()
    except guests.GuestsUnavailable as exc:
        pytest.skip(str(exc))
    # A path longer than any terminal line: output must not depend on its length.
    directory = tmp_path.joinpath(*["a-long-folder-name-for-the-lab"] * 4, "lab")
    records: list[process.ProcessRecord] = []
    spawned: list[process.ProcessRecord] = []
    session = None
    first = _cli("up", "--nodes", "2", "--dir", str(directory))
    try:
        assert first.returncode == 0, first.stderr
        records = _recorded(directory)
        assert len(records) == 3
        # The CLI has exited; what it started keeps running in the background.
        assert all(process.is_alive(r) for r in records)
        from vcfslm.inventory_load import load_inventory

        inventory = load_inventory(directory / "inventory.yaml")
        assert [n.name for n in inventory.nodes] == ["slm-01", "slm-02"]
        env = generate.parse_env_file((directory / "lab.env").read_text())
        assert env["VCFSLM_INVENTORY"] == str(directory / "inventory.yaml")
        assert env["VCFSLM_VCENTER_PASSWORD"]

        second = _cli("up", "--nodes", "2", "--dir", str(directory))
        assert second.returncode == 0, second.stderr
        lines = second.stdout.splitlines()
        assert f"lab {directory}: everything was running" in lines
        assert f"  . {directory / 'lab.env'}" in lines
        assert {"vcsim", "slm-01", "slm-02"} <= {line.split("|")[1].strip() for line in lines
                                                 if line.startswith("| ")}
        running = f"slm-01: running (pid {records[1].pid}) on 127.0.0.11:{inventory.nodes[0].ssh_port}"
        assert running in second.stderr.splitlines()
        assert _recorded(directory) == records

        status = _cli("status", "--dir", str(directory), "--output", "json")
        assert status.returncode == 0, status.stderr
        assert {s["pid"] for s in json.loads(status.stdout)["services"]} == {r.pid for r in records}

        # Something running inside a guest session is the lab's too: down must stop it.
        guest = json.loads((directory / "state.json").read_text())["guests"][0]
        session = subprocess.Popen(
            ["ssh", "-i", guest["key"], "-o", f"UserKnownHostsFile={guest['known_hosts']}",
             "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-p", str(guest["port"]),
             f"{guest['user']}@{guest['address']}", "sleep 120"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sshd_pid = records[1].pid
        deadline = time.monotonic() + 10
        while not process.descendants(sshd_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        spawned = [process.record(p, marker="") for p in process.descendants(sshd_pid)]
        assert spawned, "the ssh session did not start"
    finally:
        down = _cli("down", "--dir", str(directory), merged=True)
    assert down.returncode == 0, down.stdout
    # stdout and stderr share one pipe here: each record is still a line of its own
    assert sorted(down.stdout.splitlines()) == sorted([
        "slm-01: stopped", "slm-02: stopped", "vcsim: stopped",
        f"lab {directory}: stopped slm-01, slm-02, vcsim"])
    assert not any(process.is_alive(r) for r in records)
    assert not any(process.is_alive(r) for r in spawned)
    if session is not None:
        session.wait(timeout=10)
    assert not (directory / "state.json").exists()
    assert _cli("status", "--dir", str(directory)).returncode == 0
