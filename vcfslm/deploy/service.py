"""`vcfslm serve up | status | down`: the deployment across its nodes.

up: install what the nodes lack (the vllm and serve playbooks), settle the key (saved
to its file before anything starts) and the certificates, plan every node's changes,
apply them, and wait until every server is healthy, the router lists them all, and the
front door refuses a request without the key and serves one with it, over TLS verified
against the deployment's CA. A second `up` with nothing changed plans no change and touches nothing. Nodes that
served before and are no longer chosen are taken down (a smaller deployment stops
exactly the servers it drops).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CommandFailed, Problem, ServeError, TransportError
from ..guest.provision import GuestRun, provision_guests
from ..guest.transport import Transport
from ..guest_layout import guest_paths
from ..inventory_load import located, service_model_problems
from ..progress import NullReporter, Reporter
from ..serving.servers import parse_metrics
from . import keys
from .changes import NodeChanges, node_changes
from .desired import Deployment, plan_deployment, router_node_of, serve_dir, serving_nodes
from .driver import GAVE_UP, NodeDriver
from .material import client_ca, deployment_tls
from .rollout import Rollout, plan_roll, router_workers

# A program that died this many times before its server answered /health is crashing, not
# loading: its supervisor would go on restarting it, so serve up stops and quotes the cause.
CRASH_RESTARTS = 3
ROUTER_WAIT_S = 60.0


@dataclass(frozen=True)
class UpOptions:
    """What one `serve up` does: the nodes (names or a count; None: serve.nodes or all),
    the key file to read or write (None: ~/.vcfslm/keys/<deployment>.key), a new key
    (or the key file's, when it differs from the nodes'), plan only, and whether to
    install first."""

    names: Sequence[str] | None = None
    count: int | None = None
    key_file: str | None = None
    rotate_key: bool = False
    dry_run: bool = False
    install: bool = True
    log_dir: str | None = None


@dataclass
class UpResult:
    deployment: Deployment
    changes: list[NodeChanges]
    dropped: dict[str, list[str]]            # nodes taken down -> programs stopped
    new_key: str | None = field(default=None, repr=False)   # only when made by this up
    key_file: str | None = None
    ca_file: str | None = None                               # what clients trust (None: the system's store)
    tls_made: list[str] = field(default_factory=list)        # certificate files this up made
    healthy_s: dict[str, float] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    rolls: list[dict[str, Any]] = field(default_factory=list)    # servers rolled one at a time

    @property
    def changed(self) -> bool:
        return bool(self.dropped) or any(not c.empty for c in self.changes)


Connect = Callable[[Any], Transport]


def _drivers(inventory, nodes, connect: Connect, deployment: str) -> dict[str, NodeDriver]:
    paths = guest_paths(inventory)
    venv_bin = f"{paths.vllm_venv}/bin"

    def one(node) -> tuple[str, NodeDriver]:
        return node.name, NodeDriver(connect(node), serve_dir=serve_dir(paths, node.name), venv_bin=venv_bin,
                                     deployment=deployment, service_user=inventory.guest.service_user)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        return dict(pool.map(one, nodes))


def _reachable_drivers(inventory, nodes, connect: Connect,
                       deployment: str) -> tuple[dict[str, NodeDriver], dict[str, str]]:
    """(drivers of the nodes that answer, node -> why each other one does not)."""
    def one(node) -> tuple[NodeDriver | None, str]:
        try:
            return _drivers(inventory, [node], connect, deployment)[node.name], ""
        except TransportError as e:
            return None, _why(e)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        answers = dict(zip([n.name for n in nodes], pool.map(one, nodes), strict=True))
    return ({n: d for n, (d, _) in answers.items() if d is not None},
            {n: why for n, (d, why) in answers.items() if d is None})


def _why(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _each_reached(drivers: dict[str, NodeDriver], fn: Callable[[str, NodeDriver], Any],
                  unreachable: dict[str, str]) -> dict[str, Any]:
    """_each, a node whose connection fails on the way added to `unreachable` (not raised)."""
    def guarded(name: str, d: NodeDriver) -> Any:
        try:
            return fn(name, d)
        except CommandFailed:
            raise
        except TransportError as e:
            unreachable[name] = _why(e)
            return None

    return {n: v for n, v in _each(drivers, guarded).items() if n not in unreachable}


def _close(drivers: dict[str, NodeDriver]) -> None:
    for d in drivers.values():
        d.t.close()


def _each(drivers: dict[str, NodeDriver], fn: Callable[[str, NodeDriver], Any]) -> dict[str, Any]:
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(drivers)))) as pool:
        futures = {name: pool.submit(fn, name, d) for name, d in drivers.items()}
        return {name: f.result() for name, f in futures.items()}


def key_file_of(inventory, options: UpOptions) -> str:
    return str(Path(options.key_file).expanduser() if options.key_file
               else keys.default_key_file(inventory.serve.name or inventory.name))


def settle_key(key_file: str, rotate: bool, held: Sequence[str | None]) -> tuple[str, bool]:
    """(the deployment's key, whether the key file must be written): the key file's when it
    exists (an error when the nodes hold another, unless rotating: then the nodes take the
    file's), else the one the nodes hold, else a new one; rotating with no other key in
    the file makes a new one. `held`: the nodes' keys, the router's first."""
    known = [k for k in held if k]
    if Path(key_file).is_file():
        key = keys.read_key_file(key_file)
        if known and known[0] != key and not rotate:
            raise keys.KeyFileError([Problem(key_file, None, None, "--key-file", (
                "holds another key than the deployment's nodes: give the key file of this deployment, or "
                "--rotate-key to have every node take this one"))])
        if rotate and (not known or known[0] == key):
            return keys.new_key(), True
        return key, False
    if known and not rotate:
        return known[0], True
    return keys.new_key(), True


def serve_up(inventory, connect: Connect, options: UpOptions, reporter: Reporter | None = None) -> UpResult:
    reporter = reporter or NullReporter()
    problems = service_model_problems(inventory)
    if problems:
        raise located(inventory, problems)
    chosen = serving_nodes(inventory, options.names, options.count)
    name = inventory.serve.name or inventory.name
    if options.install and not options.dry_run:
        reporter.log(f"serve up: installing vLLM, the model, the router and the supervisor where missing on "
                     f"{', '.join(n.name for n in chosen)}")
        summary = provision_guests(inventory, lambda node, **kw: connect(node), reporter,
                                   GuestRun(playbooks=["vllm", "model", "serve"], hosts=[n.name for n in chosen],
                                            run_dir=options.log_dir))
        if not summary.ok:
            failed = "; ".join(f"{h.host}: {h.error}" for h in summary.failed_hosts)
            raise ServeError(f"serve up: installing on the nodes failed: {failed}")
    drivers = _drivers(inventory, list(inventory.nodes), connect, name)
    try:
        return _up(inventory, drivers, chosen, options, reporter, name)
    finally:
        _close(drivers)


def _up(inventory, drivers: dict[str, NodeDriver], chosen, options: UpOptions, reporter: Reporter,
        name: str) -> UpResult:
    service = inventory.serve
    chosen_names = [n.name for n in chosen]
    manifests = _each(drivers, lambda _, d: d.manifest())
    held = _each({n: drivers[n] for n in drivers if manifests[n]}, lambda _, d: d.read_key())
    router_first = sorted(held, key=lambda n: n != (service.router.node or chosen_names[0]))
    key_file = key_file_of(inventory, options)
    key, save_key = settle_key(key_file, options.rotate_key, [held[n] for n in router_first])
    made = key not in held.values()
    router_ip = str(inventory.node(router_node_of(inventory, chosen)).bench_ip)
    certificates, tls_made = deployment_tls(inventory, key_file, [str(n.bench_ip) for n in chosen], router_ip,
                                            write=not options.dry_run)
    supervisors = _each({n: drivers[n] for n in chosen_names},
                        lambda _, d: d.supervisor_of_guest(service.supervisor))
    deployment = plan_deployment(inventory, key, supervisors, chosen, tls=certificates)
    phases = rotation_phases(inventory, deployment, key, supervisors, chosen, certificates,
                             [held[n] for n in router_first] if options.rotate_key else [])
    # A rotation's new key waits beside the key file until the door and every server take
    # it (clients that follow the key file move to it then); any other is saved in it.
    pending = f"{key_file}.new" if save_key and made and len(phases) > 1 else None
    if save_key and not options.dry_run:
        # Before anything starts: a key the nodes take is never only on the nodes.
        keys.write_key_file(pending or key_file, key)
    if deployment.policy == "power_of_two" and len(deployment.servers) < 2:
        # vllm-router refuses to start so; refuse before anything changes.
        raise located(inventory, [(("serve", "router", "policy"),
                                   f"power_of_two needs two servers or more; this deployment has "
                                   f"{len(deployment.servers)} (use round_robin)")])
    observed = _each({n: drivers[n] for n in chosen_names},
                     lambda n, d: d.observe(phases[0].node(n)))
    changes = [node_changes(phases[0].node(n), observed[n]) for n in chosen_names]
    leaving = [n for n in drivers if n not in chosen_names and manifests[n]]
    for c in changes:
        for line in c.lines():
            reporter.log(("would " if options.dry_run else "") + line)
    for n in leaving:
        reporter.log(f"{'would take' if options.dry_run else 'taking'} down {n} (no longer in the deployment)")
    if len(phases) > 1:
        reporter.log(f"{'would rotate' if options.dry_run else 'rotating'} the key: the door and the servers "
                     f"take the old and the new key while the servers roll, then the new one only")
    result = UpResult(deployment, changes, {}, key if made else None, key_file,
                      client_ca(key_file, inventory) if certificates.door else None, tls_made)
    if options.dry_run:
        return result
    dropped = _each({n: drivers[n] for n in leaving}, lambda _, d: d.down())
    result.dropped = dropped
    serving = {n: drivers[n] for n in chosen_names}
    for i, phase in enumerate(phases):
        if i:
            observed = _each(serving, lambda n, d, p=phase: d.observe(p.node(n)))
            changes = [node_changes(phase.node(n), observed[n]) for n in chosen_names]
        result.rolls += apply_changes(phase, serving, changes, inventory, reporter, key)
        result.healthy_s = wait_healthy(phase, serving, inventory, reporter, timeout_s=service.health_timeout_s)
        result.checks = check_front_door(phase, drivers[phase.router_node], inventory, key)
        if pending:
            Path(pending).replace(key_file)
            reporter.log(f"the door and every server take the new key: it is in {key_file}; "
                         f"the old one stops working now")
            pending = None
    return result


def rotation_phases(inventory, deployment: Deployment, key: str, supervisors, chosen, certificates,
                    held: Sequence[str | None]) -> list[Deployment]:
    """The deployments a key change goes through: with a previous key and two servers or
    more, first one where the door, the proxies and the servers take both keys (the servers
    roll into it, clients move to the new key meanwhile), then the one with the new key
    only. Otherwise the deployment itself."""
    previous = sorted({k for k in held if k and k != key})
    if not previous or len(deployment.servers) < 2:
        return [deployment]
    both = plan_deployment(inventory, key, supervisors, chosen, tls=certificates, api_keys=[*previous, key])
    return [both, deployment]


def apply_changes(deployment: Deployment, drivers: dict[str, NodeDriver], changes: Sequence[NodeChanges],
                  inventory, reporter: Reporter, key: str) -> list[dict[str, Any]]:
    """Every node's changes: servers rolled one at a time where rollout.plan_roll says so,
    else at once; the rolls' records."""
    plan = plan_roll(deployment, changes)
    for line in plan.lines():
        reporter.log(line)
    if not plan.rolling:
        by_node = {c.node: c for c in changes}
        _each({n: drivers[n] for n in by_node if not by_node[n].empty},
              lambda n, d: d.apply(deployment.node(n), by_node[n]))
        return []
    return Rollout(deployment, drivers, python=_python(inventory), router_port=inventory.serve.router.port,
                   health_timeout_s=inventory.serve.health_timeout_s, reporter=reporter).apply(plan, changes, key)


def _python(inventory) -> str:
    return guest_paths(inventory).vllm_python


def _node_ca(service) -> str:
    """The deployment CA's copy on a node: what its checks verify the proxies and the door with."""
    return f"{service.serve_dir}/tls/ca.pem"


def wait_healthy(deployment: Deployment, drivers: dict[str, NodeDriver], inventory, reporter: Reporter,
                 timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> dict[str, float]:
    """Seconds until each server answered /health; ServeError quoting the log of a program
    that gave up, or naming the ones still not healthy at the timeout."""
    started = time.monotonic()
    healthy: dict[str, float] = {}
    pids_seen: dict[str, set[int]] = {}
    python = _python(inventory)
    while True:
        pending = [s for s in deployment.servers if f"{s.node}/{s.program}" not in healthy]
        if not pending:
            return healthy
        for node in sorted({s.node for s in pending}):
            d, service = drivers[node], deployment.node(node)
            gets = [{"id": s.program, "url": s.url + "/health", "timeout": 2, "ca": _node_ca(service)}
                    for s in pending if s.node == node]
            answers = d.probe(python, gets)["http"]
            for s in pending:
                if s.node == node and answers.get(s.program, {}).get("status") == 200:
                    healthy[f"{node}/{s.program}"] = round(time.monotonic() - started, 1)
                    reporter.update(node, f"{s.program} healthy")
            _, states = d.programs(service.supervisor, {p.name: p.unit(deployment.name) for p in service.programs})
            for program in service.programs:
                state = states.get(program.name)
                if state is not None and state.state in GAVE_UP:
                    raise ServeError(f"{node}: {program.name} is {state.state} (its supervisor gave up); "
                                     f"its log {program.log}{d.log_cause(program.log)}")
                seen = pids_seen.setdefault(f"{node}/{program.name}", set())
                if state is not None and state.pid:
                    seen.add(state.pid)
                if program.health_url and len(seen) > CRASH_RESTARTS and f"{node}/{program.name}" not in healthy:
                    raise ServeError(f"{node}: {program.name} died {len(seen) - 1} times before it was healthy; "
                                     f"its log {program.log}{d.log_cause(program.log)}")
        if time.monotonic() - started > timeout_s:
            names = ", ".join(f"{s.node}/{s.program}" for s in pending)
            raise ServeError(f"not healthy {timeout_s:g} s after serve up: {names} (serve.health_timeout_s)")
        sleep(2.0)


def check_front_door(deployment: Deployment, router: NodeDriver, inventory, key: str,
                     sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """From the router's node: the router lists every server; the endpoint answers /health,
    refuses a request without the key (401), serves one with it, and hides the router's
    management calls (404); over TLS, verified with the deployment's CA (an operator's
    certificate: with the system's trust store, or the CA the inventory names, on the node)."""
    service = inventory.serve
    python = _python(inventory)
    router_url = f"http://127.0.0.1:{service.router.port}"
    want = {s.url for s in deployment.servers}
    ca = deployment.door_ca
    deadline = time.monotonic() + ROUTER_WAIT_S
    while True:
        got = router.probe(python, [
            {"id": "workers", "url": router_url + "/list_workers"},
            {"id": "health", "url": deployment.endpoint + "/health", "ca": ca},
            {"id": "keyless", "url": deployment.endpoint + "/v1/models", "ca": ca},
            {"id": "keyed", "url": deployment.endpoint + "/v1/models", "key": True, "ca": ca},
            {"id": "management", "url": deployment.endpoint + "/list_workers", "ca": ca}], key=key)["http"]
        listed = router_workers(got.get("workers", {}).get("body", ""))
        statuses = {k: v.get("status") for k, v in got.items()}
        ok = (set(listed) == want and statuses.get("health") == 200 and statuses.get("keyless") == 401
              and statuses.get("keyed") == 200 and statuses.get("management") == 404)
        if ok or time.monotonic() > deadline:
            break
        sleep(1.0)
    if not ok:
        service_node = deployment.node(deployment.router_node)
        _, states = router.programs(service_node.supervisor,
                                    {p.name: p.unit(deployment.name) for p in service_node.programs})
        causes = "".join(f"\n{p.name} is {states[p.name].state}; its log {p.log}{router.log_cause(p.log)}"
                         for p in service_node.programs if p.name in ("router", "frontdoor")
                         and p.name in states and states[p.name].state != "RUNNING")
        raise ServeError(f"the endpoint {deployment.endpoint} is not right {ROUTER_WAIT_S:g} s after serve up: "
                         f"router lists {sorted(listed)} (want {sorted(want)}), /health {statuses.get('health')}, "
                         f"no key {statuses.get('keyless')} (want 401), with the key {statuses.get('keyed')} "
                         f"(want 200), /list_workers {statuses.get('management')} (want 404){causes}")
    return {"router_workers": sorted(listed), **{k: statuses[k] for k in ("health", "keyless", "keyed", "management")}}


# ---------------------------------------------------------------------- status


def serve_status(inventory, connect: Connect) -> dict[str, Any]:
    """Every node's programs (state, pid, peak RSS), each server's health, version and KV
    use, the router's view, and the endpoint; the nodes that could not be reached, by name
    and why (the others are reported all the same; the deployment is then not healthy)."""
    name = inventory.serve.name or inventory.name
    drivers, unreachable = _reachable_drivers(inventory, list(inventory.nodes), connect, name)
    try:
        return _status(inventory, drivers, name, unreachable)
    finally:
        _close(drivers)


def _status(inventory, drivers: dict[str, NodeDriver], name: str,
            unreachable: dict[str, str] | None = None) -> dict[str, Any]:
    unreachable = dict(unreachable or {})
    python = _python(inventory)
    service = inventory.serve

    def one(node: str, d: NodeDriver) -> dict[str, Any] | None:
        manifest = d.manifest()
        if manifest is None:
            return None
        programs = list(manifest.get("programs") or {})
        units = {p: f"vcfslm-{name}-{p}.service" for p in programs}
        up, states = d.programs(str(manifest.get("supervisor")), units)
        servers = [str(u) for u in manifest.get("servers") or []]
        ca = str(manifest.get("ca") or "")
        gets = []
        for i, url in enumerate(servers):
            gets += [{"id": f"{i}/health", "url": url + "/health", "timeout": 3, "ca": ca},
                     {"id": f"{i}/version", "url": url + "/version", "timeout": 3, "ca": ca, "key": True},
                     {"id": f"{i}/metrics", "url": url + "/metrics", "timeout": 5, "ca": ca, "key": True}]
        if manifest.get("router_node") == node:
            gets += [{"id": "router/workers", "url": f"http://127.0.0.1:{service.router.port}/list_workers"},
                     {"id": "endpoint/health", "url": f"{manifest.get('endpoint')}/health",
                      "ca": str(manifest.get("door_ca") or "")}]
        rss = {p: s.pid for p, s in states.items() if s.pid}
        # The proxies take /version and /metrics with the key only: the node's own copy.
        answers = d.probe(python, gets, rss, key=d.read_key() if servers else None)
        http, peaks = answers["http"], answers["rss"]
        rows = []
        for i, url in enumerate(servers):
            program = _program_of(manifest, i)
            metrics = parse_metrics(http.get(f"{i}/metrics", {}).get("body", "")) \
                if http.get(f"{i}/metrics", {}).get("status") == 200 else {}
            state = states.get(program)
            rows.append({"program": program, "url": url, "state": state.state if state else "UNKNOWN",
                         "pid": state.pid if state else None,
                         "healthy": http.get(f"{i}/health", {}).get("status") == 200,
                         "version": _version(http.get(f"{i}/version", {})),
                         "model": manifest.get("model_name"),
                         "peak_rss_bytes": peaks.get(program),
                         "kv_cache_usage": metrics.get("vllm:kv_cache_usage_perc"),
                         "running_requests": metrics.get("vllm:num_requests_running"),
                         "requests_finished": metrics.get("vllm:request_success_total")})
        out: dict[str, Any] = {"supervisor": manifest.get("supervisor"), "supervisor_up": up, "servers": rows,
                               "programs": {p: (states[p].state if p in states else "UNKNOWN") for p in programs}}
        if manifest.get("router_node") == node:
            out["router"] = {"workers": router_workers(http.get("router/workers", {}).get("body", "")),
                             "state": states["router"].state if "router" in states else "UNKNOWN",
                             "peak_rss_bytes": peaks.get("router")}
            out["endpoint"] = {"url": manifest.get("endpoint"),
                               "transport": "TLS" if manifest.get("tls") else "plain HTTP",
                               "health": http.get("endpoint/health", {}).get("status"),
                               "state": states["frontdoor"].state if "frontdoor" in states else "UNKNOWN"}
        return out

    nodes = {n: v for n, v in _each_reached(drivers, one, unreachable).items() if v is not None}
    endpoint = next((v["endpoint"] for v in nodes.values() if "endpoint" in v), None)
    servers = [s for v in nodes.values() for s in v["servers"]]
    return {"deployment": name, "deployed": bool(nodes), "endpoint": endpoint, "nodes": nodes,
            "unreachable": dict(sorted(unreachable.items())),
            "healthy": bool(nodes) and not unreachable and all(s["healthy"] for s in servers) and bool(endpoint)
            and endpoint.get("health") == 200}


def _program_of(manifest: dict[str, Any], index: int) -> str:
    servers = [p for p in (manifest.get("programs") or {}) if str(p).startswith("vllm-node")]
    return servers[index] if index < len(servers) else f"server-{index}"


def _version(answer: dict[str, Any]) -> str | None:
    if answer.get("status") != 200:
        return None
    try:
        return json.loads(answer.get("body") or "{}").get("version")
    except ValueError:
        return None


# ---------------------------------------------------------------------- down


@dataclass
class DownResult:
    stopped: dict[str, list[str]]           # node -> the programs stopped (nodes that had none: absent)
    unreachable: dict[str, str]             # node -> why it could not be reached (nothing done there)


def serve_down(inventory, connect: Connect) -> DownResult:
    """Take the deployment down on every node that has it and can be reached; the nodes
    that cannot are named, not waited for."""
    name = inventory.serve.name or inventory.name
    drivers, unreachable = _reachable_drivers(inventory, list(inventory.nodes), connect, name)
    try:
        stopped = _each_reached(drivers, lambda _, d: d.down(), unreachable)
        return DownResult({n: v for n, v in stopped.items() if v}, dict(sorted(unreachable.items())))
    finally:
        _close(drivers)


# ---------------------------------------------------------------------- faults


def kill_program(inventory, connect: Connect, node_name: str, program: str) -> int:
    """SIGKILL one program of the deployment on its node, as a crash would (its supervisor
    then brings it back); the pid killed (a vLLM server's API process, else the program's
    main process). ServeError when it is not running."""
    name = inventory.serve.name or inventory.name
    node = inventory.node(node_name)
    drivers = _drivers(inventory, [node], connect, name)
    try:
        d = drivers[node_name]
        manifest = d.manifest()
        if manifest is None or program not in (manifest.get("programs") or {}):
            raise ServeError(f"{node_name} runs no program {program!r} of deployment {name}")
        supervisor = str(manifest.get("supervisor"))
        _, states = d.programs(supervisor, {program: f"vcfslm-{name}-{program}.service"})
        state = states.get(program)
        if state is None or not state.pid:
            raise ServeError(f"{node_name}: {program} is not running ({state.state if state else 'unknown'})")
        # A crash: vLLM's API process dies, which under vLLM's entry (templates/vllm-entry.py)
        # is the entry's one child; any other program's is its main process. Its supervisor
        # sees it die and restarts it, its engine gone with it.
        pid = state.pid
        done = d.t.run(f"api=$(pgrep -P {pid} -f vllm-entry.py | head -n 1); kill -KILL ${{api:-{pid}}} && "
                       f"echo ${{api:-{pid}}}", sudo=d.sudo)
        return int(done.stdout.strip().splitlines()[-1])
    finally:
        _close(drivers)
