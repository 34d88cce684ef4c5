"""Serving through one endpoint (pure): the scale-out curve, sizing on it, and the faults.

Runs of `bench --serve --endpoint` load a deployment's front door, and their records say
how many nodes stood behind it (`endpoint_nodes`). Their series (analysis/serve.py) are
judged as every serving series is; here they are read side by side:

- Scale-out: per SLO and context or workload (one server, one model), the threshold at N
  nodes behind the endpoint (the deployment's requests/s), N x the single node's, and their
  ratio, the scale-out efficiency. Its interval pairs the two thresholds' intervals the
  cautious way: low = low(N) / (N x high(1)), high = high(N) / (N x low(1)). An end that is
  a bound ("≥", every load tried passed) leaves the efficiency open on that side.
- Sizing on the curve: the fewest measured N whose capacity (its threshold, or its busy
  streams there, less the headroom) carries the peak; past the largest N measured, that
  N's capacity per node (its efficiency kept) times the nodes.
- Faults: each window that took one (`--fault`), as its record accounts it.

Duck-typed on analysis/serve.py's thresholds (`key`, `slo`, `status`, `passing`,
`interval`, `point`, `streams_per_vm`), so it imports nothing of that module and that
module may call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vcfslm.serving import judging
from vcfslm.serving.judging import Interval

MEASURED = ("threshold", "above")


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}"


@dataclass(frozen=True, eq=False)
class ScaleRow:
    """One node count of a scale-out curve."""

    nodes: int
    threshold: Any                 # the series' ServeThreshold at `nodes`
    single: Any | None             # ... at one node (None: not measured)

    @property
    def measured(self) -> float | None:
        """The deployment's requests/s (or users) at the threshold (None: none passed)."""
        t = self.threshold
        return t.passing if t.status in MEASURED else None

    @property
    def ideal(self) -> float | None:
        """N x the single node's threshold."""
        s = self.single
        return None if s is None or s.status not in MEASURED else self.nodes * s.passing

    @property
    def efficiency(self) -> float | None:
        m, i = self.measured, self.ideal
        return None if m is None or not i else m / i

    @property
    def efficiency_mark(self) -> str:
        """"≥ " when the threshold at N is a lower bound, "≤ " when the single node's is; "" else."""
        above_n = self.threshold.status == "above"
        above_1 = self.single is not None and self.single.status == "above"
        if above_n and above_1:
            return "?"
        return "≥ " if above_n else ("≤ " if above_1 else "")

    @property
    def efficiency_interval(self) -> Interval | None:
        """low(N) / (N x high(1)) to high(N) / (N x low(1)) from the two threshold intervals."""
        iv_n = self.threshold.interval
        iv_1 = None if self.single is None else self.single.interval
        if iv_n is None or iv_1 is None or self.single.status not in MEASURED:
            return None
        n = self.nodes
        low = (iv_n.low / (n * iv_1.high) if iv_n.low is not None and iv_1.high and not iv_1.high_bound
               else None)
        high = (iv_n.high / (n * iv_1.low) if iv_n.high is not None and iv_1.low else None)
        return Interval(low, high, False, iv_n.high_bound or high is None, min(iv_n.replicates, iv_1.replicates),
                        iv_n.confidence, False)

    @property
    def efficiency_text(self) -> str:
        e = self.efficiency
        if e is None or self.efficiency_mark == "?":
            return "–"
        if self.nodes == 1:
            return "1 (the reference)"
        iv = self.efficiency_interval
        text = self.efficiency_mark + fmt_ratio(e)
        if iv is not None and (iv.low is not None or iv.high is not None):
            text += " " + interval_text(iv)
        return text

    @property
    def streams(self) -> float | None:
        """Concurrent streams across the deployment at the threshold (busy slots, Little's law)."""
        s = self.threshold.streams_per_vm
        return None if s is None or self.measured is None else s * self.nodes

    def split(self) -> dict[str, float]:
        """Each server's share of the requests its counter finished at the threshold load."""
        p = self.threshold.point(self.threshold.passing)
        return server_shares(p.result.windows if p is not None and p.result is not None else ())

    def to_dict(self) -> dict[str, Any]:
        t = self.threshold
        iv = self.efficiency_interval
        return {"nodes": self.nodes, "status": t.status, "threshold": self.measured,
                "threshold_text": deployment_text(t),
                "threshold_interval": None if t.interval is None else t.interval.to_dict(),
                "single_node_threshold": None if self.single is None else self.single.passing,
                "ideal": self.ideal, "efficiency": self.efficiency, "efficiency_text": self.efficiency_text,
                "efficiency_interval": None if iv is None else iv.to_dict(), "streams": self.streams,
                "first_failing": t.failing, "binding": t.binding, "server_shares": self.split()}


