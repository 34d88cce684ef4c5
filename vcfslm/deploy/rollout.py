"""Changes without downtime: with two servers or more, a change that restarts servers rolls
them one at a time behind the router, so the others keep serving.

For each server in turn: out of the router (vllm-router's management API, called from the
router's node: `POST /remove_worker?url=` — the router sends it no new request), wait
until its streams have finished (the server's own /metrics: no request running or
waiting, twice in a row), restart it under its supervisor, wait until it answers /health,
and back in (`POST /add_worker?url=`, which the router accepts once the server answers
its health check). The router reaches each server through its node's proxy (nginx, TLS,
the key checked), so the server's https URL is the proxy's, and the checks here go through
it too, verified against the deployment's CA. The front door and the proxies read a changed
config (a key rotation's keys) with nginx's graceful reload (SIGHUP: open connections
finish on the old workers) instead of a restart; a server's own restart needs none (the
proxy reaches its Unix socket afresh). The router, whose restart no roll can hide, goes
last. Every node's manifest is written after its
programs run what it records, so a roll cut short is redone by the next `serve up`.

The decisions (whether to roll, which server next, when one is drained) are the pure
functions here; `Rollout` is the thin driver that calls the nodes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from urllib.parse import quote

from ..errors import ServeError
from ..progress import NullReporter, Reporter
from ..serving.servers import parse_metrics
from .changes import NodeChanges
from .desired import MANIFEST, Deployment, ServerEntry
from .driver import GAVE_UP, NodeDriver

ROUTER = "router"
DOOR = "frontdoor"
PROXY = "proxy"
# Consecutive idle readings of a server's /metrics before it counts as drained: a request
# the router sent just before the removal shows up as running within milliseconds.
QUIET_READINGS = 2
DRAIN_POLL_S = 0.5
# A stream longer than this is cut by the restart (and the roll says so).
DRAIN_TIMEOUT_S = 600.0
HEALTH_POLL_S = 1.0
IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def is_server(program: str) -> bool:
    return program.startswith("vllm-node")


@dataclass(frozen=True)
class RollPlan:
    """How a `serve up` applies its changes: rolling (servers one at a time) or at once."""

    rolling: bool
    servers: tuple[ServerEntry, ...] = ()     # to restart one at a time
    reload_door: bool = False                 # the door reads its new config with a graceful reload
    reload_proxies: tuple[str, ...] = ()      # the nodes whose proxy does the same
    restart_router: bool = False              # after the servers
    why: str = ""

    def lines(self) -> list[str]:
        if not self.rolling:
            return [f"changes apply at once: {self.why}"] if self.why else []
        out = [f"rolling {len(self.servers)} server(s) one at a time: "
               + ", ".join(f"{s.node}/{s.program}" for s in self.servers)]
        if self.reload_door:
            out.append("the front door reloads its config (graceful)")
        if self.reload_proxies:
            out.append(f"the proxies of {', '.join(self.reload_proxies)} reload their config (graceful)")
        if self.restart_router:
            out.append("the router restarts after the servers (its own settings changed)")
        return out


def plan_roll(deployment: Deployment, changes: Sequence[NodeChanges]) -> RollPlan:
    """Roll when the deployment has two servers or more and some of them restart (a setting
    or the key changed); new, stopped and not-running programs need no roll."""
    by_node = {c.node: c for c in changes}
    restarting = [s for s in deployment.servers if s.program in by_node.get(s.node, NodeChanges(s.node)).restart]
    if not restarting:
        return RollPlan(False)
    if len(deployment.servers) < 2:
        return RollPlan(False, why="one server: nothing else can serve while it restarts")
    router_changes = by_node.get(deployment.router_node, NodeChanges(deployment.router_node))
    if ROUTER in router_changes.start or ROUTER in router_changes.revive:
        return RollPlan(False, why="the router is not running to take servers out")
    proxies = tuple(c.node for c in changes if PROXY in c.restart)
    return RollPlan(True, tuple(restarting), reload_door=DOOR in router_changes.restart,
                    reload_proxies=proxies, restart_router=ROUTER in router_changes.restart)


def held_back(changes: NodeChanges, plan: RollPlan) -> NodeChanges:
    """What a node applies before the roll: everything but the restarts the roll does (its
    servers, the door's and its proxy's reloads, the router), its manifest (written after the
    roll) and the removals (after the programs that used them stop)."""
    rolled = {s.program for s in plan.servers if s.node == changes.node}
    later = rolled | ({DOOR} if plan.reload_door else set()) | ({ROUTER} if plan.restart_router else set()) | (
        {PROXY} if changes.node in plan.reload_proxies else set())
    return replace(changes, write=tuple(p for p in changes.write if not p.endswith("/" + MANIFEST)),
                   restart=tuple(p for p in changes.restart if p not in later), remove=())


def next_server(pending: Sequence[ServerEntry], healthy: Mapping[str, bool]) -> ServerEntry:
    """The server to roll next: one that serves nothing now (not healthy: restarting it
    costs no capacity) before the healthy ones, else the deployment's order."""
    return sorted(pending, key=lambda s: healthy.get(s.url, False))[0]


