"""The node driver (deploy/driver.py) over the scripted transport: what it runs to read a
node, to bring its programs up under supervisord or systemd, to take them down, and how
it reads the key back (with the transport's get, never a command that prints it)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from test_deploy_support import KEY, deployment, inventory

from vcfslm.deploy.changes import NodeChanges, NodeState, ProgramState, node_changes
from vcfslm.deploy.desired import MANIFEST, SYSTEMD, UNIT_DIR, supervisor_socket
from vcfslm.deploy.driver import NodeDriver
from vcfslm.errors import ServeError
from vcfslm.guest import facts as F
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.transport import sudo_wrap

ANY = re.compile(r".*")
STATUS = ("vllm-node0                       RUNNING   pid 412, uptime 0:01:02\n"
          "vllm-node1                       RUNNING   pid 413, uptime 0:01:02\n"
          "proxy                            RUNNING   pid 414, uptime 0:01:02\n"
          "router                           BACKOFF   Exited too quickly (process log may have details)\n"
          "frontdoor                        FATAL     Exited too quickly\n")
REFUSED = (7, "", "unix:///x/supervisor.sock refused connection")
# guest/'s file fact (as root or through sudo) on a node that has none of the files yet.
NO_FILE = re.compile(r".*if \[ -e .*echo absent; fi'?", re.S)


def venv_bin(inv) -> str:
    return f"{inv.guest.workdir}/vllm-venv/bin"


def driver(inv, node, t: FakeTransport) -> NodeDriver:
    return NodeDriver(t, serve_dir=node.serve_dir, venv_bin=venv_bin(inv), deployment="slm")


def ctl(inv, node, *args: str) -> str:
    return shlex.join([f"{venv_bin(inv)}/supervisorctl", "-c", node.supervisor_conf, *args])


def cat_manifest(node) -> str:
    return f"cat {shlex.quote(node.serve_dir + '/' + MANIFEST)} 2>/dev/null"


def manifest_text(node) -> str:
    return next(f.content for f in node.files if f.path.endswith("/" + MANIFEST))


def fresh(node) -> NodeChanges:
    return node_changes(node, NodeState({f.path: None for f in node.files}, None, False))


def unwrap(call: str) -> str:
    """The command a `sudo -n sh -c '...'` call runs (a call without sudo as it is)."""
    words = shlex.split(call)
    return words[4] if words[:4] == ["sudo", "-n", "sh", "-c"] else call


def no_key_in(t: FakeTransport) -> None:
    assert not [c for c in t.calls if KEY in c]


# ------------------------------------------------------------------ reading a node


def file_answers(paths, known: dict) -> dict:
    """The scripted answer of guest/'s file fact for each path: a file with its digest, or absent."""
    return {F.file_state(p).command: (f"regular file|600|u|u\n{known[p]}  {p}\n" if p in known else "absent\n")
            for p in paths}


