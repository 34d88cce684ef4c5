"""`vcfslm guests` and `vcfslm verify`: help, bad input (exit 2), dry run against
unreachable hosts (planned as fresh guests), failures (exit 1)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.cli.guests import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable(tmp_path) -> Path:
    """The brief's inventory with every node on a loopback address where nothing listens."""
    doc = yaml.safe_load(BRIEF.read_text())
    port = closed_port()
    for i, node in enumerate(doc["nodes"]):
        node["management_ip"] = f"127.0.0.{31 + i}"
        node["ssh_port"] = port
    doc["placement"]["networks"]["management"]["gateway"] = None
    doc["guest"]["known_hosts"] = str(tmp_path / "known_hosts")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_commands_are_exported():
    assert [c.name for c in COMMANDS] == ["guests", "verify"]


def test_help_has_examples():
    r = run("guests", "--help")
    assert r.exit_code == 0 and "--dry-run" in r.output and "vcfslm guests cluster.yaml" in r.output
    r = run("verify", "--help")
    assert r.exit_code == 0 and "expected vs seen" in r.output


def test_unknown_playbook_and_host_are_bad_input(unreachable):
    r = run("guests", str(unreachable), "-p", "nope")
    assert r.exit_code == 2 and "no such playbook" in r.output and "Traceback" not in r.output
    r = run("guests", str(unreachable), "--hosts", "slm-01,slm-99")
    assert r.exit_code == 2 and "unknown node(s) slm-99" in r.output


def test_bad_playbook_file_names_file_and_line(unreachable, tmp_path):
    book = tmp_path / "bad.yaml"
    book.write_text("steps:\n  - pakages: {apt: [x]}\n")
    r = run("guests", str(unreachable), "-p", str(book))
    assert r.exit_code == 2 and f"{book}:2:5: steps[0].pakages: unknown step type" in r.output


def test_dry_run_on_unreachable_hosts_prints_commands(unreachable, tmp_path):
    r = run("guests", str(unreachable), "-p", "base", "-p", "model", "--dry-run", "--hosts", "slm-02",
            "--log-dir", str(tmp_path / "logs"))
    assert r.exit_code == 0, r.output
    assert "slm-02: 5 command(s) would run (not reachable, planned as a fresh guest" in " ".join(r.output.split())
    assert "$ mkdir -p /opt/vcfslm/models/microsoft-Phi-3-mini-128k-instruct" not in r.output
    assert "DEBIAN_FRONTEND=noninteractive apt-get install" in r.output
    r = run("guests", str(unreachable), "-p", "base", "--dry-run", "--hosts", "slm-02", "-o", "json",
            "--log-dir", str(tmp_path / "logs"))
    data = json.loads(r.output[r.output.index("{"):])
    assert data["dry_run"] and data["hosts"][0]["steps"][0]["status"] == "changed"


def test_real_run_on_unreachable_hosts_fails_each(unreachable, tmp_path):
    r = run("verify", str(unreachable), "--hosts", "slm-01,slm-03", "--wait", "0")
    assert r.exit_code == 1
    assert "2 of 2 host(s) failed" in r.output and "cannot connect to 127.0.0.33" in r.output


def test_parallel_flag_reaches_the_guest_stage(unreachable, monkeypatch):
    from vcfslm.guest import provision

    seen = []

    def fake(inv, connect, reporter=None, options=None):
        seen.append(options.max_workers)
        return provision.RunSummary([])

    monkeypatch.setattr(provision, "provision_guests", fake)
    assert run("guests", str(unreachable), "--parallel", "3").exit_code == 0
    assert run("guests", str(unreachable)).exit_code == 0
    assert run("verify", str(unreachable), "--parallel", "2").exit_code == 0
    assert seen == [3, None, 2]
    r = run("guests", str(unreachable), "--parallel", "0")
    assert r.exit_code == 2 and "--parallel" in r.output
    assert "guest.parallel" in run("guests", "--help").output
