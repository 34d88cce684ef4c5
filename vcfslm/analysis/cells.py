"""Aggregate the window records of one or more run dirs into per-scope cells.

A cell is one (scope, VMs, ranks per VM, batch per rank, input, output) point of the
matrix. How the numbers are pooled (the brief measures one rank per node and
averages those; this harness records every rank):

- TTFT and TPOT percentiles pool the per-stream values of every rank and every
  valid window: each stream is a user, so p50/p90/p99 are "what users saw".
- Rank throughput is the p50 over all (rank, window) values; its run-to-run spread
  is min..max over repeats of the per-repeat mean across ranks (the brief's
  "per-node results are averaged", once per repeat).
- A repeat is one (run id, window) pair, so several runs of the same scope and
  matrix pool into one cell and their differences count as run-to-run spread.
- Invalid windows (recompiles, worker-detected problems) are left out of every
  statistic and counted; a cell without any valid window has no numbers.
- The model is part of a cell's key: runs of different models never pool into one
  cell, and every answer built on cells keeps one row per model.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from vcfslm.contract import LEGACY_COMPILE_MODES, MEASUREMENT_MODES
from vcfslm.errors import RunFolderError
from vcfslm.matrix import recorded_scenarios
from vcfslm.results import (
    RunFile,
    RunMeta,
    WindowRecord,
    percentile,
    read_run,
)
from vcfslm.steadiness import rank_verdicts
from vcfslm.verdicts import is_numerics_gate, numerics_gate_detail

PERCENTILES = ("p50", "p90", "p99")
SINGLE = "single"
CLUSTER = "cluster"
SCOPE_TITLES = {SINGLE: "single VM", CLUSTER: "cluster"}

# A rank that starts this late has not shared the memory bus with the others for the
# whole window, so the window under-states contention.
SKEW_WARN_S = 0.05
SKEW_WARN_FRACTION = 0.05


@dataclass(frozen=True)
class Quantiles:
    """p50 / p90 / p99 of one indicator; None when unknown (e.g. a CSV without p90)."""

    p50: float
    p90: float | None = None
    p99: float | None = None

    def get(self, pct: str) -> float | None:
        if pct not in PERCENTILES:
            raise ValueError(f"percentile must be one of {', '.join(PERCENTILES)}, not {pct!r}")
        value = getattr(self, pct)
        return None if value is None or not math.isfinite(value) else value


@dataclass(frozen=True)
class CellKey:
    scope: str
    vms: int
    ranks_per_vm: int
    batch_per_rank: int
    input_tokens: int
    output_tokens: int
    model: str = ""          # what the run benchmarked (meta.json `model`); "" when unknown (a CSV without it)


@dataclass(frozen=True)
class Cell:
    """One measured point of the matrix for one scope."""

    key: CellKey
    ttft_s: Quantiles
    tpot_ms: Quantiles
    rank_tps: float
    source: str = ""
    origin: str = "run"                       # "run" (window records) | "csv" (imported table)
    rank_tps_repeats: tuple[float, ...] = ()
    ttft_repeats: tuple[float, ...] = ()      # per-repeat p50 TTFT (s)
    tpot_repeats: tuple[float, ...] = ()      # per-repeat p50 TPOT (ms)
    roofline_tpot_ms: float | None = None
    roofline_ttft_s: float | None = None      # prefill floor: prompt FLOPs / measured GEMM rate
    windows: int = 0
    invalid_windows: int = 0
    expected_windows: int | None = None
    ranks_measured: int = 0
    max_start_skew_s: float | None = None
    recompiles: int = 0
    flags: tuple[str, ...] = ()
    # What the bootstrap resamples: per rank (run, node, rank), its valid windows, each
    # (per-stream TTFT s, per-stream TPOT ms). Empty for imported or predicted cells.
    strata: tuple[tuple[tuple[tuple[float, ...], tuple[float, ...]], ...], ...] = field(
        default=(), compare=False, repr=False)

    # Shorthands so callers read like the tables.
    scope = property(lambda self: self.key.scope)
    vms = property(lambda self: self.key.vms)
    ranks_per_vm = property(lambda self: self.key.ranks_per_vm)
    batch_per_rank = property(lambda self: self.key.batch_per_rank)
    input_tokens = property(lambda self: self.key.input_tokens)
    output_tokens = property(lambda self: self.key.output_tokens)
    model = property(lambda self: self.key.model)

    @property
    def streams_per_vm(self) -> int:
        return self.key.batch_per_rank * self.key.ranks_per_vm

    @property
    def streams_cluster(self) -> int:
        return self.streams_per_vm * self.key.vms

    @property
    def repeats(self) -> int:
        return len(self.tpot_repeats)

    @property
    def samples(self) -> int | None:
        """Per-stream values a percentile of this cell is taken of (None: unknown, e.g. a CSV)."""
        return sum(len(w[1]) for windows in self.strata for w in windows) if self.strata else None

    @property
    def has_data(self) -> bool:
        """Both p50s measured: what a cell needs to be judged against an SLO."""
        return math.isfinite(self.tpot_ms.p50) and math.isfinite(self.ttft_s.p50)

    def per_user_tps(self, pct: str = "p50") -> float | None:
        """Per-user speed (tokens/s) = 1000 / TPOT."""
        tpot = self.tpot_ms.get(pct)
        return 1000.0 / tpot if tpot else None

    @property
    def roofline_efficiency(self) -> float | None:
        """Roofline TPOT / measured p50 TPOT: 1.0 means decode runs at its floor."""
        return _efficiency(self.roofline_tpot_ms, self.tpot_ms.get("p50"))

    @property
    def ttft_efficiency(self) -> float | None:
        """Roofline TTFT / measured p50 TTFT: 1.0 means prefill runs at its floor."""
        return _efficiency(self.roofline_ttft_s, self.ttft_s.get("p50"))

    @property
    def rank_tps_spread(self) -> tuple[float, float] | None:
        return spread(self.rank_tps_repeats)


def finite(value: float | None) -> float | None:
    """The value, or None when it is missing, infinite or NaN (what JSON and CSV can hold)."""
    return value if value is not None and math.isfinite(value) else None


def spread(values: Sequence[float]) -> tuple[float, float] | None:
    """(min, max) over repeats, or None with fewer than two repeats (spread unknown)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return (min(xs), max(xs)) if len(xs) >= 2 else None


