"""What serve up changes on a node (deploy/changes.py, pure): the desired files and programs
against the node's manifest, file digests and supervisor states; and the two supervisors'
status output read into program states."""

from __future__ import annotations

import json

import pytest
from test_deploy_support import deployment, inventory

from vcfslm.deploy.changes import (
    NodeChanges,
    NodeState,
    ProgramState,
    node_changes,
    parse_supervisor_status,
    parse_systemd_show,
)
from vcfslm.deploy.desired import MANIFEST

ALL = ("vllm-node0", "vllm-node1", "proxy", "router", "frontdoor")


def manifest_of(node) -> dict:
    return json.loads(next(f.content for f in node.files if f.path.endswith("/" + MANIFEST)))


def running(names, state: str = "RUNNING") -> dict[str, ProgramState]:
    return {n: ProgramState(n, state, 100 + i) for i, n in enumerate(names)}


def as_deployed(node, up: bool = True, programs: dict | None = None) -> NodeState:
    """The node after a serve up of `node` that went through: its files, its manifest, its programs."""
    return NodeState({f.path: f.digest for f in node.files}, manifest_of(node), up,
                     running(p.name for p in node.programs) if programs is None else programs)


@pytest.fixture
def node(tmp_path):
    return deployment(inventory(tmp_path)).node("slm-01")


def test_a_fresh_node_starts_and_writes_everything(node):
    fresh = NodeState({f.path: None for f in node.files}, None, False)
    changes = node_changes(node, fresh)
    assert changes.start == ALL
    assert set(changes.write) == {f.path for f in node.files} and len(changes.write) == len(node.files)
    assert changes.write[-1] == f"{node.serve_dir}/{MANIFEST}"                # the record goes last
    assert changes.restart == changes.stop == changes.revive == changes.remove == ()
    assert not changes.empty
    assert changes.lines()[0] == "slm-01: start vllm-node0, vllm-node1, proxy, router, frontdoor"


def test_a_node_as_deployed_and_running_needs_nothing(node):
    changes = node_changes(node, as_deployed(node))
    assert changes.empty and changes.lines() == []
    assert changes == NodeChanges("slm-01")
    assert changes.to_dict() == {k: [] for k in ("write", "remove", "start", "restart", "stop", "revive")}


def test_a_changed_digest_restarts_only_that_program(tmp_path):
    old = deployment(inventory(tmp_path)).node("slm-01")
    new = deployment(inventory(tmp_path, {"router": {"policy": "round_robin"}})).node("slm-01")
    changes = node_changes(new, as_deployed(old))
    assert changes.restart == ("router",)
    assert changes.start == changes.stop == changes.revive == changes.remove == ()
    # The router's section of supervisord.conf and the record differ; the key and nginx's files do not.
    assert changes.write == (new.supervisor_conf, f"{new.serve_dir}/{MANIFEST}")
    assert changes.lines() == ["slm-01: restart (settings changed) router",
                               f"slm-01: write {new.supervisor_conf}, {new.serve_dir}/{MANIFEST}"]


def test_a_recorded_digest_that_differs_restarts_the_program(node):
    observed = as_deployed(node)
    manifest = dict(observed.manifest)
    manifest["programs"] = {**manifest["programs"], "vllm-node1": "0123456789abcdef"}
    changes = node_changes(node, NodeState(observed.digests, manifest, True, observed.programs))
    assert changes.restart == ("vllm-node1",) and changes.start == changes.revive == ()


def test_a_program_the_deployment_drops_is_stopped_and_its_files_removed(tmp_path):
    old = deployment(inventory(tmp_path, {"router": {"node": "slm-01"}}))
    new = deployment(inventory(tmp_path, {"router": {"node": "slm-02"}}))
    was_router = node_changes(new.node("slm-01"), as_deployed(old.node("slm-01")))
    assert sorted(was_router.stop) == ["frontdoor", "router"]
    folder = old.node('slm-01').serve_dir
    assert sorted(was_router.remove) == sorted([f"{folder}/frontdoor/nginx.conf", f"{folder}/tls/door.pem",
                                                f"{folder}/tls/door.key"])
    assert was_router.start == was_router.revive == ()
    assert f"slm-01: stop {', '.join(was_router.stop)}" in was_router.lines()
    # The servers read the router's workers from nowhere: they stay; the proxy lets the new
    # router's node in instead.
    assert was_router.restart == ("proxy",)
    now_router = node_changes(new.node("slm-02"), as_deployed(old.node("slm-02")))
    assert now_router.start == ("router", "frontdoor") and now_router.stop == now_router.remove == ()
    assert f"{new.node('slm-02').serve_dir}/frontdoor/nginx.conf" in now_router.write


