"""The requests of one serving window drawn from a workload (pure, standard library only).

How a window draws its requests from a workload (`WindowPlan`):
- Sampled: the arrival process of the spec at `load` requests/s; each request's lengths
  drawn from the workload (a mix's distributions, or a row of the file).
- Replay: the rows' own times, scaled so their mean rate is `load` (the time scale is
  `load / mean_rate`, recorded per window). Each window starts at a seeded offset into
  the trace and wraps around its end, so repeats see different stretches of it.
- Conversations: a conversation's first turn arrives by the spec's process (or its own
  time in a replay) at `load / mean turns` conversations/s, so requests arrive at about
  `load`/s; each next turn arrives its think time after the previous reply and carries the
  history (earlier prompts and replies) as its prefix, so a server's prefix cache hits it."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .workloads import MOONCAKE_BLOCK_TOKENS, Row, Segment, Workload, stable_key, trace_span


@dataclass(frozen=True)
class Ask:
    """One request a window plans: when, how long, and its prompt's segments."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    segments: tuple[Segment, ...] = ()
    conversation: int | None = None     # the window's conversation number
    turn: int = 0
    prefix_tokens: int = 0              # of the prompt, the tokens its conversation sent before


@dataclass
class _Conversation:
    """A conversation going on in a window: what it sent so far and what comes next."""

    number: int
    history: list[Segment]
    turns_left: int                       # mixes: further turns still to come
    rows: list[Row] = field(default_factory=list)   # files: its later turns, in order


