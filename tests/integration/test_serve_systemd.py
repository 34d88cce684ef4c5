"""`vcfslm serve up | status | down` with `supervisor: systemd`, on a guest that systemd
booted (vcfslm/lab/nspawn.py: the operator's root under an overlay, systemd as PID 1 in
systemd-nspawn, its own sshd on loopback). The real router (vllm-router) and the real
front door (nginx) in front of fake OpenAI servers started from the rendered launch
script as if they were vLLM (tests/fake_openai.py), every program as the service's
system user (made by the serve playbook's step) in its sandbox: up, status, a SIGKILLed
server back through Restart=, a changed setting that restarts only the router, and a
down that leaves no unit, no unit file and no process of the service user. Then the same
guest under supervisord: every program it starts runs as the service user.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.serve_lab import ROOT, VLLM_VENV, free_port
from vcfslm.deploy.material import ca_file
from vcfslm.guest import vllm as guest_vllm
from vcfslm.guest.provision import GuestRun, provision_guests
from vcfslm.guest.templates import render_template
from vcfslm.inventory_load import load_inventory
from vcfslm.lab import generate, guests, nspawn

pytestmark = pytest.mark.integration

ADDRESS = "127.0.2.11"           # out of the loopback lab's 127.0.0.x: both can run at once
WORKDIR = "/opt/vcfslm"
SITE = "/opt/vcfslm-router-site"  # the operator's vLLM venv's site-packages, bound read-only
EXPOSURE_OK = 4.0


def _reason() -> str | None:
    reason = nspawn.unavailable_reason()
    if reason:
        return reason
    if not (VLLM_VENV / "bin" / "vllm-router").exists():
        return "vllm-router is not installed here (make vllm installs it)"
    if not Path("/usr/bin/python3").exists():
        return "the guest's Python (/usr/bin/python3) is missing"
    return None


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    reason = _reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"the systemd-booted guest cannot run in CI: {reason}")
        pytest.skip(reason)
    folder = Path(f"/tmp/vcfslm-nspawn-{uuid.uuid4().hex[:8]}")
    ssh = tmp_path_factory.mktemp("ssh")
    client = guests.ensure_client_keys(ssh)
    site = next(VLLM_VENV.resolve().glob("lib/python3*/site-packages"))
    started = time.monotonic()
    guest = nspawn.boot(folder, name="slm-01", address=ADDRESS, client_public_key=client.public_key,
                        binds=[(str(site), SITE)])
    try:
        client.known_hosts.write_text(guests.known_hosts_line(ADDRESS, guest.port, guest.host_public_key) + "\n")
        yield guest, client, time.monotonic() - started
    finally:
        nspawn.halt(guest)


def prepare_guest(guest: nspawn.BootedGuest, tmp: Path, inventory: Path) -> None:
    """What the vllm playbook would have left, stood in for: a vLLM venv from the guest's
    Python that reads the operator's router from the bound site-packages, the fake server
    as its 'vLLM', and the launch scripts rendered as the playbook renders them."""
    venv = guest.path(f"{WORKDIR}/vllm-venv")
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = next(venv.glob("lib/python3*/site-packages"))
    assert site.parent.name == version, f"the guest's Python is {site.parent.name}, the vLLM venv's {version}"
    (site / "vcfslm-router.pth").write_text(SITE + "\n")
    for tool, module in (("vllm-router", "vllm_router.launch_router"), ("supervisord", "supervisor.supervisord"),
                         ("supervisorctl", "supervisor.supervisorctl")):
        script = venv / "bin" / tool
        script.write_text(f"#!{WORKDIR}/vllm-venv/bin/python\nimport sys\nfrom {module} import main\n"
                          "sys.exit(main())\n")
        script.chmod(0o755)
    fake = guest.path(f"{WORKDIR}/fake")
    fake.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "fake_openai.py", fake / "fake_openai.py")
    python = fake / "python"
    python.write_text(f"#!/bin/bash\nexec /usr/bin/python3 {WORKDIR}/fake/fake_openai.py \"$@\"\n")
    python.chmod(0o755)
    for item in guest_vllm.launch_scripts(load_inventory(inventory)):
        dest = guest.path(item["dest"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(render_template("vllm.sh.j2", {**item["vars"], "python": f"{WORKDIR}/fake/python",
                                                       "entry": "vllm-entry.py", "kv_cache_gib": 1,
                                                       "use_numactl": False, "env_file": ""}))
        dest.chmod(0o755)
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "vocab_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128,
        "num_hidden_layers": 2, "max_position_embeddings": 4096}))


def write_inventory(guest: nspawn.BootedGuest, client: guests.ClientKeys, tmp: Path,
                    supervisor: str = "systemd") -> Path:
    doc = generate.lab_inventory(
        vcenter=generate.LabVcenter(host="127.0.0.1", port=443, user="lab", ca_bundle="/dev/null",
                                    template="vcfslm-template"),
        nodes=[generate.LabNode("slm-01", "DC0_C0_H0", ADDRESS, ADDRESS, guest.port)],
        guest=generate.LabGuestLogin(user="root", ssh_key=str(client.key), known_hosts=str(client.known_hosts),
                                     workdir=WORKDIR),
        bench_port=free_port(), shape=generate.machine_shape())
    # The guest has files of its own: the service runs as its own user there, as on a VM.
    doc["guest"]["service_user"] = "vcfslm"
    doc["guest"]["model"] = str(tmp / "model")
    doc["bench"]["serve"]["vllm"]["venv"] = f"{WORKDIR}/vllm-venv"
    doc["bench"]["serve"]["vllm"]["reserved_cores"] = 0
    doc["serve"] = {"nodes": ["slm-01"], "supervisor": supervisor, "port": free_port(),
                    "router": {"port": free_port(), "prometheus_port": free_port(), "health_check_interval_s": 1},
                    "front_door": {"port": free_port()}, "health_timeout_s": 60}
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def make_service_user(inventory: Path, tmp: Path) -> None:
    """The serve playbook's own step that makes the service user, run alone on the guest."""
    from vcfslm.cli.guest_stage import ssh_connector
    from vcfslm.resources import resource_dir

    book = yaml.safe_load((resource_dir("playbooks") / "serve.yaml").read_text())
    book["steps"] = [s for s in book["steps"] if s["name"] == "service user"]
    assert len(book["steps"]) == 1
    path = tmp / "service-user.yaml"
    path.write_text(yaml.safe_dump(book, sort_keys=False))
    inv = load_inventory(inventory)
    connect = ssh_connector(inv, None)
    summary = provision_guests(inv, lambda node, **kw: connect(node, log_dir=tmp / "logs", wait_s=10), None,
                               GuestRun(playbooks=[path], run_dir=tmp / "logs"))
    assert summary.ok, [h.error for h in summary.failed_hosts]


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vcfslm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "VCFSLM_VCENTER_PASSWORD": "unused"})