def load_text(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def deployment_text(t: Any) -> str:
    """A threshold in the deployment's own load (what the endpoint was offered), with its
    interval: `7 [6–<14]`, `< 2`, `≥ 14`."""
    judged = t.judged
    if t.status == "below":
        return f"< {load_text(judged[0].load)}"
    if t.status == "unjudged":
        return "–"
    text = ("≥ " if t.status == "above" else "") + load_text(judged[-1].load if t.status == "above" else t.passing)
    iv = "" if t.interval is None else t.interval.text(load_text)
    return f"{text} {iv}".strip()


def failing_text(t: Any) -> str:
    """The first failing load offered at the endpoint, or `> the largest tried`."""
    if t.failing is None:
        judged = t.judged
        return f"> {load_text(judged[-1].load)}" if judged else "–"
    return load_text(t.failing)


def interval_text(iv: Interval) -> str:
    """`[0.81–1.1]`, an open end "none" below or "≥" above."""
    low = "none" if iv.low is None else fmt_ratio(iv.low)
    high = "open" if iv.high is None else ("≥ " if iv.high_bound else "") + fmt_ratio(iv.high)
    return f"[{low}–{high}]"


def server_shares(records: Sequence[Any]) -> dict[str, float]:
    """Each server's share of the requests its own counter finished over these windows
    (servers whose counter was not read in some window are left out of it)."""
    totals: dict[str, int] = {}
    for r in records:
        for url, n in (getattr(r, "server_requests", None) or {}).items():
            if n is not None:
                totals[url] = totals.get(url, 0) + int(n)
    whole = sum(totals.values())
    return {url: n / whole for url, n in sorted(totals.items())} if whole else {}


def shares_text(shares: Mapping[str, float]) -> str:
    """`2 servers, 48–52 %`: how evenly the router spread the requests."""
    if not shares:
        return "–"
    values = sorted(shares.values())
    return f"{len(values)} servers, {values[0] * 100:.0f}–{values[-1] * 100:.0f} %"


@dataclass(frozen=True, eq=False)
class ScaleOut:
    """One SLO and context's curve: its node counts ascending."""

    slo: Any
    rows: tuple[ScaleRow, ...]

    @property
    def key(self):
        return self.rows[0].threshold.key

    @property
    def nodes(self) -> list[int]:
        return [r.nodes for r in self.rows]

    @property
    def usable(self) -> bool:
        """A curve to size on: a passing threshold at more than one node count, or beyond one node."""
        measured = [r.nodes for r in self.rows if r.measured is not None]
        return len(measured) > 1 or any(n > 1 for n in measured)

    def capacities(self, which: str = "rate") -> list[tuple[int, float, float | None, float | None]]:
        """(N, the deployment's capacity at N, its interval's low and high ends) for the node
        counts with a passing threshold: requests/s ("rate") or busy streams ("streams")."""
        out = []
        for r in self.rows:
            if r.measured is None:
                continue
            t = r.threshold
            if which == "rate":
                iv = t.interval
                out.append((r.nodes, r.measured, None if iv is None else iv.low,
                            None if iv is None or iv.high_bound else iv.high))
            elif r.streams is not None:
                iv = t.streams_interval
                k = r.nodes
                out.append((r.nodes, r.streams, None if iv is None or iv.low is None else iv.low * k,
                            None if iv is None or iv.high is None or iv.high_bound else iv.high * k))
        return out

    def to_dict(self) -> dict[str, Any]:
        k = self.key
        return {"slo": self.slo.to_dict(), "input_tokens": k.input_tokens, "output_tokens": k.output_tokens,
                "workload": k.workload, "load_kind": k.load_kind, "arrival": k.arrival, "slots": k.slots,
                "server": k.server, "model": k.model, "rows": [r.to_dict() for r in self.rows]}


def scale_outs(thresholds: Sequence[Any]) -> list[ScaleOut]:
    """Every endpoint series' thresholds as curves: one per SLO, context, workload, load kind,
    arrival, slots, server and model, rows by the nodes behind the endpoint. A curve needs more
    than one node count, or one beyond a single node."""
    groups: dict[tuple, dict[int, Any]] = {}
    for t in thresholds:
        k = t.key
        if not k.endpoint_nodes or k.faulted:         # a curve of capacity: windows without faults
            continue
        group = (t.slo, k.input_tokens, k.output_tokens, k.workload, k.load_kind, k.arrival, k.slots, k.server,
                 k.model)
        groups.setdefault(group, {})[k.endpoint_nodes] = t
    out = []
    for group, by_n in groups.items():
        if len(by_n) < 2 and 1 in by_n:
            continue
        single = by_n.get(1)
        out.append(ScaleOut(group[0], tuple(ScaleRow(n, by_n[n], single) for n in sorted(by_n))))
    return out


def curve_for(curves: Sequence[ScaleOut], t: Any) -> ScaleOut | None:
    """The usable curve of the same SLO, context, workload, load kind, server and model as `t`."""
    k = t.key
    for c in curves:
        ck = c.key
        if (c.slo == t.slo and c.usable and _curve_group(ck) == _curve_group(k)):
            return c
    return None


def _curve_group(k: Any) -> tuple:
    return (k.input_tokens, k.output_tokens, k.workload, k.load_kind, k.server, k.model)


def curve_nodes(capacities: Sequence[tuple[int, float]], peak: float, headroom: float = 0.0
                ) -> tuple[int, bool] | None:
    """(nodes, extrapolated) to carry `peak` on a measured curve of (N, capacity at N): the
    fewest measured N whose capacity less the headroom carries it, else the largest N's
    capacity per node times the nodes (its efficiency kept). None: no capacity measured."""
    measured = sorted((n, c) for n, c in capacities if c is not None and c > 0)
    if not measured:
        return None
    for n, c in measured:
        if c * (1 - headroom) >= peak:
            return n, False
    n, c = measured[-1]
    return max(n + 1, judging.nodes_required(peak, c / n, headroom)), True


def curve_interval(capacities: Sequence[tuple[int, float, float | None, float | None]], peak: float,
                   headroom: float = 0.0) -> Interval | None:
    """The node counts the capacities' interval ends imply: the high ends give the fewest,
    the low ends the most (None at an end some node count lacks)."""
    if not capacities:
        return None
    fewest = curve_nodes([(n, hi) for n, _, _, hi in capacities if hi is not None], peak, headroom) \
        if all(hi is not None for *_, hi in capacities) else None
    most = curve_nodes([(n, lo) for n, _, lo, _ in capacities if lo is not None], peak, headroom) \
        if all(lo is not None for _, _, lo, _ in capacities) else None
    if fewest is None and most is None:
        return None
    return Interval(None if fewest is None else fewest[0], None if most is None else most[0])


def curve_text(curve: ScaleOut, which: str, unit: str) -> str:
    """`1 node 3.1, 2 nodes 6.0 req/s (efficiency 0.97)`: what the sizing reads."""
    parts = []
    for r in curve.rows:
        value = r.measured if which == "rate" else r.streams
        if value is None:
            continue
        eff = "" if r.nodes == 1 or r.efficiency is None else f" (efficiency {r.efficiency_text})"
        parts.append(f"{r.nodes} node{'s' if r.nodes > 1 else ''} {value:.3g}{eff}")
    return ", ".join(parts) + f" {unit}"


# ------------------------------------------------------------------ faults


@dataclass(frozen=True)
class FaultWindow:
    """One window that took a fault, as its record accounts it."""

    run_id: str
    nodes: int
    load: float
    load_kind: str
    input_tokens: int
    window: int
    fault: Mapping[str, Any]
    valid: bool

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "nodes": self.nodes, "load": self.load, "load_kind": self.load_kind,
                "input_tokens": self.input_tokens, "window": self.window, "valid": self.valid, **self.fault}


def fault_windows(runs: Sequence[Any]) -> list[FaultWindow]:
    """Every window of `runs` that took a fault, in run, node count and load order."""
    out = [FaultWindow(r.run_id, r.endpoint_nodes, float(r.load), r.load_kind, r.input_tokens, r.window,
                       dict(r.fault), r.valid)
           for run in runs for r in (getattr(run, "serve_records", None) or ()) if getattr(r, "fault", None)]
    return sorted(out, key=lambda f: (f.run_id, f.nodes, f.input_tokens, f.load, f.window))


def seconds_text(value: Any) -> str:
    return "–" if value is None else f"{value:.1f}"


def share_text(value: Any) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 100:.0f} %"
