"""The one window loop: every kind of run measures its scenarios' windows through it.

A `WindowDriver` measures a window: the static engine (bench/worker.py), the slot engine
(bench/serve_worker.py), a vNUMA node's HTTP server (serve/http_backend.py) or a
deployment's front door (endpoint/client.py). A `Coordinator` says who measures alongside:
torchrun's ranks (bench/rank.Ranks: barrier-aligned windows, agreed skips) or nobody
(`Alone`). The loop is the same for all: the resume prologue (what every member finished
is skipped; a scenario partly measured loses its records and runs again), warm-ups
(negative indices, discarded), each window's record appended as it ends, its progress
event. A static run goes through its list of scenarios (`StaticWindows`); a serving run
through its contexts, at the loads the sweep decides from the members' shared history
(`ServeWindows`), so every rank takes the same decisions and their barriers stay aligned.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import results
from ..results import ServeRecord, WindowRecord
from ..serving import decisions as serving
from ..serving import lowering
from ..serving.decisions import ServeSpec
from ..verdicts import recompiled

log = logging.getLogger("vcfslm.bench.worker")
# A bound on the sweep's extra windows whatever the budget: windows that come out invalid
# add no requests but still cost time.
MAX_REFINE_ROUNDS = 20


@dataclass(frozen=True)
class Window:
    scenario: tuple     # what its record's `scenario` says
    index: int          # at its scenario; negative: a warm-up, discarded
    seed: int = 0       # its arrivals' seed (serving)


class WindowDriver(Protocol):
    compiles: int       # graphs compiled so far: one compiled inside a window makes it invalid

    def window(self, w: Window) -> tuple[dict[str, Any], list[str]]: ...   # measured fields, why invalid
    def rss(self) -> tuple[int, int]: ...                                   # (peak, current) bytes


class Coordinator(Protocol):
    identity: dict[str, Any]   # the records' RankWindow fields
    seat: int                  # whose arrivals a window draws: the rank, or the stage's node count

    def agree(self, finished: set[tuple]) -> set[tuple]: ...   # what every member finished
    def share(self, records: list, kind: type) -> list: ...    # every member's records
    # measure() started with the others: its result, the start skew, threads that left the binding
    def aligned(self, measure: Callable[[], Any]) -> tuple[Any, float, list[str]]: ...
    def report(self, event: dict[str, Any], record: Any = None) -> None: ...


@dataclass
class Alone:
    """One process with no ranks: nobody to agree with or wait for."""

    identity: dict[str, Any]
    seat: int
    report: Callable[..., None]

    def agree(self, finished: set[tuple]) -> set[tuple]:
        return set(finished)

    def share(self, records: list, kind: type) -> list:
        return list(records)

    def aligned(self, measure: Callable[[], Any]) -> tuple[Any, float, list[str]]:
        return measure(), 0.0, []


def drop_scenarios(path: Path, scenarios: set[tuple], kind: type = WindowRecord,
                   ours: Callable[[Any], bool] = lambda r: True) -> int:
    """Remove the records of `scenarios` (of those `ours`) from a record file; count removed."""
    if not path.exists() or not scenarios:
        return 0
    every = results.read_records(path, kind=kind)
    kept = [r for r in every if not (ours(r) and r.scenario in scenarios)]
    if len(kept) != len(every):
        results.write_records(path, kept)
    return len(every) - len(kept)


class Windows:
    """One member's windows, appended to `file` as each ends; `records`: the kept ones, then each
    measured one. invalid: reasons every window carries (the rank's placement, a failed gate
    of a graph every window runs). ours: the file's records that are this loop's (the
    endpoint's file holds every stage's). Without `resume` an old file is removed first."""

    kind: type = WindowRecord
    phase = "measure"

    def __init__(self, driver: WindowDriver, team: Coordinator, file: Path, *, resume: bool,
                 placement: dict, invalid: Sequence[str] = (), ours: Callable[[Any], bool] = lambda r: True):
        self.driver, self.team, self.file, self.resume = driver, team, file, resume
        self.placement, self.invalid, self.ours = placement, list(invalid), ours
        self.records: list = []
        self.skip: set[tuple] = set()
        self.measured = 0

    def resumed(self, repeats: int, within: Sequence[tuple] | None = None) -> set[tuple]:
        """The scenarios (of `within`) every member finished: skipped. The others' records go."""
        if not self.resume and self.file.exists():
            self.file.unlink()
        kept = [r for r in results.read_records(self.file, kind=self.kind) if self.ours(r)] \
            if self.file.exists() else []
        self.skip = self.team.agree(results.finished_scenarios(kept, repeats))
        if within is not None:
            self.skip &= set(within)
        stale = {r.scenario for r in kept if within is None or r.scenario in within} - self.skip
        if drop_scenarios(self.file, stale, self.kind, self.ours):
            log.info("dropped the partial records of %d scenario(s) to rerun", len(stale))
        self.records = [r for r in kept if r.scenario not in stale]
        return self.skip

    def windows(self, scenario: tuple, indices: range, where: dict[str, Any], seed: Callable[[int], int] = int,
                invalid: Sequence[str] = ()) -> None:
        """Measure `indices` of one scenario; `invalid`: reasons these windows carry first."""
        for index in indices:
            w = Window(scenario, index, seed(index))
            before = self.driver.compiles
            (measured, why), skew, moved = self.team.aligned(lambda w=w: self.driver.window(w))
            compiles = self.driver.compiles - before
            reasons = [*invalid, *self.invalid, *moved, *why] + ([recompiled(compiles)] if compiles else [])
            peak, rss = self.driver.rss()
            record = self.kind(**self.team.identity, **self.fields(w), **measured, window=max(index, 0),
                               start_skew_s=skew, peak_rss_bytes=peak, rss_bytes=rss, recompiles=compiles,
                               valid=not reasons, invalid_reasons=reasons, placement=self.placement)
            if index >= 0:
                results.append_record(self.file, record)
                self.records.append(record)
                self.measured += 1
            self.kept(record, index >= 0)
            self.team.report({**where, "phase": self.phase if index >= 0 else "warmup",
                              "window": index if index >= 0 else index - indices.start,
                              **self.summary(record)}, record)

    def fields(self, w: Window) -> dict[str, Any]:
        return {}      # a static driver's fields say the scenario

    def summary(self, r) -> dict[str, Any]:
        return {"tpot_ms_p50": round(results.percentile(r.tpot_ms, 50), 3),
                "ttft_s_p50": round(results.percentile(r.ttft_s, 50), 4), "rank_tps": round(r.rank_tps, 3),
                "wall_s": round(r.wall_s, 4), "skew_ms": round(r.start_skew_s * 1000, 3), "valid": r.valid,
                "compiles": r.recompiles, "roofline_tpot_ms": r.roofline_tpot_ms and round(r.roofline_tpot_ms, 3),
                "roofline_ttft_s": r.roofline_ttft_s and round(r.roofline_ttft_s, 4),
                "rss_gb": round(r.rss_bytes / 1e9, 3), "peak_rss_gb": round(r.peak_rss_bytes / 1e9, 3)}

    def kept(self, record, measured: bool) -> None:
        """After each window, before its progress event."""


