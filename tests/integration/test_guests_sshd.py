"""The guest stage against real OpenSSH sshd guests on loopback (the lab's `ssh_guests`).

Lab guests share this machine, so they share one venv, prepared once the way a warm
VM image would be: the operator's interpreter with its site-packages on the path (torch
2.13.0 included), so the playbooks find torch satisfied instead of unpacking it four
times. Everything else — the project's wheel, model marker, launch scripts, NUMA and
bench-network verification — runs for real over SSH on 4 guests.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from vcfslm.cli.guest_stage import ssh_connector
from vcfslm.errors import HostKeyError, TransportError
from vcfslm.guest.provision import GuestRun, provision_guests, verify_guests
from vcfslm.guest.transport import SshLogin, SSHTransport
from vcfslm.guest.wheel import ProjectWheel
from vcfslm.guest_layout import guest_paths
from vcfslm.inventory_load import load_inventory
from vcfslm.lab import generate
from vcfslm.lab import guests as lab_guests
from vcfslm.lab.lab import seed_guest_venv
from vcfslm.progress import RecordingReporter

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------ helpers and fixtures


def write_inventory(guests, workdir: Path, path: Path, **vm) -> Path:
    """The lab's inventory document for these guests (vm overrides: another topology)."""
    doc = generate.guests_inventory(guests, str(workdir))
    doc["vm"].update(vm)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def wheel() -> ProjectWheel:
    """The project's wheel, built once for this module (every run in it pushes the same build)."""
    built = ProjectWheel()
    built.get()
    return built


@pytest.fixture(scope="module")
def lab_inv(ssh_guests, tmp_path_factory):
    base = tmp_path_factory.mktemp("guest-stage")
    seed_guest_venv(base / "work" / "venv")
    return load_inventory(write_inventory(ssh_guests, base / "work", base / "inventory.yaml"))


@pytest.fixture(scope="module")
def provisioned(lab_inv, wheel, tmp_path_factory):
    """Every shipped playbook on the 4 guests, twice: (first summary, second summary)."""
    logs = tmp_path_factory.mktemp("guest-logs")
    reporter = RecordingReporter()
    first = provision_guests(lab_inv, ssh(lab_inv), reporter,
                             options=GuestRun(run_dir=logs / "first", wheel=wheel))
    second = provision_guests(lab_inv, ssh(lab_inv),
                              options=GuestRun(run_dir=logs / "second", wheel=wheel))
    return first, second, reporter, logs


def ssh(inv, reporter=None):
    """The connector the CLI hands to the guest stage: real SSH to the lab's sshd guests."""
    return ssh_connector(inv, reporter)


def failures(summary) -> str:
    return "\n".join(f"{h.host}: {h.error}" for h in summary.failed_hosts)


# ------------------------------------------------------------------ playbooks


def test_every_playbook_runs_on_four_guests(provisioned, lab_inv):
    first, _, reporter, logs = provisioned
    assert len(first.hosts) == 4
    assert first.ok, failures(first)
    assert first.changed > 0
    playbooks = {s.playbook for h in first.hosts for s in h.steps}
    assert playbooks == {"base", "pytorch", "model", "launch", "verify"}
    total = sum(len(h.steps) for h in first.hosts) // 4
    assert ("slm-03", f"step {total}/{total} verify: vNUMA topology and bench network") in reporter.updates
    assert "numactl --hardware" in (logs / "first" / "slm-02.log").read_text()


def test_a_converged_run_is_one_connection_and_one_round_trip_per_host(provisioned, lab_inv, wheel,
                                                                        tmp_path):
    inner = ssh(lab_inv)
    connects: list[str] = []

    def counting(node, **kw):
        connects.append(node.name)
        return inner(node, **kw)

    summary = provision_guests(lab_inv, counting,
                               options=GuestRun(run_dir=tmp_path / "logs", wheel=wheel))
    assert summary.ok and summary.changed == 0, failures(summary)
    assert sorted(connects) == sorted(n.name for n in lab_inv.nodes)  # five playbooks, one connection
    log = (tmp_path / "logs" / "slm-03.log").read_text()
    assert log.count("connected to ") == 1
    commands = re.findall(r"^\[[^]]+\] \$ (.*)$", log, re.M)
    assert len(commands) == 1 and commands[0].startswith("# vcfslm fact batch "), commands


def test_second_run_changes_nothing(provisioned):
    _, second, _, _ = provisioned
    assert second.ok, failures(second)
    changed = {h.host: [(s.playbook, s.name, s.commands) for s in h.steps if s.status != "ok"]
               for h in second.hosts}
    assert all(not c for c in changed.values()), changed


