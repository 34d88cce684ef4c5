"""`vcfslm serve up | status | down` on two lab guests (real sshd), with the real router
(vllm-router), the real front door (nginx) and the real supervisor (supervisord), in
front of fake OpenAI servers started from the rendered launch scripts as if they were
vLLM (tests/fake_openai.py): two servers per node, the key refused and required, a
second up that changes nothing, a killed server brought back, a changed setting that
restarts only what it touches, a smaller deployment, and a down that leaves nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.serve_lab import VLLM_VENV, free_port, lab_cli, serve_inventory
from vcfslm.guest import vllm as guest_vllm
from vcfslm.inventory import load_inventory

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


def stream(endpoint: str, key: str | None, max_tokens: int = 4) -> tuple[int, list[str]]:
    body = json.dumps({"model": "model", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(endpoint + "/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, [line.decode().strip() for line in r if line.strip()]
    except urllib.error.HTTPError as e:
        return e.code, []


def get_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
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

        doc = status(lab, inventory)
        assert doc["healthy"] is True and doc["endpoint"]["health"] == 200
        assert sorted(doc["nodes"]) == ["slm-01", "slm-02"]
        assert all(s["state"] == "RUNNING" and s["version"] == "fake-1.0" for n in doc["nodes"].values()
                   for s in n["servers"])
        assert sorted(doc["nodes"]["slm-01"]["router"]["workers"]) == sorted(first["servers"])

        # Through the front door: streamed with the key, refused without it or with a wrong one;
        # the router's management calls are not on the door, and the router is not on the network.
        code, lines = stream(endpoint, key)
        assert code == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 4
        assert stream(endpoint, None)[0] == 401
        assert stream(endpoint, "wrong")[0] == 401
        door = endpoint.rsplit("/v1", 1)[0]
        assert get_status(door + "/list_workers") == 404
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
        assert stream(endpoint, key)[0] == 200
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


@pytest.mark.skipif(not (VLLM_VENV / "bin" / "vllm-router").exists() and not os.environ.get("CI"),
                    reason="vLLM CPU and its router are not installed here (make vllm); CI installs them and runs this")
def test_a_real_vllm_server_behind_the_real_router(lab, tmp_path):
    """serve up with its install step, on one node: vLLM CPU on a tiny checkpoint behind the
    router and the front door; a streamed completion with the key, refused without it."""
    from tests.vllm_model import write_tiny_vllm_model

    doc = yaml.safe_load(lab.inventory.read_text())
    model = write_tiny_vllm_model(tmp_path / "tiny")
    doc["guest"]["model"] = str(model)
    doc["guest"]["workdir"] = str(tmp_path / "work")
    doc["bench"]["serve"]["vllm"]["venv"] = str(VLLM_VENV)
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
        first = json.loads(done.stdout)
        assert first["checks"]["keyless"] == 401 and first["checks"]["keyed"] == 200
        key = key_file.read_text().strip()
        body = json.dumps({"model": str(model.name), "prompt": "hello world", "max_tokens": 8, "min_tokens": 8,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(first["endpoint"] + "/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [line.decode().strip() for line in r if line.strip()]
        assert events[-1] == "data: [DONE]" and len(events) >= 9, events
        assert stream(first["endpoint"], None)[0] == 401

        doc_status = status(lab, inventory)
        assert doc_status["healthy"] is True
        [server] = doc_status["nodes"]["slm-01"]["servers"]
        assert server["version"].startswith("0.32") and server["peak_rss_bytes"] > 100e6
        assert server["kv_cache_usage"] is not None and server["requests_finished"] >= 1

        again = cli(lab, "serve", "up", str(inventory), "--key-file", str(key_file), "--output", "json",
                    "--log-dir", str(tmp_path / "logs"), timeout=900)
        assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False, again.stderr[-2000:]
    finally:
        done = cli(lab, "serve", "down", str(inventory))
    assert done.returncode == 0, done.stderr[-2000:]
    assert processes_under(tmp_path / "work") == []


class SteadyClients:
    """A steady stream of streamed completions through the door, each with the key the key
    file holds at that moment (as a client that follows a rotation does): every answer that
    is not a whole stream counts as failed."""

    def __init__(self, endpoint: str, key_file: Path, clients: int = 3):
        self.endpoint, self.key_file = endpoint, key_file
        self.results: list[tuple[float, int, bool]] = []      # (time, status, whole stream)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _loop(self) -> None:
        while not self.stop.is_set():
            key = self.key_file.read_text().strip()
            try:
                code, lines = stream(self.endpoint, key, max_tokens=16)
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
        with SteadyClients(first["endpoint"], key_file) as clients:
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
        assert stream(first["endpoint"], old_key)[0] == 401 and stream(first["endpoint"], new_key)[0] == 200
        assert sorted(rotated["checks"]["router_workers"]) == servers
    finally:
        done = cli(lab, "serve", "down", str(inventory), "--output", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert processes_under(work) == []
    for path in [*work.rglob("*"), *(tmp_path / "logs").rglob("*")]:
        if path.is_file():
            text = path.read_text(errors="replace")
            assert old_key not in text and new_key not in text, path