def on_guest(guest: nspawn.BootedGuest, client: guests.ClientKeys, command: str) -> str:
    done = subprocess.run(["ssh", "-i", str(client.key), "-o", f"UserKnownHostsFile={client.known_hosts}",
                           "-o", "BatchMode=yes", "-p", str(guest.port), f"root@{ADDRESS}", command],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    return done.stdout


def status(inventory: Path) -> dict:
    done = cli("serve", "status", str(inventory), "--output", "json")
    assert done.returncode in (0, 1, 3), done.stderr[-2000:]
    return json.loads(done.stdout)


def up(inventory: Path, key_file: Path) -> dict:
    done = cli("serve", "up", str(inventory), "--key-file", str(key_file), "--no-install", "--output", "json")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def server_pid(doc: dict) -> int | None:
    [server] = doc["nodes"]["slm-01"]["servers"]
    return server["pid"]


def restarted(inventory: Path, killed: int, timeout_s: float = 60) -> dict:
    """The service's status once it is healthy again with a server on a pid other than `killed`."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = status(inventory)
        if now["healthy"] and server_pid(now) not in (None, killed):
            return now
        assert time.monotonic() < deadline, now
        time.sleep(1)


def test_serve_up_status_restart_change_and_down_under_systemd_as_pid_1(booted, tmp_path):
    guest, client, boot_s = booted
    started = time.monotonic()
    inventory = write_inventory(guest, client, tmp_path)
    prepare_guest(guest, tmp_path, inventory)
    key_file = tmp_path / "slm.key"
    assert on_guest(guest, client, "cat /proc/1/comm").strip() == "systemd"
    make_service_user(inventory, tmp_path)
    assert on_guest(guest, client, "id -u vcfslm").strip().isdigit()
    name = load_inventory(inventory).name
    units = [f"vcfslm-{name}-{p}.service" for p in ("vllm-node0", "proxy", "router", "frontdoor")]
    try:
        first = up(inventory, key_file)
        assert first["deployment"] == name
        assert first["changed"] is True and len(first["servers"]) == 1
        assert first["checks"]["keyless"] == 401 and first["checks"]["keyed"] == 200
        assert first["checks"]["management"] == 404

        # Every program is systemd's, as the service user, confined; systemd-analyze rates each unit OK.
        for unit in units:
            show = dict(line.split("=", 1) for line in on_guest(
                guest, client, f"systemctl show -p ActiveState,MainPID,User,NoNewPrivileges {unit}").split())
            assert show["ActiveState"] == "active" and show["User"] == "vcfslm" and show["NoNewPrivileges"] == "yes"
            owner = on_guest(guest, client, f"ps -o user= -p {show['MainPID']}").strip()
            assert owner == "vcfslm", unit
            report = on_guest(guest, client, f"systemd-analyze security --no-pager {unit} 2>&1 | tail -1")
            rated = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", report)
            assert rated and float(rated.group(1)) <= EXPOSURE_OK and rated.group(2) == "OK", report

        doc = status(inventory)
        assert doc["healthy"] is True and doc["unreachable"] == {}
        info = doc["nodes"]["slm-01"]
        assert info["supervisor"] == "systemd"
        assert set(info["programs"].values()) == {"ACTIVE"}
        assert info["router"]["workers"] == first["servers"]
        killed = server_pid(doc)
        assert killed

        # A server SIGKILLed comes back through Restart=, on a new pid.
        from vcfslm.cli.guest_stage import ssh_connector
        from vcfslm.deploy.service import kill_program

        inv = load_inventory(inventory)
        connect = ssh_connector(inv, None)
        assert kill_program(inv, lambda n: connect(n, log_dir=tmp_path / "logs", wait_s=10), "slm-01",
                            "vllm-node0") == killed
        now = restarted(inventory, killed)
        restarts = on_guest(guest, client, f"systemctl show -p NRestarts --value {units[0]}")
        assert int(restarts) >= 1

        # A changed router setting restarts the router alone: the server keeps its pid.
        new_pid = server_pid(now)
        doc_inv = yaml.safe_load(inventory.read_text())
        doc_inv["serve"]["router"]["policy"] = "random"
        inventory.write_text(yaml.safe_dump(doc_inv, sort_keys=False))
        changed = up(inventory, key_file)
        assert changed["changes"]["slm-01"]["restart"] == ["router"]
        after = status(inventory)
        assert after["healthy"] is True and server_pid(after) == new_pid
        key = key_file.read_text().strip()
        # The door's certificate is the deployment CA's, which serve up put beside the key file.
        assert changed["ca_file"] == str(ca_file(key_file))
        trusting = ssl.create_default_context(cafile=changed["ca_file"])
        req = urllib.request.Request(changed["endpoint"] + "/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=10, context=trusting) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(changed["endpoint"] + "/models", timeout=10, context=trusting)
        assert refused.value.code == 401
    finally:
        done = cli("serve", "down", str(inventory), "--output", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(json.loads(done.stdout)["stopped"]["slm-01"]) == ["frontdoor", "proxy", "router", "vllm-node0"]
    listed = on_guest(guest, client, f"systemctl list-units --all --no-legend --plain 'vcfslm-{name}-*'")
    assert listed.strip() == "", listed
    assert on_guest(guest, client, f"ls /etc/systemd/system | grep -c '^vcfslm-{name}-' || true").strip() == "0"
    assert on_guest(guest, client, "pgrep -u vcfslm -a || true").strip() == ""
    assert status(inventory)["deployed"] is False
    print(f"\nsystemd-booted guest: boot {boot_s:.1f} s, the test's serve cycle {time.monotonic() - started:.1f} s")


def test_supervisords_programs_run_as_the_service_user_too(booted, tmp_path):
    """The same guest with `supervisor: supervisord`: supervisord as root (the SSH user),
    every program it runs as the service user, a killed server back, nothing left after down."""
    guest, client, _ = booted
    inventory = write_inventory(guest, client, tmp_path, supervisor="supervisord")
    if not guest.path(f"{WORKDIR}/vllm-venv").exists():
        prepare_guest(guest, tmp_path, inventory)
    else:
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text(json.dumps({
            "vocab_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128,
            "num_hidden_layers": 2, "max_position_embeddings": 4096}))
    make_service_user(inventory, tmp_path)
    key_file = tmp_path / "slm.key"
    try:
        first = up(inventory, key_file)
        assert first["checks"]["keyless"] == 401 and first["checks"]["keyed"] == 200
        doc = status(inventory)
        assert doc["healthy"] is True and doc["nodes"]["slm-01"]["supervisor"] == "supervisord"
        # Every program supervisord started (its children: the server, its proxy, the router, the door) is the
        # service user's.
        pid_file = f"{WORKDIR}/serve/slm-01/supervisord.pid"
        assert on_guest(guest, client, f"ps -o user= -p $(cat {pid_file})").strip() == "root"
        users = on_guest(guest, client, f"ps -o user= --ppid $(cat {pid_file})").split()
        assert len(users) == 4 and set(users) == {"vcfslm"}, users
        killed = server_pid(doc)
        assert on_guest(guest, client, f"ps -o user= -p {killed}").strip() == "vcfslm"
        on_guest(guest, client, f"kill -KILL {killed}")
        restarted(inventory, killed)
    finally:
        done = cli("serve", "down", str(inventory), "--output", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert on_guest(guest, client, "pgrep -u vcfslm -a || true").strip() == ""