def _efficiency(floor: float | None, measured: float | None) -> float | None:
    """floor / measured, None when either is unknown (or nothing was measured)."""
    if floor is None or not measured:
        return None
    return floor / measured


@dataclass
class Analysis:
    """Cells of all inputs plus what makes them less trustworthy."""

    cells: list[Cell]
    metas: list[RunMeta] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    runs: list[RunFile] = field(default_factory=list)   # the run folders read (what a model is fitted on)

    def scopes(self) -> list[str]:
        return [s for s in (SINGLE, CLUSTER) if any(c.scope == s for c in self.cells)]

    def scope_cells(self, scope: str) -> list[Cell]:
        return sorted((c for c in self.cells if c.scope == scope), key=sort_key)

    def models(self) -> list[str]:
        return models_of(self.cells)


def models_of(cells: Iterable[Cell]) -> list[str]:
    """The models the cells were measured on, in cell order, once each."""
    return list(dict.fromkeys(c.model for c in cells))


MODEL_UNKNOWN = "–"


def model_text(model: str) -> str:
    """A model as the tables show it ("–" for a CSV that did not name one)."""
    return model or MODEL_UNKNOWN


def sort_key(cell: Cell) -> tuple:
    return key_order(cell.key)


def key_order(k: CellKey) -> tuple:
    return (k.scope != SINGLE, k.vms, k.input_tokens, k.output_tokens, k.ranks_per_vm, k.batch_per_rank)


def scope_of(meta: RunMeta) -> str:
    """Single VM when the run used one node, cluster otherwise."""
    return SINGLE if len(meta.nodes) <= 1 else CLUSTER


# ------------------------------------------------------------------ loading