@pytest.mark.parametrize("state", ["BACKOFF", "FATAL", "EXITED", "STOPPED", "FAILED", "INACTIVE"])
def test_an_unchanged_program_that_is_not_running_is_revived(node, state):
    programs = {**running(ALL), "router": ProgramState("router", state)}
    changes = node_changes(node, as_deployed(node, programs=programs))
    assert changes.revive == ("router",)
    assert changes.start == changes.restart == changes.stop == changes.write == ()
    assert changes.lines() == ["slm-01: start again (not running) router"]


@pytest.mark.parametrize("state", ["STARTING", "ACTIVE", "ACTIVATING", "RELOADING"])
def test_a_program_on_its_way_up_is_left_alone(node, state):
    programs = {**running(ALL), "vllm-node0": ProgramState("vllm-node0", state)}
    assert node_changes(node, as_deployed(node, programs=programs)).empty


@pytest.mark.parametrize("programs", [{}, running(ALL)], ids=["no-status", "stale-status"])
def test_every_program_is_revived_when_supervisord_does_not_answer(node, programs):
    changes = node_changes(node, as_deployed(node, up=False, programs=programs))
    assert changes.revive == ALL and changes.start == changes.restart == ()


def test_a_program_missing_from_the_status_is_revived(node):
    programs = running(["vllm-node0", "vllm-node1", "proxy", "frontdoor"])
    assert node_changes(node, as_deployed(node, programs=programs)).revive == ("router",)


def test_a_changed_program_is_restarted_not_revived(node):
    observed = as_deployed(node, programs={**running(ALL), "router": ProgramState("router", "FATAL")})
    manifest = {**observed.manifest, "programs": {**observed.manifest["programs"], "router": "old"}}
    changes = node_changes(node, NodeState(observed.digests, manifest, True, observed.programs))
    assert changes.restart == ("router",) and changes.revive == ()


def test_the_manifest_is_written_last_whatever_else_changes(node):
    digests = {f.path: "0" * 64 for f in node.files}
    changes = node_changes(node, NodeState(digests, manifest_of(node), True, running(ALL)))
    assert changes.write[-1] == f"{node.serve_dir}/{MANIFEST}" and len(changes.write) == len(node.files)


# ------------------------------------------------------------------ supervisors' status


SUPERVISORCTL_STATUS = """\
vllm-node0                       RUNNING   pid 412, uptime 0:01:02
vllm-node1                       STARTING
router                           BACKOFF   Exited too quickly (process log may have details)
frontdoor                        FATAL     Exited too quickly

"""


def test_supervisorctl_status_lines():
    states = parse_supervisor_status(SUPERVISORCTL_STATUS)
    assert states == {"vllm-node0": ProgramState("vllm-node0", "RUNNING", 412),
                      "vllm-node1": ProgramState("vllm-node1", "STARTING", None),
                      "router": ProgramState("router", "BACKOFF", None),
                      "frontdoor": ProgramState("frontdoor", "FATAL", None)}
    assert [n for n, s in states.items() if s.running] == ["vllm-node0", "vllm-node1"]


def test_supervisorctl_errors_read_as_no_program():
    assert parse_supervisor_status("unix:///x/supervisor.sock no such file\n") == {}
    assert parse_supervisor_status("") == {}


SYSTEMCTL_SHOW = """\
Id=vcfslm-slm-vllm-node0.service
ActiveState=active
MainPID=123

MainPID=0
Id=vcfslm-slm-router.service
ActiveState=failed

Id=vcfslm-slm-frontdoor.service
ActiveState=activating
MainPID=456

Id=sshd.service
ActiveState=active
MainPID=77
"""


def test_systemctl_show_blocks():
    units = {"vcfslm-slm-vllm-node0.service": "vllm-node0", "vcfslm-slm-router.service": "router",
             "vcfslm-slm-frontdoor.service": "frontdoor"}
    states = parse_systemd_show(SYSTEMCTL_SHOW, units)
    assert states == {"vllm-node0": ProgramState("vllm-node0", "ACTIVE", 123),
                      "router": ProgramState("router", "FAILED", None),
                      "frontdoor": ProgramState("frontdoor", "ACTIVATING", 456)}
    assert {n: s.running for n, s in states.items()} == {"vllm-node0": True, "router": False, "frontdoor": True}
