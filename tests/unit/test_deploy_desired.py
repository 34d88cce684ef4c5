"""The deployment serve up wants (deploy/desired.py, pure): one vLLM server per vNUMA node
on every serving node, the router and the front door on one node, the key in its two
0600 files only, digests that follow exactly the settings each program reads, and the
supervisors' files as systemd and supervisord read them."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from test_deploy_support import BENCH_IPS, KEY, deployment, inventory

from vcfslm.deploy.desired import (
    MANIFEST,
    NGINX,
    SUPERVISORD,
    SYSTEMD,
    UNIT_DIR,
    key_digest,
    socket_folder,
    supervisor_socket,
)
from vcfslm.guest import vllm
from vcfslm.serving.servers import ServerSpec, server_argv

SERVERS = ("vllm-node0", "vllm-node1")


def digests(dep) -> dict[tuple[str, str], str]:
    return {(n.node, p.name): p.digest for n in dep.nodes for p in n.programs}


def changed(before, after) -> set[tuple[str, str]]:
    a, b = digests(before), digests(after)
    assert a.keys() == b.keys()
    return {k for k in a if a[k] != b[k]}


# ------------------------------------------------------------------ servers, router, front door


@pytest.mark.parametrize(("serve", "slots", "name"), [
    ({}, "6", "tiny-llm"),                                          # bench.serve.slots, the folder's name
    ({"max_num_seqs": 3, "model_name": "slm-chat"}, "3", "slm-chat"),
], ids=["defaults", "serve-settings"])
def test_one_server_per_vnuma_node_on_every_chosen_node(tmp_path, serve, slots, name):
    inv = inventory(tmp_path, {"nodes": ["slm-01", "slm-03"], "port": 9100, **serve})
    dep = deployment(inv)
    assert [n.node for n in dep.nodes] == ["slm-01", "slm-03"]
    model = f"{tmp_path}/work/models/tiny-llm"
    assert dep.model == model and dep.model_name == name
    for node in dep.nodes:
        servers = [p for p in node.programs if p.name.startswith("vllm-node")]
        assert [p.name for p in servers] == list(SERVERS)
        for numa, program in enumerate(servers):
            ip = BENCH_IPS[node.node]
            assert program.argv[:2] == ("/bin/bash", vllm.script_path(inv, numa))
            assert program.argv[1] == f"{tmp_path}/work/launch/vllm-node{numa}.sh"
            spec = ServerSpec(name="vllm", listen="bench", host=ip, port=9100)
            socket = f"{socket_folder(node.serve_dir)}/vllm-node{numa}.sock"
            assert list(program.argv[2:]) == server_argv(spec, model_dir=model, served_name=name, slots=int(slots),
                                                         max_model_len=40, numa_node=numa, uds=socket)
            argv = list(program.argv)
            assert argv[2:4] == ["serve", model]
            assert argv[argv.index("--served-model-name") + 1] == name
            # No network port of its own: a Unix socket in the node's private folder.
            assert "--host" not in argv and "--port" not in argv
            assert argv[argv.index("--uds") + 1] == socket
            assert argv[argv.index("--max-num-seqs") + 1] == slots
            assert program.health_url == f"https://{ip}:{9100 + numa}/health"
            assert program.env_file == f"{node.serve_dir}/serve.env"
    assert [(s.node, s.numa_node, s.url) for s in dep.servers] == [
        ("slm-01", 0, "https://10.20.1.11:9100"), ("slm-01", 1, "https://10.20.1.11:9101"),
        ("slm-03", 0, "https://10.20.1.13:9100"), ("slm-03", 1, "https://10.20.1.13:9101")]


def test_every_node_serves_when_serve_nodes_is_unset(tmp_path):
    dep = deployment(inventory(tmp_path))
    assert [n.node for n in dep.nodes] == ["slm-01", "slm-02", "slm-03"]
    assert len(dep.servers) == 6


@pytest.mark.parametrize(("serve", "router"), [
    ({"nodes": ["slm-02", "slm-03"]}, "slm-02"),                                  # the first serving node
    ({"nodes": ["slm-01", "slm-02", "slm-03"], "router": {"node": "slm-03"}}, "slm-03"),
], ids=["first-serving-node", "serve.router.node"])
def test_router_and_front_door_only_on_the_router_node(tmp_path, serve, router):
    serve = {**serve, "front_door": {"port": 8443}}
    serve["router"] = {**serve.get("router", {}), "port": 8555, "prometheus_port": 8556, "policy": "random"}
    inv = inventory(tmp_path, serve)
    dep = deployment(inv)
    assert dep.router_node == router
    assert dep.endpoint == f"https://{BENCH_IPS[router]}:8443"
    for node in dep.nodes:
        names = [p.name for p in node.programs]
        assert names == ([*SERVERS, "proxy", "router", "frontdoor"] if node.node == router else [*SERVERS, "proxy"])
        door_files = [f.path for f in node.files if "/frontdoor/" in f.path]
        assert door_files == ([f"{node.serve_dir}/frontdoor/nginx.conf"] if node.node == router else [])
    node = dep.node(router)
    argv = list(node.program("router").argv)
    assert argv[0] == f"{tmp_path}/work/vllm-venv/bin/vllm-router"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8555"
    assert argv[argv.index("--prometheus-port") + 1] == "8556"
    assert argv[argv.index("--policy") + 1] == "random"
    workers = argv[argv.index("--worker-urls") + 1:]
    assert workers == [s.url for s in dep.servers] and len(workers) == 2 * len(dep.nodes)
    assert not any(ip in " ".join(argv[:argv.index("--worker-urls")]) for ip in BENCH_IPS.values())
    conf = next(f.content for f in node.files if f.path.endswith("/frontdoor/nginx.conf"))
    assert f"listen {BENCH_IPS[router]}:8443 ssl;" in conf
    assert f"ssl_certificate {node.serve_dir}/tls/door.pem;" in conf
    assert "server 127.0.0.1:8555;" in conf
    assert f'"Bearer {KEY}" 1;' in conf
    door = node.program("frontdoor").argv
    assert door == (NGINX, "-p", f"{node.serve_dir}/frontdoor", "-c", f"{node.serve_dir}/frontdoor/nginx.conf",
                    "-g", "daemon off;")


def test_a_router_node_outside_the_chosen_nodes_falls_back_to_the_first(tmp_path):
    inv = inventory(tmp_path, {"router": {"node": "slm-03"}})
    dep = deployment(inv, nodes=[inv.node("slm-01"), inv.node("slm-02")])     # as --nodes 2 chooses
    assert dep.router_node == "slm-01" and dep.endpoint == "https://10.20.1.11:8000"
    assert "router" in [p.name for p in dep.node("slm-01").programs]


# ------------------------------------------------------------------ the key


@pytest.mark.parametrize("supervisor", [SUPERVISORD, SYSTEMD])
def test_the_key_is_only_in_its_0600_files(tmp_path, supervisor):
    inv = inventory(tmp_path, {"router": {"node": "slm-02"}})
    dep = deployment(inv, supervisor=supervisor)
    holding = {f.path: f for n in dep.nodes for f in n.files if KEY in f.content}
    want = ({f"{n.serve_dir}/serve.env" for n in dep.nodes} | {f"{n.serve_dir}/proxy/nginx.conf" for n in dep.nodes}
            | {f"{dep.node('slm-02').serve_dir}/frontdoor/nginx.conf"})
    assert set(holding) == want
    assert all(f.mode == 0o600 for f in holding.values())
    for path, f in holding.items():
        if path.endswith("serve.env"):
            assert f.content == f"VLLM_API_KEY={KEY}\n"
        else:
            assert [line.strip() for line in f.content.splitlines() if KEY in line] == [f'"Bearer {KEY}" 1;']
    # Certificates and their keys: 0600 as well; the rest (configs without a key, units) 0644.
    private = [f for n in dep.nodes for f in n.files if "/tls/" in f.path]
    assert private and all(f.mode == 0o600 for f in private)
    others = [f for n in dep.nodes for f in n.files if f.path not in want and "/tls/" not in f.path]
    assert others and all(f.mode == 0o644 for f in others)
    for n in dep.nodes:
        manifest = next(f.content for f in n.files if f.path.endswith(MANIFEST))
        assert KEY not in manifest and key_digest(KEY) not in manifest
        for p in n.programs:
            assert KEY not in " ".join(p.argv)
            assert KEY not in json.dumps(dict(p.environment))
            assert p.env_file is None or KEY not in p.env_file
    assert KEY not in repr(dep) and KEY not in str(dep)
    assert dep.key_digest == key_digest(KEY) and len(dep.key_digest) == 12


# ------------------------------------------------------------------ digests


def test_a_router_policy_change_changes_only_the_router_digest(tmp_path):
    base = deployment(inventory(tmp_path))
    other = deployment(inventory(tmp_path, {"router": {"policy": "round_robin"}}))
    assert changed(base, other) == {("slm-01", "router")}


def test_a_new_key_changes_every_server_proxy_and_the_front_door_but_not_the_router(tmp_path):
    inv = inventory(tmp_path)
    base, other = deployment(inv), deployment(inv, key="another-key-9876543210")
    servers = {(n, s) for n in ("slm-01", "slm-02", "slm-03") for s in (*SERVERS, "proxy")}
    assert changed(base, other) == servers | {("slm-01", "frontdoor")}


def test_max_num_seqs_changes_the_servers_digests_only(tmp_path):
    base = deployment(inventory(tmp_path))
    other = deployment(inventory(tmp_path, {"max_num_seqs": 2}))
    assert changed(base, other) == {(n, s) for n in ("slm-01", "slm-02", "slm-03") for s in SERVERS}


def test_enforce_eager_reaches_every_servers_argv_and_restarts_only_them(tmp_path):
    base = deployment(inventory(tmp_path))
    other = deployment(inventory(tmp_path, vllm={"enforce_eager": True}))
    assert changed(base, other) == {(n, s) for n in ("slm-01", "slm-02", "slm-03") for s in SERVERS}
    argvs = [p.argv for n in other.nodes for p in n.programs if p.name.startswith("vllm-node")]
    assert argvs and all(argv[-1] == "--enforce-eager" for argv in argvs)


def test_the_same_inventory_and_key_give_the_same_digests(tmp_path):
    assert digests(deployment(inventory(tmp_path))) == digests(deployment(inventory(tmp_path)))


def test_a_launch_script_change_restarts_the_servers(tmp_path):
    before, after = inventory(tmp_path), inventory(tmp_path, vllm={"reserved_cores": 1})
    scripts = {s["dest"]: s["vars"] for s in vllm.launch_scripts(before)}
    rendered = {s["dest"]: s["vars"] for s in vllm.launch_scripts(after)}
    assert scripts.keys() == rendered.keys() and scripts != rendered     # the same scripts, new CPUs
    servers = {(n, s) for n in ("slm-01", "slm-02", "slm-03") for s in SERVERS}
    assert changed(deployment(before), deployment(after)) == servers


# ------------------------------------------------------------------ systemd units


@pytest.fixture
def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing: CI installs the Debian package systemd (make apt)")
        pytest.skip("systemd-analyze is not installed here (make apt installs the Debian package systemd)")
    return path


def verify_units(analyze: str, paths: list[Path]) -> tuple[int, dict[str, list[str]]]:
    """systemd-analyze verify on unit files (names unique): its exit code and the lines it
    wrote about each. A misspelled key only warns ("Unknown key ..., ignoring") and exits 0,
    so both count."""
    done = subprocess.run([analyze, "verify", *map(str, paths)], capture_output=True, text=True, timeout=60)
    out = (done.stdout + done.stderr).splitlines()
    return done.returncode, {p.name: [line for line in out if p.name in line] for p in paths}


def verify_unit(analyze: str, path: Path) -> tuple[int, list[str]]:
    code, lines = verify_units(analyze, [path])
    return code, lines[path.name]


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def rendered_units(tmp_path: Path) -> tuple[object, dict[str, Path], Path]:
    """The systemd deployment with the vLLM venv at a stub (vllm-router), every unit written
    under tmp_path/units and the key's environment file written where the units read it.
    verify checks that ExecStart's program is executable, but opens no EnvironmentFile (systemd
    reads it when the service starts; verify reports only a relative path), so the test reads
    the file the unit names itself."""
    venv = tmp_path / "vllm-venv"
    executable(venv / "bin" / "vllm-router")
    nginx = Path(NGINX) if os.access(NGINX, os.X_OK) else executable(tmp_path / "stub" / "nginx")
    inv = inventory(tmp_path, vllm={"venv": str(venv)})
    dep = deployment(inv, supervisor=SYSTEMD)
    folder = tmp_path / "units"
    folder.mkdir()
    units: dict[str, Path] = {}
    for node in dep.nodes:
        for f in node.files:
            if f.path.endswith("/serve.env"):
                Path(f.path).parent.mkdir(parents=True, exist_ok=True)
                Path(f.path).write_text(f.content)
                Path(f.path).chmod(f.mode)
        for program in node.programs:
            unit = next(f for f in node.files if f.path == f"{UNIT_DIR}/{program.unit(dep.name)}")
            path = folder / node.node / Path(unit.path).name
            path.parent.mkdir(exist_ok=True)
            path.write_text(unit.content.replace(NGINX, str(nginx)))
            units[f"{node.node}/{program.name}"] = path
    return dep, units, nginx


def unit_value(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def test_systemd_units_pass_systemd_analyze_verify(tmp_path, systemd_analyze):
    dep, units, nginx = rendered_units(tmp_path)
    assert sorted(units) == sorted([f"{n}/{s}" for n in ("slm-01", "slm-02", "slm-03") for s in (*SERVERS, "proxy")]
                                   + ["slm-01/router", "slm-01/frontdoor"])
    for node in ("slm-01", "slm-02", "slm-03"):       # one call per node: unit names repeat across nodes
        paths = [path for name, path in units.items() if name.startswith(node + "/")]
        code, lines = verify_units(systemd_analyze, paths)
        assert code == 0 and all(v == [] for v in lines.values()), f"{node}: {lines}"
    for name, path in units.items():
        text = path.read_text()
        node, program = name.split("/")
        p = dep.node(node).program(program)
        assert path.name == f"vcfslm-slm-{program}.service"
        [exec_start] = unit_value(text, "ExecStart")
        assert shlex.split(exec_start) == [a.replace(NGINX, str(nginx)) for a in p.argv]
        assert shlex.split(exec_start)[0] == {"router": f"{tmp_path}/vllm-venv/bin/vllm-router",
                                              "frontdoor": str(nginx), "proxy": str(nginx)}.get(program, "/bin/bash")
        assert unit_value(text, "Restart") == ["always"]
        assert unit_value(text, "KillMode") == ["control-group"]
        assert f"VCFSLM_DIGEST={p.digest}" in unit_value(text, "Environment")
        assert KEY not in text
        if program.startswith("vllm"):
            [env_file] = unit_value(text, "EnvironmentFile")
            assert env_file == f"{dep.node(node).serve_dir}/serve.env" and Path(env_file).is_absolute()
            assert Path(env_file).read_text() == f"VLLM_API_KEY={KEY}\n"
        else:
            assert unit_value(text, "EnvironmentFile") == []


def test_systemd_analyze_reports_a_misspelled_key(tmp_path, systemd_analyze):
    _, units, _ = rendered_units(tmp_path)
    path = units["slm-02/vllm-node0"]
    path.write_text(path.read_text().replace("Restart=always", "Restartt=always"))
    code, lines = verify_unit(systemd_analyze, path)
    assert code == 0       # a warning only: the test reads the lines, not the exit code
    assert any("Unknown key" in line and "Restartt" in line for line in lines), lines


def test_systemd_analyze_reports_an_environment_file_that_is_not_absolute(tmp_path, systemd_analyze):
    _, units, _ = rendered_units(tmp_path)
    path = units["slm-03/vllm-node1"]
    path.write_text(re.sub(r"(?m)^EnvironmentFile=/", "EnvironmentFile=", path.read_text()))
    _, lines = verify_unit(systemd_analyze, path)
    assert any("EnvironmentFile=" in line and "not absolute" in line for line in lines), lines


def test_systemd_analyze_reports_a_router_binary_that_is_missing(tmp_path, systemd_analyze):
    _, units, _ = rendered_units(tmp_path)
    (tmp_path / "vllm-venv" / "bin" / "vllm-router").unlink()
    code, lines = verify_unit(systemd_analyze, units["slm-01/router"])
    assert code != 0 and any("vllm-router" in line and "not executable" in line for line in lines), lines


# ------------------------------------------------------------------ supervisord


def supervisord_config(text: str) -> configparser.ConfigParser:
    """Read as supervisord reads it: `;` or `#` after whitespace starts a comment, and every
    value is interpolated (a stray % would fail)."""
    parser = configparser.ConfigParser(inline_comment_prefixes=(";", "#"))
    parser.read_string(text)
    for section in parser.sections():
        for key in parser[section]:
            parser[section][key]    # noqa: B018 - interpolates
    return parser


def environment(value: str) -> dict[str, str]:
    return {k: v for k, v in re.findall(r'([A-Z_][A-Z0-9_]*)="([^"]*)"', value)}


def test_supervisord_config_parses_and_keeps_its_programs_running(tmp_path):
    dep = deployment(inventory(tmp_path, {"router": {"node": "slm-02"}}))
    for node in dep.nodes:
        [conf] = [f for f in node.files if f.path == node.supervisor_conf]
        assert KEY not in conf.content
        parser = supervisord_config(conf.content)
        assert parser["supervisorctl"]["serverurl"] == f"unix://{supervisor_socket(node.serve_dir)}"
        sections = [s for s in parser.sections() if s.startswith("program:")]
        assert sections == [f"program:{p.name}" for p in node.programs]
        for program in node.programs:
            section = parser[f"program:{program.name}"]
            assert section["autorestart"] == "true"
            assert section["stopasgroup"] == "true" and section["killasgroup"] == "true"
            assert section["stdout_logfile"] == program.log
            env = environment(section["environment"])
            assert env["VCFSLM_DIGEST"] == program.digest
            assert env == {**program.environment, "VCFSLM_DIGEST": program.digest}
            command = shlex.split(section["command"])
            if program.name.startswith("vllm-node"):
                # bash exports what the key file sets, then execs the server: the file's path, never the key.
                assert command[:2] == ["/bin/bash", "-c"] and "set -a" in command[2]
                assert command[3] == f"{node.serve_dir}/serve.env" and command[4:] == list(program.argv)
            else:
                assert command == list(program.argv)     # 'daemon off;' survives the comment rule


def test_the_supervisord_wrapper_sources_the_key_file(tmp_path):
    """What the server's command does before the server: the key reaches its environment."""
    dep = deployment(inventory(tmp_path))
    node = dep.node("slm-01")
    [conf] = [f for f in node.files if f.path == node.supervisor_conf]
    env_file = next(f for f in node.files if f.path.endswith("/serve.env"))
    local = tmp_path / "serve.env"
    local.write_text(env_file.content)
    command = shlex.split(supervisord_config(conf.content)["program:vllm-node0"]["command"])
    done = subprocess.run([*command[:3], str(local), "/usr/bin/env"], capture_output=True, text=True,
                          timeout=30, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert done.returncode == 0, done.stderr
    assert f"VLLM_API_KEY={KEY}" in done.stdout.splitlines()


def test_auto_routes_to_the_less_loaded_of_two_and_round_robin_with_one_server():
    from vcfslm.deploy.desired import router_policy

    assert router_policy("auto", 2) == "power_of_two" and router_policy("auto", 16) == "power_of_two"
    assert router_policy("auto", 1) == "round_robin"            # vllm-router refuses power_of_two with one
    assert router_policy("cache_aware", 1) == "cache_aware"     # an explicit choice is kept


def test_a_supervisor_socket_too_long_for_a_unix_socket_moves_to_a_short_path():
    from vcfslm.deploy.desired import SOCKET_PATH_MAX

    short = "/opt/vcfslm/serve/slm-01"
    assert supervisor_socket(short) == short + "/supervisor.sock"
    deep = "/tmp/pytest-of-root/pytest-180/popen-gw1/test_a_real_vllm_server_behind0/work/serve/slm-01"
    moved = supervisor_socket(deep)
    assert len(moved) <= SOCKET_PATH_MAX and moved.startswith("/tmp/vcfslm-supervisor-")
    assert moved != supervisor_socket(deep.replace("slm-01", "slm-02"))      # one per node folder
