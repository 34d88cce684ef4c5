"""The deployment `vcfslm serve up` wants, from the inventory (pure).

One vLLM server per vNUMA node on every serving node, started from the same launch
script `bench --server vllm` uses (templates/vllm.sh.j2: numactl binding, OpenMP threads,
KV-cache size) with the same `serve` arguments (servers.server_argv), but listening on a
Unix socket in the node's private folder: vLLM's own key check covers /v1 only, and its
other routes (/invocations, /tokenize, ...) serve anyone who reaches them. Each node's
`proxy` (nginx) holds the servers' ports on its bench address: TLS with a certificate of
the deployment's CA, only the router's node and the node itself let in, the key checked
on every route but /health. On the router's node, vLLM's router (`vllm-router`) on
loopback with every proxy as an https worker (it verifies them against the deployment's
CA), and nginx in front of it on the bench address: the one endpoint clients call, which
terminates TLS, checks the API key, limits each client and passes only the OpenAI API
and /health (the router checks no key, and its management endpoints answer anyone).

Each process is a `Program`; its `digest` covers everything it reads (command line,
environment, the files it sources), so a changed setting restarts exactly the programs
it touches. The files each node needs (the key's environment file, nginx's config, the
supervisor's config or the systemd units) are `DesiredFile`s with their content and mode.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ..guest import vllm
from ..guest.templates import render_template
from ..guest_layout import GuestPaths, guest_paths, model_kind
from ..node_selection import select_nodes
from ..resources import resource_dir
from ..serving.servers import VLLM, ServerSpec, server_argv
from .confinement import Confinement, confinement, with_environment
from .keys import check_keys, env_text
from .tls import Pair

SYSTEMD = "systemd"
SUPERVISORD = "supervisord"
SUPERVISORS = (SYSTEMD, SUPERVISORD)
UNIT_DIR = "/etc/systemd/system"
NGINX = "/usr/sbin/nginx"
KEY_VARIABLE = "VLLM_API_KEY"
PRIVATE = 0o600
# Marks the files and units serve up wrote, so serve down removes exactly those.
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DesiredFile:
    path: str
    content: str = field(repr=False)      # may hold the key: never printed
    mode: int = 0o644

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.content.encode()).hexdigest()


@dataclass(frozen=True)
class Program:
    """One supervised process: a server, the router or the front door."""

    name: str                             # vllm-node0 | router | frontdoor
    description: str
    argv: tuple[str, ...]
    environment: Mapping[str, str]        # beside the key's environment file
    env_file: str | None                  # sourced first (the key); None: none
    log: str                              # supervisord's log file (systemd: the journal)
    health_url: str | None                # polled by serve up and serve status (no key needed)
    digest: str                           # of everything above and the files it reads

    def unit(self, deployment: str) -> str:
        return f"vcfslm-{deployment}-{self.name}.service"


@dataclass(frozen=True)
class ServerEntry:
    """One vLLM server as the router and the status see it."""

    node: str
    numa_node: int
    url: str                              # https://<bench ip>:<port>: the node's proxy in front of it
    program: str
    socket: str = ""                      # where the server itself listens, in the node's private folder


@dataclass(frozen=True)
class NodeService:
    node: str
    management_ip: str
    bench_ip: str
    serve_dir: str
    supervisor: str                       # systemd | supervisord
    programs: tuple[Program, ...]
    files: tuple[DesiredFile, ...]

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)

    @property
    def supervisor_conf(self) -> str:
        return f"{self.serve_dir}/supervisord.conf"


@dataclass(frozen=True)
class Deployment:
    name: str
    model: str                            # as the servers load it on the guest
    model_name: str                       # as the API names it
    key_digest: str                       # the first 12 hex of the key's sha256: changes follow the key
    router_node: str
    endpoint: str                         # https://<router node's bench ip>:<front door port> (http: no TLS)
    policy: str
    servers: tuple[ServerEntry, ...]
    nodes: tuple[NodeService, ...]
    door_ca: str | None = None            # the CA file on the router's node the door is checked with

    def node(self, name: str) -> NodeService:
        return next(n for n in self.nodes if n.node == name)


# A Unix socket's path must fit sun_path (108 bytes with its NUL on Linux).
SOCKET_PATH_MAX = 100


def supervisor_socket(folder: str) -> str:
    """supervisord's control socket: in the node's folder, or, when that path is too long for
    a Unix socket, a short one in /tmp named after the folder (one per deployment node)."""
    path = f"{folder}/supervisor.sock"
    if len(path.encode()) <= SOCKET_PATH_MAX:
        return path
    return f"/tmp/vcfslm-supervisor-{hashlib.sha256(folder.encode()).hexdigest()[:16]}.sock"


@dataclass(frozen=True)
class DeploymentTls:
    """The certificates the deployment uses: its CA (which the router and the nodes' checks
    trust), each node's proxy certificate by bench address, and the door's (None: plain HTTP
    at the door, as the inventory said)."""

    ca_cert: str = field(repr=False)
    nodes: Mapping[str, Pair] = field(repr=False)
    door: Pair | None = field(default=None, repr=False)
    # What checks the operator's door certificate, when the inventory names a CA for it
    # (None with an operator's certificate: the nodes' trust store).
    door_ca: str | None = field(default=None, repr=False)
    operator_door: bool = False


def socket_folder(folder: str) -> str:
    """Where a node's servers put their Unix sockets: its folder, or, when a socket's path
    there would be too long, a folder in /tmp named after it (made 0700 as the folder is)."""
    if len(f"{folder}/sockets/vllm-node99.sock".encode()) <= SOCKET_PATH_MAX:
        return f"{folder}/sockets"
    return f"/tmp/vcfslm-sockets-{hashlib.sha256(folder.encode()).hexdigest()[:16]}"


def service_user(inventory, supervisor: str) -> str:
    """nginx's `user` directive, which only a root master reads (its workers must reach the
    servers' sockets). The programs run as guest.service_user from the start (confinement.py),
    so this matters only to an nginx started by hand as root."""
    return "root" if supervisor == SYSTEMD else inventory.guest.user


def template_text(name: str) -> str:
    return (resource_dir("templates") / name).read_text()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def serve_dir(paths: GuestPaths, node: str) -> str:
    """The node's own folder: lab guests share one work folder, so it is named per node."""
    return f"{paths.workdir}/serve/{node}"


