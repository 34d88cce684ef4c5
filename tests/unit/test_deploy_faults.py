"""Faults of the fleet itself: a node that cannot be reached does not block `serve status`
or `serve down` on the others; both name it and exit 1 (deploy/service.py, cli/serve.py)."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner
from test_deploy_support import deployment, dump, inventory_doc

from vcfslm.cli import main
from vcfslm.contract import guest_paths
from vcfslm.deploy import remote
from vcfslm.deploy.desired import MANIFEST, SYSTEMD
from vcfslm.deploy.service import serve_down, serve_status
from vcfslm.errors import TransportError
from vcfslm.guest.fake import FakeTransport
from vcfslm.inventory import load_inventory

REFUSED = "slm-02: cannot connect to 10.20.0.12:22 after 3 tries (Connection refused)"


def setup(tmp_path):
    path = tmp_path / "cluster.yaml"
    doc = inventory_doc(tmp_path)
    doc["serve"] = {"nodes": ["slm-01", "slm-02"]}
    path.write_text(dump(doc))
    inv = load_inventory(path)
    dep = deployment(inv, supervisor=SYSTEMD)
    router = dep.node(dep.router_node)
    manifest = next(f.content for f in router.files if f.path.endswith("/" + MANIFEST))
    units = json.loads(manifest)["units"]
    # status asks in the manifest's program order, down in its unit list's.
    by_program = [f"vcfslm-slm-{p}.service" for p in json.loads(manifest)["programs"]]
    active = "".join(f"Id={u}\nActiveState=active\nMainPID={100 + i}\n\n" for i, u in enumerate(by_program))
    stopped = "".join(f"Id={u}\nActiveState=inactive\nMainPID=0\n\n" for u in units)
    transports: dict[str, FakeTransport] = {}

    def connect(node):
        if node.name == "slm-02":
            raise TransportError(REFUSED)
        if node.name == "slm-01":
            t = FakeTransport("slm-01", {
                f"cat {router.serve_dir}/{MANIFEST} 2>/dev/null": manifest,
                "systemctl show -p Id,ActiveState,MainPID " + " ".join(by_program): active,
                "systemctl show -p Id,ActiveState,MainPID " + " ".join(units): stopped,
                remote.probe_command(guest_paths(inv).vllm_python): json.dumps({"http": {}, "rss": {}}),
                f"test -f {router.serve_dir}/serve.env": (1, ""),
                re.compile(r".*"): ""})
        else:
            t = FakeTransport(node.name, {re.compile(r"cat .*manifest.json.*"): (1, ""), re.compile(r".*"): ""})
        transports[node.name] = t
        return t

    return path, inv, connect, transports, units


def test_status_reports_the_nodes_it_reaches_and_names_the_other(tmp_path):
    _, inv, connect, _, _ = setup(tmp_path)
    doc = serve_status(inv, connect)
    assert doc["unreachable"] == {"slm-02": REFUSED}
    assert doc["deployed"] is True and sorted(doc["nodes"]) == ["slm-01"]
    assert doc["nodes"]["slm-01"]["programs"]["router"] == "ACTIVE"
    assert doc["healthy"] is False


def test_down_takes_the_rest_down_and_names_the_node_it_could_not_reach(tmp_path):
    _, inv, connect, transports, units = setup(tmp_path)
    done = serve_down(inv, connect)
    assert done.unreachable == {"slm-02": REFUSED}
    assert sorted(done.stopped) == ["slm-01"] and "router" in done.stopped["slm-01"]
    assert f"systemctl disable --now {' '.join(units)}" in transports["slm-01"].calls
    assert "slm-03" in transports and done.stopped.get("slm-03") is None


def test_the_cli_exits_1_naming_the_unreachable_node(tmp_path, monkeypatch):
    path, _, connect, _, _ = setup(tmp_path)
    monkeypatch.setattr("vcfslm.cli.serve._connect", lambda *a, **k: connect)
    status = CliRunner().invoke(main, ["serve", "status", str(path), "--output", "json"])
    assert status.exit_code == 1, status.output
    assert json.loads(status.output)["unreachable"] == {"slm-02": REFUSED}
    down = CliRunner().invoke(main, ["serve", "down", str(path), "--output", "json"])
    assert down.exit_code == 1, down.output
    doc = json.loads(down.output)
    assert doc["unreachable"] == {"slm-02": REFUSED} and sorted(doc["stopped"]) == ["slm-01"]


def test_down_with_every_node_reached_exits_0(tmp_path, monkeypatch):
    path, _, connect, _, _ = setup(tmp_path)

    def reached(node):
        if node.name == "slm-02":
            return FakeTransport("slm-02", {re.compile(r"cat .*manifest.json.*"): (1, ""), re.compile(r".*"): ""})
        return connect(node)

    monkeypatch.setattr("vcfslm.cli.serve._connect", lambda *a, **k: reached)
    down = CliRunner().invoke(main, ["serve", "down", str(path)])
    assert down.exit_code == 0, down.output
    assert down.output.startswith("slm-01: stopped ")


def test_a_crash_kills_a_vllm_servers_api_process_under_its_entry(tmp_path):
    """kill_program kills the entry's one child (vLLM's API process) when there is one, else
    the program's main process; the pid it killed comes back."""
    from vcfslm.deploy.service import kill_program

    _, inv, connect, transports, _ = setup(tmp_path)
    kill = "api=$(pgrep -P 412 -f vllm-entry.py | head -n 1); kill -KILL ${api:-412} && echo ${api:-412}"

    def answering(node):
        t = connect(node)
        t.add("systemctl show -p Id,ActiveState,MainPID vcfslm-slm-vllm-node0.service",
              "Id=vcfslm-slm-vllm-node0.service\nActiveState=active\nMainPID=412\n")
        t.add(kill, "4321\n")
        return t

    assert kill_program(inv, answering, "slm-01", "vllm-node0") == 4321
    assert kill in transports["slm-01"].calls