def load_runs(paths: Iterable[str | os.PathLike[str]]) -> list[RunFile]:
    """Load run dirs, each checked against the schema (see results.read_run); the problems of
    every bad one are one RunFolderError. A RunFile unpacks as (meta, records)."""
    runs, problems = [], []
    for path in paths:
        try:
            runs.append(read_run(Path(path)))
        except RunFolderError as exc:
            problems.extend(exc.problems)
    if problems:
        raise RunFolderError(problems)
    return runs


# -------------------------------------------------------------- aggregation


def aggregate(runs: Sequence[RunFile | tuple[RunMeta, Sequence[WindowRecord]]]) -> Analysis:
    """Cells of every (scope, config, scenario) in `runs`, with validity warnings (a RunFile's own
    warnings among them)."""
    groups: dict[CellKey, list[WindowRecord]] = defaultdict(list)
    expected: dict[CellKey, int] = defaultdict(int)
    sources: dict[CellKey, set[str]] = defaultdict(set)
    warnings: list[str] = []
    numerics: list[str] = []
    for run in runs:
        meta, records = run
        scope, vms = scope_of(meta), max(len(meta.nodes), 1)
        numerics.extend(numerics_warnings(meta.run_id, records))
        serves = bool(getattr(run, "serve_records", None))
        warnings.extend(run_warnings(meta, records, getattr(run, "warnings", ()), serves))
        for r in records:
            key = CellKey(scope, vms, r.ranks_per_node, r.batch_per_rank, r.input_tokens, r.output_tokens,
                          meta.model)
            groups[key].append(r)
            sources[key].add(meta.run_id)
        # A serving run without static windows asked for none (its matrix may still list them).
        for scenario in () if serves and not records else expected_scenarios(meta):
            key = CellKey(scope, vms, meta.ranks_per_node, *scenario, meta.model)
            expected[key] += expected_windows(meta)
            sources[key].add(meta.run_id)
    cells = []
    # Models in the order their runs were given: the answer lists them as the user did.
    model_rank = {m: n for n, m in enumerate(dict.fromkeys(meta.model for meta, _ in runs))}
    several_models = len(model_rank) > 1
    for key in sorted(set(groups) | set(expected), key=lambda k: (model_rank[k.model], key_order(k))):
        cell = cell_from_records(key, groups.get(key, []), expected.get(key) or None,
                                 ", ".join(sorted(sources[key])))
        cells.append(cell)
        explained = numerics_flag(groups.get(key, []))
        # A cell whose only invalid windows are a gate-failed rank's is already said per rank.
        warnings.extend(f"{describe(cell, several_models)}: {flag}" for flag in cell.flags if flag != explained)
    # A failed numerics gate voids the numbers of the graphs it failed: say it before anything else.
    return Analysis(cells=cells, metas=[m for m, _ in runs], warnings=numerics + warnings,
                    runs=[r for r in runs if isinstance(r, RunFile)])


def cell_from_records(key: CellKey, records: Sequence[WindowRecord], expected: int | None = None,
                      source: str = "") -> Cell:
    """Pool the records of one cell (see the module docstring for how)."""
    valid = [r for r in records if r.valid]
    ttft = [v for r in valid for v in r.ttft_s]
    tpot = [v for r in valid for v in r.tpot_ms]
    by_repeat: dict[tuple[str, int], list[WindowRecord]] = defaultdict(list)
    for r in valid:
        by_repeat[(r.run_id, r.window)].append(r)
    repeats = [by_repeat[k] for k in sorted(by_repeat)]
    rooflines = [r.roofline_tpot_ms for r in valid if r.roofline_tpot_ms is not None]
    ttft_floors = [r.roofline_ttft_s for r in valid if r.roofline_ttft_s is not None]   # None in old runs
    skews = [r.start_skew_s for r in records]
    by_rank: dict[tuple[str, str, int], list[WindowRecord]] = defaultdict(list)
    for r in valid:
        by_rank[(r.run_id, r.node, r.rank)].append(r)
    strata = tuple(tuple((tuple(r.ttft_s), tuple(r.tpot_ms)) for r in sorted(rs, key=lambda r: r.window))
                   for _, rs in sorted(by_rank.items()))
    cell = Cell(
        key=key,
        ttft_s=Quantiles(*(percentile(ttft, q) for q in (50, 90, 99))),
        tpot_ms=Quantiles(*(percentile(tpot, q) for q in (50, 90, 99))),
        rank_tps=percentile([r.rank_tps for r in valid], 50),
        source=source,
        rank_tps_repeats=tuple(sum(r.rank_tps for r in rs) / len(rs) for rs in repeats),
        ttft_repeats=tuple(percentile([v for r in rs for v in r.ttft_s], 50) for rs in repeats),
        tpot_repeats=tuple(percentile([v for r in rs for v in r.tpot_ms], 50) for rs in repeats),
        roofline_tpot_ms=percentile(rooflines, 50) if rooflines else None,
        roofline_ttft_s=percentile(ttft_floors, 50) if ttft_floors else None,
        windows=len(records),
        invalid_windows=len(records) - len(valid),
        expected_windows=expected,
        ranks_measured=len({(r.run_id, r.rank) for r in valid}),
        max_start_skew_s=max(skews) if skews else None,
        recompiles=sum(r.recompiles for r in records),
        strata=strata,
    )
    return replace(cell, flags=tuple(cell_flags(cell, records)))


