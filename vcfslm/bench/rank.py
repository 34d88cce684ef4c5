"""What every kind of rank worker shares: the rank's coordinates, its records' identity,
resume agreement, the window barriers (`Ranks`, the window loop's coordinator of torchrun's
ranks), its record files and its progress lines.

The static worker (bench/worker.py), the in-process serving loop (bench/serve_worker.py)
and the HTTP-backed one (bench/http_worker.py) all import from here and never from
each other's drivers, so the bench's import graph has no cycle (docs/ARCHITECTURE.md).
No torch here: the module is imported before any rank has chosen its threads.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..contract import format_progress
from ..results import ServeRecord
from ..runspec import WorkerSpec
from .placement import placement_problems, thread_cpus
from .windows import ServeWindows

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
    return set.intersection(*map(set, per_rank_finished)) if per_rank_finished else set()


class Ranks:
    """The window loop's coordinator of torchrun's ranks (bench/windows.py): every window, warm-up
    included, starts right after a `dist.barrier()` across all ranks of the run; after it the
    ranks all_gather the wall clock each noted as it left the barrier, and each records its own
    minus the earliest as its start skew. allowed_cpus: the rank's binding (numactl's), to
    catch a thread that left it during a window."""

    def __init__(self, args: RankArgs, env: TorchrunEnv, dist, allowed_cpus: str | None = None):
        self.env, self.dist, self.allowed_cpus = env, dist, allowed_cpus
        self.identity, self.base, self.seat = rank_window(args, env), rank_base(args, env), env.rank

    def _gathered(self, mine: Any) -> list[Any]:
        out: list[Any] = [None] * self.env.world_size
        self.dist.all_gather_object(out, mine)
        return out

    def agree(self, finished: set[tuple]) -> set[tuple]:
        return agreed_skips([{tuple(s) for s in g} for g in self._gathered(sorted(finished))])

    def share(self, records: list, kind: type) -> list:
        return [kind.from_dict(d) for recs in self._gathered([asdict(r) for r in records]) for d in recs]

    def aligned(self, measure: Callable[[], Any]) -> tuple[Any, float, list[str]]:
        injected_delay(self.env.rank)
        self.dist.barrier()
        released = time.time()
        out = measure()
        skew = released - min(self._gathered(released))
        # Where the threads ran during this window: a thread outside the rank's CPUs
        # (a lost binding) makes the window untrustworthy.
        return out, skew, placement_problems(process_cpus=self.allowed_cpus, process_mems=None, intended_cpus=None,
                                             intended_node=None, threads=thread_cpus())

    def report(self, event: dict[str, Any], record: Any = None) -> None:
        progress({**self.base, **event})


def serve_windows(args: RankArgs, env: TorchrunEnv, dist, driver, placement: dict, invalid: list[str], *,
                  allowed_cpus: str | None = None, stops: list | None = None) -> list[ServeRecord]:
    """A serving rank's windows (the spec's loads and the sweep's, per context) over `driver`
    (SlotDriver or serve/http_backend.HttpDriver); its records. invalid: reasons every window
    carries (the rank's placement, a failed slot-graph gate); stops: ServeWindows'."""
    spec = args.spec.run.serve
    if spec is None:
        raise ValueError("serve_windows: the run's spec has no serving settings")
    return ServeWindows(driver, Ranks(args, env, dist, allowed_cpus), serve_file(Path(args.spec.out), env.rank),
                        spec=spec, limits=args.spec.run.serve_limits(), stops=stops, resume=args.spec.resume,
                        placement=placement, invalid=invalid).run()


def injected_delay(rank: int) -> None:
    """Fault injection for tests: VCFSLM_FAULT_DELAY="RANK:SECONDS" makes that rank late to
    every window's barrier (a barrier that works keeps the start skew small anyway)."""
    who, _, seconds = os.environ.get("VCFSLM_FAULT_DELAY", "").partition(":")
    if who.strip().isdigit() and int(who) == rank and seconds:
        time.sleep(float(seconds))


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