def in_flight(metrics_text: str | None) -> float | None:
    """Requests running or waiting on a server, from its /metrics (None: unreadable)."""
    if metrics_text is None:
        return None
    values = parse_metrics(metrics_text)
    if not any(name in values for name in IN_FLIGHT):
        return None
    return sum(values.get(name, 0.0) for name in IN_FLIGHT)


def drain_verdict(readings: Sequence[float | None], waited_s: float, timeout_s: float = DRAIN_TIMEOUT_S,
                  quiet: int = QUIET_READINGS) -> str:
    """'drained' when the last `quiet` readings found nothing in flight, 'timeout' when the
    wait is over, else 'wait'. An unreadable reading (None) counts as busy: a server that
    cannot say it is idle is not taken as idle."""
    last = list(readings)[-quiet:]
    if len(last) == quiet and all(r == 0 for r in last):
        return "drained"
    if waited_s >= timeout_s:
        return "timeout"
    return "wait"


def router_workers(body: str) -> list[str]:
    """The worker URLs of vllm-router's /list_workers answer ({"urls": [...]})."""
    try:
        data = json.loads(body or "{}")
    except ValueError:
        return []
    urls = data.get("urls") if isinstance(data, dict) else data
    return [str(item.get("url") if isinstance(item, dict) else item).rstrip("/") for item in urls or []]


def router_lists(body: str, url: str) -> bool:
    return url.rstrip("/") in router_workers(body)


# ---------------------------------------------------------------------- the driver


