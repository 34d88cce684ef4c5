"""Results schema and atomic I/O, shared by the rank worker, the launcher and the report.

A run directory (`runs/<run-id>/`) holds:

- `meta.json`       run metadata (see `RunMeta`); `complete` is false until every
                    scenario of every rank has its windows.
- `results.jsonl`   one `WindowRecord` per line: rank x scenario x measured window.
- `ranks/rank-<global rank>.jsonl`  the same records as each rank wrote them
                    (appended atomically as each window ends).
- `serving.jsonl`   serving mode (bench --serve): one `ServeRecord` per line, rank x
                    load x measured window, every request's times in it; as each rank
                    wrote them in `ranks/serve-<global rank>.jsonl`.
- `logs/<node>/rank-<n>.log`  per-rank output.

`WindowRecord` fields (JSON, one object per line; times in seconds unless the name
says `_ms`):

    schema            int, SCHEMA_VERSION
    run_id            str
    node              str   node name from the inventory ("local" for --local)
    node_rank         int   torchrun node rank
    rank              int   global rank
    local_rank        int   rank within its node (its vNUMA node index)
    world_size        int
    ranks_per_node    int
    nodes             int   number of nodes in the run
    batch_per_rank    int   concurrent streams on this rank
    input_tokens      int   prompt length per stream
    output_tokens     int   generated tokens per stream (EOS ignored)
    window            int   0..repeats-1 (warmup windows are not recorded)
    start_skew_s      float time from the first rank leaving the barrier to this one
    wall_s            float window wall time (request start -> last token)
    generated_tokens  int   batch_per_rank x output_tokens
    rank_tps          float generated_tokens / wall_s (input tokens never count)
    ttft_s            list[float] per stream
    tpot_ms           list[float] per stream: (e2e - ttft) / (output_tokens - 1)
    e2e_s             list[float] per stream
    peak_rss_bytes    int   the rank's peak resident set so far (compile transients included)
    rss_bytes         int   its resident set at the window's end (the steady footprint)
    recompiles        int   compilations that happened inside this window
    valid             bool  false when something makes the window untrustworthy
    invalid_reasons   list[str]
    roofline_tpot_ms  float | null  bytes read per step / measured bandwidth
    roofline_ttft_s   float | null  prompt FLOPs / measured bf16 GEMM rate (the prefill floor)
    placement         dict  cpu affinity, numa node, threads, versions, cpu capability

Reading checks every object against these types (read_records, read_meta, read_run):
a bad one is a RunFolderError naming file, line and field; a torn last line is skipped
with a warning; keys this version does not know are ignored.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from vcfslm.errors import Problem, RunFolderError

SCHEMA_VERSION = 1

@dataclass
class RankWindow:
    """Which run, node and rank a measured window (static or serving) belongs to."""

    run_id: str
    node: str
    node_rank: int
    rank: int
    local_rank: int
    world_size: int
    ranks_per_node: int
    nodes: int


@dataclass
class WindowRecord(RankWindow):
    """One measured window of one rank for one scenario."""

    batch_per_rank: int
    input_tokens: int
    output_tokens: int
    window: int
    start_skew_s: float
    wall_s: float
    generated_tokens: int
    rank_tps: float
    ttft_s: list[float]
    tpot_ms: list[float]
    e2e_s: list[float]
    peak_rss_bytes: int = 0
    rss_bytes: int = 0
    recompiles: int = 0
    valid: bool = True
    invalid_reasons: list[str] = field(default_factory=list)
    roofline_tpot_ms: float | None = None
    roofline_ttft_s: float | None = None
    placement: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    @property
    def scenario(self) -> tuple[int, int, int]:
        """(batch_per_rank, input_tokens, output_tokens): what identifies a scenario."""
        return (self.batch_per_rank, self.input_tokens, self.output_tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowRecord:
        """A record from its JSON object; SchemaError (a ValueError) lists every field that breaks the schema."""
        return _checked(cls, data, record_findings)


# Serving mode (bench --serve): one record per rank x load window. Requests arrive on
# their own (open loop: Poisson or gamma at `load` requests/s per rank; closed loop:
# `load` users per rank, each waiting `think_s` after its reply) and join a continuous
# batch of `slots` streams between decode steps. Times are seconds from the window's
# start (the barrier) unless the name says `_ms`; the request lists are parallel, one
# entry per request that arrived inside the measured span [warmup_s, duration_s -
# cooldown_s] and finished (`unfinished` counts those that did not by the window's end:
# they fail every SLO).
SERVE_LOAD_KINDS = ("rate", "users")
SERVE_ARRIVALS = ("poisson", "gamma", "closed")


@dataclass
class ServeRecord(RankWindow):
    """One measured serving window of one rank at one load."""

    load_kind: str                 # "rate" (requests/s per rank) | "users" (per rank)
    load: float
    arrival: str                   # "poisson" | "gamma" | "closed"
    slots: int                     # the batch cap: streams decoded together at most
    input_tokens: int              # the context's nominal prompt length (its largest when drawn)
    output_tokens: int             # the nominal output length (its largest when drawn)
    window: int                    # 0..repeats-1 at this load
    seed: int                      # this rank's arrival/length seed for the window
    duration_s: float              # arrivals are generated over [0, duration_s)
    warmup_s: float
    cooldown_s: float
    span_s: float                  # the measured span's length
    wall_s: float                  # barrier -> last request done (or the window's cutoff)
    offered: int                   # requests that arrived in the measured span
    completed: int                 # of them, finished
    unfinished: int                # of them, not finished by the cutoff
    arrival_s: list[float]         # per finished measured request
    queue_s: list[float]           # arrival -> its prefill started
    ttft_s: list[float]            # arrival -> first token (the queue included)
    tpot_ms: list[float]           # (e2e - ttft) / (output tokens - 1)
    e2e_s: list[float]             # arrival -> last token
    request_input_tokens: list[int]
    request_output_tokens: list[int]
    generated_tokens: int          # tokens produced inside the measured span (every request)
    rank_tps: float                # generated_tokens / span_s
    mean_active: float             # time-averaged busy slots over the measured span
    max_queue: int                 # most requests waiting for a slot at once
    burstiness: float = 1.0        # gamma shape (1 = Poisson); for "closed", unused
    think_s: float = 0.0           # closed loop: mean think time between a reply and the next request
    goodput: dict[str, Any] = field(default_factory=dict)   # SLO name -> requests/s that met it
    start_skew_s: float = 0.0
    peak_rss_bytes: int = 0
    rss_bytes: int = 0
    recompiles: int = 0
    valid: bool = True
    invalid_reasons: list[str] = field(default_factory=list)
    placement: dict[str, Any] = field(default_factory=dict)
    # An HTTP server's window (vcfslm.servers): which server, what its client saw, and
    # the server's own /metrics over the window. The in-process engine leaves them empty.
    server: str = "vcfslm"
    sent_s: list[float] = field(default_factory=list)          # per finished request: when it went out
    token_s: list[list[float]] = field(default_factory=list)   # per finished request: each token's time
    max_send_lag_s: float = 0.0    # the latest a counted request went out after its planned arrival
    failed: int = 0                # counted requests the server refused, dropped or never answered
    errors: list[str] = field(default_factory=list)            # the distinct failures (a few)
    server_metrics: dict[str, Any] = field(default_factory=dict)
    # The in-process engine's steps over the window: the most prompt tokens one step took
    # (its chunk; 0 for an HTTP server), how many steps ran, the mean real tokens per step,
    # and the prompt tokens' share of them.
    chunk_tokens: int = 0
    batched_tokens: int = 0        # the most under a backlog
    batched_steps: int = 0         # steps that took several prompts or more than a chunk
    steps: int = 0
    step_tokens_mean: float = 0.0
    prefill_share: float = 0.0
    schema: int = SCHEMA_VERSION

    @property
    def scenario(self) -> tuple[str, float, int, int]:
        """(load kind, load, input tokens, output tokens): what identifies a serving scenario."""
        return (self.load_kind, float(self.load), self.input_tokens, self.output_tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeRecord:
        """A record from its JSON object; SchemaError lists every field that breaks the schema."""
        return _checked(cls, data, serve_record_findings)


def _required(f) -> bool:
    from dataclasses import MISSING

    return f.default is MISSING and f.default_factory is MISSING


def _checked(cls, data: dict[str, Any], findings: Callable[[Any], list]):
    """`cls` from `data` once `findings` has nothing against it, else SchemaError."""
    found = findings(data)
    if found:
        raise SchemaError(found)
    return _build(cls, data)


def _build(cls, data: dict[str, Any]):
    """An instance of dataclass `cls` from the keys it knows (newer writers may add others)."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


