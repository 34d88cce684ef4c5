"""`vcfslm serve up | status | down` on two lab guests (real sshd), with the real router
(vllm-router), the real front door (nginx) and the real supervisor (supervisord), in
front of fake OpenAI servers started from the rendered launch scripts as if they were
vLLM (tests/fake_openai.py): two servers per node, the key refused and required, a
second up that changes nothing, a killed server brought back, a changed setting that
restarts only what it touches, a smaller deployment, and a down that leaves nothing.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.serve_lab import VLLM_VENV, free_port, lab_cli, serve_inventory
from vcfslm.guest import vllm as guest_vllm
from vcfslm.inventory_load import load_inventory

pytestmark = pytest.mark.integration


needs_router = pytest.mark.skipif(
    not (VLLM_VENV / "bin" / "vllm-router").exists() and not os.environ.get("CI"),
    reason="vllm-router is not installed here (make vllm installs it); CI installs it and runs this")


def cli(lab, *args, timeout=180) -> subprocess.CompletedProcess:
    return lab_cli(lab, *args, timeout=timeout)


def up(lab, inventory: Path, key_file: Path, *extra: str) -> dict:
    done = cli(lab, "serve", "up", str(inventory), "--key-file", str(key_file), "--no-install",
               "--output", "json", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def status(lab, inventory: Path) -> dict:
    done = cli(lab, "serve", "status", str(inventory), "--output", "json")
    assert done.returncode in (0, 1, 3), done.stderr[-2000:]
    return json.loads(done.stdout)


def pids(doc: dict) -> dict[str, int]:
    out = {}
    for node, info in doc["nodes"].items():
        for s in info["servers"]:
            out[f"{node}/{s['program']}"] = s["pid"]
    return out


def trusting(ca_file: str | None) -> ssl.SSLContext:
    """A client that trusts the deployment's CA only (the system's store with None)."""
    return ssl.create_default_context(cafile=ca_file)


def stream(endpoint: str, key: str | None, ca_file: str | None = None, model: str = "model",
           max_tokens: int = 4) -> tuple[int, list[str]]:
    body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(endpoint + "/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30, context=trusting(ca_file)) as r:
            return r.status, [line.decode().strip() for line in r if line.strip()]
    except urllib.error.HTTPError as e:
        return e.code, []


def get_status(url: str, ca_file: str | None = None) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5, context=trusting(ca_file)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def processes_under(folder: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(folder) in line and "ps -eo" not in line]


@needs_router
def test_serve_up_status_kill_change_and_down_on_two_lab_nodes(lab, tmp_path):
    inventory = serve_inventory(lab, tmp_path)
    key_file = tmp_path / "keys" / "slm.key"
    work = tmp_path / "work"
    try:
        first = up(lab, inventory, key_file)
        per_node = len(guest_vllm.node_cpus(load_inventory(inventory)))
        assert first["changed"] is True and len(first["servers"]) == 2 * per_node
        assert first["checks"]["keyless"] == 401 and first["checks"]["keyed"] == 200
        assert first["checks"]["management"] == 404
        assert sorted(first["checks"]["router_workers"]) == sorted(first["servers"])
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        key = key_file.read_text().strip()
        endpoint = first["endpoint"]
        ca = first["ca_file"]
        assert endpoint.startswith("https://") and first["tls"] is True
        assert ca == str(key_file.parent / "slm-tls" / "ca.pem") and Path(ca).is_file()
        assert key not in json.dumps(first)

        doc = status(lab, inventory)
        assert doc["healthy"] is True and doc["endpoint"]["health"] == 200
        assert sorted(doc["nodes"]) == ["slm-01", "slm-02"]
        assert all(s["state"] == "RUNNING" and s["version"] == "fake-1.0" for n in doc["nodes"].values()
                   for s in n["servers"])
        assert sorted(doc["nodes"]["slm-01"]["router"]["workers"]) == sorted(first["servers"])

        # Through the front door: streamed with the key, refused without it or with a wrong one;
        # the router's management calls are not on the door, and the router is not on the network.
        code, lines = stream(endpoint, key, ca)
        assert code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 4
        assert stream(endpoint, None, ca)[0] == 401
        assert stream(endpoint, "wrong", ca)[0] == 401
        door = endpoint.rsplit("/v1", 1)[0]
        assert get_status(door + "/list_workers", ca) == 404
        assert doc["endpoint"]["transport"] == "TLS"
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://{door.split('//')[1].split(':')[0]}:"
                                   f"{yaml.safe_load(inventory.read_text())['serve']['router']['port']}/list_workers",
                                   timeout=3)

        # A second up changes nothing and says so.
        again = up(lab, inventory, key_file)
        assert again["changed"] is False
        assert all(not any(c.values()) for c in again["changes"].values())

        # A server killed as a crash would be comes back under its supervisor, on a new pid.
        from vcfslm.cli.guest_stage import ssh_connector
        from vcfslm.deploy.service import kill_program

        inv = load_inventory(inventory)
        before = pids(status(lab, inventory))
        connect = ssh_connector(inv, None)
        killed = kill_program(inv, lambda n: connect(n, log_dir=tmp_path / "logs", wait_s=10), "slm-02", "vllm-node0")
        assert killed == before["slm-02/vllm-node0"]
        deadline = time.monotonic() + 60
        while True:
            now = status(lab, inventory)
            new = pids(now)
            if now["healthy"] and new["slm-02/vllm-node0"] not in (None, killed):
                break
            assert time.monotonic() < deadline, now
            time.sleep(1)
        assert {k: v for k, v in new.items() if k != "slm-02/vllm-node0"} == \
               {k: v for k, v in before.items() if k != "slm-02/vllm-node0"}

        # A changed router setting restarts the router alone: every server keeps its pid.
        # (auto ran power_of_two over the two nodes' servers.)
        assert first["policy"] == "power_of_two"
        doc = yaml.safe_load(inventory.read_text())
        doc["serve"]["router"]["policy"] = "round_robin"
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        changed = up(lab, inventory, key_file)
        assert changed["changes"]["slm-01"]["restart"] == ["router"]
        assert changed["changes"]["slm-02"]["restart"] == []
        assert pids(status(lab, inventory)) == new

        # One node: power_of_two cannot route one server, so that is refused before any change;
        # with round_robin slm-02 is taken down and the router keeps slm-01's servers only.
        if per_node == 1:
            doc["serve"]["router"]["policy"] = "power_of_two"
            inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
            refused = cli(lab, "serve", "up", str(inventory), "--key-file", str(key_file), "--no-install",
                          "--nodes", "1")
            assert refused.returncode == 2 and "serve.router.policy" in refused.stderr, refused.stderr
            assert pids(status(lab, inventory)) == new
        doc["serve"]["router"]["policy"] = "auto"
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
        smaller = up(lab, inventory, key_file, "--nodes", "1")
        assert sorted(smaller["dropped"]) == ["slm-02"] and len(smaller["servers"]) == per_node
        assert smaller["changes"]["slm-01"]["restart"] == ["router"]
        assert sorted(smaller["checks"]["router_workers"]) == sorted(smaller["servers"])
        assert stream(endpoint, key, ca)[0] == 200
    finally:
        done = cli(lab, "serve", "down", str(inventory), "--output", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert processes_under(work) == []
    assert not list(work.glob("serve/*/manifest.json")) and not list(work.glob("serve/*/serve.env"))
    assert not list(work.glob("serve/*/frontdoor/key.conf"))
    assert status(lab, inventory)["deployed"] is False
    # The key never reached a log, a command line or a config other than its 0600 files.
    key = key_file.read_text().strip()
    for path in [*work.rglob("*"), *(tmp_path / "logs").rglob("*")]:
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path


needs_vllm = pytest.mark.skipif(
    not (VLLM_VENV / "bin" / "vllm-router").exists() and not os.environ.get("CI"),
    reason="vLLM CPU and its router are not installed here (make vllm); CI installs them and runs this")


@dataclass
class RealDeployment:
    """One serve up of vLLM CPU on a tiny checkpoint on slm-01, shared by the module's tests."""

    lab: object
    inventory: Path
    key_file: Path
    model: Path
    work: Path
    logs: Path
    first: dict          # serve up's -o json

    @property
    def key(self) -> str:
        return self.key_file.read_text().strip()

    @property
    def ca(self) -> str:
        return self.first["ca_file"]


