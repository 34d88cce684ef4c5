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

How a window draws its requests from a workload is vcfslm.serving.window_plan's (`WindowPlan`).

A prompt is a list of segments, each `(key, length)`: the tokens of a segment are a pure
function of its key, so equal keys are equal tokens whoever builds them (the history a
turn carries, a Mooncake block shared between requests)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Problem, WorkloadError

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
