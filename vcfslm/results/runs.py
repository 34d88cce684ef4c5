"""Run folders: meta.json (RunMeta) and its checks, the ranks' facts, reading a run back.

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

Reading checks every object against its types (read_records, read_meta, read_run): a
bad one is a RunFolderError naming file, line and field; a torn last line is skipped
with a warning; keys this version does not know are ignored.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Discriminator, Tag, WrapValidator
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from vcfslm.errors import Problem, RunFolderError

from .files import atomic_write_json, capped, checked_records, read_text
from .records import ServeRecord, WindowRecord, build, merge_records
from .schema import (
    AtLeastOne,
    Count,
    Findings,
    Flag,
    Object,
    SchemaError,
    Text,
    Texts,
    got,
    one_of,
    schema_findings,
)

SERVE_RESULTS = "serving.jsonl"   # a run's merged ServeRecords (results.jsonl holds WindowRecords)


# The matrix keys the analysis reads, each may be null: a list of integers (or one), a
# count, a text, and the judging rule the run recorded.
PERCENTILES = ("p50", "p90", "p99")


def _which(value: Any) -> str:
    return "<many>" if isinstance(value, list) else "<one>"


def _int_or_list(value: Any, handler) -> Any:
    if not isinstance(value, (int, list)):
        raise PydanticCustomError("int_or_list", "expected an integer or a list of integers, got {got}",
                                  {"got": got(value)})
    return handler(value)


# the union's tags are left out of a finding's key (schema.key_path)
OneOrMany = Annotated[Annotated[AtLeastOne, Tag("<one>")] | Annotated[list[AtLeastOne], Tag("<many>")],
                      Discriminator(_which), WrapValidator(_int_or_list)]


def _share(value: Any, handler) -> Any:
    """matrix.serve.attainment: the share of requests that must meet an SLO, strictly inside (0, 1)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1):
        raise PydanticCustomError("share", "expected a share between 0 and 1, got {value}", {"value": repr(value)})
    return value


def _if_object(value: Any, handler) -> Any:
    """matrix.serve is checked when it is an object; anything else the analysis does not read."""
    return handler(value) if isinstance(value, dict) else value


class Judging(TypedDict, total=False):
    percentile: Annotated[Any, one_of(PERCENTILES)] | None


class ServeMatrix(TypedDict, total=False):
    attainment: Annotated[Any, WrapValidator(_share)]


class MetaMatrix(TypedDict, total=False):
    """meta.json's `matrix` as recorded (older runs wrote scalars; matrix.Matrix is the typed run matrix)."""

    batch_sizes: OneOrMany | None
    input_tokens: OneOrMany | None
    output_tokens: OneOrMany | None
    warmup: Count | None
    repeats: AtLeastOne | None
    scenarios: Text | None
    compile: Text | None
    judging: Judging | None
    serve: Annotated[ServeMatrix, WrapValidator(_if_object)] | None


@dataclass
class RunMeta:
    """What `meta.json` says about a run."""

    run_id: Text
    created: Text
    command: Texts
    mode: Text                     # "local" | "cluster"
    nodes: Texts
    ranks_per_node: AtLeastOne
    threads_per_rank: AtLeastOne
    model: Text
    matrix: Object                 # batch_sizes, input_tokens, output_tokens, warmup, repeats (see MetaMatrix)
    complete: Flag = False
    label: Text | None = None
    inventory_sha256: Text | None = None
    failure: Text | None = None
    vcenter: Object = field(default_factory=dict)      # observed VM config per node
    guests: Object = field(default_factory=dict)       # NUMA facts per node
    versions: Object = field(default_factory=dict)
    probe: Object = field(default_factory=dict)        # bandwidth per node/rank
    slos: Object = field(default_factory=dict)
    ranks: Object = field(default_factory=dict)        # per global rank: engine, numerics gate
    spec: Object = field(default_factory=dict)         # the run's whole spec (vcfslm.runspec.RunSpec)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunMeta:
        """Run metadata from meta.json's object; SchemaError lists every field that breaks the schema."""
        found = meta_findings(data)
        if found:
            raise SchemaError(found)
        return build(cls, data)


def meta_findings(data: Any) -> Findings:
    """What is wrong with meta.json's object, field by field, then its matrix (empty: good metadata)."""
    found = schema_findings(RunMeta, data)
    matrix = data.get("matrix") if isinstance(data, dict) else None
    if isinstance(matrix, dict):
        found.extend((f"matrix.{key}", message) for key, message in schema_findings(MetaMatrix, matrix))
    return found


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
    text = read_text(path)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RunFolderError([Problem(str(path), getattr(exc, "lineno", None), getattr(exc, "colno", None),
                                      "", f"not valid JSON: {getattr(exc, 'msg', exc)}")]) from None
    found = meta_findings(data)
    if found:
        raise RunFolderError(capped([Problem(str(path), _key_line(text, key), None, key, message)
                                      for key, message in found], path))
    return build(RunMeta, data)


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
    the merged file is missing (rank-<n>.jsonl, serve-<n>.jsonl), merged as rank 0 merges them.

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
    warnings: list[str] = []
    per_file: list[list[WindowRecord]] = []
    for path in sources:                        # every bad file is named, not only the first
        good, bad = checked_records(path, warnings)
        per_file.append(good)
        problems.extend(bad)
    records = per_file[0] if sources == [results] else merge_records(per_file)
    serving = run_dir / SERVE_RESULTS
    serve_sources = [serving] if serving.exists() else sorted((run_dir / "ranks").glob("serve-*.jsonl"))
    per_serve_file: list[list[ServeRecord]] = []
    for path in serve_sources:
        good, bad = checked_records(path, warnings, ServeRecord)
        per_serve_file.append(good)
        problems.extend(bad)
    serve_records = per_serve_file[0] if serve_sources == [serving] else merge_records(per_serve_file)
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
