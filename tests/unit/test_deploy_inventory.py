"""The inventory's `serve:` section: its nodes and router node exist among the serving
nodes, its ports do not collide on a node, and serve up refuses a synthetic model; every
problem at its file, line and key."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from test_deploy_support import build, dump, inventory, inventory_doc

from vcfslm.cli import main
from vcfslm.errors import InventoryError
from vcfslm.inventory_load import load_inventory, located, service_model_problems


def line_of(text: str, fragment: str) -> int:
    """1-based line of the first `fragment` inside the top-level serve: section."""
    lines = text.splitlines()
    start = lines.index("serve:")
    return next(i for i, line in enumerate(lines[start:], start + 1) if fragment in line)


def problems(tmp_path, serve: dict) -> tuple[str, list[str]]:
    doc = inventory_doc(tmp_path)
    doc["serve"] = serve
    with pytest.raises(InventoryError) as info:
        build(doc, "cluster.yaml")
    return dump(doc), [str(p) for p in info.value.problems]


@pytest.mark.parametrize(("serve", "fragment", "key", "message"), [
    ({"nodes": ["slm-01", "slm-09"]}, "- slm-09", "serve.nodes[1]",
     "no node is named 'slm-09' (nodes: slm-01, slm-02, slm-03)"),
    ({"nodes": ["slm-01", "slm-02"], "router": {"node": "slm-03"}}, "node: slm-03", "serve.router.node",
     "'slm-03' runs no server of the deployment (serving nodes: slm-01, slm-02)"),
    ({"port": 9000, "front_door": {"port": 9001}}, "port: 9001", "serve.front_door.port",
     "port 9001 is one of the servers' (9000-9001, serve.port + vNUMA node)"),
    ({"router": {"port": 8400, "prometheus_port": 8400}}, "prometheus_port: 8400", "serve.router.prometheus_port",
     "port 8400 is already serve.router.port"),
    ({"port": 8299, "router": {"port": 8300}}, "port: 8300", "serve.router.port",
     "port 8300 is one of the servers' (8299-8300, serve.port + vNUMA node)"),
], ids=["unknown-serving-node", "router-node-not-serving", "front-door-among-servers", "router-on-prometheus",
        "router-among-servers"])
def test_a_bad_serve_section_is_placed_at_its_line_and_key(tmp_path, serve, fragment, key, message):
    text, found = problems(tmp_path, serve)
    line = line_of(text, fragment)
    assert len(found) == 1, found
    assert re.fullmatch(rf"cluster\.yaml:{line}:\d+: {re.escape(key)}: {re.escape(message)}", found[0]), found


@pytest.mark.parametrize("serve", [
    {"nodes": ["slm-02", "slm-03"], "router": {"node": "slm-03"}},
    {"port": 9000, "front_door": {"port": 9002}, "router": {"port": 8999, "prometheus_port": 9003}},
    {},
], ids=["router-among-serving-nodes", "ports-beside-the-servers", "defaults"])
def test_a_good_serve_section_passes(tmp_path, serve):
    inv = inventory(tmp_path, serve)
    assert inv.serve.router.policy == "auto" and service_model_problems(inv) == []


def test_the_servers_port_range_follows_the_vnuma_nodes(tmp_path):
    doc = inventory_doc(tmp_path)
    doc["vm"].update(vnuma_nodes=1, host_numa_nodes=[0])
    doc["bench"].update(ranks_per_node=1)
    doc["serve"] = {"port": 9000, "front_door": {"port": 9001}}      # one vNUMA node: one server port
    assert build(doc).serve.front_door.port == 9001


def test_serve_up_refuses_a_synthetic_model_at_guest_model(tmp_path):
    doc = inventory_doc(tmp_path, model="synthetic:tiny")
    path = tmp_path / "cluster.yaml"
    path.write_text(dump(doc))
    inv = load_inventory(path)                       # an inventory the bench takes
    [(key, message)] = service_model_problems(inv)
    assert key == ("guest", "model")
    assert message.startswith("serve up serves a model folder, not synthetic:tiny")
    error = located(inv, service_model_problems(inv))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "synthetic:tiny" in text)
    [problem] = [str(p) for p in error.problems]
    assert re.match(rf"{re.escape(str(path))}:{line}:\d+: guest\.model: serve up serves a model folder", problem)


def test_serve_up_dry_run_on_a_synthetic_model_exits_2_naming_guest_model(tmp_path, monkeypatch):
    monkeypatch.delenv("VCFSLM_INVENTORY", raising=False)
    path = tmp_path / "cluster.yaml"
    path.write_text(dump(inventory_doc(tmp_path, model="synthetic:tiny")))
    result = CliRunner().invoke(main, ["serve", "up", str(path), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "guest.model" in result.output and f"{path}:" in result.output
    assert "serve up serves a model folder" in result.output