def model_on_guest(inventory) -> str:
    """What a server loads: the staged folder, or the hub id from the guest's HF cache."""
    model = inventory.guest.model
    if model_kind(model) == "dir":
        return f"{guest_paths(inventory).models_dir}/{PurePosixPath(model.rstrip('/')).name}"
    return model


def api_model_name(inventory) -> str:
    if inventory.serve.model_name:
        return inventory.serve.model_name
    model = inventory.guest.model
    return PurePosixPath(model.rstrip("/")).name if model_kind(model) == "dir" else model


def router_node_of(inventory, chosen: Sequence) -> str:
    """The node that runs the router and the door: serve.router.node when it serves, else the first."""
    wanted = inventory.serve.router.node
    return wanted if wanted in {n.name for n in chosen} else chosen[0].name


def serving_nodes(inventory, names: Sequence[str] | None = None, count: int | None = None) -> list:
    """The nodes that run servers: `names`, else the first `count`, else serve.nodes, else all."""
    if names or count is not None:
        return select_nodes(inventory, count, names)
    return select_nodes(inventory, None, inventory.serve.nodes)


def router_policy(policy: str, servers: int) -> str:
    """The policy the router runs: `auto` is power_of_two (the less loaded of two servers,
    by the requests it has in flight on each) wherever there are two servers to choose
    from, round_robin otherwise (vllm-router refuses power_of_two with one). Measured on
    the lab (benchmarks/serve_scaleout.py, docs/deploy.md): at two servers power_of_two
    held every load tried, to 16 requests/s, where round_robin's threshold was 2.4: a
    server slowed by what shares its cores gets fewer requests, not the same share."""
    if policy != "auto":
        return policy
    return "power_of_two" if servers >= 2 else "round_robin"


