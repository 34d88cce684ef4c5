"""The serving answer, simulated (pure): per load the attainment and the TTFT/TPOT tails, per
SLO the threshold load with its bootstrap interval and the fit's interval, the nodes for a
peak, and the fleet's scale-out efficiency at N nodes behind the router.

Everything is judged by the bench's code: the simulated windows pool through
`serving.load_results`, a load meets an SLO by `serving.meets_limit` (the share of requests
that met every limit, `judging`), the threshold is `judging.threshold` over the loads, its
interval `serving.threshold_interval`'s bootstrap over the windows (each server its own
stratum), and the node count `judging.nodes_required` / `nodes_of`. The loads are the grid
asked for, narrowed by the bench's bisection (`serving.next_load`) when the spec sweeps.

Two intervals, because they answer two questions. The bootstrap one is the sampling
spread of a measured sweep of the same windows: what a bench run of this length could read.
The fit's ends are the thresholds simulated again with every step cost at the lower and at
the upper end of the performance model's 95 % prediction interval (`cost.scaled`): how far
the step costs the simulation rests on could be off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..analysis.slo_spec import Slo
from ..serving import decisions as serving
from ..serving import judging
from ..serving.decisions import LoadResult, ServeSpec
from .cost import StepModel
from .fleet import ROUND_ROBIN, Fleet, simulate_window
from .server import Policy

MID, OPTIMISTIC, PESSIMISTIC = "mid", "optimistic", "pessimistic"
# Bisection steps past the grid when the spec sweeps and for each fleet size of the
# scale-out table: simulated windows are cheap, so more than the bench's.
SIM_SWEEP_STEPS = 6


@dataclass(frozen=True)
class Setup:
    """What a simulated serving answer is for: the step costs (MID, and the fit's interval ends
    when known), the scheduler, the bench's serving spec, the SLOs, the servers per VM and
    the router's policy."""

    costs: dict[str, StepModel]
    policy: Policy
    spec: ServeSpec
    slos: tuple[Slo, ...]
    servers_per_vm: int = 1
    router: str = ROUND_ROBIN

    @property
    def input_tokens(self) -> int:
        return self.spec.input_tokens[0]

    def limit(self, slo: Slo) -> dict[str, Any]:
        return slo.limits()

    def share(self, slo: Slo) -> float:
        return serving.share_for(slo.limits(), self.spec.attainment)


@dataclass(frozen=True)
class LoadRow:
    """One load (per server): its pooled result and per SLO the share that met it and the verdict."""

    load: float
    result: LoadResult
    attained: dict[str, float]
    verdicts: dict[str, bool | None]
    # The same load simulated at the fit interval's ends (OPTIMISTIC, PESSIMISTIC), where known.
    ends: dict[str, LoadResult] = field(default_factory=dict)

    def p50_interval(self, which: str) -> list[float | None] | None:
        """The p50 of `which` ("ttft" or "tpot") at the fit interval's ends, low to high."""
        if len(self.ends) < 2:
            return None
        tail = {"ttft": LoadResult.ttft_tail, "tpot": LoadResult.tpot_tail}[which]
        ends = [_finite(tail(self.ends[e], 50)) for e in (OPTIMISTIC, PESSIMISTIC)]
        return sorted(ends) if None not in ends else ends

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {"load": self.load, "requests": r.requests, "completed": len(r.ttft_s), "unfinished": r.unfinished,
                "ttft_s": {"p50": _finite(r.ttft_tail(50)), "p90": _finite(r.ttft_tail(90)),
                           "p50_fit_interval": self.p50_interval("ttft")},
                "tpot_ms": {"p50": _finite(r.tpot_tail(50)), "p90": _finite(r.tpot_tail(90)),
                            "p50_fit_interval": self.p50_interval("tpot")},
                "mean_active": r.mean_active, "attainment": self.attained, "meets": self.verdicts}