def recompile_flag(records: Iterable) -> str | None:
    """What the report says about recompiles (of WindowRecords or ServeRecords alike): said once.

    The worker marks a window that compiled invalid, and its reason says how many
    compilations, so the invalid-window flag already tells those; flagging them again
    would count them twice. Only a window counted valid that still recompiled (a record
    no worker judged, e.g. written by hand) needs a flag of its own: its numbers include
    the compile time."""
    counted = sum(1 for r in records if r.valid and r.recompiles)
    return f"recompiles inside {counted} window(s) counted as valid" if counted else None


def cell_flags(cell: Cell, records: Sequence[WindowRecord]) -> list[str]:
    """Plain-language reasons to distrust a cell."""
    flags = []
    if not records:
        flags.append("no windows recorded (scenario missing)")
    elif cell.expected_windows and cell.windows < cell.expected_windows:
        flags.append(f"incomplete: {cell.windows} of {cell.expected_windows} windows recorded")
    if cell.invalid_windows:
        invalid = [r for r in records if not r.valid]
        reasons = sorted({why for r in invalid for why in r.invalid_reasons if not is_numerics_gate(why)})
        # The gate's own message is said once per rank (numerics_warnings); here only who.
        failed = sorted({rank_name(r) for r in invalid if any(is_numerics_gate(w) for w in r.invalid_reasons)})
        if failed:
            reasons.append(f"numerics gate failed on {', '.join(failed)}")
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        flags.append(f"{cell.invalid_windows} invalid window(s) left out{detail}")
        if cell.invalid_windows == cell.windows:
            flags.append("no valid window: no numbers")
    recompiled = recompile_flag(records)
    if recompiled:
        flags.append(recompiled)
    skewed = [r for r in records if r.start_skew_s > max(SKEW_WARN_S, SKEW_WARN_FRACTION * r.wall_s)]
    if skewed:
        worst = max(r.start_skew_s for r in skewed)
        flags.append(f"start skew up to {worst:.3f} s in {len(skewed)} window(s)")
    return flags


def numerics_flag(records: Sequence[WindowRecord]) -> str | None:
    """The invalid-window flag of a cell whose invalid windows all (and only) failed the numerics gate."""
    invalid = [r for r in records if not r.valid]
    if not invalid or not all(r.invalid_reasons and all(is_numerics_gate(w) for w in r.invalid_reasons)
                              for r in invalid):
        return None
    failed = sorted({rank_name(r) for r in invalid})
    return f"{len(invalid)} invalid window(s) left out (numerics gate failed on {', '.join(failed)})"


def rank_name(r: WindowRecord) -> str:
    return f"{r.node} rank {r.rank}"