def router_argv(python_bin: str, service, workers: Sequence[str]) -> tuple[str, ...]:
    """vllm-router on loopback with every server as a worker (vllm-router 0.1.17's flags).

    Its defaults are for a fleet that changes slowly: a health check a minute, a circuit
    breaker that opens after 10 failures and stays open 60 s. A supervised server comes
    back within seconds, so here a dead one leaves the rotation after a few failed calls
    or `health_failure_threshold` checks, and a restarted one is taken back after one
    good check. No --api-key: the client's Authorization passes verbatim on the OpenAI
    routes, so the key stays on no command line."""
    router = service.router
    return (f"{python_bin}/vllm-router", "--host", "127.0.0.1", "--port", str(router.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(router.prometheus_port),
            "--policy", router_policy(router.policy, len(workers)),
            "--health-check-interval-secs", str(router.health_check_interval_s),
            "--health-check-timeout-secs", "1",
            "--health-failure-threshold", str(router.health_failure_threshold),
            "--health-success-threshold", "1",
            "--cb-failure-threshold", "3", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "5",
            # The servers load for minutes; the router waits for them rather than exit.
            "--worker-startup-timeout-secs", str(int(service.health_timeout_s)),
            "--worker-startup-check-interval", "2",
            "--worker-urls", *workers)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_deployment(inventory, key: str, supervisors: Mapping[str, str],
                    nodes: Sequence | None = None, *, tls: DeploymentTls,
                    api_keys: Sequence[str] | None = None) -> Deployment:
    """The deployment on `nodes` (None: serving_nodes), each supervised as `supervisors`
    says (node name -> systemd | supervisord: what the guest runs, or the inventory's choice).
    `key` is the current key; `api_keys` what the door, the proxies and the servers take
    (default: `key` alone; old and new while a key rotation rolls: keys.env_text hands the
    others to the servers beside `key`)."""
    keys = check_keys(list(api_keys) if api_keys else [key])
    previous_keys = [k for k in keys if k != key]
    service, bench = inventory.serve, inventory.bench
    paths = guest_paths(inventory)
    chosen = list(nodes) if nodes is not None else serving_nodes(inventory)
    router_node = router_node_of(inventory, chosen)
    name = service.name or inventory.name
    slots = service.max_num_seqs or bench.serve.slots
    max_len = service.max_model_len or vllm.context_tokens(bench)
    model, model_name = model_on_guest(inventory), api_model_name(inventory)
    kv_gib = vllm.default_kv_cache_gib(inventory)
    digest_of_key = key_digest(key)
    # The digest the servers follow: the key's alone unless others are taken beside it.
    digest_of_keys = digest_of_key if not previous_keys else key_digest("\n".join([key, *previous_keys]))
    venv_bin = f"{paths.vllm_venv}/bin"
    numa_nodes = sorted(vllm.node_cpus(inventory))
    # What the vllm playbook renders each launch script from: a change to any of it
    # (the CPUs a server binds, its KV cache, the template itself) restarts that server.
    scripts = {item["dest"]: item["vars"] for item in vllm.launch_scripts(inventory)}
    script_inputs = (paths.vllm_python, paths.vllm_entry, kv_gib, template_text(VLLM.template))

    servers: list[ServerEntry] = []
    node_servers: dict[str, list[Program]] = {}
    for node in chosen:
        folder = serve_dir(paths, node.name)
        sockets = socket_folder(folder)
        spec = ServerSpec(name=VLLM.name, listen="bench", host=str(node.bench_ip), port=service.port,
                          chunked_prefill=bench.serve.vllm.chunked_prefill,
                          prefix_caching=bench.serve.vllm.prefix_caching,
                          enforce_eager=bench.serve.vllm.enforce_eager)
        programs = []
        for numa in numa_nodes:
            script = vllm.script_path(inventory, numa)
            socket = f"{sockets}/vllm-node{numa}.sock"
            argv = ("/bin/bash", script, *server_argv(spec, model_dir=model, served_name=model_name, slots=slots,
                                                      max_model_len=max_len, numa_node=numa, uds=socket))
            env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
            url = f"https://{node.bench_ip}:{spec.port_for(numa)}"
            program = Program(name=f"vllm-node{numa}", description=f"vLLM server on vNUMA node {numa}",
                              argv=argv, environment=env, env_file=f"{folder}/serve.env",
                              log=f"{folder}/logs/vllm-node{numa}.log", health_url=f"{url}/health",
                              digest=_digest(argv, env, digest_of_keys, script, scripts.get(script), script_inputs))
            programs.append(program)
            servers.append(ServerEntry(node.name, numa, url, program.name, socket))
        node_servers[node.name] = programs

    router_ip = str(next(n for n in chosen if n.name == router_node).bench_ip)
    door_settings = service.front_door
    endpoint = f"{'https' if tls.door else 'http'}://{router_ip}:{door_settings.port}"
    workers = [s.url for s in servers]
    out_nodes = []
    door_ca: str | None = None
    for node in chosen:
        folder = serve_dir(paths, node.name)
        supervisor = supervisors[node.name]
        user = service_user(inventory, supervisor)
        programs = list(node_servers[node.name])
        ca = f"{folder}/tls/ca.pem"
        node_pair = tls.nodes[str(node.bench_ip)]
        files = [DesiredFile(f"{folder}/serve.env", env_text(key, previous_keys), PRIVATE),
                 DesiredFile(ca, tls.ca_cert, PRIVATE),
                 DesiredFile(f"{folder}/tls/node.pem", node_pair.cert, PRIVATE),
                 DesiredFile(f"{folder}/tls/node.key", node_pair.key, PRIVATE)]
        proxy = f"{folder}/proxy"
        conf = render_template("node-proxy-nginx.conf.j2", {
            "prefix": proxy, "api_keys": keys, "user": user,
            "servers": [{"listen": f"{node.bench_ip}:{s.url.rsplit(':', 1)[1]}", "socket": s.socket}
                        for s in servers if s.node == node.name],
            "allow": sorted({router_ip, str(node.bench_ip), "127.0.0.1"}),
            "tls": {"cert": f"{folder}/tls/node.pem", "key": f"{folder}/tls/node.key"}})
        files.append(DesiredFile(f"{proxy}/nginx.conf", conf, PRIVATE))
        argv = (NGINX, "-p", proxy, "-c", f"{proxy}/nginx.conf", "-g", "daemon off;")
        programs.append(Program(
            name="proxy", description="nginx: the node's servers on its bench address, for the router only",
            argv=argv, environment={}, env_file=None, log=f"{folder}/logs/proxy.log", health_url=None,
            digest=_digest(argv, conf, node_pair.cert, node_pair.key)))
        if node.name == router_node:
            argv = router_argv(venv_bin, service, workers)
            # vllm-router (reqwest on OpenSSL) trusts SSL_CERT_FILE: the deployment's CA only.
            env = {"SSL_CERT_FILE": ca}
            programs.append(Program(
                name="router", description="vLLM router in front of the deployment's servers", argv=argv,
                environment=env, env_file=None, log=f"{folder}/logs/router.log",
                health_url=None, digest=_digest(argv, env, tls.ca_cert)))
            door = f"{folder}/frontdoor"
            door_tls = None
            if tls.door is not None:
                door_tls = {"cert": f"{folder}/tls/door.pem", "key": f"{folder}/tls/door.key"}
                files += [DesiredFile(door_tls["cert"], tls.door.cert, PRIVATE),
                          DesiredFile(door_tls["key"], tls.door.key, PRIVATE)]
                door_ca = ca
                if tls.operator_door:
                    door_ca = f"{folder}/tls/door-ca.pem" if tls.door_ca else None
                    if tls.door_ca:
                        files.append(DesiredFile(door_ca, tls.door_ca, PRIVATE))
            conf = render_template("frontdoor-nginx.conf.j2", {
                "prefix": door, "listen": f"{router_ip}:{door_settings.port}",
                "router": f"127.0.0.1:{service.router.port}", "api_keys": keys, "tls": door_tls,
                "limits": {"requests_per_s": door_settings.requests_per_s, "burst": door_settings.burst,
                           "connections": door_settings.connections_per_client},
                "user": user, "supervisor": supervisor,
                # supervisord as root starting nginx as the service user: nginx cannot reopen
                # the root-owned pipe of its stdout, so it logs to its own folder.
                "access_file": f"{door}/access.log" if supervisor == SUPERVISORD and
                inventory.guest.service_user != inventory.guest.user else ""})
            files.append(DesiredFile(f"{door}/nginx.conf", conf, PRIVATE))
            argv = (NGINX, "-p", door, "-c", f"{door}/nginx.conf", "-g", "daemon off;")
            programs.append(Program(
                name="frontdoor", description="nginx: the deployment's endpoint, checking its API key",
                argv=argv, environment={}, env_file=None, log=f"{folder}/logs/frontdoor.log",
                health_url=None, digest=_digest(argv, conf, door_tls and (tls.door.cert, tls.door.key))))
        confined = {p.name: confinement(p.name, folder, inventory.guest.service_user, service.front_door.port,
                                        socket_folder(folder))
                    for p in programs}
        programs = [with_environment(p, confined[p.name]) for p in programs]
        files += supervisor_files(name, folder, supervisor, programs, confined)
        facts = {"model": model, "model_name": model_name, "router_node": router_node,
                 "endpoint": endpoint, "tls": tls.door is not None, "ca": ca,
                 "door_ca": door_ca if node.name == router_node else None,
                 "servers": [s.url for s in servers if s.node == node.name]}
        files.append(DesiredFile(f"{folder}/{MANIFEST}", manifest_text(facts, supervisor, name, programs, files)))
        out_nodes.append(NodeService(node.name, str(node.management_ip), str(node.bench_ip), folder, supervisor,
                                     tuple(programs), tuple(files)))
    return Deployment(name=name, model=model, model_name=model_name, key_digest=digest_of_key,
                      router_node=router_node, endpoint=endpoint, door_ca=door_ca,
                      policy=router_policy(service.router.policy, len(servers)), servers=tuple(servers),
                      nodes=tuple(out_nodes))


def supervisor_files(deployment: str, folder: str, supervisor: str, programs: Sequence[Program],
                     confined: Mapping[str, Confinement] | None = None) -> list[DesiredFile]:
    """supervisord's one config, or one systemd unit per program (each confined as
    `confined` says; none: as root, unconfined)."""
    confined = confined or {}
    if supervisor == SUPERVISORD:
        text = render_template("serve-supervisord.conf.j2", {
            "deployment": deployment, "folder": folder, "socket": supervisor_socket(folder),
            "programs": [_template_program(p, confined.get(p.name)) for p in programs]})
        return [DesiredFile(f"{folder}/supervisord.conf", text)]
    return [DesiredFile(f"{UNIT_DIR}/{p.unit(deployment)}",
                        render_template("serve-unit.service.j2", {
                            "deployment": deployment, "program": _template_program(p, confined.get(p.name))}))
            for p in programs]


def _template_program(program: Program, confined: Confinement | None) -> dict[str, object]:
    confined = confined or Confinement("root")
    return {"name": program.name, "description": program.description,
            "command": shlex.join(program.argv), "env_file": program.env_file, "log": program.log,
            "environment": dict(program.environment, VCFSLM_DIGEST=program.digest),
            "user": confined.user, "read_write": list(confined.read_write),
            "deny_write_execute": confined.deny_write_execute, "proc_pids_only": confined.proc_pids_only,
            "capabilities": list(confined.capabilities)}


def manifest_text(facts: Mapping[str, object], supervisor: str, deployment: str,
                  programs: Sequence[Program], files: Sequence[DesiredFile]) -> str:
    """The node's record of this serve up: its programs with their digests, its units and
    files (no content), and the deployment's facts status reads back. Never the key."""
    return json.dumps({**facts, "deployment": deployment, "supervisor": supervisor,
                       "programs": {p.name: p.digest for p in programs},
                       "units": [p.unit(deployment) for p in programs] if supervisor == SYSTEMD else [],
                       "files": sorted(f.path for f in files)}, indent=1, sort_keys=True) + "\n"
