"""The two nginx configs serve up writes (templates/frontdoor-nginx.conf.j2 and
node-proxy-nginx.conf.j2), as rendered for a deployment: what they let in and pass, and
nginx's own check of them (`nginx -t`, with their certificates written where they name)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
from test_deploy_support import BENCH_IPS, KEY, deployment, inventory

from vcfslm.deploy.desired import NGINX, SUPERVISORD, SYSTEMD

OTHER = "n3w-key-0123456789abcdefABCDEF"


def conf_of(node, program: str) -> str:
    folder = {"frontdoor": "frontdoor", "proxy": "proxy"}[program]
    return next(f.content for f in node.files if f.path == f"{node.serve_dir}/{folder}/nginx.conf")


def test_the_door_takes_every_key_of_its_list(tmp_path):
    dep = deployment(inventory(tmp_path), api_keys=[KEY, OTHER])
    door = conf_of(dep.node("slm-01"), "frontdoor")
    assert re.findall(r'"Bearer ([^"]+)" 1;', door) == [KEY, OTHER]
    for node in dep.nodes:
        assert re.findall(r'"Bearer ([^"]+)" 1;', conf_of(node, "proxy")) == [KEY, OTHER]
    # The servers hold the deployment's key, and take the others beside it (vLLM's entry hands
    # them to vLLM in-process).
    env = next(f.content for f in dep.node("slm-02").files if f.path.endswith("/serve.env"))
    assert env == f"VLLM_API_KEY={KEY}\nVCFSLM_PREVIOUS_API_KEYS={OTHER}\n"


def test_the_door_limits_each_client_and_passes_its_address_on(tmp_path):
    dep = deployment(inventory(tmp_path, {"front_door": {"requests_per_s": 50, "burst": 80,
                                                         "connections_per_client": 300}}))
    door = conf_of(dep.node("slm-01"), "frontdoor")
    assert "limit_req_zone $binary_remote_addr zone=vcfslm_requests:10m rate=50r/s;" in door
    assert "limit_req zone=vcfslm_requests burst=80 nodelay;" in door
    assert "limit_conn vcfslm_connections 300;" in door
    assert "proxy_set_header X-Real-IP $remote_addr;" in door
    assert "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;" in door
    assert "limit_req_status 429;" in door


def test_the_default_limits_are_beyond_a_64_node_service():
    from vcfslm.inventory import FrontDoor

    door = FrontDoor()
    # 64 nodes x 4 servers x 16 sequences streaming at once from one load generator.
    assert door.connections_per_client >= 64 * 4 * 16 * 2
    assert door.requests_per_s >= 64 * 4 * 16


@pytest.mark.parametrize(("supervisor", "service_user", "where"), [
    (SUPERVISORD, "root", "access_log /dev/stdout door;"),                # supervisord's log, rotated at 50 MB
    # supervisord as root, nginx as the service user, which cannot reopen root's stdout pipe
    (SUPERVISORD, "vcfslm", "access_log {folder}/frontdoor/access.log door;"),
    (SYSTEMD, "vcfslm", "access_log syslog:server=unix:/dev/log,tag=vcfslm_frontdoor,nohostname door;")])
def test_the_access_log_goes_where_the_supervisor_rotates_it_and_holds_no_header(tmp_path, supervisor, service_user,
                                                                               where):
    node = deployment(inventory(tmp_path, service_user=service_user), supervisor=supervisor).node("slm-01")
    door = conf_of(node, "frontdoor")
    assert where.format(folder=node.serve_dir) in door
    [fmt] = re.findall(r"log_format door '([^']*)'", door)
    assert "$http_" not in fmt and "$request " not in fmt.replace('"$request"', "")
    assert "$remote_addr" in fmt


def test_plain_http_only_when_the_inventory_says_so(tmp_path):
    from test_deploy_support import CERTIFICATES

    from vcfslm.deploy.desired import DeploymentTls

    plain = DeploymentTls(CERTIFICATES.ca_cert, CERTIFICATES.nodes, None)
    dep = deployment(inventory(tmp_path, {"front_door": {"tls": False}}), certificates=plain)
    assert dep.endpoint == f"http://{BENCH_IPS['slm-01']}:8000"
    door = conf_of(dep.node("slm-01"), "frontdoor")
    assert f"listen {BENCH_IPS['slm-01']}:8000;" in door and "ssl_certificate" not in door
    assert "listen " in conf_of(dep.node("slm-02"), "proxy") and " ssl;" in conf_of(dep.node("slm-02"), "proxy")


def test_each_proxy_lets_in_the_router_node_and_its_own_node_only(tmp_path):
    dep = deployment(inventory(tmp_path, {"router": {"node": "slm-02"}}))
    for node in dep.nodes:
        proxy = conf_of(node, "proxy")
        allowed = re.findall(r"^\s*allow (\S+);", proxy, re.M)
        assert allowed == sorted({BENCH_IPS["slm-02"], BENCH_IPS[node.node], "127.0.0.1"}) * 2    # per server
        assert proxy.count("deny all;") == 2
        for s in [s for s in dep.servers if s.node == node.node]:
            assert f"listen {s.url.removeprefix('https://')} ssl;" in proxy
            assert f"server unix:{s.socket};" in proxy
        # /health without the key (the router's checks); the API and status's reads with it; else 404.
        assert "location = /health" in proxy and "location ~ ^/(v1/|version$|metrics$)" in proxy
        assert re.findall(r"return (\d+)", proxy) == ["403", "401", "404"] * 2
        geo = proxy.split("geo $vcfslm_client_ok {")[1].split("}")[0]
        assert re.findall(r"^\s*(\S+) 1;", geo, re.M) == sorted({BENCH_IPS["slm-02"], BENCH_IPS[node.node],
                                                                  "127.0.0.1"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_certificates(dep) -> None:
    """The certificate files the configs name, where they name them (nginx -t loads them)."""
    for node in dep.nodes:
        for f in node.files:
            if "/tls/" in f.path:
                Path(f.path).parent.mkdir(parents=True, exist_ok=True)
                Path(f.path).write_text(f.content)


@pytest.mark.skipif(not os.access(NGINX, os.X_OK) and not os.environ.get("CI"),
                    reason="nginx is not installed here (make apt installs nginx-light); CI runs this")
@pytest.mark.parametrize("supervisor", [SUPERVISORD, SYSTEMD])
def test_nginx_accepts_both_configs(tmp_path, supervisor):
    dep = deployment(inventory(tmp_path), supervisor=supervisor, api_keys=[KEY, OTHER])
    write_certificates(dep)
    for node in dep.nodes:
        programs = ["proxy", "frontdoor"] if node.node == dep.router_node else ["proxy"]
        for program in programs:
            prefix = Path(node.serve_dir) / program
            (prefix / "tmp").mkdir(parents=True, exist_ok=True)
            conf = prefix / "nginx.conf"
            # nginx -t binds its addresses: loopback ports free now in place of the bench addresses.
            conf.write_text(re.sub(r"listen [\d.]+:\d+", lambda _: f"listen 127.0.0.1:{free_port()}",
                                   conf_of(node, program)))
            done = subprocess.run([NGINX, "-t", "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{node.node}/{program}: {done.stderr}"
            assert "syntax is ok" in done.stderr