def test_guests_are_ready_for_the_bench(provisioned, lab_inv, ssh_guests):
    paths = guest_paths(lab_inv)
    g = ssh_guests[0]
    with SSHTransport(g.name, SshLogin(g.address, g.known_hosts, port=g.port, user=g.user,
                                       key_file=g.key)).connect() as t:
        env = t.run(f". {paths.env_file} && env").stdout
        assert "GLOO_SOCKET_IFNAME=lo" in env and "HF_HUB_OFFLINE=1" in env
        assert "VCFSLM_MODEL=synthetic:tiny" in env
        t.run(f"test -x {paths.rank_script} && bash -n {paths.rank_script}")
        where = t.run(f"{paths.python} -c 'import vcfslm; print(vcfslm.__file__)'").stdout.strip()
        assert where.startswith(paths.venv + "/lib/")  # the pushed wheel, not the operator's checkout
        hosts = t.run(f"cat {paths.hosts_file}").stdout
        assert "127.0.1.14" in hosts and "slm-04-bench" in hosts
    facts = provisioned[1].host("slm-01").records["facts"]
    assert len(facts.numa.nodes) == lab_inv.vm.vnuma_nodes
    assert all(r.ok for r in facts.reach.values()) and len(facts.reach) == 3


def test_dry_run_lists_commands_and_runs_none(provisioned, lab_inv, wheel, tmp_path):
    hosts_file = Path(guest_paths(lab_inv).hosts_file)
    hosts_file.unlink()
    try:
        summary = provision_guests(lab_inv, ssh(lab_inv),
                                   options=GuestRun(playbooks=["launch"], dry_run=True,
                                                    run_dir=tmp_path, wheel=wheel))
        assert summary.ok, failures(summary)
        for host, commands in summary.commands().items():
            assert any(c.startswith("put <") and c.endswith(f"-> {hosts_file} (mode 0644)")
                       for c in commands), (host, commands)
        assert not hosts_file.exists()
    finally:
        again = provision_guests(lab_inv, ssh(lab_inv),
                                 options=GuestRun(playbooks=["launch"], hosts=["slm-01"],
                                                  run_dir=tmp_path, wheel=wheel))
        assert again.ok and hosts_file.exists()


# ------------------------------------------------------------------ verification


def test_verification_passes_on_a_correct_guest(lab_inv, tmp_path):
    summary = verify_guests(lab_inv, ssh(lab_inv), run_dir=tmp_path)
    assert summary.ok, failures(summary)
    assert all(h.records["facts"].numa.available for h in summary.hosts)


def test_verification_fails_with_expected_vs_seen(ssh_guests, lab_inv, tmp_path):
    shape = generate.machine_shape()
    wrong = load_inventory(write_inventory(ssh_guests, Path(lab_inv.guest.workdir), tmp_path / "wrong.yaml",
                                           vcpus=96, cores_per_socket=24, vnuma_nodes=4,
                                           host_numa_nodes=[0, 1, 2, 3]))
    summary = verify_guests(wrong, ssh(wrong), run_dir=tmp_path)
    assert [h.host for h in summary.failed_hosts] == ["slm-01", "slm-02", "slm-03", "slm-04"]
    seen = f"seen {shape.numa_nodes} node{'s' if shape.numa_nodes > 1 else ''} of " \
           f"{shape.cpus // shape.numa_nodes} CPUs"
    for h in summary.hosts:
        assert f"expected 4 vNUMA nodes of 24 CPUs, {seen}" in h.error, h.error


# ------------------------------------------------------------------ host keys


def other_key_line(guest, tmp_path: Path) -> str:
    """A known_hosts line naming this guest with some other ed25519 key."""
    key = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return lab_guests.known_hosts_line(guest.address, guest.port, (key.with_suffix(".pub")).read_text())


def test_changed_host_key_is_refused(ssh_guests, lab_inv, tmp_path):
    known = tmp_path / "known_hosts"
    lines = Path(ssh_guests[0].known_hosts).read_text().splitlines()
    victim = ssh_guests[1]
    known.write_text("\n".join(line for line in lines if not line.startswith(f"[{victim.address}]:"))
                     + "\n" + other_key_line(victim, tmp_path) + "\n")
    t = SSHTransport(victim.name, SshLogin(victim.address, known, port=victim.port, user=victim.user,
                                           key_file=victim.key, trust_new_hosts=True))
    with pytest.raises(HostKeyError, match="CHANGED"):
        t.connect()  # even when trusting new hosts
    doc = yaml.safe_load(Path(lab_inv.source).read_text())
    doc["guest"]["known_hosts"] = str(known)
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(doc))
    inv = load_inventory(tmp_path / "inv.yaml")
    summary = verify_guests(inv, ssh(inv), run_dir=tmp_path / "logs")
    assert [h.host for h in summary.failed_hosts] == [victim.name]
    assert "host key" in summary.host(victim.name).error and "CHANGED" in summary.host(victim.name).error