class StaticWindows(Windows):
    """A static run: each scenario of its list, `warmup` discarded windows then `repeats`;
    begin(scenario, where) readies one before its first window and says what its windows carry."""

    def run(self, scenarios: Sequence[tuple[int, int, int]], warmup: int, repeats: int,
            begin: Callable[[tuple, dict], list[str]]) -> None:
        skip = self.resumed(repeats, within=scenarios)
        for k, scenario in enumerate(scenarios, 1):
            where = dict(zip(("scenario", "scenarios", "batch", "input_tokens", "output_tokens"),
                             (k, len(scenarios), *scenario), strict=True))
            if scenario in skip:
                self.team.report({**where, "phase": "skip", "window": 0})
                continue
            self.windows(scenario, range(-warmup, repeats), where, invalid=begin(scenario, where))
            self.team.report({**where, "phase": "done", "window": repeats})


class ServeWindows(Windows):
    """A serving run: each context's loads, the spec's and the sweep's. Each window's records are
    shared as it ends, so every member holds the same history. stops: gets one {slo,
    input_tokens, reason} per SLO and context the sweep finished."""

    kind = ServeRecord
    phase = "serve"

    def __init__(self, driver: WindowDriver, team: Coordinator, file: Path, *, spec: ServeSpec,
                 limits: dict[str, Any], stops: list | None = None, **kw):
        super().__init__(driver, team, file, **kw)
        self.spec, self.limits, self.stops = spec, limits, stops
        self.history: list[ServeRecord] = []

    def run(self) -> list[ServeRecord]:
        spec = self.spec
        self.resumed(spec.repeats)
        # Every member's kept records of the agreed loads: the sweep's history starts from them.
        self.history = self.team.share(self.records, ServeRecord)
        for input_tokens in spec.input_tokens:
            where = self.where(input_tokens)
            sweep_input(spec, self.limits, input_tokens, self.measure,
                        lambda _i=input_tokens: [r for r in self.history if r.input_tokens == _i and
                                                 r.output_tokens == spec.output_tokens and
                                                 r.load_kind == spec.load_kind],
                        lambda name, why, _w=where: self.stopped(name, why, _w))
            self.team.report({**where, "phase": "done", "window": spec.repeats})
        return self.records

    def where(self, input_tokens: int, **load) -> dict[str, Any]:
        return {**load, "load_kind": self.spec.load_kind, "input_tokens": input_tokens,
                "output_tokens": self.spec.output_tokens}

    def measure(self, load: float, input_tokens: int, extra: int | None = None) -> None:
        """The load's repeats (skipped when resumed; after warm-ups if it is this member's
        first), or with `extra` that one more window."""
        spec, where = self.spec, self.where(input_tokens, load=load)
        scenario = (spec.load_kind, float(load), input_tokens, spec.output_tokens)
        if extra is None and scenario in self.skip:
            self.team.report({**where, "phase": "skip", "window": 0})
            return
        indices = (range(extra, extra + 1) if extra is not None else
                   range(-spec.warmup_windows if self.measured == 0 else 0, spec.repeats))
        self.windows(scenario, indices, where,
                     lambda index: serving.window_seed(spec.seed, self.team.seat, load, input_tokens, index))

    def fields(self, w: Window) -> dict[str, Any]:
        spec, (load_kind, load, input_tokens, output_tokens) = self.spec, w.scenario
        return {"load_kind": load_kind, "load": load, "arrival": spec.arrival_kind, "slots": spec.slots,
                "input_tokens": input_tokens, "output_tokens": output_tokens, "seed": w.seed,
                "burstiness": spec.burstiness, "think_s": spec.think_s}

    def summary(self, r: ServeRecord) -> dict[str, Any]:
        return {"offered": r.offered, "completed": r.completed, "unfinished": r.unfinished,
                "ttft_s_p90": _rounded(serving.tail(r.ttft_s, r.unfinished), 4),
                "tpot_ms_p90": _rounded(serving.tail(r.tpot_ms, r.unfinished), 3),
                "mean_active": round(r.mean_active, 3), "max_queue": r.max_queue, "rank_tps": round(r.rank_tps, 3),
                "goodput": r.goodput, "valid": r.valid, "wall_s": round(r.wall_s, 3)}

    def kept(self, record: ServeRecord, measured: bool) -> None:
        self.history.extend(self.team.share([record] if measured else [], ServeRecord))

    def stopped(self, name: str, why: str, where: dict[str, Any]) -> None:
        log.info("sweep %s, input %d: stopped: %s", name, where["input_tokens"], why)
        if self.stops is not None:
            self.stops.append({"slo": name, "input_tokens": where["input_tokens"], "reason": why})
        self.team.report({**where, "phase": "swept", "slo": name, "reason": why})