class WindowPlan:
    """The requests of one window of a workload (the module docstring): `first`, planned at
    the start, then `follow(ask, produced, replied_at)` after each reply of a conversation.

    gaps(rate, rng) -> the next open-loop gap: the spec's arrival process."""

    # A replay compressed so far that one window would hold more requests than this is a
    # mistake in the load, not a workload.
    MAX_ASKS = 1_000_000

    def __init__(self, workload: Workload, rate: float | None, duration_s: float, rng: random.Random,
                 gaps: Callable[[float, random.Random], float], *, think_s: float = 0.0):
        """rate None: a closed loop's window, whose users `draw` each request themselves."""
        self.workload, self.rate, self.duration_s, self.rng = workload, rate or 0.0, duration_s, rng
        self.think_s = think_s
        self.time_scale: float | None = None
        self.first: list[Ask] = []
        self._conversations: dict[int, _Conversation] = {}
        self._starts = [r for r in workload.rows if r.conversation is None]
        self._later: dict[str, list[Row]] = {}
        for name, turns in _by_conversation(workload.rows).items():
            self._starts.append(turns[0])
            self._later[name] = turns[1:]
        if rate is None:
            return
        if workload.replay:
            self._replay()
            return
        multi = workload.multi_turn
        rate = rate / max(workload.mean_turns, 1.0) if multi else rate
        t = 0.0
        while True:
            t += gaps(rate, rng)
            if t >= duration_s:
                return
            row = self._starts[rng.randrange(len(self._starts))] if self._starts else None
            self._start(t, row) if multi else self.first.append(self._single(t, row))
            if len(self.first) > self.MAX_ASKS:
                raise ValueError(f"more than {self.MAX_ASKS} requests in one window at {rate:g}/s")

    def draw(self, at: float) -> Ask:
        """A request that stands alone arriving at `at`, its lengths drawn from the workload
        (a closed-loop user's next request)."""
        return self._single(at, self._starts[self.rng.randrange(len(self._starts))] if self._starts else None)

    def _single(self, at: float, row: Row | None) -> Ask:
        """A request that stands alone, arriving at `at`."""
        w, rng = self.workload, self.rng
        if w.kind == "fixed":
            return Ask(at, w.input_tokens, w.output_tokens)
        mix = w.mix
        if mix is not None:
            system = ((stable_key("system", mix.name), mix.system_tokens),) if mix.system_tokens else ()
            ins = min(mix.system_tokens + mix.prompt.draw(rng), mix.max_context)
            return Ask(at, ins, mix.output.draw(rng), (*system, (rng.getrandbits(62), ins - mix.system_tokens)))
        assert row is not None
        return Ask(at, row.input_tokens, row.output_tokens, self._row_segments(row))

    def _row_segments(self, row: Row) -> tuple[Segment, ...]:
        """A file's request: fresh tokens, or a trace's blocks (equal ids, equal tokens)."""
        if not row.blocks:
            return ((self.rng.getrandbits(62), row.input_tokens),)
        out: list[Segment] = []
        left = row.input_tokens
        for block in row.blocks:
            take = min(MOONCAKE_BLOCK_TOKENS, left)
            out.append((stable_key("block", block), take))
            left -= take
        if left > 0:
            out.append((self.rng.getrandbits(62), left))
        return tuple(out)

    def _replay(self) -> None:
        """The trace's own times from a seeded offset, scaled, wrapping round its end; a later
        turn of a conversation follows its reply, not the clock."""
        starts = sorted(self._starts, key=lambda r: float(r.arrival_s))      # type: ignore[arg-type]
        every = sorted(float(r.arrival_s) for r in self.workload.rows)       # type: ignore[arg-type]
        span = trace_span(every)
        # The speed-up that makes the trace's mean rate the load (--time-scale gives loads so).
        scale = self.rate / (len(every) / span)
        self.time_scale = scale
        times = [float(r.arrival_s) for r in starts]                         # type: ignore[arg-type]
        offset = self.rng.uniform(every[0], every[0] + span)
        i, lap = bisect.bisect_left(times, offset), 0
        while True:
            if i == len(times):
                i, lap = 0, lap + 1
            at = (times[i] + lap * span - offset) / scale
            if at >= self.duration_s:
                return
            self._start(at, starts[i])
            i += 1
            if len(self.first) > self.MAX_ASKS:
                raise ValueError(f"more than {self.MAX_ASKS} requests in one window at a time scale of {scale:g}")

    def _start(self, at: float, row: Row | None) -> None:
        """A conversation's first turn, or a request that stands alone, arriving at `at`."""
        if row is not None and row.conversation is None:
            self.first.append(self._single(at, row))
            return
        number = len(self._conversations)
        if row is not None:
            conv = _Conversation(number, [], 0, list(self._later.get(str(row.conversation), ())))
            ask = self._turn(conv, at, row.input_tokens, row.output_tokens, row.prefix_tokens)
        else:
            mix = self.workload.mix
            assert mix is not None
            system = [(stable_key("system", mix.name), mix.system_tokens)] if mix.system_tokens else []
            conv = _Conversation(number, system, self._geometric(mix.turns) - 1)
            ask = self._turn(conv, at, mix.prompt.draw(self.rng), mix.output.draw(self.rng), None)
        self._conversations[number] = conv
        self.first.append(ask)

    def _geometric(self, mean: float) -> int:
        """A conversation's turns: geometric on 1, 2, … with this mean."""
        n = 1
        while mean > 1 and self.rng.random() > 1.0 / mean and n < 1000:
            n += 1
        return n

    def _turn(self, conv: _Conversation, at: float, size: int, outs: int, prefix: int | None) -> Ask:
        """A turn: the history so far (or a file's `prefix` tokens of it) and new tokens.
        From a file (`prefix` given) `size` is the whole prompt; from a mix it is the turn's
        new tokens, and the prompt is the history plus them."""
        have = sum(n for _, n in conv.history)
        shared = have if prefix is None else min(prefix, have)
        ins = have + size if prefix is None else size
        segments = _take(conv.history, shared)
        if ins > shared:
            segments = (*segments, (self.rng.getrandbits(62), ins - shared))
        return Ask(at, ins, outs, segments, conv.number, 0, shared)

    def follow(self, ask: Ask, produced: int, replied_at: float) -> Ask | None:
        """The conversation's next turn after `ask`'s reply (`produced` tokens, done at
        `replied_at` on the window's clock); None when it has ended, would outgrow the
        mix's context, or would arrive after the window."""
        conv = self._conversations.get(ask.conversation) if ask.conversation is not None else None
        if conv is None:
            return None
        # The history a client sends back: the prompt and the reply (a stand-in of the
        # reply's length: what the server said is not kept, and its prefix-cache blocks
        # hold the prompt's tokens alike).
        conv.history = [*ask.segments, (stable_key("reply", conv.number, ask.turn, ask.arrival_s), max(produced, 0))]
        mix = self.workload.mix
        if conv.rows:
            row = conv.rows.pop(0)
            think = row.think_s if row.think_s is not None else self.think_s
            at = replied_at + (self.rng.expovariate(1.0 / think) if think > 0 else 0.0)
            nxt = self._turn(conv, at, row.input_tokens, row.output_tokens, row.prefix_tokens)
        elif mix is not None and conv.turns_left > 0:
            conv.turns_left -= 1
            think = self.think_s if self.think_s > 0 else mix.think_s
            at = replied_at + (self.rng.expovariate(1.0 / think) if think > 0 else 0.0)
            nxt = self._turn(conv, at, mix.prompt.draw(self.rng), mix.output.draw(self.rng), None)
            if nxt.input_tokens > mix.max_context:
                return None
        else:
            return None
        return None if nxt.arrival_s >= self.duration_s else replace(nxt, turn=ask.turn + 1)


def _by_conversation(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """Each conversation's rows in turn order."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        if r.conversation is not None:
            out.setdefault(r.conversation, []).append(r)
    return {name: sorted(turns, key=lambda r: r.turn) for name, turns in out.items()}


def _take(segments: Sequence[Segment], tokens: int) -> tuple[Segment, ...]:
    """The first `tokens` tokens of a segment list (the last segment cut short if need be)."""
    out: list[Segment] = []
    left = tokens
    for key, n in segments:
        if left <= 0:
            break
        out.append((key, min(n, left)))
        left -= n
    return tuple(out)
