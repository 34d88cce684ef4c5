"""The service's programs unprivileged and confined (deploy/confinement.py and the unit and
supervisord templates): every systemd unit rated OK by `systemd-analyze security`, what
vLLM, the router and nginx keep of the system, supervisord's programs as the same user,
and the node driver handing the user what it writes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from test_deploy_desired import (
    environment,
    rendered_units,
    supervisord_config,
    systemd_analyze,
    unit_value,
)
from test_deploy_support import build, deployment, inventory, inventory_doc

from vcfslm.deploy.changes import node_changes
from vcfslm.deploy.confinement import home_dir
from vcfslm.deploy.desired import SUPERVISORD, SYSTEMD, socket_folder
from vcfslm.deploy.driver import NodeDriver
from vcfslm.errors import InventoryError, ServeError
from vcfslm.guest.fake import FakeTransport

__all__ = ["systemd_analyze"]        # the fixture, used by name

# systemd-analyze security's scale: 0 (confined) to 10 (exposed); up to 4.0 it says "OK".
EXPOSURE_OK = 4.0
_EXPOSURE = re.compile(r"Overall exposure level for (\S+): ([0-9.]+) (\w+)")


def exposure(analyze: str, unit: Path) -> tuple[float, str, str]:
    """(exposure, its word, the whole report) of an offline unit file."""
    done = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=60)
    report = done.stdout + done.stderr
    m = _EXPOSURE.search(report)
    assert m, report
    return float(m.group(2)), m.group(3), report


def test_every_unit_is_rated_ok_by_systemd_analyze_security(tmp_path, systemd_analyze):
    _, units, _ = rendered_units(tmp_path)
    assert {k.split("/")[1] for k in units} == {"vllm-node0", "vllm-node1", "router", "frontdoor", "proxy"}
    for name, path in units.items():
        level, word, report = exposure(systemd_analyze, path)
        assert level <= EXPOSURE_OK and word == "OK", f"{name}: {level} {word}\n{report}"


def test_a_door_on_a_privileged_port_gets_that_one_capability_and_stays_ok(tmp_path, systemd_analyze):
    dep = deployment(inventory(tmp_path, {"front_door": {"port": 443}}), supervisor=SYSTEMD)
    node = dep.node(dep.router_node)
    units = {Path(f.path).name: f.content for f in node.files if f.path.endswith(".service")}
    door = units["vcfslm-slm-frontdoor.service"]
    assert unit_value(door, "AmbientCapabilities") == ["CAP_NET_BIND_SERVICE"]
    assert unit_value(door, "CapabilityBoundingSet") == ["CAP_NET_BIND_SERVICE"]
    for name, text in units.items():
        if name != "vcfslm-slm-frontdoor.service":
            assert unit_value(text, "CapabilityBoundingSet") == [""] and unit_value(text, "AmbientCapabilities") == [""]
        path = tmp_path / name
        path.write_text(text)
        level, word, report = exposure(systemd_analyze, path)
        assert level <= EXPOSURE_OK and word == "OK", f"{name}: {level} {word}\n{report}"


def test_each_unit_keeps_what_its_program_needs(tmp_path):
    dep = deployment(inventory(tmp_path), supervisor=SYSTEMD)
    node = dep.node(dep.router_node)
    units = {Path(f.path).name.split("-", 2)[2].removesuffix(".service"): f.content
             for f in node.files if f.path.endswith(".service")}
    for text in units.values():
        assert unit_value(text, "User") == ["vcfslm"] and unit_value(text, "NoNewPrivileges") == ["yes"]
        assert unit_value(text, "ProtectSystem") == ["strict"] and unit_value(text, "ProtectHome") == ["yes"]
        assert unit_value(text, "PrivateTmp") == ["yes"] and unit_value(text, "PrivateDevices") == ["yes"]
        assert unit_value(text, "KillMode") == ["control-group"]
        # numactl's set_mempolicy and sched_setaffinity (@resources) are never denied.
        denied = " ".join(v for v in unit_value(text, "SystemCallFilter") if v.startswith("~"))
        assert "@resources" not in denied and "set_mempolicy" not in denied
    home = home_dir(node.serve_dir)
    for server in ("vllm-node0", "vllm-node1"):
        text = units[server]
        # Its caches (HOME) and its socket, nothing else writable; oneDNN's JIT needs writable code pages.
        assert unit_value(text, "ReadWritePaths") == [home, socket_folder(node.serve_dir)] and f"Environment=HOME={home}" in text
        assert unit_value(text, "MemoryDenyWriteExecute") == [] and unit_value(text, "ProcSubset") == []
    assert unit_value(units["router"], "ReadWritePaths") == []
    assert unit_value(units["frontdoor"], "ReadWritePaths") == [f"{node.serve_dir}/frontdoor"]
    assert unit_value(units["frontdoor"], "MemoryDenyWriteExecute") == ["yes"]
    assert unit_value(units["proxy"], "ReadWritePaths") == [f"{node.serve_dir}/proxy"]
    assert unit_value(units["proxy"], "MemoryDenyWriteExecute") == ["yes"]


def test_supervisords_programs_run_as_the_service_user(tmp_path):
    for user, want in ((None, "vcfslm"), ("root", "root")):
        inv = inventory(tmp_path, **({"service_user": user} if user else {}))
        dep = deployment(inv, supervisor=SUPERVISORD)
        node = dep.node(dep.router_node)
        [conf] = [f for f in node.files if f.path == node.supervisor_conf]
        parser = supervisord_config(conf.content)
        programs = [s for s in parser.sections() if s.startswith("program:")]
        assert len(programs) == 5
        for section in programs:
            assert parser[section]["user"] == want
        assert environment(parser["program:vllm-node0"]["environment"])["HOME"] == home_dir(node.serve_dir)


def test_a_new_service_user_restarts_every_program(tmp_path):
    before = deployment(inventory(tmp_path)).node("slm-01")
    after = deployment(inventory(tmp_path, service_user="svc")).node("slm-01")
    assert {p.name for p in before.programs} == {p.name for p in after.programs}
    assert all(before.program(p.name).digest != p.digest for p in after.programs)


def test_a_service_user_that_is_no_user_name_is_refused(tmp_path):
    doc = inventory_doc(tmp_path)
    doc["guest"]["service_user"] = "vcf slm;rm"
    with pytest.raises(InventoryError, match=r"guest\.service_user"):
        build(doc)


def test_the_labs_inventory_runs_the_service_as_the_labs_own_user():
    """The lab's loopback guests share the operator's files, whose test folders are private
    to the operator's user: the service runs as that user there, with nothing to hand over."""
    from vcfslm.inventory_load import parse_inventory
    from vcfslm.lab import generate

    doc = generate.lab_inventory(
        vcenter=generate.LabVcenter(host="127.0.0.1", port=8989, user="u", ca_bundle="/ca.pem", template="t"),
        nodes=[generate.LabNode("slm-01", "DC0_C0_H0", "127.0.0.11", "127.0.0.11", 2222)],
        guest=generate.LabGuestLogin(user="operator", ssh_key="/k", known_hosts="/kh", workdir="/lab/work"),
        bench_port=29500, shape=generate.MachineShape(cpus=2, numa_nodes=1, memory_gib=24))
    inv = parse_inventory(yaml.safe_dump(doc), "lab.yaml")
    assert inv.guest.service_user == "operator"
    t = FakeTransport("slm-01", {}, user="operator")
    assert NodeDriver(t, serve_dir="/x", venv_bin="/v", service_user=inv.guest.service_user).service_user is None


