"""Results schema and atomic I/O, shared by the rank worker, the launcher and the report.

A run directory (`runs/<run-id>/`) holds:

- `meta.json`       run metadata (see `RunMeta`); `complete` is false until every
                    scenario of every rank has its windows.
- `results.jsonl`   one `WindowRecord` per line: rank x scenario x measured window.
- `ranks/rank-<global rank>.jsonl`  the same records as each rank wrote them
                    (appended atomically as each window ends).
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
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

@dataclass
class WindowRecord:
    """One measured window of one rank for one scenario."""

    run_id: str
    node: str
    node_rank: int
    rank: int
    local_rank: int
    world_size: int
    ranks_per_node: int
    nodes: int
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
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in data and _required(f)]
        if missing:
            raise ValueError(f"record misses field(s): {', '.join(missing)}")
        schema = data.get("schema", SCHEMA_VERSION)
        if schema > SCHEMA_VERSION:
            raise ValueError(f"record schema {schema} is newer than this vcfslm ({SCHEMA_VERSION})")
        return cls(**{k: v for k, v in data.items() if k in known})


def _required(f) -> bool:
    from dataclasses import MISSING

    return f.default is MISSING and f.default_factory is MISSING


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


def append_record(path: str | os.PathLike[str], record: WindowRecord) -> None:
    """Append one record so that a crash leaves either the whole line or none of it.

    The file is rewritten through a temp file + rename: records are small and few
    (one per window), and a torn last line is impossible this way.
    """
    path = Path(path)
    existing = path.read_text(encoding="utf-8") if path.exists() else ""
    if existing and not existing.endswith("\n"):
        existing += "\n"
    atomic_write_text(path, existing + record.to_json() + "\n")


def read_records(path: str | os.PathLike[str]) -> list[WindowRecord]:
    """Read a JSON-lines file of records; a blank line is skipped, a bad one raises ValueError
    naming the file and line."""
    out = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(WindowRecord.from_dict(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return out


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            yield json.loads(line)


def write_records(path: str | os.PathLike[str], records: Iterable[WindowRecord]) -> None:
    atomic_write_text(path, "".join(r.to_json() + "\n" for r in records))


def finished_scenarios(records: Iterable[WindowRecord], repeats: int) -> set[tuple[int, int, int]]:
    """Scenarios for which `repeats` windows are recorded (what --resume skips)."""
    counts: dict[tuple[int, int, int], set[int]] = {}
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
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# What meta.json keeps of each rank's facts file (ranks/rank-<n>.json, written by the
# worker): the engine and its kernel plan, the packing check, the numerics gate and the
# GEMM probe. Placement and bandwidth have their own places (guests, probe).
RANK_FACT_KEYS = ("node", "local_rank", "engine", "pack", "numerics", "gemm")


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
    return RunMeta.from_dict(json.loads((Path(run_dir) / "meta.json").read_text(encoding="utf-8")))


def load_run(run_dir: str | os.PathLike[str]) -> tuple[RunMeta, list[WindowRecord]]:
    """meta.json + results.jsonl of a run dir (records from ranks/ when results.jsonl is missing)."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    results = run_dir / "results.jsonl"
    if results.exists():
        return meta, read_records(results)
    records: list[WindowRecord] = []
    for p in sorted((run_dir / "ranks").glob("rank-*.jsonl")):
        records.extend(read_records(p))
    return meta, records