class Rollout:
    """Applies a rolling plan over the nodes' drivers (the side effects; no decisions)."""

    def __init__(self, deployment: Deployment, drivers: Mapping[str, NodeDriver], *, python: str,
                 router_port: int, health_timeout_s: float, reporter: Reporter | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        self.deployment = deployment
        self.drivers = drivers
        self.python = python
        self.router_url = f"http://127.0.0.1:{router_port}"
        self.health_timeout_s = health_timeout_s
        self.key: str | None = None            # what the proxies take /metrics with (apply's)
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self.reporter = reporter or NullReporter()
        self.sleep, self.clock = sleep, clock
        self.log: list[dict[str, object]] = []

    # -------------------------------------------------------------- the whole change

    def apply(self, plan: RollPlan, changes: Sequence[NodeChanges],
              key: str | None = None) -> list[dict[str, object]]:
        """Every node's change, the servers rolled one at a time; what each roll took. `key`:
        one the proxies take (the drain check reads the servers' /metrics through them)."""
        self.key = key
        by_node = {c.node: c for c in changes}
        first = {n: held_back(c, plan) for n, c in by_node.items()}

        def before(node: str) -> None:
            d, desired, c = self.drivers[node], self.deployment.node(node), first[node]
            d.converge_files(desired, c)
            d.run(d.prepare_ops(desired))
            d.run(d.program_ops(desired, c.start, c.restart, c.stop, c.revive))

        self._each(list(by_node), before)
        if plan.reload_door:
            router = self.drivers[self.deployment.router_node]
            router.run(router.reload_ops(self.deployment.node(self.deployment.router_node), DOOR))
            self.reporter.log("front door: reloaded its config")

        def reload_proxy(node: str) -> None:
            self.drivers[node].run(self.drivers[node].reload_ops(self.deployment.node(node), PROXY))

        self._each(list(plan.reload_proxies), reload_proxy)
        for node in plan.reload_proxies:
            self.reporter.log(f"{node}: proxy reloaded its config")
        pending = list(plan.servers)
        while pending:
            healthy = self._healthy(pending)
            server = next_server(pending, healthy)
            self.log.append(self.roll_one(server))
            pending.remove(server)
        if plan.restart_router:
            node = self.deployment.router_node
            self.drivers[node].run(self.drivers[node].program_ops(self.deployment.node(node), restart=(ROUTER,)))

        def after(node: str) -> None:
            d, desired, c = self.drivers[node], self.deployment.node(node), by_node[node]
            d.converge_files(desired, replace(c, write=tuple(p for p in c.write if p.endswith("/" + MANIFEST))))
            d.remove_files(c)

        self._each(list(by_node), after)
        return self.log

    def _each(self, nodes: Sequence[str], fn: Callable[[str], None]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
            for future in [pool.submit(fn, n) for n in nodes]:
                future.result()

    # -------------------------------------------------------------- one server

    def roll_one(self, server: ServerEntry) -> dict[str, object]:
        name = f"{server.node}/{server.program}"
        started = self.clock()
        self.router_call("POST", "/remove_worker?url=" + quote(server.url, safe=""), "take out", name)
        self.reporter.update(server.node, f"{server.program}: out of the router, draining")
        drained, drain_s = self.wait_drained(server)
        if not drained:
            self.reporter.log(f"{name}: still busy {self.drain_timeout_s:g} s after it left the router; "
                              f"restarting it anyway (its streams are cut)")
        d, desired = self.drivers[server.node], self.deployment.node(server.node)
        d.run(d.program_ops(desired, restart=(server.program,)))
        self.reporter.update(server.node, f"{server.program}: restarted, loading")
        healthy_s = self.wait_healthy(server)
        self.router_call("POST", "/add_worker?url=" + quote(server.url, safe=""), "put back", name)
        self.wait_listed(server)
        self.reporter.log(f"{name}: rolled (drained in {drain_s:.1f} s, healthy {healthy_s:.1f} s after "
                          f"its restart)")
        return {"server": name, "drained": drained, "drain_s": round(drain_s, 1),
                "healthy_s": round(healthy_s, 1), "total_s": round(self.clock() - started, 1)}

    def router_call(self, method: str, path: str, what: str, name: str) -> str:
        router = self.drivers[self.deployment.router_node]
        answer = router.probe(self.python, [{"id": "call", "url": self.router_url + path, "method": method,
                                             "timeout": 30}])["http"].get("call", {})
        if answer.get("status") != 200:
            raise ServeError(f"{name}: the router would not {what} the server ({method} {path.split('?')[0]}: "
                             f"{answer.get('status') or answer.get('error')} {str(answer.get('body', ''))[:200]})")
        return str(answer.get("body", ""))

    def wait_drained(self, server: ServerEntry) -> tuple[bool, float]:
        d = self.drivers[server.node]
        started = self.clock()
        readings: list[float | None] = []
        while True:
            answer = d.probe(self.python, [{"id": "m", "url": server.url + "/metrics", "timeout": 5, "key": True,
                                            "ca": self._ca(server.node)}], key=self.key)["http"]["m"]
            readings.append(in_flight(answer.get("body")) if answer.get("status") == 200 else None)
            verdict = drain_verdict(readings, self.clock() - started, self.drain_timeout_s)
            if verdict != "wait":
                return verdict == "drained", self.clock() - started
            self.sleep(DRAIN_POLL_S)

    def wait_healthy(self, server: ServerEntry) -> float:
        d, desired = self.drivers[server.node], self.deployment.node(server.node)
        program = desired.program(server.program)
        started = self.clock()
        while True:
            answer = d.probe(self.python, [{"id": "h", "url": server.url + "/health", "timeout": 2,
                                            "ca": self._ca(server.node)}])["http"]["h"]
            if answer.get("status") == 200:
                return self.clock() - started
            _, states = d.programs(desired.supervisor, {program.name: program.unit(self.deployment.name)})
            state = states.get(program.name)
            if state is not None and state.state in GAVE_UP:
                raise ServeError(f"{server.node}: {program.name} is {state.state} after its restart (its "
                                 f"supervisor gave up; the router runs without it); its log "
                                 f"{program.log}{d.log_cause(program.log)}")
            if self.clock() - started > self.health_timeout_s:
                raise ServeError(f"{server.node}: {program.name} is not healthy {self.health_timeout_s:g} s after "
                                 f"its restart (serve.health_timeout_s); the router runs without it")
            self.sleep(HEALTH_POLL_S)

    def wait_listed(self, server: ServerEntry) -> None:
        started = self.clock()
        while not router_lists(self.router_call("GET", "/list_workers", "list", server.url), server.url):
            if self.clock() - started > self.health_timeout_s:
                raise ServeError(f"the router does not list {server.url} {self.health_timeout_s:g} s after it "
                                 f"was put back")
            self.sleep(HEALTH_POLL_S)

    def _ca(self, node: str) -> str:
        """The deployment CA's copy on `node`: what the proxies' certificates are checked with."""
        return f"{self.deployment.node(node).serve_dir}/tls/ca.pem"

    def _healthy(self, servers: Sequence[ServerEntry]) -> dict[str, bool]:
        out = {}
        for node in sorted({s.node for s in servers}):
            gets = [{"id": s.url, "url": s.url + "/health", "timeout": 2, "ca": self._ca(node)}
                    for s in servers if s.node == node]
            answers = self.drivers[node].probe(self.python, gets)["http"]
            out.update({s.url: answers.get(s.url, {}).get("status") == 200 for s in servers if s.node == node})
        return out
