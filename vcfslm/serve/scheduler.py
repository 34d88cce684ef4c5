"""One serving window: a load generator and a continuous-batching scheduler on one rank.

The scheduler is a production server's with chunked prefill (vLLM's, Sarathi-Serve's
stall-free batching): requests that have arrived wait in FIFO order and are admitted
into free slots; their prompts go in pieces riding on the step that decodes every
running stream (decode tokens always come first: no running stream waits for a prompt);
the step that takes a prompt's last piece gives its first token (its TTFT); a request
leaves its slot when it has produced its output tokens. How much prompt a step takes
depends on the queue:
- at most one request waiting to go in, while streams decode: one piece of at most the
  engine's `chunk_tokens`, no longer than the linears run at the decode rate (the rank's
  probe), so the running streams' TPOT stays the decode step's;
- a backlog (two or more waiting to go in), or nothing decoding: pieces of as many
  waiting requests as have slots, up to `batched_tokens` prompt tokens in the step
  (vLLM's max_num_batched_tokens, 2048 on its CPU server). A queue then costs the
  streams one longer step, not one chunk per request and step: the prompts' throughput,
  and so the rate the rank holds, is no longer capped at a chunk per step.
Under the SLO rule (the engine's chunks sized from the tightest TPOT limit, Sarathi-Serve's
token budget: `Slots.capped`) every step beside running streams keeps to one piece of its
lane count's chunk, a backlog's too, so no step a running stream waits on costs more than
the limit by the rank's own numbers; with nothing decoding the prompts still go in batched.
No HTTP server: the measurement is the engine's, not a network stack's.

Arrivals (vcfslm.serving): open loop, every arrival time drawn before the window starts,
so a rank that falls behind sees its queue grow; or closed loop, N users who each send
the next request a think time after their last reply.

The loop is torch-free: it drives any object with TokenSlots' step/evict/free/reset
methods (engine/decode.py), and takes its clock, its sleep and its prompts as arguments,
so a unit test runs it against a fake engine on a fake clock.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..serving import arrivals
from ..serving import decisions as serving
from ..serving.decisions import Piece, Planned, ServeSpec
from ..serving.step_log import StepLog
from ..serving.window_plan import Ask, WindowPlan

# How long the loop sleeps at most while idle before it looks again (an arrival wakes it
# sooner: the sleep is until the next arrival).
IDLE_POLL_S = 0.05


class StepResult(Protocol):
    decoded: dict[int, int]     # each decoding slot's next token
    firsts: dict[int, int]      # slot -> first token, for the prompts whose last piece it took
    tokens: int                 # real tokens the step carried (decodes + prompt)
    prompt_tokens: int


class Slots(Protocol):
    chunk_tokens: int
    batched_tokens: int
    # Optional (TokenSlots has them; a fake engine may not): `rule` (how the chunk was
    # chosen), `chunks` (lane count -> chunk), `capped` (the SLO rule) and `step_chunk()`
    # (the next step's chunk, by its lane count).
    def free(self) -> list[int]: ...
    def step(self, pieces: list[Piece]) -> StepResult: ...
    def evict(self, slot: int) -> None: ...
    def reset(self) -> None: ...


@dataclass
class Request:
    """One request's life on the rank (times in seconds from the window's start)."""

    index: int
    user: int | None
    arrival_s: float
    input_tokens: int
    output_tokens: int
    counted: bool
    started_s: float | None = None     # its prefill began
    first_s: float | None = None       # its first token existed
    last_s: float | None = None        # its last token existed
    produced: int = 0
    token_s: list[float] | None = None  # each token's time (an HTTP client sees them all)
    error: str | None = None           # why an HTTP request failed (it then counts as unfinished)
    # From a workload (vcfslm.serving.workloads): the plan it came from (its prompt's segments, its
    # conversation and turn), and the prompt tokens the server's prefix cache held (None:
    # the server did not say).
    ask: Ask | None = None
    cached_tokens: int | None = None

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        return self.ask.segments if self.ask is not None else ()

    @property
    def prefix_tokens(self) -> int:
        return self.ask.prefix_tokens if self.ask is not None else 0

    @property
    def done(self) -> bool:
        return self.last_s is not None


@dataclass
class WindowOutcome:
    """What one window measured, before it becomes a ServeRecord."""

    requests: list[Request]
    wall_s: float
    generated_in_span: int
    busy_slot_seconds: float           # integral of busy slots over the measured span
    max_queue: int
    steps: int
    step_s: list[float] = field(default_factory=list)
    step_tokens: int = 0               # real tokens the steps carried (decodes + prompt pieces)
    prompt_tokens: int = 0             # of them, prompt tokens
    chunk_tokens: int = 0              # prompt tokens per step without a backlog (the largest lane count's)
    batched_tokens: int = 0            # ... with one
    batched_steps: int = 0             # steps that took several pieces or more than a chunk
    chunk_rule: str = ""               # how it was chosen: "slo:tpot<=580ms", "kernel" or "flag"
    chunk_by_lanes: dict[str, int] = field(default_factory=dict)   # lane count -> chunk (the SLO rule)
    time_scale: float = 0.0            # a replayed trace's time scale (0: not a replay)
    step_costs: dict[str, list[float]] = field(default_factory=dict)   # StepLog.to_json()

    @property
    def counted(self) -> list[Request]:
        return [r for r in self.requests if r.counted]


class _Occupancy:
    """The integral of busy slots over time, clipped to the measured span."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end
        self.total = 0.0
        self._busy = 0
        self._since = 0.0

    def change(self, now: float, busy: int) -> None:
        lo, hi = max(self._since, self.start), min(now, self.end)
        if hi > lo:
            self.total += self._busy * (hi - lo)
        self._busy, self._since = busy, now


