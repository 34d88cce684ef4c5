"""The runner over scripted transports: parallel hosts, steps in order, failures isolated."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from vcfslm.errors import InventoryError, TransportError
from vcfslm.guest.fake import FakeTransport, UnscriptedCommand
from vcfslm.guest.playbook import load_playbook
from vcfslm.guest.provision import GuestRun, provision_guests
from vcfslm.guest.runner import StepSettings, run_hosts
from vcfslm.inventory_load import load_inventory
from vcfslm.progress import RecordingReporter

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"
PLAYBOOK = """\
steps:
  - name: folder
    file: {path: /opt/vcfslm/launch, state: directory}
  - name: tool
    command: {cmd: install-tool, creates: /usr/bin/tool}
"""
DIR_FACT = re.compile(r"if \[ -e /opt/vcfslm/launch \].*")
TOOL_FACT = "test -e /usr/bin/tool && echo yes || echo no"


@pytest.fixture(scope="module")
def inv():
    return load_inventory(BRIEF)


@pytest.fixture
def book(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(PLAYBOOK)
    return load_playbook(path)


def fresh(name: str) -> FakeTransport:
    """A guest where nothing is done yet."""
    return FakeTransport(name, {DIR_FACT: "absent\n", TOOL_FACT: "no\n",
                                "mkdir -p /opt/vcfslm/launch": "", "install-tool": ""})


def converged(name: str) -> FakeTransport:
    """A guest where everything is done: only fact commands are scripted."""
    return FakeTransport(name, {DIR_FACT: "directory|755|root|root\n", TOOL_FACT: "yes\n"})


def run(inv, book, transports: dict, **kw):
    def connect(node):
        t = transports[node.name]
        if isinstance(t, Exception):
            raise t
        return t

    reporter = RecordingReporter()
    summary = run_hosts(inv, [book], inv.nodes, connect, reporter=reporter, **kw)
    return summary, reporter


def test_fresh_hosts_change_then_converged_hosts_do_not(inv, book):
    summary, reporter = run(inv, book, {n.name: fresh(n.name) for n in inv.nodes})
    assert summary.ok and [h.changed for h in summary.hosts] == [2, 2, 2, 2]
    assert summary.commands()["slm-03"] == ["mkdir -p /opt/vcfslm/launch", "install-tool"]
    assert ("slm-02", "step 2/2 p: tool") in reporter.updates
    assert reporter.last("slm-04").startswith("done: 2 changed, 0 ok")
    summary, _ = run(inv, book, {n.name: converged(n.name) for n in inv.nodes})
    assert summary.ok and summary.changed == 0 and all(h.ok == 2 for h in summary.hosts)


def test_one_host_failing_does_not_stop_the_others(inv, book):
    bad_step = fresh("slm-02").add("install-tool", (3, "", "E: no space left\n"))
    dropped = fresh("slm-03")
    dropped.drop_after = 1  # the connection dies after the first command
    summary, reporter = run(inv, book, {"slm-01": fresh("slm-01"), "slm-02": bad_step,
                                        "slm-03": dropped,
                                        "slm-04": TransportError("slm-04: cannot connect")})
    assert [h.host for h in summary.failed_hosts] == ["slm-02", "slm-03", "slm-04"]
    assert summary.host("slm-01").succeeded and summary.host("slm-01").changed == 2
    two = summary.host("slm-02")
    assert two.error.startswith("p step 2/2 (tool): slm-02: command failed (exit 3): install-tool")
    assert "no space left" in two.error and (two.changed, two.failed) == (1, 1)
    three = summary.host("slm-03")
    assert "connection dropped" in three.error and three.steps[-1].connection_lost
    assert len(three.steps) == 1  # steps after a failure do not run
    assert summary.host("slm-04").error == "slm-04: cannot connect"
    assert reporter.last("slm-02").startswith("FAILED: p step 2/2 (tool)")
    with pytest.raises(Exception, match="3 of 4 host"):
        summary.raise_for_failures()


def test_a_bug_on_one_host_stays_on_that_host(inv, book):
    # Unscripted command = a test-visible bug; the other hosts finish.
    odd = FakeTransport("slm-01", {TOOL_FACT: "no\n"})
    summary, reporter = run(inv, book, {"slm-01": odd, **{n.name: fresh(n.name) for n in inv.nodes[1:]}})
    assert summary.host("slm-01").error.startswith("internal error at step 1/2: UnscriptedCommand")
    assert all(summary.host(n.name).succeeded for n in inv.nodes[1:])
    assert any("Traceback" in m for m in reporter.messages)


def test_hosts_run_in_parallel(inv, book):
    # Each host's first command waits until all four are inside it: serial hosts would time out.
    barrier = threading.Barrier(len(inv.nodes), timeout=10)

    def wait(cmd, data):
        barrier.wait()
        return "absent\n"

    transports = {}
    for n in inv.nodes:
        t = fresh(n.name)
        t.add(DIR_FACT, wait)
        transports[n.name] = t
    summary, _ = run(inv, book, transports)
    assert summary.ok, summary.rows()


def test_dry_run_runs_no_changing_command(inv, book):
    # Only facts are scripted: any changing command would raise UnscriptedCommand.
    transports = {n.name: FakeTransport(n.name, {DIR_FACT: "absent\n", TOOL_FACT: "no\n"}) for n in inv.nodes}
    summary, _ = run(inv, book, transports, settings=StepSettings(dry_run=True))
    assert summary.ok and summary.dry_run
    assert summary.commands()["slm-01"] == ["mkdir -p /opt/vcfslm/launch", "install-tool"]
    assert all(t.closed for t in transports.values())


def test_dry_run_plans_unreachable_hosts_as_fresh(inv, book):
    transports = {n.name: TransportError(f"{n.name}: refused") for n in inv.nodes}
    summary, _ = run(inv, book, transports, settings=StepSettings(dry_run=True))
    assert summary.ok
    h = summary.host("slm-01")
    assert h.note == "not reachable, planned as a fresh guest (slm-01: refused)"
    assert summary.commands()["slm-01"] == ["mkdir -p /opt/vcfslm/launch", "install-tool"]


def test_unreachable_host_fails_a_real_run(inv, book):
    summary, _ = run(inv, book, {n.name: TransportError(f"{n.name}: refused") for n in inv.nodes})
    assert not summary.ok and summary.host("slm-01").failed == 1


def test_provision_guests_selects_hosts_and_checks_names(inv, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(PLAYBOOK)
    seen = []

    def connect(node, *, log_dir, wait_s):
        seen.append((node.name, log_dir, wait_s))
        return converged(node.name)

    summary = provision_guests(inv, connect,
                               options=GuestRun(playbooks=[str(path)], hosts=["slm-03", "slm-01"],
                                                run_dir=tmp_path / "logs", connect_wait_s=7))
    assert [h.host for h in summary.hosts] == ["slm-01", "slm-03"]
    assert sorted(seen) == [("slm-01", tmp_path / "logs", 7), ("slm-03", tmp_path / "logs", 7)]
    assert summary.log_dir == tmp_path / "logs"
    with pytest.raises(InventoryError, match="unknown node.s. slm-09"):
        provision_guests(inv, connect, options=GuestRun(playbooks=[str(path)], hosts=["slm-09"]))


def test_fake_transport_refuses_unscripted():
    t = FakeTransport("x", {"a": "1"})
    assert t.run("a").stdout == "1"
    with pytest.raises(UnscriptedCommand):
        t.run("b")


@pytest.mark.parametrize(("setting", "flag", "nodes", "want"), [
    (None, None, 4, 4),     # every guest (under the cap)
    (2, None, 4, 2),        # the inventory's guest.parallel
    (2, 3, 4, 3),           # --parallel wins
    (None, 1, 4, 1),
    (None, 8, 2, 2),        # never more workers than guests
])
def test_guests_at_once_come_from_flag_then_inventory(inv, tmp_path, setting, flag, nodes, want):
    path = tmp_path / "p.yaml"
    path.write_text(PLAYBOOK)
    inv = inv.model_copy(update={"guest": inv.guest.model_copy(update={"parallel": setting})})
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    gate = threading.Barrier(want, timeout=5)

    def connect(node, *, log_dir, wait_s):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            first = state.setdefault("arrived", 0) < want
            state["arrived"] += 1
        if first:
            gate.wait()  # the first `want` hosts are in here together, or the barrier breaks
        with lock:
            state["now"] -= 1
        return converged(node.name)

    hosts = [n.name for n in inv.nodes[:nodes]]
    reporter = RecordingReporter()
    summary = provision_guests(inv, connect, reporter,
                               options=GuestRun(playbooks=[str(path)], hosts=hosts,
                                                run_dir=tmp_path / "logs", max_workers=flag))
    assert summary.ok, summary.rows()
    assert state["most"] == want
    assert any(f", {want} at once;" in m for m in reporter.messages)