# ------------------------------------------------------------------ the sweep


def sweep_input(spec: ServeSpec, limits: dict[str, dict], input_tokens: int,
                measure: Callable[[float, int, int | None], None],
                records_of: Callable[[], list[ServeRecord]], stopped: Callable[[str, str], None]) -> None:
    """One context's loads: the spec's grid (ending once every SLO failed: higher loads only
    fail more), then with --sweep per SLO: lower loads while even the smallest fails
    (vcfslm.serving.lowering), bisection and refinement, `stopped(slo, why)` as each SLO's sweep ends.
    measure(load, input_tokens, extra): the load's repeats, or with `extra` that one more
    window."""

    def verdicts(limit: dict) -> dict[float, bool | None]:
        share = serving.share_for(limit, spec.attainment)
        return {load: serving.meets_limit(res, limit, share)
                for load, res in serving.load_results(records_of()).items()}

    for load in sorted(set(spec.loads)):
        measure(load, input_tokens, None)
        if spec.sweep and limits and all(verdicts(lim).get(float(load)) is False for lim in limits.values()):
            break
    if not spec.sweep:
        return
    rule = serving.RefineRule.of_spec(spec)
    for name, limit in limits.items():
        share = serving.share_for(limit, spec.attainment)
        steps = 0
        while True:
            records = records_of()
            low = lowering.lower_load(serving.load_results(records), limit, share, rule, steps,
                                      extra_seconds(records, spec.repeats, min(spec.loads)), name)
            if low.kind != lowering.LOWER:
                break
            steps += 1
            log.info("sweep %s, input %d: %s", name, input_tokens, low.reason)
            measure(low.load, input_tokens, None)
        if low.stopped:
            stopped(name, low.reason)
            continue
        while (nxt := serving.next_load(verdicts(limit), spec.load_kind, steps, spec.sweep_steps)) is not None:
            steps += 1
            if nxt in verdicts(limit):
                break
            log.info("sweep %s, input %d: next load %g", name, input_tokens, nxt)
            measure(nxt, input_tokens, None)
        stopped(name, _refine(spec, name, limit, records_of,
                              lambda load, window: measure(load, input_tokens, window)))