# ------------------------------------------------------------ schema on read
#
# Run files are input like any other: each object is checked field by field against its
# dataclass's own annotations before it is built, so a hand-edited or foreign file fails
# naming the file, line and field instead of with a TypeError deep inside the report.
# Every number a record carries is a count, a time or a rate: integers are at least 0
# (AT_LEAST_ONE: at least 1), floats finite and at least 0. Unknown keys are allowed.

Findings = list[tuple[str, str]]        # (key path, what is wrong with it)
Check = Callable[[Any], Findings]       # a value -> findings keyed relative to it

AT_LEAST_ONE = frozenset({"schema", "world_size", "ranks_per_node", "nodes", "batch_per_rank", "slots",
                          "input_tokens", "output_tokens", "threads_per_rank"})
_KINDS = {str: "a string", bool: "true or false", dict: "an object"}
_PLURALS = {float: "numbers", int: "integers", str: "strings"}


class SchemaError(ValueError):
    """A JSON object breaks a run file's schema; `findings` holds one (key, message) per problem."""

    def __init__(self, findings: Sequence[tuple[str, str]]):
        self.findings = list(findings)
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in self.findings))


def _got(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int_check(minimum: int) -> Check:
    def check(value: Any) -> Findings:
        if not isinstance(value, int) or isinstance(value, bool):
            return [("", f"expected an integer, got {_got(value)}")]
        if value < minimum:
            return [("", f"must be at least {minimum}, got {value}" if minimum else
                     f"must not be negative, got {value}")]
        return []
    return check


def _number_check(value: Any) -> Findings:
    """A time or a rate: a finite number, at least 0 (an integer will do)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return [("", f"expected a number, got {_got(value)}")]
    if not math.isfinite(value):
        return [("", f"expected a finite number, got {value}")]
    return [("", f"must not be negative, got {value}")] if value < 0 else []


def _kind_check(kind: type) -> Check:
    return lambda value: [] if isinstance(value, kind) else [("", f"expected {_KINDS[kind]}, got {_got(value)}")]


def _list_check(item: Check, plural: str) -> Check:
    def check(value: Any) -> Findings:
        if not isinstance(value, list):
            return [("", f"expected a list of {plural}, got {_got(value)}")]
        return [(f"[{i}]{key}", message) for i, v in enumerate(value) for key, message in item(v)]
    return check


def _optional(check: Check) -> Check:
    return lambda value: [] if value is None else check(value)


def _check_for(hint: Any, name: str) -> Check:
    """The check of one annotation (`int`, `list[float]`, `str | None`, `dict[str, Any]`, ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return _optional(_check_for(next(a for a in args if a is not type(None)), name))
    if hint is int:
        return _int_check(1 if name in AT_LEAST_ONE else 0)
    if hint is float:
        return _number_check
    if origin is list:
        return _list_check(_check_for(args[0], name), _PLURALS.get(args[0], "lists"))
    kind = dict if origin is dict else hint
    if kind in _KINDS:
        return _kind_check(kind)
    raise TypeError(f"no schema check for {name}: {hint!r}")


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, Check, bool], ...]:
    """(field, check, required) for every field of dataclass `cls`, from its annotations."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _check_for(hints[f.name], f.name), _required(f)) for f in fields(cls))


def schema_findings(cls: type, data: Any) -> Findings:
    """Every way `data` breaks the schema of dataclass `cls` (keys it does not know are fine)."""
    if not isinstance(data, dict):
        return [("", f"expected a JSON object, got {_got(data)}")]
    out: Findings = []
    for name, check, required in _schema(cls):
        if name not in data:
            if required:
                out.append((name, "required field missing"))
            continue
        out.extend((name + key, message) for key, message in check(data[name]))
    return out


def record_findings(data: Any) -> Findings:
    """What is wrong with one results.jsonl object, field by field (empty: a good record)."""
    if isinstance(data, dict) and data.get("output_tokens") == 1 and isinstance(data.get("tpot_ms"), list):
        # TPOT is undefined for one output token: stream_metrics writes NaN there.
        data = {**data, "tpot_ms": [0.0 if isinstance(v, float) and math.isnan(v) else v
                                    for v in data["tpot_ms"]]}
    found = schema_findings(WindowRecord, data)
    schema = data.get("schema") if isinstance(data, dict) else None
    if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
        found.append(("schema", f"version {schema} is newer than this vcfslm reads (up to "
                                f"{SCHEMA_VERSION}): upgrade vcfslm"))
    return found



def serve_record_findings(data: Any) -> Findings:
    """What is wrong with one serving.jsonl object, field by field (empty: a good record)."""
    found = schema_findings(ServeRecord, data)
    if not isinstance(data, dict):
        return found
    for name, allowed in (("load_kind", SERVE_LOAD_KINDS), ("arrival", SERVE_ARRIVALS)):
        value = data.get(name)
        if isinstance(value, str) and value not in allowed:
            found.append((name, f"expected one of {', '.join(allowed)}, got {value!r}"))
    lists = ("arrival_s", "queue_s", "ttft_s", "tpot_ms", "e2e_s", "request_input_tokens",
             "request_output_tokens")
    lengths = {len(data[k]) for k in lists if isinstance(data.get(k), list)}
    if len(lengths) > 1:
        found.append(("", "the per-request lists differ in length: " + ", ".join(
            f"{k} {len(data[k])}" for k in lists if isinstance(data.get(k), list))))
    schema = data.get("schema")
    if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
        found.append(("schema", f"version {schema} is newer than this vcfslm reads (up to "
                                f"{SCHEMA_VERSION}): upgrade vcfslm"))
    return found

# matrix keys the analysis reads: an integer or a list of them / a count / a text
MATRIX_LISTS = ("batch_sizes", "input_tokens", "output_tokens")
MATRIX_COUNTS = ("warmup", "repeats")
MATRIX_TEXTS = ("scenarios", "compile")


def meta_findings(data: Any) -> Findings:
    """What is wrong with meta.json's object, field by field (empty: good metadata)."""
    found = schema_findings(RunMeta, data)
    matrix = data.get("matrix") if isinstance(data, dict) else None
    if not isinstance(matrix, dict):
        return found
    for name in MATRIX_LISTS + MATRIX_COUNTS + MATRIX_TEXTS:
        value = matrix.get(name)
        if value is None:
            continue
        check = _kind_check(str) if name in MATRIX_TEXTS else _int_check(0 if name == "warmup" else 1)
        if name in MATRIX_LISTS:
            if isinstance(value, list):
                check = _list_check(check, "integers")
            elif not isinstance(value, int):
                found.append((f"matrix.{name}", f"expected an integer or a list of integers, got {_got(value)}"))
                continue
        found.extend((f"matrix.{name}{key}", message) for key, message in check(value))
    found.extend(_rule_findings(matrix))
    return found