class Arrivals:
    """A window's requests as its load generator plans them, for the in-process window and the
    HTTP one alike: open-loop arrivals all drawn at the start, closed-loop users' first
    requests (their follow-ups are planned with `plan` as each reply ends). With a workload
    (vcfslm.serving.workloads) its window plan draws them, and `replied` plans a conversation's next
    turn as each reply ends."""

    def __init__(self, spec: ServeSpec, load: float, input_tokens: int, rng: random.Random):
        self.spec, self.input_tokens, self.rng = spec, input_tokens, rng
        self.future: list[tuple[float, int, Request]] = []     # (arrival, index, request): a heap
        self.requests: list[Request] = []
        self.workload_plan: WindowPlan | None = None
        users = spec.load_kind == "users"
        if spec.workload is not None:
            draw = arrivals.process(spec.arrival).gaps
            assert draw is not None

            def gap(rate: float, r: random.Random) -> float:
                return draw(rate, 1, r, spec.burstiness)[0]

            self.workload_plan = WindowPlan(spec.workload, None if users else load, spec.duration_s, rng, gap,
                                            think_s=spec.think_s)
            for ask in self.workload_plan.first:
                self._add(ask, None)
        if users:
            for user in range(int(load)):
                # Users start spread over one think time, so they do not stay in lock-step.
                self.plan(rng.uniform(0, spec.think_s) if spec.think_s > 0 else 0.0, user)
        elif spec.workload is None:
            for planned in serving.open_loop_plan(spec, load, input_tokens, rng):
                self.plan(planned.arrival_s, None, planned)

    @property
    def time_scale(self) -> float:
        scale = self.workload_plan.time_scale if self.workload_plan is not None else None
        return scale or 0.0

    def plan(self, arrival: float, user: int | None, planned: Planned | None = None) -> None:
        spec, rng = self.spec, self.rng
        if self.workload_plan is not None and planned is None:
            self._add(self.workload_plan.draw(arrival), user)
            return
        if planned is None:
            planned = Planned(arrival, serving.draw_length(self.input_tokens, rng, spec.lengths, spec.length_low),
                              serving.draw_length(spec.output_tokens, rng, spec.lengths, spec.length_low))
        r = Request(len(self.requests), user, planned.arrival_s, planned.input_tokens, planned.output_tokens,
                    serving.in_span(planned.arrival_s, self.spec))
        self.requests.append(r)
        heapq.heappush(self.future, (r.arrival_s, r.index, r))

    def _add(self, ask: Ask, user: int | None) -> None:
        r = Request(len(self.requests), user, ask.arrival_s, ask.input_tokens, ask.output_tokens,
                    serving.in_span(ask.arrival_s, self.spec), ask=ask)
        self.requests.append(r)
        heapq.heappush(self.future, (r.arrival_s, r.index, r))

    def replied(self, r: Request, at: float) -> None:
        """`r`'s reply ended at `at`: its conversation's next turn, if it has one."""
        if self.workload_plan is None or r.ask is None or r.ask.conversation is None:
            return
        nxt = self.workload_plan.follow(r.ask, r.produced, at)
        if nxt is not None:
            self._add(nxt, r.user)


