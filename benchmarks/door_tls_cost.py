"""What TLS at the door costs: TTFT p50 through the door with TLS and with plain HTTP, in
rounds one after the other, on one node's share of a planned deployment on this machine.

The programs are the deployment's own, as `serve up` plans them (deploy/desired.py): the
node's nginx proxy, vllm-router (https to the proxy, the deployment's CA), the nginx
door; the servers are tests/fake_openai.py on the planned Unix sockets, answering their
first token at once, so what is left of TTFT is the path: client -> door -> router ->
proxy -> server and back. vcfslm's client opens one connection per request, so each TLS
request pays a full handshake (a client with keep-alive pays it once). Before measuring
it checks the fences (keyless/wrong key/untrusting client at the door, a stranger's
address at the proxy).

    .venv/bin/python benchmarks/door_tls_cost.py [--requests 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from test_deploy_support import inventory_doc  # noqa: E402

from vcfslm.deploy import keys  # noqa: E402
from vcfslm.deploy.desired import SUPERVISORD, plan_deployment, socket_folder  # noqa: E402
from vcfslm.deploy.material import ca_file, deployment_tls  # noqa: E402
from vcfslm.inventory import parse_inventory  # noqa: E402
from vcfslm.serve.openai_client import Endpoint, stream_completion  # noqa: E402

BENCH_IP = "127.0.1.61"         # the node's "bench address", on this machine's loopback
STRANGER = "127.0.9.77"         # an address that is neither the router's node nor the server's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"CPU: {model}; {os.cpu_count()} logical CPUs (shared with whatever else runs here)"


class Rig:
    def __init__(self, folder: Path):
        self.folder = folder
        self.ports = {"server": free_port(), "router": free_port(), "prometheus": free_port(), "door": free_port()}
        self.key_file = folder / "keys" / "slm.key"
        self.key = keys.new_key()
        keys.write_key_file(self.key_file, self.key)
        self.ca = str(ca_file(self.key_file))
        self.procs: list[subprocess.Popen] = []

    def inventory(self, tls: bool):
        doc = inventory_doc(self.folder)
        doc["nodes"] = doc["nodes"][:1]
        doc["nodes"][0]["bench_ip"] = BENCH_IP
        doc["bench"]["serve"]["vllm"]["venv"] = str(ROOT / ".venv-vllm")
        doc["serve"] = {"port": self.ports["server"], "front_door": {"port": self.ports["door"], "tls": tls},
                        "router": {"port": self.ports["router"], "prometheus_port": self.ports["prometheus"],
                                   "policy": "round_robin", "health_check_interval_s": 1}}
        path = self.folder / f"inventory-{'tls' if tls else 'plain'}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return parse_inventory(path.read_text(), str(path))

    def up(self, tls: bool):
        inv = self.inventory(tls)
        certificates, _ = deployment_tls(inv, self.key_file, [BENCH_IP], BENCH_IP)
        dep = plan_deployment(inv, self.key, {"slm-01": SUPERVISORD}, [inv.node("slm-01")], tls=certificates)
        node = dep.nodes[0]
        for sub in ("logs", "frontdoor/tmp", "proxy/tmp", "tls"):
            Path(node.serve_dir, sub).mkdir(parents=True, exist_ok=True)
        Path(socket_folder(node.serve_dir)).mkdir(parents=True, exist_ok=True, mode=0o700)
        for f in node.files:
            Path(f.path).parent.mkdir(parents=True, exist_ok=True)
            Path(f.path).write_text(f.content)
            os.chmod(f.path, f.mode)
        for s in dep.servers:
            Path(s.socket).unlink(missing_ok=True)          # as the launch script does
            self.start("fake", [sys.executable, "-m", "tests.fake_openai", "serve", "m", "--uds", s.socket],
                       {"VLLM_API_KEY": self.key, "PYTHONPATH": str(ROOT), "FAKE_FIRST_S": "0", "FAKE_TOKEN_S": "0"})
        for name in ("proxy", "router", "frontdoor"):
            program = node.program(name)
            self.start(name, program.argv, dict(program.environment))
        deadline = time.monotonic() + 60
        while status(dep.endpoint + "/v1/models", self.ca, self.key) != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"the door did not serve within 60 s; see {self.folder}/*.log")
            time.sleep(0.5)
        return dep

    def start(self, log: str, argv, env) -> None:
        out = open(self.folder / f"{log}.log", "ab")   # noqa: SIM115 - the child keeps it
        self.procs.append(subprocess.Popen(list(argv), env={**os.environ, **env}, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))

    def down(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(30)
        self.procs.clear()


def status(url: str, ca: str | None, key: str | None = None, method: str = "GET",
           source: str | None = None) -> int | str:
    parts = urlsplit(url)
    kw = {"context": ssl.create_default_context(cafile=ca)} if parts.scheme == "https" else {}
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=10, source_address=(source, 0) if source else None, **kw)
    try:
        conn.request(method, parts.path, body=b"{}" if method == "POST" else None,
                     headers={"Content-Type": "application/json",
                              **({"Authorization": f"Bearer {key}"} if key else {})})
        return conn.getresponse().status
    except OSError as exc:
        return type(exc).__name__
    finally:
        conn.close()


def fences(rig: Rig, dep) -> dict[str, object]:
    door, server, ca, key = dep.endpoint, dep.servers[0].url, rig.ca, rig.key
    return {"door, no key": status(door + "/v1/models", ca), "door, wrong key": status(door + "/v1/models", ca, "x" * 30),
            "door, the key": status(door + "/v1/models", ca, key),
            "door, a client without the CA": status(door + "/v1/models", None, key),
            "door, /list_workers": status(door + "/list_workers", ca, key),
            "proxy, stranger, /health": status(server + "/health", ca, source=STRANGER),
            "proxy, stranger, POST /invocations with the key": status(server + "/invocations", ca, key, "POST",
                                                                      STRANGER),
            "proxy, router node, no key, /v1/models": status(server + "/v1/models", ca),
            "proxy, router node, POST /invocations with the key": status(server + "/invocations", ca, key, "POST"),
            "router's workers": urllib.request.urlopen(f"http://127.0.0.1:{rig.ports['router']}/list_workers",
                                                       timeout=5).read().decode()}


def ttft_p50(rig: Rig, dep, requests: int) -> float:
    parts = urlsplit(dep.endpoint)
    ep = Endpoint(parts.hostname, parts.port, rig.key, "m", parts.scheme == "https", rig.ca)
    out = []
    for _ in range(requests):
        s = stream_completion(ep, "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2,
                                                      "stream": True}, deadline_s=time.perf_counter() + 30)
        if not s.ok:
            raise SystemExit(f"a request failed: {s.error}")
        out.append(s.token_s[0] - s.sent_s)
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="requests per round, one after the other")
    p.add_argument("--rounds", type=int, default=2, help="rounds of TLS then plain HTTP")
    args = p.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory(prefix="door-tls-") as tmp:
        rig = Rig(Path(tmp))
        results: dict[str, list[float]] = {"TLS": [], "plain HTTP": []}
        try:
            for round_ in range(args.rounds):
                for tls in (True, False):
                    dep = rig.up(tls)
                    if round_ == 0 and tls:
                        for name, value in fences(rig, dep).items():
                            print(f"  {name:52s} {value}")
                    results["TLS" if tls else "plain HTTP"].append(ttft_p50(rig, dep, args.requests))
                    rig.down()
        finally:
            rig.down()
    print(f"TTFT p50 through the door, {args.requests} requests a round, a new connection each "
          f"(fake servers: first token at once):")
    for name, values in results.items():
        print(f"  {name:11s} " + "  ".join(f"{v * 1000:.2f} ms" for v in values))
    tls, plain = statistics.median(results["TLS"]), statistics.median(results["plain HTTP"])
    print(f"  TLS adds {1000 * (tls - plain):.2f} ms a request (median of the rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