def test_unknown_host_refused_unless_trusted(ssh_guests, tmp_path):
    g = ssh_guests[2]
    known = tmp_path / "empty_known_hosts"
    with pytest.raises(HostKeyError, match="is unknown .ssh-ed25519 SHA256:.*--trust-new-hosts"):
        SSHTransport(g.name, SshLogin(g.address, known, port=g.port, user=g.user, key_file=g.key)).connect()
    reporter = RecordingReporter()
    t = SSHTransport(g.name, SshLogin(g.address, known, port=g.port, user=g.user, key_file=g.key,
                                      trust_new_hosts=True), reporter=reporter).connect()
    t.close()
    expected = subprocess.run(["ssh-keygen", "-l", "-f", "/dev/stdin"], input=g.host_public_key,
                              capture_output=True, text=True, check=True).stdout.split()[1]
    assert t.new_host_fingerprint == f"ssh-ed25519 {expected}"
    assert any(expected in m for m in reporter.messages)
    assert known.read_text().startswith(f"[{g.address}]:{g.port} ssh-ed25519 ")
    SSHTransport(g.name, SshLogin(g.address, known, port=g.port, user=g.user, key_file=g.key)).connect().close()


# ------------------------------------------------------------------ the transport itself


@pytest.mark.parametrize("persistent", [True, False], ids=["one-shell", "channel-per-command"])
def test_transport_commands_files_and_logs(ssh_guests, tmp_path, persistent):
    g = ssh_guests[3]
    with SSHTransport(g.name, SshLogin(g.address, g.known_hosts, port=g.port, user=g.user, key_file=g.key),
                      log_dir=tmp_path / "logs", persistent_shell=persistent).connect() as t:
        r = t.run("echo out; echo err >&2; exit 3", check=False)
        assert (r.exit, r.stdout, r.stderr) == (3, "out\n", "err\n")
        with pytest.raises(TransportError, match=r"command failed \(exit 3\).*\n  \| err"):
            t.run("echo err >&2; exit 3")
        assert t.run("cat; printf tail", input=b"\x00\x01binary\n").stdout == "\x00\x01binary\ntail"
        big = t.run("head -c 3000000 /dev/zero | tr '\\0' x").stdout
        assert len(big) == 3_000_000
        assert t.run("read x || echo no-stdin").stdout == "no-stdin\n"  # commands never eat the protocol
        assert t.run("echo $VCFSLM_LAB_NODE").stdout.strip() == g.name
        with pytest.raises(TransportError, match="timed out after 0.5s"):
            t.run("sleep 5", timeout=0.5)
        assert t.run("echo still usable").stdout == "still usable\n"  # a fresh shell after a timeout
        assert t.run("id -u", sudo=True).stdout.strip() == "0"
        target = f"{g.workdir}/sub-{time.time_ns()}.txt"
        t.run(f"mkdir -p {g.workdir}")
        t.put_bytes(b"one\n", target, 0o640)
        local = tmp_path / "back.txt"
        t.get(target, local)
        assert local.read_text() == "one\n"
        assert t.run(f"stat -c %a {target}").stdout.strip() == "640"
        assert t.run(f"ls {target}.tmp-* 2>/dev/null | wc -l").stdout.strip() == "0"
    log = (tmp_path / "logs" / f"{g.name}.log").read_text()
    assert "$ echo out; echo err >&2; exit 3\n# exit 3" in log and f"put <4 bytes> -> {target}" in log


# ------------------------------------------------------------------ a guest dying mid-run


SLOW = """\
steps:
  - name: slow
    command: {cmd: "sleep 3", unless: "test -e {{ workdir }}/done-{{ node.name }}"}
  - name: done
    command: {cmd: "touch {{ workdir }}/done-{{ node.name }}", creates: "{{ workdir }}/done-{{ node.name }}"}
"""