def _rule_findings(matrix: dict[str, Any]) -> Findings:
    """The judging rule a run recorded: matrix.judging.percentile and matrix.serve.attainment."""
    out: Findings = []
    judging = matrix.get("judging")
    if judging is not None:
        pct = judging.get("percentile") if isinstance(judging, dict) else None
        if not isinstance(judging, dict):
            out.append(("matrix.judging", f"expected an object, got {_got(judging)}"))
        elif pct is not None and pct not in ("p50", "p90", "p99"):
            out.append(("matrix.judging.percentile", f"expected one of p50, p90, p99, got {pct!r}"))
    serve = matrix.get("serve")
    share = serve.get("attainment") if isinstance(serve, dict) else None
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                              or not 0 < share < 1):
        out.append(("matrix.serve.attainment", f"expected a share between 0 and 1, got {share!r}"))
    return out


def stream_metrics(request_start: float, first_token: Iterable[float], last_token: Iterable[float],
                   output_tokens: int) -> tuple[list[float], list[float], list[float]]:
    """Per-stream (ttft_s, tpot_ms, e2e_s) from timestamps, by DESIGN.md's definitions.

    request_start: when the window's requests were issued; first_token/last_token:
    per-stream times the first and last generated token were available.
    """
    ttft, tpot, e2e = [], [], []
    for first, last in zip(first_token, last_token, strict=True):
        t = first - request_start
        e = last - request_start
        ttft.append(t)
        e2e.append(e)
        tpot.append((e - t) / (output_tokens - 1) * 1000.0 if output_tokens > 1 else float("nan"))
    return ttft, tpot, e2e


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of finite values; NaN when empty."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---------------------------------------------------------------- atomic I/O


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; results are ordinary files, so honour the umask instead.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def append_record(path: str | os.PathLike[str], record: WindowRecord | ServeRecord) -> None:
    """Append one record so that a crash leaves either the whole line or none of it.

    The file is rewritten through a temp file + rename: records are small and few
    (one per window), and a torn last line is impossible this way.
    """
    path = Path(path)
    existing = path.read_text(encoding="utf-8") if path.exists() else ""
    if existing and not existing.endswith("\n"):
        existing += "\n"
    atomic_write_text(path, existing + record.to_json() + "\n")