@dataclass(frozen=True)
class SloAnswer:
    slo: Slo
    threshold: float | None             # the largest load meeting it below the first failing one
    failing: float | None               # that first failing load (None: every load met it)
    interval: judging.Interval | None   # the bootstrap's
    fit_ends: tuple[float | None, float | None] | None   # (pessimistic, optimistic) thresholds
    binding: str

    @property
    def text(self) -> str:
        if self.threshold is None:
            return f"< {self.failing:g}" if self.failing is not None else "–"
        return f"≥ {self.threshold:g}" if self.failing is None else f"{self.threshold:g}"

    def to_dict(self) -> dict[str, Any]:
        return {"slo": self.slo.to_dict(), "threshold": self.threshold, "first_failing": self.failing,
                "interval": self.interval.to_dict() if self.interval else None,
                "fit_interval": list(self.fit_ends) if self.fit_ends else None, "binding": self.binding}


@dataclass(frozen=True)
class Nodes:
    slo: Slo
    peak_rps: float
    nodes: int | None
    interval: judging.Interval | None
    fit_ends: tuple[int | None, int | None] | None   # from the (pessimistic, optimistic) thresholds

    def to_dict(self) -> dict[str, Any]:
        return {"slo": self.slo.name, "peak_rps": self.peak_rps, "nodes": self.nodes,
                "interval": self.interval.to_dict() if self.interval else None,
                "fit_interval": list(self.fit_ends) if self.fit_ends else None}


@dataclass(frozen=True)
class ScaleRow:
    """One fleet size: its per-server threshold and its efficiency against one node's."""

    nodes: int
    servers: int
    threshold: float | None
    interval: judging.Interval | None
    efficiency: float | None
    efficiency_interval: tuple[float | None, float | None] | None

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "servers": self.servers, "threshold_per_server": self.threshold,
                "interval": self.interval.to_dict() if self.interval else None, "efficiency": self.efficiency,
                "efficiency_interval": list(self.efficiency_interval) if self.efficiency_interval else None}


@dataclass
class Answer:
    setup: Setup
    rows: list[LoadRow]
    slos: list[SloAnswer]
    nodes: list[Nodes] = field(default_factory=list)
    scale_out: dict[str, list[ScaleRow]] = field(default_factory=dict)   # SLO name -> rows


def _finite(x: float) -> float | None:
    return x if x == x and x not in (float("inf"), float("-inf")) else None


def simulate_loads(cost: StepModel, setup: Setup, loads: Sequence[float], servers: int = 1
                   ) -> dict[float, LoadResult]:
    """Every load's windows (the spec's repeats, each its own seed) pooled as the bench pools them."""
    limits = {s.name: setup.limit(s) for s in setup.slos}
    records = []
    for load in loads:
        for window in range(setup.spec.repeats):
            records += simulate_window(cost, setup.policy, setup.spec, load, setup.input_tokens, limits, window,
                                       Fleet(servers, setup.router))
    return serving.load_results(records)


def sweep(cost: StepModel, setup: Setup, loads: Sequence[float], slos: Sequence[Slo], servers: int = 1,
          steps: int = 0) -> dict[float, LoadResult]:
    """The grid, then up to `steps` loads per SLO: halving below the smallest while even that
    fails (as the bench's sweep goes below its grid), else bisecting between the passing and
    the first failing load (the bench's `serving.next_load`)."""
    results = simulate_loads(cost, setup, sorted(set(loads)), servers)
    for slo in slos:
        for taken in range(steps):
            verdicts = {load: serving.meets_limit(r, setup.limit(slo), setup.share(slo)) for load, r in results.items()}
            passing, failing = judging.threshold(verdicts)
            if passing is None and failing is not None and setup.spec.load_kind == "rate":
                nxt = serving.round_rate(failing / 2)
            else:
                nxt = serving.next_load(verdicts, setup.spec.load_kind, taken, steps)
            if nxt is None or nxt in results:
                break
            results.update(simulate_loads(cost, setup, [nxt], servers))
            results = dict(sorted(results.items()))
    return results