def test_killing_sshd_mid_run_fails_that_host_only(tmp_path, wheel):
    # Private guests: this test kills one, and the lab's session guests must stay up.
    client = lab_guests.ensure_client_keys(tmp_path / "ssh")
    started = [lab_guests.start_guest(i, tmp_path / "guests", client) for i in (40, 41)]
    try:
        lab_guests.write_known_hosts(client.known_hosts, started)
        inv = load_inventory(write_inventory(started, tmp_path / "work", tmp_path / "inv.yaml"))
        (tmp_path / "work").mkdir()
        book = tmp_path / "slow.yaml"
        book.write_text(SLOW)
        victim = inv.nodes[1].name
        reporter = RecordingReporter()
        result = {}
        run = threading.Thread(target=lambda: result.update(summary=provision_guests(
            inv, ssh(inv), reporter,
            options=GuestRun(playbooks=[str(book)], run_dir=tmp_path / "logs", wheel=wheel))))
        run.start()
        deadline = time.monotonic() + 30
        while not (reporter.last(victim) or "").startswith("step 1/2") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # inside `sleep 3` on the victim
        lab_guests.stop_guest(started[1])
        run.join(60)
        summary = result["summary"]
        assert [h.host for h in summary.failed_hosts] == [victim]
        assert re.search(r"connection (dropped|is lost)", summary.host(victim).error), summary.host(victim).error
        assert summary.host(inv.nodes[0].name).changed == 2
        # Bring it back (same address and host key; the port may differ): a re-run converges.
        started[1] = lab_guests.start_guest(41, tmp_path / "guests", client, port=started[1].port)
        lab_guests.write_known_hosts(client.known_hosts, started)
        inv = load_inventory(write_inventory(started, tmp_path / "work", tmp_path / "inv.yaml"))
        again = provision_guests(inv, ssh(inv),
                                 options=GuestRun(playbooks=[str(book)], run_dir=tmp_path / "logs",
                                                  wheel=wheel, connect_wait_s=10))
        assert again.ok, failures(again)
        assert [h.changed for h in again.hosts] == [0, 2]
        final = provision_guests(inv, ssh(inv),
                                 options=GuestRun(playbooks=[str(book)], run_dir=tmp_path / "logs",
                                                  wheel=wheel, connect_wait_s=10))
        assert final.ok and final.changed == 0
    finally:
        for g in started:
            lab_guests.stop_guest(g)


def test_cli_guests_json(provisioned, lab_inv, tmp_path):
    from click.testing import CliRunner

    from vcfslm.cli import main

    r = CliRunner().invoke(main, ["guests", lab_inv.source, "-p", "base", "-p", "verify", "-o", "json",
                                  "--log-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{"):])
    assert data["ok"] and all(h["changed"] == 0 for h in data["hosts"])
    assert data["hosts"][0]["facts"]["numa_nodes"][0]["cpus"]


# ------------------------------------------------------------------ transfer progress


PUSH = """\
name: push
steps:
  - name: model
    model: {{model: "{folder}", models_dir: "{{{{ workdir }}}}/pushed-models", python: "python3"}}
"""


def test_pushing_a_model_folder_reports_bytes_per_host(lab_inv, tmp_path):
    from click.testing import CliRunner

    from vcfslm.cli import main

    folder = tmp_path / "tiny-model"
    folder.mkdir()
    (folder / "model-00001.safetensors").write_bytes(b"\x01" * (5 * 1024 * 1024))
    (folder / "config.json").write_text("{}")
    book = tmp_path / "push.yaml"
    book.write_text(PUSH.format(folder=folder))
    reporter = RecordingReporter()
    summary = provision_guests(lab_inv, ssh(lab_inv), reporter,
                               options=GuestRun(playbooks=[str(book)], hosts=["slm-01"],
                                                run_dir=tmp_path / "logs"))
    assert summary.ok, failures(summary)
    pushed = [p for p in reporter.progresses if p.unit == "B"]
    assert pushed and {p.subject for p in pushed} == {"slm-01"}
    assert pushed[-1].final and pushed[-1].done == pushed[-1].total == 5 * 1024 * 1024 + 2
    assert [p.done for p in pushed] == sorted(p.done for p in pushed)
    # the CLI off a terminal: one whole line per record, the last one with the total
    (folder / "config.json").write_text('{"changed": true}')  # a new manifest: pushed again
    result = CliRunner().invoke(main, ["guests", lab_inv.source, "-p", str(book), "--hosts", "slm-02",
                                       "--log-dir", str(tmp_path / "cli")], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("slm-02: push: model: push 2 file(s)")]
    assert lines and lines[-1].startswith("slm-02: push: model: push 2 file(s), 5 MiB / 5 MiB, 100%, ")
    assert "done in" in lines[-1]