@dataclass
class _Admission:
    """A request whose prompt is going in: its slot and how many of its tokens are in."""

    request: Request
    slot: int
    prompt: Any
    done: int = 0

    @property
    def left(self) -> int:
        return self.request.input_tokens - self.done


def plan_pieces(admitting: list[_Admission], decoding: int, chunk: int, batched: int,
                capped: bool = False) -> list[Piece]:
    """The prompt pieces of one step, oldest admission first (the module docstring's rule):
    a chunk of the oldest while one waits beside running streams (with `capped`, the SLO
    rule, however many wait); else up to `batched` tokens across all of them."""
    if not admitting:
        return []
    if decoding and capped:
        a = admitting[0]
        return [Piece(a.slot, a.prompt, a.done, a.done + min(a.left, chunk), a.request.input_tokens)]
    budget = chunk if decoding and len(admitting) == 1 else batched
    pieces = []
    for a in admitting:
        take = min(a.left, budget)
        if take <= 0:
            break
        pieces.append(Piece(a.slot, a.prompt, a.done, a.done + take, a.request.input_tokens))
        budget -= take
    return pieces


def run_window(slots: Slots, spec: ServeSpec, load: float, input_tokens: int, rng: random.Random,
               prompt_for: Callable[[Request], Any], *, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep) -> WindowOutcome:
    """Serve one window at `load` (requests/s per rank, or users) for context `input_tokens`."""
    span_end = spec.duration_s - spec.cooldown_s
    closed = spec.load_kind == "users"
    planner = Arrivals(spec, load, input_tokens, rng)
    future, requests, plan = planner.future, planner.requests, planner.plan

    # A window starts with every slot free: the last one may have ended at its cutoff with
    # requests still decoding.
    slots.reset()
    chunk, batched = slots.chunk_tokens, slots.batched_tokens
    capped = bool(getattr(slots, "capped", False))
    step_chunk = getattr(slots, "step_chunk", None)
    waiting: deque[Request] = deque()
    running: dict[int, Request] = {}
    admitting: list[_Admission] = []    # prompts going in, oldest first
    occupancy = _Occupancy(spec.warmup_s, span_end)
    generated = max_queue = steps = step_tokens = prompt_tokens = batched_steps = 0
    step_times: list[float] = []
    step_log = StepLog()
    t0 = clock()
    # A step's period for the log: from the previous step's end (the loop's own work between
    # steps is part of what a stream waits per token), or from when the loop woke from idle.
    period_start = 0.0

    def now() -> float:
        return clock() - t0

    def produce(r: Request, at: float) -> None:
        nonlocal generated
        r.produced += 1
        if spec.warmup_s <= at <= span_end:
            generated += 1

    def finish(slot: int, r: Request, at: float) -> None:
        r.last_s = at
        slots.evict(slot)
        del running[slot]
        planner.replied(r, at)
        if closed and r.user is not None:
            follow = at + serving.think_time(spec.think_s, rng)
            if follow < spec.duration_s:
                plan(follow, r.user)

    def busy() -> int:
        return len(running) + len(admitting)

    while True:
        t = now()
        while future and future[0][0] <= t:
            waiting.append(heapq.heappop(future)[2])
        taken = {a.slot for a in admitting}
        free = [s for s in slots.free() if s not in taken]
        # Every waiting request that has a slot starts going in; plan_pieces decides how
        # much of each a step takes (a chunk of a lone one beside running streams).
        while waiting and free:
            r = waiting.popleft()
            r.started_s = t
            admitting.append(_Admission(r, free.pop(0), prompt_for(r)))
            occupancy.change(t, busy())
        max_queue = max(max_queue, len(waiting))   # those that must wait for a slot
        counted_left = any(r.counted and not r.done for r in requests)
        if t >= spec.cutoff_s or (t >= span_end and not counted_left and not busy()):
            break
        if busy():
            this_chunk = step_chunk() if step_chunk is not None else chunk
            pieces = plan_pieces(admitting, len(running), this_chunk, batched, capped)
            context = sum(r.input_tokens + r.produced for r in running.values())
            before = now()
            out = slots.step(pieces)
            at = now()
            steps += 1
            batched_steps += len(pieces) > 1 or sum(p.stop - p.start for p in pieces) > this_chunk
            step_times.append(at - before)
            # Lanes 0: nothing decoded (a prompt going in alone), as the simulator counts it.
            step_log.add((getattr(out, "lanes", 0) or len(running)) if running else 0,
                         [(p.start, p.stop, p.last) for p in pieces], context, at - min(period_start, before))
            period_start = at
            step_tokens += out.tokens
            prompt_tokens += out.prompt_tokens
            for slot, r in list(running.items()):
                produce(r, at)
                if r.produced >= r.output_tokens:
                    finish(slot, r, at)
            for piece in pieces:
                a = next(a for a in admitting if a.slot == piece.slot)
                a.done = piece.stop
                if piece.last:
                    admitting.remove(a)
                    r = a.request
                    running[a.slot] = r
                    r.first_s = at
                    produce(r, at)
                    if r.produced >= r.output_tokens:
                        finish(a.slot, r, at)
            occupancy.change(at, busy())
            continue
        if not future and not waiting:
            break                       # nothing waits, runs or will arrive
        sleep(max(0.0, min(future[0][0] - t, IDLE_POLL_S)))
        period_start = now()
    end = now()
    occupancy.change(end, busy())
    return WindowOutcome(requests, end, generated, occupancy.total, max_queue, steps, step_times,
                         step_tokens, prompt_tokens, chunk, batched, batched_steps,
                         chunk_rule=str(getattr(slots, "rule", "") or ""),
                         chunk_by_lanes={str(k): int(v) for k, v in (getattr(slots, "chunks", None) or {}).items()},
                         time_scale=planner.time_scale, step_costs=step_log.to_json())


