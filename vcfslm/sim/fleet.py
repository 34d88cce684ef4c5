"""Simulated serving windows (pure): one server, or a fleet of them behind the router.

A window draws its requests exactly as the bench's does (`serve.scheduler.Arrivals`, seeded
by `serving.window_seed` for rank 0 and the window's index), so one simulated server sees
the very arrivals the bench's rank 0 saw. A fleet of N servers is offered N times the
per-server load as one arrival stream (what a front door sees), which the router splits:
- round_robin: request i to server i mod N;
- power_of_two: two distinct servers at random, the one with fewer requests in flight
  (routed and not finished; the first drawn on a tie), as vllm-router's policy decides.
Servers are independent between the requests routed to them, so each runs lazily: only
the two a power_of_two choice looks at are brought to the arrival's time.

Each server's window becomes a `SimRecord` carrying the fields the bench's ServeRecord
carries for judging (`serve.scheduler.record_fields`), so `serving.load_results` pools them
and the bench's judging code reads them as it reads measured windows.

Closed loops (users) and conversations plan their next request when a reply ends: they are
simulated on one server only (a fleet's servers would then have to step in lockstep).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

from ..serve.scheduler import Arrivals, Request, WindowOutcome, record_fields
from ..serving import decisions as serving
from ..serving.decisions import ServeSpec
from .cost import StepModel
from .server import Policy, Server

ROUND_ROBIN, POWER_OF_TWO = "round_robin", "power_of_two"
ROUTERS = (ROUND_ROBIN, POWER_OF_TWO)
SIMULATED = "simulated"


@dataclass
class SimRecord:
    """One simulated server's window, in the ServeRecord fields the judging code reads."""

    load: float
    rank: int
    window: int
    fields: dict[str, Any]
    run_id: str = SIMULATED
    valid: bool = True
    invalid_reasons: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None


def _router(policy: str, servers: list[Server], rng: random.Random):
    n = len(servers)
    if policy not in ROUTERS:
        raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(ROUTERS)}")
    if policy == ROUND_ROBIN or n == 1:
        counter = iter(range(1 << 62))
        return lambda t: servers[next(counter) % n]

    def two(t: float) -> Server:
        a, b = rng.sample(range(n), 2)
        sa, sb = servers[a], servers[b]
        sa.advance(t)
        sb.advance(t)
        return sb if sb.in_flight < sa.in_flight else sa
    return two


@dataclass(frozen=True)
class Fleet:
    """The servers behind the router, and its policy."""

    servers: int = 1
    router: str = ROUND_ROBIN


ONE = Fleet()


def simulate_window(cost: StepModel, policy: Policy, spec: ServeSpec, load: float, input_tokens: int,
                    limits: dict[str, Any], window: int = 0, fleet_of: Fleet = ONE) -> list[SimRecord]:
    """One window at `load` per server (requests/s, or users on one server): a record per server."""
    servers, router = fleet_of.servers, fleet_of.router
    closed = spec.load_kind == "users"
    follows = closed or (spec.workload is not None and spec.workload.multi_turn)
    if follows and servers > 1:
        raise ValueError("closed loops and conversations are simulated on one server")
    seed = serving.window_seed(spec.seed, 0, load, input_tokens, window)
    rng = random.Random(seed)
    planner = Arrivals(spec, load if closed else load * servers, input_tokens, rng)
    span = (spec.warmup_s, spec.duration_s - spec.cooldown_s)

    def on_finish(r: Request, at: float) -> None:
        planner.replied(r, at)
        if closed and r.user is not None:
            follow = at + serving.think_time(spec.think_s, rng)
            if follow < spec.duration_s:
                planner.plan(follow, r.user)

    fleet = [Server(cost, policy, on_finish if follows else None, span) for _ in range(servers)]
    cutoff = spec.cutoff_s
    future = planner.future
    if follows:
        one = fleet[0]
        while True:
            nxt = min(future[0][0], cutoff) if future else cutoff
            if one.advance(nxt, stop_on_finish=True):
                continue
            if not future or future[0][0] >= cutoff:
                break
            one.submit(heapq.heappop(future)[2])
    else:
        route = _router(router, fleet, random.Random(seed ^ 0x5EED))
        while future and future[0][0] < cutoff:
            r = heapq.heappop(future)[2]
            route(r.arrival_s).submit(r)
    out = []
    for i, s in enumerate(fleet):
        s.advance(cutoff)
        outcome = WindowOutcome(s.requests, s.now, s.generated_in_span, s.busy_slot_seconds, s.max_queue, s.steps,
                                chunk_tokens=max(dict(policy.chunks).values()) if policy.chunks else 0,
                                batched_tokens=policy.batched_tokens)
        out.append(SimRecord(float(load), i, window, record_fields(outcome, spec, limits)))
    return out
