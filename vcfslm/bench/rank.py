"""What every kind of rank worker shares: the rank's coordinates, its records' identity,
resume agreement, its record files and its progress lines.

The static worker (bench/worker.py), the in-process serving loop (bench/serve_worker.py)
and the HTTP-backed one (bench/http_worker.py) all import from here and never from
each other's drivers, so the bench's import graph has no cycle (docs/ARCHITECTURE.md).
No torch here: the module is imported before any rank has chosen its threads.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import results
from ..contract import format_progress
from ..results import WindowRecord
from ..runspec import WorkerSpec

# The workers' one logger: every kind of rank writes its events under the same name.
log = logging.getLogger("vcfslm.bench.worker")


@dataclass(frozen=True)
class TorchrunEnv:
    """The rank's coordinates from torchrun's environment (single process when absent)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> TorchrunEnv:
        env = dict(os.environ if env is None else env)
        return cls(rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)),
                   world_size=int(env.get("WORLD_SIZE", 1)),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                   group_rank=int(env.get("GROUP_RANK", 0)),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(env.get("MASTER_PORT", 29500)))


@dataclass(frozen=True)
class RankArgs:
    """The worker's command line: its node's spec (the file the launcher wrote) and the
    node's name; the rank's place in the run is torchrun's environment (TorchrunEnv)."""

    spec: WorkerSpec
    node: str


def rank_base(args: RankArgs, env: TorchrunEnv) -> dict[str, Any]:
    """What every progress line of this rank starts with."""
    return {"rank": env.rank, "node": args.node, "local_rank": env.local_rank}


def rank_window(args: RankArgs, env: TorchrunEnv) -> dict[str, Any]:
    """The RankWindow fields of this rank's records (static and serving alike)."""
    return {"run_id": args.spec.run.run_id, "node": args.node, "node_rank": env.group_rank, "rank": env.rank,
            "local_rank": env.local_rank, "world_size": env.world_size,
            "ranks_per_node": env.local_world_size, "nodes": args.spec.nodes}


# ------------------------------------------------------------------ resume


def agreed_skips(per_rank_finished: list[set[tuple]]) -> set[tuple]:
    """Scenarios every rank has finished (only those may be skipped by all)."""
    if not per_rank_finished:
        return set()
    common = set(per_rank_finished[0])
    for finished in per_rank_finished[1:]:
        common &= set(finished)
    return common


def drop_scenarios(path: Path, scenarios: set[tuple], kind: type = WindowRecord) -> int:
    """Remove the records of `scenarios` from a rank file (a rerun replaces them); count removed."""
    if not path.exists() or not scenarios:
        return 0
    every = results.read_records(path, kind=kind)
    kept = [r for r in every if r.scenario not in scenarios]
    removed = len(every) - len(kept)
    if removed:
        results.write_records(path, kept)
    return removed


# ------------------------------------------------------------------ files and progress


def rank_file(out: Path, rank: int) -> Path:
    """A static rank's window records, appended as each window ends."""
    return out / "ranks" / f"rank-{rank}.jsonl"


def serve_file(out: Path, rank: int) -> Path:
    """A serving rank's window records, appended as each window ends."""
    return out / "ranks" / f"serve-{rank}.jsonl"


def facts_file(out: Path, rank: int) -> Path:
    """This rank's facts (placement, probe, model, engine or server)."""
    return out / "ranks" / f"rank-{rank}.json"


def progress(event: dict[str, Any]) -> None:
    """One progress line on stdout (flushed: the launcher reads it live) and in the log."""
    line = format_progress(event)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    log.info("%s", line)
