"""Workloads: what the requests of a serving window look like (pure, standard library only).

A workload is a named, recorded thing. `--workload` and the inventory's
`bench.serve.workload` take one of:
- `fixed:IN/OUT`: every request IN prompt tokens and OUT output tokens. Without a
  workload a run is this at its contexts and output length (the brief's method).
- `chat`, `rag`: synthetic mixes whose lengths follow published statistics (`MIXES`, each
  citing its source). Facts carry over; no data is copied.
- a JSONL file of requests, one object per line: `input_tokens`, `output_tokens`, and
  optionally `arrival_s` (a replay), `conversation` and `turn` (a multi-turn chat),
  `prefix_tokens` (how much of the prompt is its conversation's history) and `think_s`.
- `mooncake:FILE`: a trace in the Mooncake JSONL format (`timestamp` in ms, `input_length`,
  `output_length`, `hash_ids`: one id per 512-token block, equal ids equal blocks).

Records keep the workload's name and a digest of its definition (the file's bytes, or the
mix's parameters), so runs on different workloads never pool, as different models never do.

How a window draws its requests from a workload (`WindowPlan`):
- Sampled: the arrival process of the spec at `load` requests/s; each request's lengths
  drawn from the workload (a mix's distributions, or a row of the file).
- Replay: the rows' own times, scaled so their mean rate is `load` (the time scale is
  `load / mean_rate`, recorded per window). Each window starts at a seeded offset into
  the trace and wraps around its end, so repeats see different stretches of it.
- Conversations: a conversation's first turn arrives by the spec's process (or its own
  time in a replay) at `load / mean turns` conversations/s, so requests arrive at about
  `load`/s; each next turn arrives its think time after the previous reply and carries the
  history (earlier prompts and replies) as its prefix, so a server's prefix cache hits it.

A prompt is a list of segments, each `(key, length)`: the tokens of a segment are a pure
function of its key, so equal keys are equal tokens whoever builds them (the history a
turn carries, a Mooncake block shared between requests).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import Problem, WorkloadError

# Mooncake's trace: every hash id stands for one block of this many tokens.
MOONCAKE_BLOCK_TOKENS = 512
# The most rows a workload file may hold: the rows travel in the run's spec to every rank.
MAX_ROWS = 200_000
# The prompt-length buckets the report splits TTFT and TPOT by (upper ends, exclusive).
LENGTH_BUCKETS = (256, 1024, 4096)

Segment = tuple[int, int]           # (key, length): a segment's tokens are a function of its key


def stable_key(*parts: Any) -> int:
    """A 63-bit key from its parts, the same in every process (Python's hash() is salted)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def segment_ids(segments: Sequence[Segment], vocab: int) -> list[int]:
    """A prompt's token ids, segment by segment (ids 3..vocab-1: the low ids are usually
    special tokens)."""
    out: list[int] = []
    for key, length in segments:
        rng = random.Random(key)
        out.extend(rng.randrange(3, vocab) for _ in range(length))
    return out


def length_bucket(input_tokens: int) -> str:
    """The report's bucket of a prompt length: `<256`, `256–1023`, …, `≥4096`."""
    low = 0
    for high in LENGTH_BUCKETS:
        if input_tokens < high:
            return f"<{high}" if low == 0 else f"{low}–{high - 1}"
        low = high
    return f"≥{low}"


def bucket_order(label: str) -> int:
    """Where a bucket label sorts (shortest prompts first)."""
    labels = [length_bucket(0)] + [length_bucket(b) for b in LENGTH_BUCKETS]
    return labels.index(label) if label in labels else len(labels)


# ------------------------------------------------------------------ synthetic mixes


@dataclass(frozen=True)
class Lengths:
    """A log-normal length distribution given by its median and mean, clipped to [low, high].

    Log-normal because published token-length distributions of chat prompts and replies are
    right-skewed with a long tail; a median and a mean are what papers publish, and they fix
    it: sigma = sqrt(2 ln(mean / median))."""

    median: float
    mean: float
    low: int
    high: int

    @property
    def sigma(self) -> float:
        return math.sqrt(2.0 * math.log(self.mean / self.median)) if self.mean > self.median else 0.0

    def draw(self, rng: random.Random) -> int:
        value = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return max(self.low, min(self.high, int(round(value))))


@dataclass(frozen=True)
class Mix:
    """A synthetic workload: prompt and reply lengths, turns per conversation (1: every
    request stands alone) and the mean think time between a reply and the next turn."""

    name: str
    prompt: Lengths                 # the new tokens of each turn (its history comes on top)
    output: Lengths
    turns: float = 1.0              # mean turns per conversation (geometric)
    think_s: float = 0.0            # mean think time between turns (exponential)
    max_context: int = 4096         # a conversation ends before a turn would exceed this
    system_tokens: int = 0          # a system prompt every request of the mix starts with
    source: str = ""

    def describe(self) -> str:
        return (f"{self.name}: prompt median {self.prompt.median:g} mean {self.prompt.mean:g} "
                f"[{self.prompt.low}, {self.prompt.high}], reply median {self.output.median:g} "
                f"mean {self.output.mean:g} [{self.output.low}, {self.output.high}], "
                f"{self.turns:g} turns, think {self.think_s:g} s, system {self.system_tokens}")


MIXES: dict[str, Mix] = {
    # Chat. LMSYS-Chat-1M (Zheng et al., "LMSYS-Chat-1M: A Large-Scale Real-World LLM
    # Conversation Dataset", ICLR 2024, Table 1): 2.0 turns per conversation on average,
    # 69.5 tokens per user prompt and 214.5 per reply on average. Medians: the replies'
    # from ShareGPT as vLLM's paper plots it (Kwon et al., SOSP 2023, Fig. 11), the prompts'
    # assumed at half the mean (a short-question-heavy tail, as the LMSYS paper's length
    # histogram shows). Think time: 10 s, a person reading a short reply and typing.
    "chat": Mix("chat", prompt=Lengths(median=35, mean=69.5, low=4, high=1024),
                output=Lengths(median=150, mean=214.5, low=8, high=1024),
                turns=2.0, think_s=10.0, max_context=4096, system_tokens=64,
                source="LMSYS-Chat-1M (ICLR 2024) Table 1; vLLM (SOSP 2023) Fig. 11"),
    # RAG: a question with retrieved passages, a short grounded answer, one turn. Lengths
    # after Splitwise's "conversation" trace of Azure's production service (Patel et al.,
    # "Splitwise", ISCA 2024, Table 2: median prompt 1020 tokens, median output 129), the
    # means from the released Azure LLM inference trace 2023 (AzurePublicDataset,
    # AzureLLMInferenceTrace_conv: mean context about 1155 tokens, mean generated about 211).
    "rag": Mix("rag", prompt=Lengths(median=1020, mean=1155, low=128, high=4096),
               output=Lengths(median=129, mean=211, low=8, high=1024),
               turns=1.0, think_s=0.0, max_context=8192, system_tokens=128,
               source="Splitwise (ISCA 2024) Table 2; Azure LLM inference trace 2023 (conv)"),
}


# ------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Row:
    """One request of a file or a trace."""

    input_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    conversation: str | None = None
    turn: int = 0
    prefix_tokens: int = 0
    think_s: float | None = None
    blocks: tuple[int, ...] = ()    # Mooncake hash ids, one per block of MOONCAKE_BLOCK_TOKENS

    def to_list(self) -> list[Any]:
        return [self.input_tokens, self.output_tokens, self.arrival_s, self.conversation, self.turn,
                self.prefix_tokens, self.think_s, list(self.blocks)]

    @classmethod
    def of_list(cls, v: Sequence[Any]) -> Row:
        return cls(int(v[0]), int(v[1]), v[2], v[3], int(v[4]), int(v[5]), v[6], tuple(int(b) for b in v[7]))


@dataclass(frozen=True)
class Workload:
    """What a run's requests look like (the module docstring)."""

    kind: str                           # "fixed" | "mix" | "requests" | "mooncake"
    name: str                           # as records and the report name it
    digest: str = ""                    # 12 hex digits of its definition
    input_tokens: int = 0               # fixed
    output_tokens: int = 0
    rows: tuple[Row, ...] = field(default=(), repr=False)
    source: str = ""                    # the file as the operator named it

    @property
    def mix(self) -> Mix | None:
        return MIXES.get(self.name) if self.kind == "mix" else None

    @property
    def replay(self) -> bool:
        """Do its requests come with their own times?"""
        return bool(self.rows) and all(r.arrival_s is not None for r in self.rows)

    @property
    def multi_turn(self) -> bool:
        mix = self.mix
        return (mix is not None and mix.turns > 1) or any(r.conversation is not None for r in self.rows)

    @property
    def max_input(self) -> int:
        if self.kind == "fixed":
            return self.input_tokens
        if self.mix is not None:
            return self.mix.max_context
        return max(r.input_tokens for r in self.rows)

    @property
    def max_output(self) -> int:
        if self.kind == "fixed":
            return self.output_tokens
        if self.mix is not None:
            return self.mix.output.high
        return max(r.output_tokens for r in self.rows)

    @property
    def mean_turns(self) -> float:
        if self.mix is not None:
            return self.mix.turns
        conversations = {r.conversation for r in self.rows if r.conversation is not None}
        singles = sum(1 for r in self.rows if r.conversation is None)
        starts = len(conversations) + singles
        return len(self.rows) / starts if starts else 1.0

    @property
    def mean_rate(self) -> float | None:
        """A replay's own mean rate (requests/s over its span); None without times."""
        if not self.replay:
            return None
        times = sorted(float(r.arrival_s) for r in self.rows)  # type: ignore[arg-type]
        return len(times) / trace_span(times)

    def rate_of_scale(self, scale: float) -> float:
        """The load (requests/s) a replay at this time scale offers."""
        rate = self.mean_rate
        if rate is None:
            raise ValueError(f"{self.name} has no arrival times to scale")
        return rate * scale

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "name": self.name, "digest": self.digest,
                               "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                               "source": self.source}
        if self.rows:
            out["rows"] = [r.to_list() for r in self.rows]
        return out

    @classmethod
    def of_record(cls, data: dict[str, Any]) -> Workload:
        return cls(kind=data["kind"], name=data["name"], digest=data.get("digest", ""),
                   input_tokens=int(data.get("input_tokens") or 0), output_tokens=int(data.get("output_tokens") or 0),
                   rows=tuple(Row.of_list(v) for v in data.get("rows") or ()), source=data.get("source", ""))


def trace_span(times: Sequence[float]) -> float:
    """A trace's span: first to last arrival plus one mean gap (so n requests over it have a
    mean rate of n / span, and a replay that wraps around keeps that gap at the seam)."""
    if len(times) < 2:
        return 1.0
    first, last = times[0], times[-1]
    gap = (last - first) / (len(times) - 1)
    return (last - first) + (gap if gap > 0 else 1.0)


def fixed(input_tokens: int, output_tokens: int) -> Workload:
    return Workload("fixed", f"fixed:{input_tokens}/{output_tokens}", input_tokens=input_tokens,
                    output_tokens=output_tokens)


# ------------------------------------------------------------------ reading a workload


def parse_workload(value: str, *, source: str = "--workload") -> Workload:
    """The workload a `--workload` value (or the inventory's, its file made absolute by
    inventory.serve_settings) names. WorkloadError names the file, line and key of every
    problem (exit 2); `source` is where the value came from."""
    text = value.strip()
    if text.startswith("fixed:"):
        try:
            a, b = text.removeprefix("fixed:").split("/")
            ins, outs = int(a), int(b)
        except ValueError:
            raise WorkloadError([Problem(source, None, None, "workload",
                                         f"fixed workloads are fixed:IN/OUT in tokens, like fixed:128/16, "
                                         f"got {value!r}")]) from None
        if ins < 1 or outs < 1:
            raise WorkloadError([Problem(source, None, None, "workload",
                                         f"fixed:IN/OUT needs at least one token each, got {value!r}")])
        return fixed(ins, outs)
    if text in MIXES:
        mix = MIXES[text]
        return Workload("mix", text, digest=_digest(mix.describe().encode()))
    kind, path_text = ("mooncake", text.removeprefix("mooncake:")) if text.startswith("mooncake:") else ("requests", text)
    if not path_text.endswith((".jsonl", ".json")) and kind == "requests":
        raise WorkloadError([Problem(source, None, None, "workload",
                                     f"unknown workload {value!r}: fixed:IN/OUT, {', '.join(MIXES)}, a JSONL file "
                                     "of requests (.jsonl) or mooncake:FILE")])
    path = Path(path_text).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WorkloadError([Problem(str(path), None, None, "workload",
                                     f"cannot read the workload file: {exc.strerror or exc}")]) from None
    rows = read_mooncake(data, str(path)) if kind == "mooncake" else read_requests(data, str(path))
    workload = Workload(kind, f"{kind}:{path.name}" if kind == "mooncake" else f"file:{path.name}",
                        digest=_digest(data), rows=rows, source=str(path))
    return workload


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _lines(data: bytes, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line; a line that is not a JSON object is a problem."""
    problems: list[Problem] = []
    out: list[tuple[int, dict[str, Any]]] = []
    for number, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            problems.append(Problem(path, number, None, "", f"not JSON: {exc}"))
            continue
        if not isinstance(obj, dict):
            problems.append(Problem(path, number, None, "", f"each line is a JSON object, got {type(obj).__name__}"))
            continue
        out.append((number, obj))
    if problems:
        raise WorkloadError(problems[:20])
    if not out:
        raise WorkloadError([Problem(path, None, None, "", "the workload file holds no requests")])
    if len(out) > MAX_ROWS:
        raise WorkloadError([Problem(path, None, None, "", f"{len(out)} requests; a workload holds at most {MAX_ROWS}")])
    return iter(out)


def _count(obj: dict[str, Any], key: str, path: str, line: int, problems: list[Problem], *, minimum: int = 1,
           required: bool = True) -> int | None:
    value = obj.get(key)
    if value is None:
        if required:
            problems.append(Problem(path, line, None, key, "missing"))
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(Problem(path, line, None, key, f"expected a whole number of at least {minimum}, got {value!r}"))
        return None
    return value


def _seconds(obj: dict[str, Any], key: str, path: str, line: int, problems: list[Problem], scale: float = 1.0
             ) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        problems.append(Problem(path, line, None, key, f"expected a non-negative number, got {value!r}"))
        return None
    return float(value) * scale


REQUEST_KEYS = ("input_tokens", "output_tokens", "arrival_s", "conversation", "turn", "prefix_tokens", "think_s")


def read_requests(data: bytes, path: str) -> tuple[Row, ...]:
    """A JSONL file of requests (the module docstring), checked line by line."""
    problems: list[Problem] = []
    rows: list[Row] = []
    turns: dict[str, list[tuple[int, int]]] = {}
    for line, obj in _lines(data, path):
        for key in obj:
            if key not in REQUEST_KEYS:
                problems.append(Problem(path, line, None, key, f"unknown key; a request has {', '.join(REQUEST_KEYS)}"))
        ins = _count(obj, "input_tokens", path, line, problems)
        outs = _count(obj, "output_tokens", path, line, problems)
        arrival = _seconds(obj, "arrival_s", path, line, problems)
        think = _seconds(obj, "think_s", path, line, problems)
        prefix = _count(obj, "prefix_tokens", path, line, problems, minimum=0, required=False) or 0
        conversation = obj.get("conversation")
        if conversation is not None and not isinstance(conversation, str | int):
            problems.append(Problem(path, line, None, "conversation", f"expected a name or number, got {conversation!r}"))
            conversation = None
        turn = _count(obj, "turn", path, line, problems, minimum=0, required=False)
        if turn is not None and conversation is None:
            problems.append(Problem(path, line, None, "turn", "a turn belongs to a conversation"))
        if ins is not None and prefix > ins:
            problems.append(Problem(path, line, None, "prefix_tokens",
                                    f"{prefix} shared tokens in a prompt of {ins}"))
        if prefix and conversation is None:
            problems.append(Problem(path, line, None, "prefix_tokens", "a prefix is shared with a conversation's "
                                    "earlier turns: give its conversation"))
        if ins is None or outs is None:
            continue
        name = None if conversation is None else str(conversation)
        if name is not None:
            turns.setdefault(name, []).append((turn if turn is not None else len(turns.get(name, ())), line))
        rows.append(Row(ins, outs, arrival, name, turns[name][-1][0] if name is not None else 0, prefix, think))
    for name, seen in turns.items():
        numbers = [t for t, _ in seen]
        if len(set(numbers)) != len(numbers):
            dup = next(line for t, line in seen if numbers.count(t) > 1)
            problems.append(Problem(path, dup, None, "turn", f"conversation {name!r} has turn {numbers[0]} twice"))
    with_times = sum(1 for r in rows if r.arrival_s is not None)
    if 0 < with_times < len(rows):
        first = next(i for i, r in enumerate(rows) if r.arrival_s is None)
        problems.append(Problem(path, None, None, "arrival_s",
                                f"{with_times} of {len(rows)} requests carry an arrival time (request {first + 1} "
                                "does not): a replay needs every one, a sampled workload none"))
    if problems:
        raise WorkloadError(problems[:20])
    return tuple(rows)


def read_mooncake(data: bytes, path: str) -> tuple[Row, ...]:
    """A Mooncake trace (timestamp in ms, input_length, output_length, hash_ids)."""
    problems: list[Problem] = []
    rows: list[Row] = []
    for line, obj in _lines(data, path):
        stamp = obj.get("timestamp")
        if stamp is None:
            problems.append(Problem(path, line, None, "timestamp", "missing (milliseconds from the trace's start)"))
        arrival = _seconds(obj, "timestamp", path, line, problems, scale=0.001)
        ins = _count(obj, "input_length", path, line, problems)
        outs = _count(obj, "output_length", path, line, problems)
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            problems.append(Problem(path, line, None, "hash_ids", f"expected a list of whole numbers, got {ids!r}"))
            ids = []
        if ins is not None and len(ids) > math.ceil(ins / MOONCAKE_BLOCK_TOKENS):
            problems.append(Problem(path, line, None, "hash_ids",
                                    f"{len(ids)} blocks of {MOONCAKE_BLOCK_TOKENS} tokens for {ins} input tokens"))
        if ins is None or outs is None or arrival is None:
            continue
        rows.append(Row(ins, outs, arrival, blocks=tuple(ids)))
    if problems:
        raise WorkloadError(problems[:20])
    return tuple(rows)


# ------------------------------------------------------------------ planning a window


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