@pytest.fixture(scope="module")
def real_vllm(lab, tmp_path_factory):
    """serve up with its install step, on one node: vLLM CPU on a tiny checkpoint behind the
    router and the front door (started once for the module: minutes on two cores); down after."""
    from tests.vllm_model import write_tiny_vllm_model

    tmp_path = tmp_path_factory.mktemp("real-vllm")
    doc = yaml.safe_load(lab.inventory.read_text())
    model = write_tiny_vllm_model(tmp_path / "tiny")
    doc["guest"]["model"] = str(model)
    doc["guest"]["workdir"] = str(tmp_path / "work")
    doc["bench"]["serve"]["vllm"]["venv"] = str(VLLM_VENV)
    # Eager: vLLM's compile of the model is half its start, and both starts here (the first,
    # and the supervisor's after a kill) check the deployment, not vLLM's compiled steps.
    doc["bench"]["serve"]["vllm"]["enforce_eager"] = True
    doc["bench"]["serve"]["slots"] = 4
    doc["serve"] = {"nodes": ["slm-01"], "port": free_port(), "max_model_len": 256,
                    "router": {"port": free_port(), "prometheus_port": free_port()},
                    "front_door": {"port": free_port()}, "health_timeout_s": 600}
    inventory = tmp_path / "serve.yaml"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    key_file = tmp_path / "slm.key"
    try:
        done = cli(lab, "serve", "up", str(inventory), "--key-file", str(key_file), "--output", "json",
                   "--log-dir", str(tmp_path / "logs"), timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        yield RealDeployment(lab, inventory, key_file, model, tmp_path / "work", tmp_path / "logs",
                             json.loads(done.stdout))
    finally:
        done = cli(lab, "serve", "down", str(inventory))
    assert done.returncode == 0, done.stderr[-2000:]
    assert processes_under(tmp_path / "work") == []


@needs_vllm
def test_a_real_vllm_server_behind_the_real_router(real_vllm):
    """A streamed completion with the key through the door, refused without it; status reads
    the server; a second up changes nothing."""
    lab, inventory, first, model = real_vllm.lab, real_vllm.inventory, real_vllm.first, real_vllm.model
    assert first["checks"]["keyless"] == 401 and first["checks"]["keyed"] == 200
    key, ca = real_vllm.key, real_vllm.ca
    body = json.dumps({"model": str(model.name), "prompt": "hello world", "max_tokens": 8, "min_tokens": 8,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(first["endpoint"] + "/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=120, context=trusting(ca)) as r:
        events = [line.decode().strip() for line in r if line.strip()]
    assert events[-1] == "data: [DONE]" and len(events) >= 9, events
    assert stream(first["endpoint"], None, ca)[0] == 401

    doc_status = status(lab, inventory)
    assert doc_status["healthy"] is True
    [server] = doc_status["nodes"]["slm-01"]["servers"]
    assert server["version"].startswith("0.32") and server["peak_rss_bytes"] > 100e6
    assert server["kv_cache_usage"] is not None and server["requests_finished"] >= 1
    log = real_vllm.work / "serve" / "slm-01" / "logs" / "vllm-node0.log"
    assert "enforce_eager=True" in log.read_text(errors="replace")     # the inventory's setting reached vLLM

    again = cli(lab, "serve", "up", str(inventory), "--key-file", str(real_vllm.key_file), "--output", "json",
                "--log-dir", str(real_vllm.logs), timeout=900)
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False, again.stderr[-2000:]


def openapi_of(socket_path: str) -> dict:
    """The server's own OpenAPI document, asked on its Unix socket (no key: vLLM serves it to anyone)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(socket_path)
        s.sendall(b"GET /openapi.json HTTP/1.0\r\nHost: localhost\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split()[1] == b"200", head[:200]
    return json.loads(body)


def ask(url: str, method: str, source: str, ca: str, key: str | None = None) -> int | str:
    """One request from `source` (a local address the connection is bound to): the status, or
    how the connection failed."""
    parts = urlsplit(url)
    conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=10, context=trusting(ca),
                                       source_address=(source, 0))
    try:
        conn.request(method, parts.path, body=b"{}" if method == "POST" else None,
                     headers={"Content-Type": "application/json",
                              **({"Authorization": f"Bearer {key}"} if key else {})})
        return conn.getresponse().status
    except OSError as exc:
        return type(exc).__name__
    finally:
        conn.close()


@needs_vllm
def test_no_server_serves_any_route_of_its_openapi_to_an_address_but_the_router_node(real_vllm):
    """Every path of each server's own /openapi.json, by each of its methods: from an address
    that is neither the router's node nor the server's, a refusal (403) on every one; from the
    router's node without the key, nothing but /health (200) is served (401 or 404)."""
    from vcfslm.deploy.desired import serve_dir, socket_folder
    from vcfslm.guest_layout import guest_paths

    inv = load_inventory(real_vllm.inventory)
    router_ip = str(inv.node("slm-01").bench_ip)
    stranger = "127.0.9.77"                       # on this machine's loopback, no node's address
    assert stranger not in {str(n.bench_ip) for n in inv.nodes}
    [server] = real_vllm.first["servers"]
    folder = serve_dir(guest_paths(inv), "slm-01")
    spec = openapi_of(f"{socket_folder(folder)}/vllm-node0.sock")
    routes = [(path, method.upper()) for path, item in spec["paths"].items() for method in item
              if method in ("get", "post", "put", "delete", "patch")]
    assert len(routes) > 10 and ("/invocations", "POST") in routes and ("/tokenize", "POST") in routes
    served_to_stranger, served_keyless = {}, {}
    for path, method in routes:
        url = server + path.replace("{", "").replace("}", "")
        code = ask(url, method, stranger, real_vllm.ca)
        if code != 403:
            served_to_stranger[f"{method} {path}"] = code
        code = ask(url, method, router_ip, real_vllm.ca)
        if code not in (401, 404) and path != "/health":
            served_keyless[f"{method} {path}"] = code
    assert served_to_stranger == {}
    assert served_keyless == {}
    assert ask(server + "/health", "GET", router_ip, real_vllm.ca) == 200
    assert ask(server + "/health", "GET", stranger, real_vllm.ca) == 403
    # With the key the router's node gets the API; the stranger does not, key or not.
    assert ask(server + "/v1/models", "GET", router_ip, real_vllm.ca, real_vllm.key) == 200
    assert ask(server + "/v1/models", "GET", stranger, real_vllm.ca, real_vllm.key) == 403
    # The server itself listens on no TCP port: only its Unix socket.
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    pid = status(real_vllm.lab, real_vllm.inventory)["nodes"]["slm-01"]["servers"][0]["pid"]
    tree, todo = [], [str(pid)]
    while todo:                                   # the API process, its engine and their children
        p = todo.pop()
        tree.append(p)
        todo += subprocess.run(["pgrep", "-P", p], capture_output=True, text=True).stdout.split()
    assert len(tree) >= 2
    # Nothing of it on the bench address or every address (vLLM's engine may keep a port on its
    # node's own loopback, which no other node reaches); its API on no TCP port at all.
    ours = [line.split() for line in listening.splitlines() if any(f"pid={p}," in line for p in tree)]
    assert [fields[3] for fields in ours if fields[3].rsplit(":", 1)[0] not in ("127.0.0.1", "[::1]")] == []
    assert not [fields for fields in ours if f"pid={pid}," in fields[-1]]


@needs_vllm
def test_the_door_refuses_keyless_wrong_key_and_untrusting_clients_over_tls(real_vllm):
    endpoint, key, ca = real_vllm.first["endpoint"], real_vllm.key, real_vllm.ca
    assert endpoint.startswith("https://")
    assert stream(endpoint, key, ca, real_vllm.model.name)[0] == 200
    assert stream(endpoint, None, ca)[0] == 401
    assert stream(endpoint, "not-the-key-0123456789abcdef", ca)[0] == 401
    # A client that does not trust the deployment's CA never gets to send its request.
    from vcfslm.deploy import tls

    other = tls.make_ca("someone-else")
    stranger_ca = real_vllm.key_file.parent / "other-ca.pem"
    stranger_ca.write_text(other.cert)
    for untrusting in (None, str(stranger_ca)):           # the system's store; another CA
        with pytest.raises(urllib.error.URLError) as info:
            stream(endpoint, key, untrusting)
        assert isinstance(info.value.reason, ssl.SSLCertVerificationError), info.value
    # Plain HTTP to the door's port is not served either.
    assert get_status(endpoint.replace("https://", "http://").rsplit("/v1", 1)[0] + "/health") == 400
    # The access log has the requests, never the key.
    folder = real_vllm.work / "serve" / "slm-01"
    log = (folder / "logs" / "frontdoor.log").read_text()
    assert '"POST /v1/completions HTTP/1.1" 401' in log and key not in log
    # What holds the key or a private key on the node is 0600; the key file and the CA's key here too.
    for path in (folder / "serve.env", folder / "frontdoor" / "nginx.conf", folder / "proxy" / "nginx.conf",
                 folder / "tls" / "node.key", folder / "tls" / "door.key", real_vllm.key_file,
                 Path(real_vllm.ca).with_name("ca.key")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def process_tree(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (start time, command line) of `root` and every process below it, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        out[pid] = (start, cmdline.strip())
        todo.extend(kids.get(pid, []))
    return out


def still_alive(tree: dict[int, tuple[str, str]]) -> list[str]:
    """The processes of a recorded tree that still run (same pid and start time). A zombie
    has ended: one whose parent was killed waits for PID 1 to reap it, which a guest's init
    does at once but a sandbox's init may never do."""
    alive = []
    for pid, (start, cmdline) in tree.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            alive.append(f"{pid} {cmdline}")
    return alive


def test_a_killed_vllm_api_process_leaves_no_engine_behind(request):
    """The real server's API process SIGKILLed (as a crash or the OOM killer would): its
    engine and workers end with it, its supervisor starts it again, and nothing of the old
    tree runs after the restart; a stop (as down stops it) leaves nothing of the new one."""
    try:
        real = request.getfixturevalue("real_vllm")
    except pytest.FixtureLookupError:
        pytest.skip("needs this module's real_vllm deployment")
    lab, inventory = real.lab, real.inventory
    [server] = status(lab, inventory)["nodes"]["slm-01"]["servers"]
    main = server["pid"]
    tree = process_tree(main)
    assert any(cmd.startswith("VLLM::EngineCore") for _, cmd in tree.values()), tree
    # The entry (the supervisor's pid) runs vLLM's API process as its one child.
    [api] = [pid for pid in tree if pid != main and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
             .split()[1] == str(main)]
    subprocess.run(["kill", "-KILL", str(api)], check=True)
    deadline = time.monotonic() + 900
    while True:
        now = status(lab, inventory)
        [server] = now["nodes"]["slm-01"]["servers"]
        if now["healthy"] and server["pid"] not in (None, main):
            break
        assert time.monotonic() < deadline, now
        time.sleep(2)
    assert still_alive(tree) == []

    # Stopped as serve down stops it (supervisord's stop): nothing of the new tree runs. It
    # stays stopped (this is the module's last test on the server; its fixture takes the
    # deployment down), so the model is not loaded a third time.
    tree = process_tree(server["pid"])
    assert any(cmd.startswith("VLLM::EngineCore") for _, cmd in tree.values()), tree
    ctl = [str(VLLM_VENV / "bin" / "supervisorctl"), "-c", str(real.work / "serve" / "slm-01" / "supervisord.conf")]
    stopped = subprocess.run([*ctl, "stop", "vllm-node0"], capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert still_alive(tree) == []


class SteadyClients:
    """A steady stream of streamed completions through the door, each with the key the key
    file holds at that moment (as a client that follows a rotation does): every answer that
    is not a whole stream counts as failed."""

    def __init__(self, endpoint: str, key_file: Path, ca_file: str, clients: int = 3):
        self.endpoint, self.key_file, self.ca_file = endpoint, key_file, ca_file
        self.results: list[tuple[float, int, bool]] = []      # (time, status, whole stream)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        while not self.stop.is_set():
            key = self.key_file.read_text().strip()
            try:
                code, lines = stream(self.endpoint, key, self.ca_file, max_tokens=16)
                whole = code == 200 and bool(lines) and lines[-1] == "data: [DONE]"
            except OSError:
                code, whole = 0, False
            self.results.append((time.monotonic(), code, whole))

    def __enter__(self) -> SteadyClients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def between(self, start: float, end: float) -> tuple[int, list[tuple[float, int, bool]]]:
        """(requests that finished in [start, end], the failed ones)."""
        inside = [r for r in self.results if start <= r[0] <= end]
        return len(inside), [r for r in inside if not r[2]]


@needs_router
def test_a_setting_change_and_a_key_rotation_roll_under_load_without_a_failure(lab, tmp_path):
    """Fake servers (each stream about a second) behind the real router and door on two lab
    nodes, three clients streaming all along: a server setting change, then a key rotation,
    each rolls the servers one at a time, and not one request fails."""
    inventory = serve_inventory(lab, tmp_path, token_s=0.06)
    key_file = tmp_path / "keys" / "slm.key"
    work = tmp_path / "work"
    try:
        first = up(lab, inventory, key_file)
        old_key = key_file.read_text().strip()
        servers = sorted(first["servers"])
        ca = first["ca_file"]
        with SteadyClients(first["endpoint"], key_file, ca) as clients:
            time.sleep(2)
            doc = yaml.safe_load(inventory.read_text())
            doc["serve"]["max_num_seqs"] = 3
            inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
            started = time.monotonic()
            changed = up(lab, inventory, key_file)
            setting = clients.between(started, time.monotonic())
            assert sorted(r["server"].split("/")[1] for r in changed["rolled"]) == \
                   sorted(c for node in changed["changes"].values() for c in node["restart"])
            assert len(changed["rolled"]) == len(servers) and all(r["drained"] for r in changed["rolled"])

            started = time.monotonic()
            rotated = up(lab, inventory, key_file, "--rotate-key")
            rotation = clients.between(started, time.monotonic())
            time.sleep(2)
        new_key = key_file.read_text().strip()
        print(f"setting change: {setting[0]} requests, {len(setting[1])} failed; key rotation: {rotation[0]} "
              f"requests, {len(rotation[1])} failed; rolls {[r['total_s'] for r in changed['rolled']]} s and "
              f"{[r['total_s'] for r in rotated['rolled']]} s")
        assert new_key != old_key
        # Both phases rolled every server: into both keys, then into the new one only.
        assert len(rotated["rolled"]) == 2 * len(servers)
        assert setting[0] >= 10 and setting[1] == [], setting
        assert rotation[0] >= 10 and rotation[1] == [], rotation
        assert [r for r in clients.results if not r[2]] == []
        assert stream(first["endpoint"], old_key, ca)[0] == 401 and stream(first["endpoint"], new_key, ca)[0] == 200
        assert sorted(rotated["checks"]["router_workers"]) == servers
    finally:
        done = cli(lab, "serve", "down", str(inventory), "--output", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert processes_under(work) == []
    for path in [*work.rglob("*"), *(tmp_path / "logs").rglob("*")]:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert old_key not in text and new_key not in text, path
