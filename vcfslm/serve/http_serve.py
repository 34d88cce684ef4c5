"""One serving window against an HTTP server: vcfslm's own arrival processes, each request
sent on a thread of its own the moment it is due, its tokens timed as they stream back.

The same plan as the in-process window (serve/scheduler.py): open-loop arrivals drawn before
the window starts, closed-loop users who send again a think time after their last token,
only requests arriving inside the measured span counted, a cutoff after which an
unfinished request has missed every limit. What differs is who schedules: the server
does, so the client only keeps its promise to send on time. A request that went out
later than planned by more than the allowed lag means the offered load was lower than
the record says, and the window is marked invalid with that lag.

Torch-free, and the sending is a callable, so a unit test runs the loop against a fake
server or a fake `send` on the real clock.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..serving import decisions as serving
from ..serving import servers
from ..serving.decisions import ServeSpec
from .openai_client import Stream
from .scheduler import IDLE_POLL_S, Arrivals, Request, WindowOutcome, _Occupancy, record_fields

# After the cutoff, how long the loop waits for the threads of requests still out (each
# gives up at the cutoff on its own: this only bounds a socket that ignores its timeout).
JOIN_GRACE_S = 5.0
MAX_ERRORS_KEPT = 5


@dataclass
class HttpOutcome(WindowOutcome):
    """A window's outcome plus what only a client sees: send lags and failures."""

    lags_s: list[float] = field(default_factory=list)       # counted requests: sent - planned
    errors: list[str] = field(default_factory=list)
    failed: int = 0


Send = Callable[[Request, float], Stream]   # (request, deadline on the window's clock) -> its stream


def run_http_window(send: Send, spec: ServeSpec, load: float, input_tokens: int, rng: random.Random, *,
                    clock: Callable[[], float] = time.perf_counter,
                    sleep: Callable[[float], None] = time.sleep) -> HttpOutcome:
    """Drive one window at `load` (requests/s per rank, or users) for context `input_tokens`.

    `send(request, deadline)` streams one request and returns its Stream, its times on
    `clock`; the deadline is the window's cutoff on that clock."""
    span_end = spec.duration_s - spec.cooldown_s
    closed = spec.load_kind == "users"
    lock = threading.Lock()
    planner = Arrivals(spec, load, input_tokens, rng)
    future, requests, plan = planner.future, planner.requests, planner.plan
    threads: list[threading.Thread] = []
    in_flight: set[int] = set()
    occupancy = _Occupancy(spec.warmup_s, span_end)
    t0 = clock()
    deadline = t0 + spec.cutoff_s

    def now() -> float:
        return clock() - t0

    def serve_one(r: Request) -> None:
        stream = send(r, deadline)
        with lock:
            r.started_s = None if stream.sent_s is None else stream.sent_s - t0
            times = [t - t0 for t in stream.token_s]
            r.token_s = times
            r.produced = stream.tokens if stream.ok else len(times)
            if times:
                r.first_s = times[0]
            if stream.ok and times:
                r.last_s = times[-1]
            else:
                r.error = stream.error or "the server sent no token"
            r.cached_tokens = stream.cached_tokens
            in_flight.discard(r.index)
            at = now()
            occupancy.change(at, len(in_flight))
            if r.done:
                planner.replied(r, at)
            if closed and r.user is not None and r.done:
                follow = at + serving.think_time(spec.think_s, rng)
                if follow < spec.duration_s:
                    plan(follow, r.user)

    while True:
        t = now()
        with lock:
            while future and future[0][0] <= t:
                r = heapq.heappop(future)[2]
                in_flight.add(r.index)
                occupancy.change(t, len(in_flight))
                thread = threading.Thread(target=serve_one, args=(r,), daemon=True, name=f"request-{r.index}")
                threads.append(thread)
                thread.start()
            counted_left = any(r.counted and not r.done and r.error is None for r in requests)
            busy = bool(in_flight)
            next_at = future[0][0] if future else None
        if t >= spec.cutoff_s or (t >= span_end and not counted_left and not busy):
            break
        if next_at is None and not busy:
            break                      # nothing is out or will arrive
        sleep(max(0.0, min((next_at - t) if next_at is not None else IDLE_POLL_S, IDLE_POLL_S)))
    end_by = time.monotonic() + JOIN_GRACE_S
    for thread in threads:
        thread.join(max(0.0, end_by - time.monotonic()))
    with lock:
        end = now()
        occupancy.change(end, len(in_flight))
        generated = sum(1 for r in requests for at in (r.token_s or ()) if spec.warmup_s <= at <= span_end)
        counted = [r for r in requests if r.counted]
        lags = [r.started_s - r.arrival_s for r in counted if r.started_s is not None]
        failures = [r for r in counted if r.error is not None]
        errors: list[str] = []
        for r in failures:
            if r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
                errors.append(r.error)
        return HttpOutcome(list(requests), end, generated, occupancy.total, 0, 0, [], time_scale=planner.time_scale,
                           lags_s=lags, errors=errors, failed=len(failures))


def http_record_fields(outcome: HttpOutcome, spec: ServeSpec, limits: dict[str, Any], server: str,
                       server_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ServeRecord fields of an HTTP window: the in-process ones, plus what the client saw."""
    fields_ = record_fields(outcome, spec, limits)
    done = [r for r in outcome.counted if r.done]
    metrics = dict(server_metrics or {})
    fields_.update(
        server=server, sent_s=[r.started_s for r in done],
        token_s=[[round(t, 5) for t in (r.token_s or ())] for r in done],
        max_send_lag_s=max(outcome.lags_s, default=0.0), failed=outcome.failed, errors=outcome.errors,
        server_metrics=metrics,
        # The server's queue, not the client's: requests waiting for a sequence slot.
        max_queue=int(metrics.get("waiting_max", 0)))
    return fields_


def invalid_reasons(outcome: HttpOutcome, spec_lag_s: float) -> list[str]:
    """Why an HTTP window cannot be trusted as measured (empty: it can)."""
    problem = servers.lag_problem(outcome.lags_s, spec_lag_s)
    return [problem] if problem else []