def record_fields(outcome: WindowOutcome, spec: ServeSpec, limits: dict[str, Any]) -> dict[str, Any]:
    """The ServeRecord fields one window's outcome gives (the rest are the rank's identity)."""
    counted = outcome.counted
    done = [r for r in counted if r.done]
    ttft = [r.first_s - r.arrival_s for r in done]
    e2e = [r.last_s - r.arrival_s for r in done]
    tpot = [(e - f) / (r.produced - 1) * 1000.0 if r.produced > 1 else 0.0
            for r, f, e in zip(done, ttft, e2e, strict=True)]
    span = spec.span_s
    return {
        "duration_s": spec.duration_s, "warmup_s": spec.warmup_s, "cooldown_s": spec.cooldown_s,
        "span_s": span, "wall_s": outcome.wall_s, "offered": len(counted), "completed": len(done),
        "unfinished": len(counted) - len(done),
        "arrival_s": [r.arrival_s for r in done], "queue_s": [r.started_s - r.arrival_s for r in done],
        "ttft_s": ttft, "tpot_ms": tpot, "e2e_s": e2e,
        "request_input_tokens": [r.input_tokens for r in done],
        "request_output_tokens": [r.produced for r in done],
        "generated_tokens": outcome.generated_in_span,
        "rank_tps": outcome.generated_in_span / span if span > 0 else 0.0,
        "mean_active": outcome.busy_slot_seconds / span if span > 0 else 0.0,
        "max_queue": outcome.max_queue,
        "goodput": serving.goodput(ttft, tpot, span, limits, [r.input_tokens for r in done]),
        "chunk_tokens": outcome.chunk_tokens, "batched_tokens": outcome.batched_tokens,
        "chunk_rule": outcome.chunk_rule, "chunk_by_lanes": outcome.chunk_by_lanes,
        "steps": outcome.steps, "batched_steps": outcome.batched_steps,
        "step_tokens_mean": outcome.step_tokens / outcome.steps if outcome.steps else 0.0,
        "step_costs": outcome.step_costs,
        "prefill_share": outcome.prompt_tokens / outcome.step_tokens if outcome.step_tokens else 0.0,
        **workload_fields(spec, outcome, done),
    }


def workload_fields(spec: ServeSpec, outcome: WindowOutcome, done: list[Request]) -> dict[str, Any]:
    """The record's workload fields: which one, its replay's scale, and per finished counted
    request its conversation's prefix and what the server's prefix cache held of it."""
    w = spec.workload
    cached = [r.cached_tokens for r in done]
    return {"workload": "" if w is None else w.name, "workload_digest": "" if w is None else w.digest,
            "time_scale": outcome.time_scale,
            "request_prefix_tokens": [r.prefix_tokens for r in done] if w is not None else [],
            "request_cached_tokens": [c or 0 for c in cached] if any(c is not None for c in cached) else []}