def test_observe_reads_every_file_as_guest_facts_in_one_round_trip(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    old = json.loads(manifest_text(node))
    old["files"] = [*old["files"], "/var/lib/old/legacy.conf"]
    paths = sorted({f.path for f in node.files} | {"/var/lib/old/legacy.conf"})
    known = {f.path: f.digest for f in node.files if not f.path.endswith("/serve.env")}
    t = FakeTransport("slm-01", {cat_manifest(node): json.dumps(old), ctl(inv, node, "pid"): "4242\n",
                                 ctl(inv, node, "status"): (3, STATUS), **file_answers(paths, known)})
    state = driver(inv, node, t).observe(node)
    assert len(t.batches) == 1 and sorted(t.batches[0]) == sorted(F.file_state(p).command for p in paths)
    assert state.digests == {p: known.get(p) for p in paths}
    assert state.manifest == old and state.supervisor_up is True
    assert {n: s.state for n, s in state.programs.items()} == {
        "vllm-node0": "RUNNING", "vllm-node1": "RUNNING", "proxy": "RUNNING", "router": "BACKOFF",
        "frontdoor": "FATAL"}
    assert state.programs["vllm-node0"].pid == 412
    assert node_changes(node, state).revive == ("router", "frontdoor")


def test_observe_reads_the_units_as_root(tmp_path):
    inv = inventory(tmp_path, {"supervisor": "systemd"})
    node = deployment(inv, supervisor=SYSTEMD).node("slm-01")
    units = [f.path for f in node.files if f.path.startswith(UNIT_DIR)]
    t = FakeTransport("slm-01", {cat_manifest(node): (1, ""), ANY: ""}, user="deploy")
    driver(inv, node, t).observe(node)
    reads = [c for c in t.calls if "sha256sum" in c]
    assert units and all(unwrap(c) != c for c in reads if any(u in c for u in units))
    assert all(unwrap(c) == c for c in reads if not any(u in c for u in units))


def test_observe_a_node_without_supervisord(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-02")
    t = FakeTransport("slm-02", {cat_manifest(node): (1, ""), ctl(inv, node, "pid"): REFUSED,
                                 **file_answers([f.path for f in node.files], {})})
    state = driver(inv, node, t).observe(node)
    assert state == NodeState({f.path: None for f in node.files}, None, False, {})
    assert not [c for c in t.calls if c.endswith(" status")]


# ------------------------------------------------------------------ supervisord


def test_apply_with_supervisord_down_starts_it_once(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    changes = fresh(node)
    start = f"{venv_bin(inv)}/supervisord -c {node.supervisor_conf}"
    t = FakeTransport("slm-01", {re.compile(r"mkdir -p .*"): "", ctl(inv, node, "pid"): REFUSED, start: "",
                                 NO_FILE: "absent\n"})
    driver(inv, node, t).apply(node, changes)
    assert t.calls.count(start) == 1
    assert not [c for c in t.calls if "supervisorctl" in c and c != ctl(inv, node, "pid")]
    assert t.puts == list(changes.write) and t.puts[-1].endswith("/" + MANIFEST)
    for f in node.files:
        assert t.files[f.path] == f.content.encode() and t.modes[f.path] == f.mode
    assert t.modes[f"{node.serve_dir}/serve.env"] == 0o600
    assert t.modes[f"{node.serve_dir}/frontdoor/nginx.conf"] == 0o600
    assert t.modes[f"{node.serve_dir}/proxy/nginx.conf"] == 0o600
    assert t.modes[f"{node.serve_dir}/tls/node.key"] == 0o600
    assert t.calls.index(start) > t.calls.index(next(c for c in t.calls if c.startswith("mkdir -p ")))
    no_key_in(t)


def test_apply_with_supervisord_up_updates_what_changed(tmp_path):
    old = deployment(inventory(tmp_path)).node("slm-01")
    inv = inventory(tmp_path, {"router": {"policy": "round_robin"}})
    node = deployment(inv).node("slm-01")
    observed = NodeState({f.path: f.digest for f in old.files}, json.loads(manifest_text(old)), True,
                         {p.name: ProgramState(p.name, "RUNNING", 400 + i) for i, p in enumerate(old.programs)})
    changes = node_changes(node, observed)
    assert changes.restart == ("router",) and changes.revive == ()
    update = ctl(inv, node, "update", "router")
    t = FakeTransport("slm-01", {re.compile(r"mkdir -p .*"): "", ctl(inv, node, "pid"): "4242\n",
                                 update: "router: stopped\nrouter: updated process group\n", NO_FILE: "absent\n"})
    driver(inv, node, t).apply(node, changes)
    assert t.calls.count(update) == 1
    assert not [c for c in t.calls if "supervisord -c" in c]
    assert t.puts == [node.supervisor_conf, f"{node.serve_dir}/{MANIFEST}"]
    no_key_in(t)


def test_apply_with_only_programs_to_revive_starts_them(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    start = ctl(inv, node, "start", "router", "frontdoor") + " || true"
    t = FakeTransport("slm-01", {re.compile(r"mkdir -p .*"): "", ctl(inv, node, "pid"): "4242\n", start: ""})
    driver(inv, node, t).apply(node, NodeChanges("slm-01", revive=("router", "frontdoor")))
    assert t.calls[-1] == start and t.puts == []
    assert not [c for c in t.calls if c.endswith(" update") or "supervisord -c" in c]


def test_down_shuts_supervisord_and_removes_every_file_it_wrote(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    manifest = json.loads(manifest_text(node))
    t = FakeTransport("slm-01", {cat_manifest(node): manifest_text(node), ctl(inv, node, "pid"): "4242\n",
                                 ctl(inv, node, "shutdown"): "Shut down\n", "kill -0 4242": (1, "", "No such process"),
                                 re.compile(r"rm -f .*"): "", re.compile(r"rm -rf .*"): ""})
    stopped = driver(inv, node, t).down()
    assert sorted(stopped) == sorted(["vllm-node0", "vllm-node1", "proxy", "router", "frontdoor"])
    assert t.calls.count(ctl(inv, node, "shutdown")) == 1
    removed = [shlex.split(c)[2:] for c in t.calls if c.startswith("rm -f ")]
    assert sorted(p for r in removed for p in r) == sorted(
        [*manifest["files"], f"{node.serve_dir}/{MANIFEST}", supervisor_socket(node.serve_dir)])
    assert set(manifest["files"]) == {f.path for f in node.files if not f.path.endswith(MANIFEST)}
    assert t.calls.index(ctl(inv, node, "shutdown")) < min(i for i, c in enumerate(t.calls) if c.startswith("rm"))
    assert t.calls[-1].startswith("rm -f ") and MANIFEST in t.calls[-1]    # the record goes last


def test_down_without_a_manifest_touches_nothing(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-03")
    t = FakeTransport("slm-03", {cat_manifest(node): (1, "")})
    assert driver(inv, node, t).down() == []
    assert t.calls == [cat_manifest(node)]


# ------------------------------------------------------------------ systemd


@pytest.mark.parametrize("user", ["root", "deploy"])
def test_apply_with_systemd_reloads_then_enables_restarts_and_disables(tmp_path, user):
    inv = inventory(tmp_path)
    node = deployment(inv, supervisor=SYSTEMD).node("slm-01")
    unit = {p.name: f"{UNIT_DIR}/{p.unit('slm')}" for p in node.programs}
    gone = f"{UNIT_DIR}/vcfslm-slm-vllm-node7.service"
    changes = NodeChanges("slm-01", write=(unit["vllm-node0"], unit["router"], f"{node.serve_dir}/serve.env"),
                          remove=(gone,), start=("vllm-node0",), restart=("router",), stop=("vllm-node7",),
                          revive=("frontdoor",))
    t = FakeTransport("slm-01", {re.compile(r".*mkdir -p .*"): "", re.compile(r".*install -m 0644 .*"): "",
                                 re.compile(r".*systemctl .*"): "", re.compile(r".*rm -f .*"): "",
                                 sudo_wrap(F.file_state(gone).command, user, user != "root"):
                                     f"regular file|644|root|root\nab  {gone}\n",
                                 NO_FILE: "absent\n"}, user=user)
    driver(inv, node, t).apply(node, changes)
    sudo = user != "root"
    [chain] = [c for c in t.calls if "systemctl" in c]
    assert chain.startswith("sudo -n sh -c ") == sudo
    steps = unwrap(chain).split(" && ")
    reload = steps.index("systemctl daemon-reload")
    assert steps.index("systemctl enable --now vcfslm-slm-vllm-node0.service") > reload
    assert steps.index("systemctl restart vcfslm-slm-router.service") > reload
    assert "systemctl disable --now vcfslm-slm-vllm-node7.service" in steps
    assert "systemctl start vcfslm-slm-frontdoor.service" in steps
    assert not [s for s in steps if s.startswith("systemctl enable") and "router" in s]
    # The stopped unit's file goes after it is disabled, as root when the login user is not.
    [rm] = [c for c in t.calls if gone in c and "rm -f" in c]
    assert rm.startswith("sudo -n sh -c ") == sudo and t.calls.index(rm) > t.calls.index(chain)
    contents = {f.path: f.content.encode() for f in node.files}
    for path in (unit["vllm-node0"], unit["router"]):
        if sudo:    # put in a private temporary file, installed by root (guest/ops.py's execute)
            [install] = [c for c in t.calls if "install -m 0644" in c and path in c]
            staged = shlex.split(unwrap(install))[3]
            assert t.files[staged] == contents[path] and t.modes[staged] == 0o600 and path not in t.files
            assert install.startswith("sudo -n sh -c ") and t.calls.index(install) < t.calls.index(chain)
        else:
            assert t.files[path] == contents[path]
    assert t.modes[f"{node.serve_dir}/serve.env"] == 0o600
    assert not [c for c in t.calls if c.startswith("sudo") and "mkdir" in c and node.serve_dir in c]
    no_key_in(t)


def test_the_service_users_rooms_are_staged_installed_with_sudo_and_handed_over(tmp_path):
    """Under another login than the service user, the files of nginx's prefixes and the
    certificates are read and written as root (put in a private temporary file, installed
    0600), owned by the service user; the rest of the folder stays the login's."""
    inv = inventory(tmp_path)
    node = deployment(inv, supervisor=SYSTEMD).node("slm-01")
    t = FakeTransport("slm-01", {re.compile(r".*mkdir -p .*"): "", re.compile(r".*install -m 0[0-7]{3} .*"): "",
                                 re.compile(r".*chown .*"): "", re.compile(r".*systemctl .*"): "",
                                 NO_FILE: "absent\n"}, user="deploy")
    NodeDriver(t, serve_dir=node.serve_dir, venv_bin=venv_bin(inv), deployment="slm",
               service_user="vcfslm").apply(node, fresh(node))
    rooms = [f for f in node.files if f.path.startswith(tuple(f"{node.serve_dir}/{r}/" for r in
                                                             ("frontdoor", "proxy", "tls")))]
    assert {f.path.rsplit("/", 1)[1] for f in rooms} >= {"nginx.conf", "ca.pem", "node.key"}
    for f in rooms:
        [install] = [c for c in t.calls if "install -m 0600" in c and f.path in c]
        staged = shlex.split(unwrap(install))[3]
        assert install.startswith("sudo -n sh -c ") and t.files[staged] == f.content.encode()
        assert f.path not in t.files
        [chown] = [c for c in t.calls if c.startswith("sudo") and unwrap(c) == f"chown vcfslm:vcfslm {f.path}"]
        assert t.calls.index(chown) > t.calls.index(install)
    env = f"{node.serve_dir}/serve.env"
    assert t.modes[env] == 0o600 and not [c for c in t.calls if "chown" in c and env in c]
    [hand_over] = [c for c in t.calls if "chown -R" in c]
    starts = [i for i, c in enumerate(t.calls) if "systemctl" in c]
    assert hand_over.startswith("sudo -n sh -c ") and t.calls.index(hand_over) < min(starts)
    no_key_in(t)


def test_down_with_systemd_disables_the_units_and_removes_them(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv, supervisor=SYSTEMD).node("slm-02")
    manifest = json.loads(manifest_text(node))
    assert manifest["units"] == ["vcfslm-slm-vllm-node0.service", "vcfslm-slm-vllm-node1.service",
                                 "vcfslm-slm-proxy.service"]
    show = "systemctl show -p Id,ActiveState,MainPID " + " ".join(manifest["units"])
    stopped = "".join(f"Id={u}\nActiveState={state}\nMainPID=0\n\n"
                      for u, state in zip(manifest["units"], ("inactive", "failed", "inactive"), strict=True))
    t = FakeTransport("slm-02", {cat_manifest(node): manifest_text(node), show: stopped,
                                 re.compile(r".*systemctl .*"): "", re.compile(r".*rm -f .*"): "",
                                 re.compile(r".*rm -rf .*"): ""}, user="deploy")
    assert sorted(driver(inv, node, t).down()) == ["proxy", "vllm-node0", "vllm-node1"]
    disable = [c for c in t.calls if "disable --now" in c]
    assert [unwrap(c) for c in disable] == ["systemctl disable --now " + " ".join(manifest["units"])]
    assert disable[0].startswith("sudo -n sh -c ")
    # Stopped as systemd says, before anything is removed.
    assert t.calls.index(disable[0]) < t.calls.index(show) < min(i for i, c in enumerate(t.calls) if "rm -f" in c)
    for path in manifest["files"]:
        [rm] = [c for c in t.calls if c.endswith(f"rm -f {path}") or unwrap(c) == f"rm -f {path}"]
        assert rm.startswith("sudo") == path.startswith(UNIT_DIR)
    [reload] = [unwrap(c) for c in t.calls if "daemon-reload" in c]
    assert reload.startswith("systemctl daemon-reload; systemctl reset-failed " + " ".join(manifest["units"]))
    assert not [c for c in t.calls if "supervisorctl" in c]


def test_down_with_systemd_names_a_unit_that_does_not_stop(tmp_path, monkeypatch):
    monkeypatch.setattr("vcfslm.deploy.driver.STOP_WAIT_S", 0.0)
    inv = inventory(tmp_path)
    node = deployment(inv, supervisor=SYSTEMD).node("slm-02")
    units = json.loads(manifest_text(node))["units"]
    show = "systemctl show -p Id,ActiveState,MainPID " + " ".join(units)
    t = FakeTransport("slm-02", {cat_manifest(node): manifest_text(node),
                                 show: f"Id={units[0]}\nActiveState=inactive\nMainPID=0\n\n"
                                       f"Id={units[1]}\nActiveState=deactivating\nMainPID=77\n\n"
                                       f"Id={units[2]}\nActiveState=inactive\nMainPID=0\n",
                                 re.compile(r".*systemctl .*"): "", re.compile(r".*rm -f .*"): ""})
    with pytest.raises(ServeError, match=f"slm-02: still running 0 s after systemctl stop: {units[1]}$"):
        driver(inv, node, t).down()
    # Nothing is removed while a unit runs: the next down finds it all again.
    assert not [c for c in t.calls if "rm -f" in c]


# ------------------------------------------------------------------ the key


def test_read_key_gets_the_file_and_prints_it_nowhere(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    env = f"{node.serve_dir}/serve.env"
    t = FakeTransport("slm-01", {f"test -f {env}": ""}, files={env: f"VLLM_API_KEY={KEY}\n".encode()})
    assert driver(inv, node, t).read_key() == KEY
    assert [c for c in t.calls if "serve.env" in c] == [f"test -f {env}"]
    no_key_in(t)


@pytest.mark.parametrize(("exists", "content"), [(False, None), (True, b"OTHER=1\n"), (True, b"VLLM_API_KEY=\n")])
def test_read_key_without_a_key(tmp_path, exists, content):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    env = f"{node.serve_dir}/serve.env"
    t = FakeTransport("slm-01", {f"test -f {env}": "" if exists else (1, "")},
                      files={env: content} if content is not None else {})
    assert driver(inv, node, t).read_key() is None
    assert t.calls == [f"test -f {env}"]


def test_a_program_that_gave_up_is_quoted_by_its_first_error_not_its_last_lines(tmp_path):
    inv = inventory(tmp_path)
    node = deployment(inv).node("slm-01")
    log = "\n".join(["INFO starting", "Traceback (most recent call last):", '  File "sampler.py", line 9, in apply',
                     "IndexError: index 32011 is out of bounds for dimension 1 with size 32000",
                     *[f"nanobind: leaked {i} instances!" for i in range(200)]])
    t = FakeTransport("slm-01", {re.compile(r"tail -n \d+ .*vllm-node0\.log"): log})
    quoted = driver(inv, node, t).log_cause(node.program("vllm-node0").log)
    assert "IndexError: index 32011 is out of bounds" in quoted
    assert quoted.index("IndexError") < quoted.index("nanobind")