def _threshold(results: dict[float, LoadResult], setup: Setup, slo: Slo) -> tuple[float | None, float | None]:
    return judging.threshold({load: serving.meets_limit(r, setup.limit(slo), setup.share(slo))
                              for load, r in results.items()})


def answer(setup: Setup, loads: Sequence[float], peaks_rps: Sequence[float] = (),
           scale_nodes: Sequence[int] = ()) -> Answer:
    """The whole serving answer: per load, per SLO, the nodes for each peak, the scale-out table."""
    steps = SIM_SWEEP_STEPS if setup.spec.sweep else 0
    results = sweep(setup.costs[MID], setup, loads, setup.slos, 1, steps)
    grid = sorted(results)
    ends = {end: simulate_loads(setup.costs[end], setup, grid) for end in (PESSIMISTIC, OPTIMISTIC)
            if end in setup.costs}
    rows = []
    for load, r in results.items():
        attained, verdicts = {}, {}
        for slo in setup.slos:
            a = r.attainment(slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms)
            attained[slo.name] = a.share if a.requests else None
            verdicts[slo.name] = serving.meets_limit(r, setup.limit(slo), setup.share(slo))
        rows.append(LoadRow(load, r, attained, verdicts, {e: got[load] for e, got in ends.items() if load in got}))
    out = []
    for slo in setup.slos:
        passing, failing = _threshold(results, setup, slo)
        iv = serving.threshold_interval(results, setup.limit(slo), setup.share(slo), seed=setup.spec.seed)
        fit = ((_threshold(ends[PESSIMISTIC], setup, slo)[0], _threshold(ends[OPTIMISTIC], setup, slo)[0])
               if len(ends) == 2 else None)
        binding = ""
        if failing is not None:
            binding = results[failing].attainment(slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms).binding(
                setup.share(slo))
        out.append(SloAnswer(slo, passing, failing, iv, fit, binding))
    result = Answer(setup, rows, out)
    k = setup.servers_per_vm
    for peak in peaks_rps:
        for a in out:
            nodes = judging.nodes_required(peak, a.threshold * k) if a.threshold else None
            iv = judging.nodes_of(a.interval, peak / k) if a.interval is not None else None
            fit = (tuple(judging.nodes_required(peak, t * k) if t else None for t in a.fit_ends)
                   if a.fit_ends else None)
            result.nodes.append(Nodes(a.slo, peak, nodes, iv, fit))
    if scale_nodes:
        for a in out:
            result.scale_out[a.slo.name] = scale_out(setup, a, scale_nodes)
    return result


# A fleet's per-server threshold is looked for on this grid around one node's (then bisected):
# routing can only move it by a fraction, either way.
SCALE_GRID = (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6, 2.0)


def scale_out(setup: Setup, one: SloAnswer, node_counts: Sequence[int]) -> list[ScaleRow]:
    """Per-server threshold at each fleet size (nodes x servers per VM behind the router), and
    its efficiency: the fleet's threshold over N times one node's. The efficiency's interval is
    the fleet threshold's bootstrap interval over one node's point threshold."""
    if not one.threshold:
        return []
    grid = [serving.round_rate(one.threshold * f) for f in SCALE_GRID]
    rows = []
    base = None
    for n in node_counts:
        servers = n * setup.servers_per_vm
        results = sweep(setup.costs[MID], setup, grid, [one.slo], servers, SIM_SWEEP_STEPS)
        passing, _ = _threshold(results, setup, one.slo)
        iv = serving.threshold_interval(results, setup.limit(one.slo), setup.share(one.slo), seed=setup.spec.seed)
        if base is None:
            base = passing if n == 1 else one.threshold
        eff = passing / base if passing and base else None
        eff_iv = ((iv.low / base if iv.low else None, iv.high / base if iv.high else None)
                  if iv is not None and base else None)
        rows.append(ScaleRow(n, servers, passing, iv, eff, eff_iv))
    return rows