# ------------------------------------------------------------------ the driver


def driver(inv, node, t: FakeTransport) -> NodeDriver:
    return NodeDriver(t, serve_dir=node.serve_dir, venv_bin=f"{inv.guest.workdir}/vllm-venv/bin",
                      deployment="slm", service_user=inv.guest.service_user)


def fresh(node):
    from vcfslm.deploy.changes import NodeState

    return node_changes(node, NodeState({f.path: None for f in node.files}, None, False))


@pytest.mark.parametrize("supervisor", [SYSTEMD, SUPERVISORD])
def test_apply_hands_the_service_user_its_folders_before_anything_starts(tmp_path, supervisor):
    inv = inventory(tmp_path)
    node = deployment(inv, supervisor=supervisor).node("slm-01")
    t = FakeTransport("slm-01", {re.compile(r".*"): ""})
    driver(inv, node, t).apply(node, fresh(node))
    [chown] = [c for c in t.calls if "chown -R" in c]
    folder = node.serve_dir
    owned = (f"{folder}/home {folder}/frontdoor {folder}/proxy {folder}/tls {socket_folder(folder)}" +
             (f" {folder}/serve.env" if supervisor == SUPERVISORD else ""))
    assert chown == (f"mkdir -p {folder}/home && chown -R vcfslm:vcfslm {owned} && "
                     f"chgrp vcfslm {folder} && chmod 750 {folder}")
    starts = [i for i, c in enumerate(t.calls) if "systemctl" in c or "supervisord -c" in c]
    assert starts and t.calls.index(chown) < min(starts)


def test_apply_as_the_service_user_itself_hands_nothing_over(tmp_path):
    inv = inventory(tmp_path, service_user="root")
    node = deployment(inv).node("slm-01")
    t = FakeTransport("slm-01", {re.compile(r".*"): ""})
    driver(inv, node, t).apply(node, fresh(node))
    assert not [c for c in t.calls if "chown" in c or "chgrp" in c]


def test_supervisord_as_another_login_cannot_switch_user_and_says_so(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv, supervisor=SUPERVISORD).node("slm-01")
    t = FakeTransport("slm-01", {re.compile(r".*"): ""}, user="deploy")
    with pytest.raises(ServeError, match="supervisord runs as deploy there and cannot switch to "
                                         "guest.service_user vcfslm"):
        driver(inv, node, t).apply(node, fresh(node))
    assert t.puts == []


# ------------------------------------------------------------------ the serve playbook


USERADD = "useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vcfslm"


def run_service_user_step(inv, t: FakeTransport):
    from dataclasses import replace

    from vcfslm.guest.playbook import load_playbook
    from vcfslm.guest.runner import run_hosts

    book = load_playbook("serve", inv)
    assert book.steps[0].name == "service user"      # before anything the service needs is installed
    summary = run_hosts(inv, [replace(book, steps=book.steps[:1])], inv.nodes[:1], lambda node: t)
    return summary.hosts[0]


@pytest.mark.parametrize("login", ["root", "deploy"])
def test_the_serve_playbook_makes_the_service_user_once(tmp_path, login):
    inv = inventory(tmp_path, user=login)
    fresh_guest = FakeTransport("slm-01", {re.compile(r".*id -u vcfslm.*", re.S): "no\n",
                                           re.compile(r".*useradd .*"): ""}, user=login)
    host = run_service_user_step(inv, fresh_guest)
    assert host.succeeded, host.error
    [made] = [c for c in fresh_guest.calls if "useradd" in c]
    assert USERADD in made and made.startswith("sudo") == (login != "root")
    again = FakeTransport("slm-01", {re.compile(r".*id -u vcfslm.*", re.S): "yes\n",
                                     re.compile(r".*useradd .*"): ""}, user=login)
    assert run_service_user_step(inv, again).succeeded
    assert not [c for c in again.calls if "useradd" in c]