def _refine(spec: ServeSpec, name: str, limit: dict, records_of, measure_extra) -> str:
    """Narrow the threshold's interval until it is within the precision or the budget is spent:
    a new load inside the gap while the gap alone is too wide, else one more window at each
    load the replicates disagree about; why it stopped.

    A new load's window is numbered after the repeats, as every added window is, so
    `extra_seconds` counts it against the budget (with the windows below the grid)."""
    share = serving.share_for(limit, spec.attainment)
    rule = serving.RefineRule.of_spec(spec)
    for _ in range(MAX_REFINE_ROUNDS):
        records = records_of()
        step = serving.refine(serving.load_results(records), limit, share, rule,
                              extra_seconds(records, spec.repeats, min(spec.loads)))
        if step.done:
            return step.reason
        if step.new_load is not None:
            log.info("sweep %s: %s; a new load at %g", name, step.reason, step.new_load)
            measure_extra(step.new_load, max(spec.repeats, next_window(records, step.new_load)))
            continue
        log.info("sweep %s: %s; one more window at %s", name, step.reason, ", ".join(f"{v:g}" for v in step.loads))
        for load in step.loads:
            measure_extra(load, next_window(records, load))
    return f"{MAX_REFINE_ROUNDS} rounds of extra windows, the most a sweep adds"


def extra_seconds(records, repeats: int, below: float = 0.0) -> float:
    """Wall time the sweep's budget counts (each window as long as its slowest rank): its extra
    windows (numbered after the repeats) and every window at a load below `below` (the grid's
    smallest: the loads lowering added, and what bisection measured down there)."""
    walls: dict[tuple[float, int], float] = {}
    for r in records:
        if r.window >= repeats or float(r.load) < below:
            key = (float(r.load), r.window)
            walls[key] = max(walls.get(key, 0.0), r.wall_s)
    return sum(walls.values())


def next_window(records, load: float) -> int:
    """The next window index at `load` (after every one any rank recorded)."""
    return 1 + max((r.window for r in records if float(r.load) == float(load)), default=-1)


def _rounded(value: float, digits: int) -> float | None:
    return round(value, digits) if math.isfinite(value) else None