SERVE_RESULTS = "serving.jsonl"   # a run's merged ServeRecords (results.jsonl holds WindowRecords)
MAX_PROBLEMS = 20     # per file: enough to see the pattern, few enough to read
TORN = "torn last line skipped (no newline at the end and not valid JSON: its writer was stopped mid-line)"


def read_records(path: str | os.PathLike[str], warnings: list[str] | None = None,
                 kind: type = WindowRecord) -> list[Any]:
    """Read a JSON-lines file of records (`kind`: WindowRecord or ServeRecord), each checked
    against its schema.

    A blank line is skipped. A torn last line (no newline at the end and not valid JSON:
    what a killed writer leaves) is skipped too, and said in `warnings` when given. Any
    other bad line raises RunFolderError listing every problem as file:line field: message.
    """
    records, problems = _checked_records(Path(path), warnings if warnings is not None else [], kind)
    if problems:
        raise RunFolderError(problems)
    return records


def read_serve_records(path: str | os.PathLike[str], warnings: list[str] | None = None) -> list[ServeRecord]:
    """read_records for a serving.jsonl (or ranks/serve-<n>.jsonl) file."""
    return read_records(path, warnings, ServeRecord)


def _checked_records(path: Path, warnings: list[str], kind: type = WindowRecord
                     ) -> tuple[list[Any], list[Problem]]:
    """The good records of a JSON-lines file and the problems of the others (capped, see _capped)."""
    findings = serve_record_findings if kind is ServeRecord else record_findings
    lines = _read_text(path).split("\n")
    records, problems = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            if lineno == len(lines):         # the last piece: no newline after it
                warnings.append(str(Problem(str(path), lineno, None, "", TORN)))
            else:
                problems.append(Problem(str(path), lineno, getattr(exc, "colno", None), "",
                                        f"not valid JSON: {getattr(exc, 'msg', exc)}"))
            continue
        found = findings(data)
        problems.extend(Problem(str(path), lineno, None, key, message) for key, message in found)
        if not found:
            records.append(_build(kind, data))
    return records, _capped(problems, path)


