"""Changes without downtime (deploy/rollout.py): whether a change rolls, which server goes
next, when one is drained, and the driver's order over scripted nodes: out of the router,
drained, restarted, healthy, back in, one server at a time, the manifests last."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from urllib.parse import unquote

import pytest
from test_deploy_support import KEY, deployment, inventory

from vcfslm.deploy.changes import NodeChanges, NodeState, ProgramState, node_changes
from vcfslm.deploy.desired import MANIFEST
from vcfslm.deploy.driver import NodeDriver
from vcfslm.deploy.keys import PREVIOUS_KEYS_VARIABLE
from vcfslm.deploy.rollout import (
    Rollout,
    drain_verdict,
    held_back,
    in_flight,
    next_server,
    plan_roll,
    router_workers,
)
from vcfslm.errors import ServeError
from vcfslm.guest.fake import FakeTransport
from vcfslm.resources import resource_dir


def running(node) -> NodeState:
    manifest = json.loads(next(f.content for f in node.files if f.path.endswith("/" + MANIFEST)))
    return NodeState({f.path: f.digest for f in node.files}, manifest, True,
                     {p.name: ProgramState(p.name, "RUNNING", 400 + i) for i, p in enumerate(node.programs)})


def changes_between(old, new) -> list[NodeChanges]:
    return [node_changes(new.node(n.node), running(old.node(n.node))) for n in new.nodes]


# ------------------------------------------------------------------ the decisions


def test_a_server_setting_rolls_every_server_one_at_a_time(tmp_path):
    old = deployment(inventory(tmp_path))
    new = deployment(inventory(tmp_path, {"max_num_seqs": 3}))
    plan = plan_roll(new, changes_between(old, new))
    assert plan.rolling and [f"{s.node}/{s.program}" for s in plan.servers] == \
           [f"{s.node}/{s.program}" for s in new.servers]
    assert not plan.reload_door and not plan.restart_router
    # The proxies' config does not change with a server's setting: they are left alone.
    assert plan.reload_proxies == ()
    assert not [c for c in changes_between(old, new) if "proxy" in c.restart]


def test_a_key_change_rolls_the_servers_and_reloads_the_door(tmp_path):
    inv = inventory(tmp_path)
    old, new = deployment(inv), deployment(inv, key="n" * 43)
    plan = plan_roll(new, changes_between(old, new))
    assert plan.rolling and len(plan.servers) == len(new.servers) and plan.reload_door
    assert plan.reload_proxies == tuple(n.node for n in new.nodes)
    for c in changes_between(old, new):
        assert "proxy" not in held_back(c, plan).restart and "frontdoor" not in held_back(c, plan).restart
    assert not plan.restart_router     # the router checks no key: its settings did not change


def test_no_roll_without_a_server_restart_or_with_one_server(tmp_path):
    old = deployment(inventory(tmp_path))
    router_only = deployment(inventory(tmp_path, {"router": {"policy": "round_robin"}}))
    assert plan_roll(router_only, changes_between(old, router_only)).rolling is False
    new = deployment(inventory(tmp_path, {"max_num_seqs": 3}))
    changes = changes_between(old, new)
    lone = replace(new, servers=new.servers[:1])
    plan = plan_roll(lone, changes)
    assert plan.rolling is False and "one server" in plan.why
    assert plan_roll(replace(new, servers=new.servers[:2]), changes).rolling is True


def test_a_fresh_deployment_does_not_roll(tmp_path):
    new = deployment(inventory(tmp_path))
    fresh = [node_changes(n, NodeState({}, None, False)) for n in new.nodes]
    assert plan_roll(new, fresh).rolling is False


def test_what_a_node_applies_before_the_roll(tmp_path):
    inv = inventory(tmp_path)
    old, new = deployment(inv), deployment(inv, key="n" * 43)
    changes = changes_between(old, new)
    plan = plan_roll(new, changes)
    router = next(c for c in changes if c.node == new.router_node)
    first = held_back(router, plan)
    assert first.restart == () and not [p for p in first.write if p.endswith(MANIFEST)]
    assert set(first.write) == {p for p in router.write if not p.endswith(MANIFEST)}


def test_the_next_server_is_one_that_serves_nothing_now(tmp_path):
    servers = list(deployment(inventory(tmp_path)).servers)
    assert next_server(servers, {s.url: True for s in servers}) == servers[0]
    assert next_server(servers, {**{s.url: True for s in servers}, servers[3].url: False}) == servers[3]


def test_in_flight_counts_running_and_waiting_requests():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n')
    assert in_flight(text) == 3.0
    assert in_flight("vllm:kv_cache_usage_perc 0.1\n") is None and in_flight(None) is None


@pytest.mark.parametrize("readings, waited, verdict", [
    ([0.0, 0.0], 1.0, "drained"),
    ([3.0, 0.0], 1.0, "wait"),            # one idle reading may be a request on its way in
    ([0.0], 0.0, "wait"),
    ([0.0, None], 1.0, "wait"),           # unreadable is not idle
    ([2.0, 1.0], 601.0, "timeout"),
    ([1.0, 0.0, 0.0], 900.0, "drained"),
])
def test_drain_verdict(readings, waited, verdict):
    assert drain_verdict(readings, waited, timeout_s=600.0) == verdict


def test_router_workers_reads_the_list():
    assert router_workers('{"urls":["http://a:1/","http://b:2"]}') == ["http://a:1", "http://b:2"]
    assert router_workers("not json") == []


def test_during_a_rotation_the_door_the_proxies_and_the_servers_take_both_keys(tmp_path):
    inv = inventory(tmp_path)
    new = "n" * 43
    both = deployment(inv, key=new, api_keys=[KEY, new])
    router = both.node(both.router_node)
    files = {f.path.split("/serve/", 1)[1].split("/", 1)[1]: f for f in router.files}
    for conf in ("frontdoor/nginx.conf", "proxy/nginx.conf"):
        assert re.findall(r'"Bearer ([^"]+)" 1;', files[conf].content) == [KEY, new]
        assert files[conf].mode == 0o600
    assert files["serve.env"].content == f"VLLM_API_KEY={new}\n{PREVIOUS_KEYS_VARIABLE}={KEY}\n"
    assert files["serve.env"].mode == 0o600
    assert not [f for f in router.files if f.path.endswith("key.conf")]
    only_new = deployment(inv, key=new)
    assert {p.digest for p in router.programs if p.name.startswith("vllm")} \
        .isdisjoint({p.digest for p in only_new.node(both.router_node).programs})
    assert KEY not in json.dumps([f.content for f in router.files if f.path.endswith(MANIFEST)])


# ------------------------------------------------------------------ the driver over scripted nodes


class World:
    """The nodes, their servers and the router as the probe and the supervisor see them."""

    def __init__(self, dep):
        self.dep = dep
        self.listed = {s.url for s in dep.servers}
        self.busy = {s.url: 2 for s in dep.servers}          # streams still running per server
        self.down = {}                                        # url -> health polls left before it answers
        self.events: list[tuple[str, str]] = []
        self.metrics_keys: set[str] = set()                   # the keys /metrics was read with
        self.out_at_once = 0

    def probe(self, cmd, data):
        ask = json.loads(data)
        out = {}
        for item in ask["get"]:
            url, method = item["url"], item.get("method", "GET")
            if "/remove_worker?url=" in url:
                target = _target(url)
                self.listed.discard(target)
                self.events.append(("out", target))
                self.out_at_once = max(self.out_at_once, len({s.url for s in self.dep.servers} - self.listed))
                out[item["id"]] = {"status": 200, "body": "Successfully removed worker"}
            elif "/add_worker?url=" in url:
                target = _target(url)
                assert target not in self.down, "put back before it was healthy"
                self.listed.add(target)
                self.events.append(("in", target))
                out[item["id"]] = {"status": 200, "body": "Successfully added worker"}
            elif url.endswith("/list_workers"):
                out[item["id"]] = {"status": 200, "body": json.dumps({"urls": sorted(self.listed)})}
            elif url.endswith("/metrics"):
                server = url.removesuffix("/metrics")
                assert item.get("key") and item.get("ca", "").endswith("/tls/ca.pem")
                self.metrics_keys.add(ask["key"])
                if server not in self.listed and self.busy[server]:
                    self.busy[server] -= 1                   # its streams finish while it drains
                out[item["id"]] = {"status": 200,
                                   "body": f'vllm:num_requests_running{{engine="0"}} {self.busy[server]}.0\n'}
            elif url.endswith("/health"):
                server = url.removesuffix("/health")
                if self.down.get(server):
                    self.down[server] -= 1
                    out[item["id"]] = {"status": None, "error": "ConnectionRefusedError"}
                else:
                    self.down.pop(server, None)
                    out[item["id"]] = {"status": 200, "body": ""}
            assert method in ("GET", "POST")
        return json.dumps({"http": out, "rss": {}})

    def restart(self, node, program):
        url = next(s.url for s in self.dep.servers if s.node == node and s.program == program)
        assert url not in self.listed, f"{url} restarted while the router still sent it requests"
        assert self.busy[url] == 0, f"{url} restarted with streams running"
        self.down[url] = 2
        self.events.append(("restart", url))


def _target(url: str) -> str:
    return unquote(url.split("?url=", 1)[1])


def rollout_over(world: World, dep, inv) -> tuple[Rollout, dict[str, FakeTransport]]:
    venv = f"{inv.guest.workdir}/vllm-venv/bin"
    transports, drivers = {}, {}
    for node in dep.nodes:
        def update(cmd, _data, node=node.node):
            for name in shlex.split(cmd)[4:]:
                world.restart(node, name)
            return ""

        ctl = re.escape(f"{venv}/supervisorctl -c {node.supervisor_conf}")
        t = FakeTransport(node.node, {
            re.compile(r".* -c .*urllib.*", re.S): world.probe,
            re.compile(ctl + r" pid"): "4242\n",
            re.compile(ctl + r" reread"): "",
            re.compile(ctl + r" update( vllm-node\d)+"): update,
            re.compile(ctl + r" signal HUP frontdoor"): lambda c, d: world.events.append(("reload", "door")) or "",
            re.compile(ctl + r" signal HUP proxy"):
                lambda c, d, n=node.node: world.events.append(("reload", f"proxy {n}")) or "",
            re.compile(ctl + r" status"): "".join(f"{p.name} RUNNING pid 4{i}\n" for i, p in enumerate(node.programs)),
            re.compile(r"mkdir -p .*"): "",
            re.compile(r".*if \[ -e .*echo absent; fi'?", re.S): "absent\n"})
        transports[node.node] = t
        drivers[node.node] = NodeDriver(t, serve_dir=node.serve_dir, venv_bin=venv, deployment=dep.name)
    return Rollout(dep, drivers, python="/usr/bin/python3", router_port=8090, health_timeout_s=60,
                   sleep=lambda s: None), transports


def test_the_driver_rolls_one_server_at_a_time_and_writes_the_manifests_last(tmp_path):
    inv = inventory(tmp_path)
    old, new = deployment(inv), deployment(inv, key="n" * 43)
    changes = changes_between(old, new)
    plan = plan_roll(new, changes)
    world = World(new)
    rollout, transports = rollout_over(world, new, inv)
    log = rollout.apply(plan, changes, "n" * 43)

    assert world.out_at_once == 1 and world.listed == {s.url for s in new.servers}
    # The door, then every node's proxy, reload (no restart) before the servers roll.
    reloads = 1 + len(new.nodes)
    assert [e[0] for e in world.events] == ["reload"] * reloads + ["out", "restart", "in"] * len(new.servers)
    assert world.events[0] == ("reload", "door")
    assert sorted(e[1] for e in world.events[1:reloads]) == [f"proxy {n.node}" for n in new.nodes]
    assert world.metrics_keys == {"n" * 43}
    assert [e[1] for e in world.events if e[0] == "restart"] == [s.url for s in new.servers]
    assert [r["server"] for r in log] == [f"{s.node}/{s.program}" for s in new.servers]
    assert all(r["drained"] for r in log)
    for node in new.nodes:
        t = transports[node.node]
        manifest = f"{node.serve_dir}/{MANIFEST}"
        assert t.puts[-1] == manifest and t.files[manifest].decode() == \
               next(f.content for f in node.files if f.path == manifest)
        assert not [c for c in t.calls if KEY in c or "n" * 43 in c]


def test_a_server_that_gives_up_after_its_restart_stops_the_roll(tmp_path):
    inv = inventory(tmp_path)
    old, new = deployment(inv), deployment(inventory(tmp_path, {"max_num_seqs": 3}))
    changes = changes_between(old, new)
    world = World(new)
    world.restart = lambda node, program: world.down.__setitem__(
        next(s.url for s in new.servers if s.node == node and s.program == program), 10**6)
    rollout, transports = rollout_over(world, new, inv)
    first = new.servers[0]
    t = transports[first.node]
    t.script[next(k for k in t.script if isinstance(k, re.Pattern) and k.pattern.endswith(" status"))] = \
        f"{first.program} FATAL Exited too quickly\n"
    t.script[re.compile(r"tail -n \d+ .*")] = "Traceback: boom\n"
    with pytest.raises(ServeError, match=f"{first.program} is FATAL after its restart"):
        rollout.apply(plan_roll(new, changes), changes)
    # The roll stopped at the first server: the others never left the router, no manifest moved.
    assert world.listed == {s.url for s in new.servers} - {first.url}
    assert not [p for tr in transports.values() for p in tr.puts if p.endswith(MANIFEST)]


def test_the_vllm_entry_hands_the_previous_keys_to_vllm_beside_the_current_one():
    code = ("import os, runpy, sys; g = runpy.run_path(sys.argv[1]); "
            "print(g['_with_previous_keys'](['vllm', 'serve', 'm', '--port', '1'])); "
            "print('VCFSLM_PREVIOUS_API_KEYS' in os.environ); "
            "print(g['_with_previous_keys'](['vllm', 'serve', 'm']))")
    entry = str(resource_dir("templates") / "vllm-entry.py")
    env = {"PATH": os.environ["PATH"], "VLLM_API_KEY": "new", PREVIOUS_KEYS_VARIABLE: "old older"}
    out = subprocess.run([sys.executable, "-c", code, entry], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["['vllm', 'serve', 'm', '--port', '1', '--api-key', 'new', 'old', 'older']", "False",
                   "['vllm', 'serve', 'm']"]
