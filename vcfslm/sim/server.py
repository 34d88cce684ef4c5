"""One simulated server (pure): the serving scheduler's decisions step by step on a
modelled clock, with runs of plain decode steps jumped over in closed form.

Two schedulers, each as it really decides:
- vcfslm's (vcfslm/serve/scheduler.py): arrivals wait in FIFO order and go into the lowest
  free slot; each step's prompt pieces are the scheduler's own `plan_pieces` (a chunk of the
  oldest admission beside running streams, its lane count's chunk under the SLO rule, else
  up to `batched_tokens` across a backlog); the decode lanes are the engine's bucket over
  the highest decoding slot, and a lone piece no longer than its chunk runs padded to it (a
  primed graph);
- vLLM's (its V1 scheduler with chunked prefill): each step has `max_num_batched_tokens`;
  every decoding sequence takes one token first, then the prompts being prefilled take
  what is left, oldest first, then waiting requests are admitted while fewer than
  `max_num_seqs` run and budget is left; a step runs at its exact token count.

A step's time is `StepModel`'s. A request's first token exists at the end of the step that
took its prompt's last piece, and every later token at the end of each step it decoded in,
as the bench's window records them. Arrivals reach the scheduler at its next step boundary
(the bench's loop looks at its clock between steps).

Between two changes of the batch (an arrival, a completion, a prompt's last piece) every
step is a plain decode at the same lanes, each stream one token longer per step, or that
and one more equal piece of the same prompt (vcfslm's chunk): `LinearRun` sums such a run
in closed form, so the loop's cost is per request, not per token. That is what lets a fleet of
hundreds of servers run an hour in seconds (docs/predict.md has the figures).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..serve.scheduler import Request, plan_pieces
from ..serving.decisions import Piece
from .cost import LinearRun, StepModel

VCFSLM, VLLM = "vcfslm", "vllm"
SCHEDULERS = (VCFSLM, VLLM)


@dataclass(frozen=True)
class Policy:
    """How a server schedules: `scheduler` one of SCHEDULERS; `slots` its slots (vLLM's
    max_num_seqs); `batched_tokens` the prompt tokens one step takes under a backlog (vLLM's
    max_num_batched_tokens: its whole step's budget); vcfslm's `chunks` (lane count -> chunk)
    and `lane_buckets` (the lane counts its steps run at), `capped` its SLO rule."""

    scheduler: str
    slots: int
    batched_tokens: int
    chunks: tuple[tuple[int, int], ...] = ()
    lane_buckets: tuple[int, ...] = ()
    capped: bool = False

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; known: {', '.join(SCHEDULERS)}")
        if self.scheduler == VCFSLM and (not self.chunks or not self.lane_buckets):
            raise ValueError("vcfslm's scheduler needs its chunks and lane buckets")
        if self.lane_buckets and max(self.lane_buckets) < self.slots:
            raise ValueError(f"lane buckets {self.lane_buckets} do not reach {self.slots} slots")
        # Lookups the loop makes every step: the lanes over each highest slot, each lanes' chunk.
        table = dict(self.chunks)
        object.__setattr__(self, "_lanes", tuple(next((b for b in self.lane_buckets if b > h), 0)
                                                 for h in range(self.slots)))
        object.__setattr__(self, "_chunk", {n: table.get(n, max(table.values(), default=0))
                                            for n in (*self.lane_buckets, 1)})

    def lanes(self, highest_slot: int) -> int:
        return self._lanes[highest_slot]

    def chunk(self, lanes: int) -> int:
        return self._chunk[lanes]


class _Admission:
    """A prompt going in (the scheduler's admission: its request, slot and tokens done)."""

    __slots__ = ("request", "slot", "prompt", "done")

    def __init__(self, request: Request, slot: int):
        self.request, self.slot, self.prompt, self.done = request, slot, None, 0

    @property
    def left(self) -> int:
        return self.request.input_tokens - self.done


class Server:
    """One server's scheduler on a modelled clock. `submit` hands it a request (at its arrival,
    in time order); `advance(t)` runs every step that ends by t. `in_flight` is what the
    router sees: submitted and not yet finished."""

    def __init__(self, cost: StepModel, policy: Policy, on_finish: Callable[[Request, float], None] | None = None,
                 span: tuple[float, float] = (0.0, float("inf"))):
        self.cost, self.policy, self.on_finish = cost, policy, on_finish
        self.now = 0.0
        self.pending: list[tuple[float, int, Request]] = []
        self.waiting: deque[Request] = deque()
        self.admitting: list[_Admission] = []
        self.running: dict[int, Request] = {}       # slot (vcfslm) or request index (vLLM) -> request
        self.kv_tokens = 0                          # context tokens of the decoding streams
        self.in_flight = 0
        self.steps = 0
        self.max_queue = 0
        self.requests: list[Request] = []
        self.span_start, self.span_end = span
        self.generated_in_span = 0
        self.busy_slot_seconds = 0.0
        self._busy_since = 0.0
        # The end of the next step when the last advance stopped before it: a later advance
        # to an earlier time has nothing to do (the router asks often; the answer is cheap).
        self._next_end: float | None = None

    # -------------------------------------------------------------- the router's side

    def submit(self, r: Request) -> None:
        if r.arrival_s <= self.now:
            self._next_end = None       # it is seen before the next step: that step may change
        heapq.heappush(self.pending, (r.arrival_s, r.index, r))
        self.requests.append(r)
        self.in_flight += 1

    # -------------------------------------------------------------- the clock

    def advance(self, until: float, stop_on_finish: bool = False) -> bool:
        """Run every step that ends by `until`. With stop_on_finish, return True right after a
        step in which a request finished (a closed loop plans its next request then)."""
        if self._next_end is not None and until < self._next_end:
            return False
        self._next_end = None
        vllm = self.policy.scheduler == VLLM
        while True:
            now = self.now
            pending = self.pending
            while pending and pending[0][0] <= now:
                self.waiting.append(heapq.heappop(pending)[2])
            if not vllm:
                self._admit_to_slots(now)
            if len(self.waiting) > self.max_queue:
                self.max_queue = len(self.waiting)
            pieces, lanes, chunk = self._plan(vllm)
            if not pieces and not self.running:
                if pending and pending[0][0] <= until:
                    self._occupancy(now)
                    self.now = pending[0][0]
                    continue
                if until > now:
                    self._occupancy(now)
                    self.now = until
                return False
            if pieces:
                finished = self._mixed_step(pieces, lanes, chunk, until, vllm)
            else:
                finished = self._decode_run(lanes, until)
            if finished is None:
                return False
            if finished and stop_on_finish:
                return True

    def _admit_to_slots(self, now: float) -> None:
        if not self.waiting:
            return
        taken = set(self.running) | {a.slot for a in self.admitting}
        if len(taken) >= self.policy.slots:
            return
        free = [s for s in range(self.policy.slots) if s not in taken]
        self._occupancy(now)
        while self.waiting and free:
            r = self.waiting.popleft()
            r.started_s = now
            self.admitting.append(_Admission(r, free.pop(0)))

    def _plan(self, vllm: bool) -> tuple[list[Piece], int, int]:
        """This step's prompt pieces, its decode lanes and (vcfslm) its chunk."""
        if not vllm:
            lanes = self.policy.lanes(max(self.running)) if self.running else 0
            chunk = self.policy.chunk(lanes or 1)
            pieces = plan_pieces(self.admitting, len(self.running), chunk, self.policy.batched_tokens,
                                 self.policy.capped) if self.admitting else []
            return pieces, lanes, chunk
        budget = self.policy.batched_tokens - len(self.running)
        pieces = []
        for a in self.admitting:
            if budget <= 0:
                break
            take = min(a.left, budget)
            pieces.append(Piece(a.slot, None, a.done, a.done + take, a.request.input_tokens))
            budget -= take
        if self.waiting and budget > 0 and len(self.running) + len(self.admitting) < self.policy.slots:
            self._occupancy(self.now)
            while self.waiting and budget > 0 and len(self.running) + len(self.admitting) < self.policy.slots:
                r = self.waiting.popleft()
                r.started_s = self.now
                a = _Admission(r, r.index)
                self.admitting.append(a)
                take = min(a.left, budget)
                pieces.append(Piece(a.slot, None, 0, take, r.input_tokens))
                budget -= take
        return pieces, len(self.running), 0

    def _mixed_step(self, pieces: list[Piece], lanes: int, chunk: int, until: float, vllm: bool) -> bool | None:
        cost = self.cost
        padded = chunk if (not vllm and len(pieces) == 1 and pieces[0].stop - pieces[0].start <= chunk) else 0
        if padded and self.running and pieces[0].stop < pieces[0].length:
            return self._piece_run(pieces[0], lanes, chunk, until)
        prompt = sum(cost.piece_s(p.start, p.stop, p.length, padded) for p in pieces)
        took = cost.decode_s(lanes, self.kv_tokens) + (prompt * cost.idle_piece_scale if lanes <= 0 else prompt)
        at = self.now + took
        if at > until:
            self._next_end = at
            return None
        self._occupancy(at)
        self.now = at
        self.steps += 1
        self._count_tokens(len(self.running), at)
        finished = self._produce(1, at)
        by_slot = {a.slot: a for a in self.admitting}
        for p in pieces:
            a = by_slot[p.slot]
            a.done = p.stop
            if p.stop >= p.length:
                self.admitting.remove(a)
                r = a.request
                r.first_s = at
                r.produced = 1
                self._count_tokens(1, at)
                if r.produced >= r.output_tokens:
                    self._finish(r, at)
                    finished = True
                else:
                    self.running[a.slot] = r
                    self.kv_tokens += r.input_tokens + 1
        return finished

    def _piece_run(self, piece: Piece, lanes: int, chunk: int, until: float) -> bool | None:
        """Steps that each take one more full chunk of the oldest admission's prompt (not its
        last piece) beside the running streams, jumped over until the next change."""
        cost, running = self.cost, self.running
        a = self.admitting[0]
        start = piece.start
        # Step k: the lanes, the streams' KV one token longer each step, a chunk at offset
        # start + k x chunk (its causal attention grows linearly with the offset).
        first = (cost.decode_s(lanes, self.kv_tokens) + chunk * cost.prompt_token_s
                 + cost.attention_s * cost.attention_pair * ((start + chunk) * (start + chunk + 1) - start * (start + 1)))
        slope = cost.kv_token_s * len(running) + cost.attention_s * cost.attention_pair * 2 * chunk * chunk
        run = LinearRun(first, slope)
        n = min((a.left - 1) // chunk, min(r.output_tokens - r.produced for r in running.values()))
        return self._run(run, n, until, lambda k: setattr(a, "done", a.done + k * chunk))

    def _decode_run(self, lanes: int, until: float) -> bool | None:
        running = self.running
        run = LinearRun(self.cost.decode_s(lanes, self.kv_tokens), self.cost.kv_token_s * len(running))
        n = min(r.output_tokens - r.produced for r in running.values())
        return self._run(run, n, until, None)

    def _arrivals_change_steps(self) -> bool:
        """Would a request arriving now change the steps of the current run? Not when it only
        waits: no slot (or sequence) is free, or (vcfslm's SLO rule beside running streams) the
        steps keep to the oldest admission's chunk however many go in behind it."""
        policy = self.policy
        if len(self.running) + len(self.admitting) >= policy.slots:
            return False
        return not (policy.scheduler == VCFSLM and policy.capped and self.admitting and self.running)

    def _run(self, run: LinearRun, n: int, until: float, also) -> bool | None:
        """At most n steps of `run`, stopping at the step an arrival lands in (when it changes
        the steps) and before any step that would end past `until`; None when no step fits."""
        stop_at_arrivals = self._arrivals_change_steps()
        if self.pending and stop_at_arrivals:
            n = min(n, run.steps_to_reach(self.pending[0][0] - self.now))
        n = min(n, run.steps_within(until - self.now))
        if n <= 0:
            self._next_end = self.now + run.first
            return None
        start = self.now
        self.now = start + run.elapsed(n)
        self.steps += n
        streams = len(self.running)
        if streams and self.span_end >= start and self.span_start <= self.now:
            inside = (run.steps_within(self.span_end - start)
                      - (run.steps_within(self.span_start - start - 1e-12) if self.span_start > start else 0))
            self.generated_in_span += streams * max(0, min(inside, n))
        if not stop_at_arrivals:
            self._arrivals_within(run, start, n)
        self._occupancy(self.now)
        if also is not None:
            also(n)
        return self._produce(n, self.now)

    def _arrivals_within(self, run: LinearRun, start: float, n: int) -> None:
        """The requests that arrived during a run and only wait: each seen at the end of the
        step it arrived in, and (vcfslm) admitted there into a free slot, as the loop would;
        those seen at the run's last step end are left to the loop (after its completions)."""
        pending = self.pending
        while pending and pending[0][0] <= self.now:
            k = run.steps_to_reach(pending[0][0] - start)
            if k >= n:
                break
            seen = start + run.elapsed(k)
            self.waiting.append(heapq.heappop(pending)[2])
            if self.policy.scheduler == VCFSLM:
                self._admit_to_slots(seen)
            self.max_queue = max(self.max_queue, len(self.waiting))

    def _count_tokens(self, tokens: int, at: float) -> None:
        if self.span_start <= at <= self.span_end:
            self.generated_in_span += tokens

    def _produce(self, n: int, at: float) -> bool:
        """Every decoding stream n tokens further; those done finish at `at`."""
        running = self.running
        if not running:
            return False
        self.kv_tokens += n * len(running)
        done = []
        for slot, r in running.items():
            r.produced += n
            if r.produced >= r.output_tokens:
                done.append(slot)
        for slot in done:
            r = running.pop(slot)
            self.kv_tokens -= r.input_tokens + r.produced
            self._finish(r, at)
        return bool(done)

    def _finish(self, r: Request, at: float) -> None:
        r.last_s = at
        self.in_flight -= 1
        if self.on_finish is not None:
            self.on_finish(r, at)

    def _occupancy(self, now: float) -> None:
        """Busy slots (decoding or going in) integrated over the measured span."""
        lo, hi = max(self._busy_since, self.span_start), min(now, self.span_end)
        if hi > lo:
            self.busy_slot_seconds += (len(self.running) + len(self.admitting)) * (hi - lo)
        self._busy_since = now