def _capped(problems: Sequence[Problem], path: Path) -> list[Problem]:
    """The first MAX_PROBLEMS problems of file `path` and a line counting the rest."""
    shown = list(problems[:MAX_PROBLEMS])
    if len(problems) > MAX_PROBLEMS:
        shown.append(Problem("", None, None, "", f"... and {len(problems) - MAX_PROBLEMS} more problem(s) in {path}"))
    return shown


def _read_text(path: Path) -> str:
    """A run file's text; RunFolderError naming it when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFolderError([Problem(str(path), None, None, "", "does not exist")]) from None
    except UnicodeDecodeError as exc:
        raise RunFolderError([Problem(str(path), None, None, "", f"not UTF-8 text (byte {exc.start})")]) from None
    except OSError as exc:
        raise RunFolderError([Problem(str(path), None, None, "", f"cannot read: {exc.strerror or exc}")]) from None


def write_records(path: str | os.PathLike[str], records: Iterable[WindowRecord | ServeRecord]) -> None:
    atomic_write_text(path, "".join(r.to_json() + "\n" for r in records))


def finished_scenarios(records: Iterable[WindowRecord | ServeRecord], repeats: int) -> set[tuple]:
    """Scenarios for which `repeats` windows are recorded (what --resume skips)."""
    counts: dict[tuple, set[int]] = {}
    for r in records:
        counts.setdefault(r.scenario, set()).add(r.window)
    return {s for s, windows in counts.items() if len(windows) >= repeats}


CSV_FIELDS = [
    "node", "rank", "local_rank", "batch_per_rank", "input_tokens", "output_tokens", "window",
    "ttft_p50_s", "tpot_p50_ms", "rank_tps", "wall_s", "valid",
]


def records_to_csv(path: str | os.PathLike[str], records: Iterable[WindowRecord]) -> None:
    """A flat CSV of records (one row per rank x scenario x window), for spreadsheets."""
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_FIELDS)
    for r in records:
        w.writerow([r.node, r.rank, r.local_rank, r.batch_per_rank, r.input_tokens, r.output_tokens,
                    r.window, f"{percentile(r.ttft_s, 50):.6f}", f"{percentile(r.tpot_ms, 50):.3f}",
                    f"{r.rank_tps:.3f}", f"{r.wall_s:.6f}", r.valid])
    atomic_write_text(path, buf.getvalue())


@dataclass
class RunMeta:
    """What `meta.json` says about a run."""

    run_id: str
    created: str
    command: list[str]
    mode: str                      # "local" | "cluster"
    nodes: list[str]
    ranks_per_node: int
    threads_per_rank: int
    model: str
    matrix: dict[str, Any]         # batch_sizes, input_tokens, output_tokens, warmup, repeats
    complete: bool = False
    label: str | None = None
    inventory_sha256: str | None = None
    failure: str | None = None
    vcenter: dict[str, Any] = field(default_factory=dict)      # observed VM config per node
    guests: dict[str, Any] = field(default_factory=dict)       # NUMA facts per node
    versions: dict[str, Any] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)        # bandwidth per node/rank
    slos: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, Any] = field(default_factory=dict)        # per global rank: engine, numerics gate

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunMeta:
        """Run metadata from meta.json's object; SchemaError lists every field that breaks the schema."""
        found = meta_findings(data)
        if found:
            raise SchemaError(found)
        return _build(cls, data)