def numerics_warnings(run_id: str, records: Sequence[WindowRecord]) -> list[str]:
    """One warning per rank whose windows failed the numerics gate: which node and rank, and why.

    Such a rank measured a different computation from the eager model, so the report
    names it rather than only counting its windows."""
    by_rank: dict[tuple[str, int], list[WindowRecord]] = defaultdict(list)
    for r in records:
        if not r.valid and any(is_numerics_gate(w) for w in r.invalid_reasons):
            by_rank[(r.node, r.rank)].append(r)
    out = []
    for (node, rank), rs in sorted(by_rank.items()):
        why = sorted({numerics_gate_detail(w) for r in rs for w in r.invalid_reasons if is_numerics_gate(w)})
        out.append(f"run {run_id}: numerics gate failed on node {node}, rank {rank} (local rank "
                   f"{rs[0].local_rank}): {'; '.join(w for w in why if w) or 'no detail recorded'}; "
                   f"its {len(rs)} window(s) are left out of every number")
    return out


def describe(cell: Cell, with_model: bool = False) -> str:
    """A cell in words; with_model names its model too (needed once the inputs hold several)."""
    k = cell.key
    return ((f"{model_text(k.model)}, " if with_model else "") + f"{SCOPE_TITLES[k.scope]} ({k.vms} VM x "
            f"{k.ranks_per_vm} ranks) input {k.input_tokens} / output {k.output_tokens}, batch {k.batch_per_rank}/rank")


# ---------------------------------------------------------------- the matrix


def expected_scenarios(meta: RunMeta) -> list[tuple[int, int, int]]:
    """(batch, input, output) scenarios the run's matrix asked for (its --scenarios filter applied)."""
    return recorded_scenarios(meta.matrix or {})


def expected_windows(meta: RunMeta) -> int:
    """Windows a complete scenario has: repeats x every rank of every node."""
    repeats = int((meta.matrix or {}).get("repeats") or 1)
    return repeats * max(len(meta.nodes), 1) * meta.ranks_per_node


def run_warnings(meta: RunMeta, records: Sequence[WindowRecord], read: Sequence[str] = (),
                 serves: bool = False) -> list[str]:
    """Run-level warnings: what reading its files skipped (`read`: a torn last line), an
    unfinished run, a failure, records of other runs (`serves`: it has serving records, so
    no static ones is no fault)."""
    out = list(read)
    if not meta.complete:
        out.append(f"run {meta.run_id} is not complete (meta.json complete=false)")
    if meta.failure:
        out.append(f"run {meta.run_id} failed: {meta.failure}")
    if not records and not serves:
        out.append(f"run {meta.run_id} has no records")
    foreign = {r.run_id for r in records} - {meta.run_id}
    if foreign:
        out.append(f"run {meta.run_id} holds records of other run(s): {', '.join(sorted(foreign))}")
    baseline = baseline_modes(meta, records)
    if baseline:
        out.append(f"run {meta.run_id} ran the decode step in {' and '.join(baseline)} mode: a baseline, "
                   "not a measurement mode (ops between the linears run unfused, so TPOT carries "
                   "per-op overhead); measure with bench.compile: compile")
    out.extend(busy_probe_warnings(meta))
    return out


def busy_probe_warnings(meta: RunMeta) -> list[str]:
    """One warning per rank whose probe found the machine busy (its recorded verdict, with the
    reasons). A run older than the verdict, or without probes, has none to say."""
    out = []
    for rank, node, verdict in rank_verdicts(meta.ranks):
        if not verdict.busy:
            continue
        where = f"node {node}, rank {rank}" if node else f"rank {rank}"
        out.append(f"run {meta.run_id}: the probe on {where} was taken on a busy machine "
                   f"({'; '.join(verdict.reasons)}): its figures are likely low, which skews the roofline floors, "
                   "efficiencies and performance model drawn from them; rerun on a quiet machine")
    return out



def baseline_modes(meta: RunMeta, records: Sequence[WindowRecord]) -> list[str]:
    """The compile modes of a run that are not measurement modes (from its records, else meta)."""
    modes = {str(r.placement.get("compile_mode")) for r in records if r.placement.get("compile_mode")}
    if not modes and (meta.matrix or {}).get("compile"):
        modes = {str(meta.matrix["compile"])}
    # Older runs recorded autotune/freezing/default: compiled, so measurements.
    return sorted(m for m in modes if LEGACY_COMPILE_MODES.get(m, m) not in MEASUREMENT_MODES)