# What meta.json keeps of each rank's facts file (ranks/rank-<n>.json, written by the
# worker): the engine and its kernel plan, the packing check, the numerics gate, the
# probes (bandwidth, GEMM rate, decode-batch linear rates) and the model's shape: what the
# performance model refits from a run without its ranks/ folder. A serving sweep adds what
# stopped it per SLO and context (`sweep`). Placement has its own
# place (guests).
RANK_FACT_KEYS = ("node", "local_rank", "engine", "pack", "numerics", "probe", "gemm", "decode_linears",
                  "model", "sweep", "server")


def rank_summaries(facts: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """meta.json's `ranks`: the kept facts of every rank, by global rank."""
    return {str(f["rank"]): {k: f.get(k) for k in RANK_FACT_KEYS}
            for f in sorted(facts, key=lambda f: f.get("rank", 0)) if "rank" in f}


def read_rank_facts(ranks_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every readable ranks/rank-<n>.json (a rank that died before writing one is absent)."""
    out = []
    for path in sorted(Path(ranks_dir).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def write_meta(run_dir: str | os.PathLike[str], meta: RunMeta) -> None:
    atomic_write_json(Path(run_dir) / "meta.json", asdict(meta))


def read_meta(run_dir: str | os.PathLike[str]) -> RunMeta:
    """A run's meta.json, checked against the schema; RunFolderError names the folder or
    the file (and the line of each bad key) when it is missing, not JSON or wrong."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a folder" if run_dir.exists() else "does not exist"
        raise RunFolderError([Problem(str(run_dir), None, None, "", f"{what}: not a run folder")])
    path = run_dir / "meta.json"
    if not path.is_file():
        raise RunFolderError([Problem(str(path), None, None, "", "does not exist: not a run folder")])
    text = _read_text(path)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RunFolderError([Problem(str(path), getattr(exc, "lineno", None), getattr(exc, "colno", None),
                                      "", f"not valid JSON: {getattr(exc, 'msg', exc)}")]) from None
    found = meta_findings(data)
    if found:
        raise RunFolderError(_capped([Problem(str(path), _key_line(text, key), None, key, message)
                                      for key, message in found], path))
    return _build(RunMeta, data)


def _key_line(text: str, key: str) -> int | None:
    """The line of top-level `key` (its first dotted part) in JSON `text`: the least indented match."""
    name = re.split(r"[.\[]", key, maxsplit=1)[0]
    if not name:
        return None
    found = [(len(m.group(1)), text.count("\n", 0, m.start()) + 1)
             for m in re.finditer(rf'^([ \t]*)"{re.escape(name)}"\s*:', text, re.MULTILINE)]
    return min(found)[1] if found else None


@dataclass
class RunFile:
    """A run folder as read: its meta, its records, the files they came from, what was skipped.

    Unpacks as (meta, records), so it stands wherever load_run's pair did.
    """

    path: Path
    meta: RunMeta
    records: list[WindowRecord]
    sources: list[Path]                 # results.jsonl, or the ranks/rank-<n>.jsonl read instead
    warnings: list[str] = field(default_factory=list)
    serve_records: list[ServeRecord] = field(default_factory=list)   # serving.jsonl (bench --serve)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.meta, self.records))


def read_run(run_dir: str | os.PathLike[str], require_records: bool = True) -> RunFile:
    """meta.json + results.jsonl (+ serving.jsonl) of a run dir; records from ranks/ when
    the merged file is missing (rank-<n>.jsonl, serve-<n>.jsonl).

    Every problem of the folder is one RunFolderError; so is a run without records of
    either kind unless `require_records` is false (a crashed run that --resume picks up again).
    """
    run_dir = Path(run_dir)
    problems: list[Problem] = []
    try:
        meta = read_meta(run_dir)
    except RunFolderError as exc:
        if not run_dir.is_dir():
            raise
        problems.extend(exc.problems)           # and the records' problems with them
    results = run_dir / "results.jsonl"
    sources = [results] if results.exists() else sorted((run_dir / "ranks").glob("rank-*.jsonl"))
    records: list[WindowRecord] = []
    warnings: list[str] = []
    for path in sources:                        # every bad file is named, not only the first
        good, bad = _checked_records(path, warnings)
        records.extend(good)
        problems.extend(bad)
    serving = run_dir / SERVE_RESULTS
    serve_sources = [serving] if serving.exists() else sorted((run_dir / "ranks").glob("serve-*.jsonl"))
    serve_records: list[ServeRecord] = []
    for path in serve_sources:
        good, bad = _checked_records(path, warnings, ServeRecord)
        serve_records.extend(good)
        problems.extend(bad)
    if problems:
        raise RunFolderError(problems)
    if require_records and not records and not serve_records:
        raise RunFolderError([Problem("", None, None, "", f"no records: {_no_records(run_dir, sources)}")])
    return RunFile(run_dir, meta, records, sources + serve_sources, warnings, serve_records)


def _no_records(run_dir: Path, sources: Sequence[Path]) -> str:
    if not sources:
        return f"{run_dir / 'results.jsonl'} does not exist and {run_dir / 'ranks'}/ holds no rank-*.jsonl"
    one = len(sources) == 1
    where = str(sources[0]) if one else f"{run_dir / 'ranks'}/rank-*.jsonl ({len(sources)} files)"
    if all(not p.read_text(encoding="utf-8").strip() for p in sources):
        return f"{where} {'is' if one else 'are'} empty"
    return f"{where} {'holds' if one else 'hold'} only a torn last line"


def load_run(run_dir: str | os.PathLike[str], warnings: list[str] | None = None
             ) -> tuple[RunMeta, list[WindowRecord]]:
    """(meta, records) of a run dir, checked as read_run checks them; a run without records is
    fine here (a crashed run to resume). Torn last lines skipped are said in `warnings` when given."""
    run = read_run(run_dir, require_records=False)
    if warnings is not None:
        warnings.extend(run.warnings)
    return run.meta, run.records
