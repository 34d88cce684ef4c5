"""Was a probe taken on a quiet machine? (pure: the probe measures, this judges and words it)

A probe's figures (read bandwidth, triad, the GEMM rate, the decode-batch curve; see
vcfslm/bench/probe.py) are each the best of a few passes, STREAM's convention: the best
pass is the one least disturbed. That convention hides a busy machine rather than
surviving it: on a machine where something else runs, every pass is disturbed, the best
one too, and the figures come out low. `vcfslm lab up --slos-from` then scales the brief's
SLOs by them, and the report's floors and efficiencies divide by them. So the probe also
says whether it was taken on a quiet machine, by two signs:

- spread: per figure, how much slower the median pass ran than the best
  (median time / best time - 1). A quiet machine repeats itself; passes that scatter
  were disturbed, and the best of them is not a floor to trust.
- other processes' CPU time: the busy time /proc/stat counts on the CPUs the probe could
  use, from just before to just after it, less the probe's own CPU time, as a share of
  those CPUs' wall time. The hypervisor's steal time on them is kept beside it. Where
  /proc/stat is missing the share is unknown, and said so, not guessed.

A probe is "steady" unless others' share (or steal) or a figure's spread passes its limit;
then it is "busy", with the reasons. A figure whose best pass is shorter than a few
scheduler ticks is kept but not judged, and of the decode-batch curve only its first row
is (the rate a decode step meets; vcfslm/bench/probe.py says why).

The limits come from probes on a 2-vCPU EPYC VM (docs/operations.md has the table):
- quiet (7 probes at --mib 64 and 1024, and a rank's probe in a local bench): others took
  0.5-3.1 % of the CPUs, steal at most 4.7 %; the judged spreads stayed under 9 % but for
  one decode curve's first row at 19 %;
- with `yes > /dev/null` on one of the two CPUs: others took 40-42 %, while the judged
  spreads stayed under 11 % (a steady load slows every pass alike; the best-of figures
  fell by a third to two thirds: decode at one row 6.1-7.6 GB/s against 10.7-20.2 quiet);
- under another job's tests: others 28-61 %, one GEMM spread 51 %.
So others' share is what tells a busy machine (10 % sits far from both sides), and the
spread limit (25 %) is a backstop above every quiet spread seen, for what CPU time does not
show (a neighbour VM's memory traffic).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STEADY = "steady"
BUSY = "busy"
VERDICTS = (STEADY, BUSY)

# A figure whose median pass ran more than this much slower than its best pass was disturbed.
SPREAD_LIMIT = 0.25
# Other processes taking more than this share of the probe's CPUs' time make a busy machine.
OTHERS_SHARE_LIMIT = 0.10
# The hypervisor taking more than this share of them (steal) does too.
STEAL_SHARE_LIMIT = 0.10
# A figure whose best pass is shorter than this is kept but not judged: one scheduler tick or
# interrupt (a few ms) can double a pass of a millisecond on the quietest machine.
SHORTEST_JUDGED_PASS_S = 0.010


# ---------------------------------------------------------------- spread of one figure's passes


@dataclass(frozen=True)
class Spread:
    """The timed passes of one figure: how many, the best and the median (seconds)."""

    passes: int
    best_s: float
    median_s: float

    @property
    def spread(self) -> float:
        """How much slower the median pass ran than the best: median / best - 1 (0: all alike)."""
        return self.median_s / self.best_s - 1.0 if self.best_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "best_s": float(f"{self.best_s:.6g}"),
                "median_s": float(f"{self.median_s:.6g}"), "spread": round(self.spread, 4)}


def spread_of(times: Sequence[float]) -> Spread:
    """The spread of one figure's pass times (seconds; at least one, each positive)."""
    if not times:
        raise ValueError("a figure needs at least one timed pass")
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times):
        raise ValueError(f"pass times must be positive seconds; got {list(times)!r}")
    return Spread(passes=len(times), best_s=float(min(times)), median_s=float(statistics.median(times)))


# ---------------------------------------------------------------- other processes' CPU time


@dataclass(frozen=True)
class CpuJiffies:
    """One `cpu` line of /proc/stat, in clock ticks: busy (user, nice, system, irq, softirq;
    guest time is inside user and nice already), idle (idle, iowait) and steal."""

    busy: int
    idle: int
    steal: int


def parse_proc_stat(text: str) -> dict[int | None, CpuJiffies]:
    """The `cpu` lines of /proc/stat's text: the total under None, each CPU under its number.

    A line needs user, nice, system and idle; iowait, irq, softirq and steal count as 0
    where an old kernel does not write them. Other lines are not read."""
    out: dict[int | None, CpuJiffies] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            continue
        suffix = name[3:]
        if suffix and not suffix.isdigit():
            continue
        try:
            values = [int(v) for v in rest.split()]
        except ValueError:
            continue
        if len(values) < 4:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
        out[int(suffix) if suffix else None] = CpuJiffies(busy=user + nice + system + irq + softirq,
                                                          idle=idle + iowait, steal=steal)
    return out


@dataclass(frozen=True)
class OthersCpu:
    """The CPU time others took on the probe's CPUs while it ran.

    share: their busy seconds less the probe's own, over wall time x CPUs (None: unknown,
    and `unknown` says why); steal_share: the hypervisor's steal time over the same."""

    cpus: int
    wall_s: float
    own_s: float
    others_s: float | None = None
    share: float | None = None
    steal_share: float | None = None
    unknown: str | None = None

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None, digits: int) -> float | None:
            return None if x is None else round(x, digits)

        return {"cpus": self.cpus, "wall_s": r(self.wall_s, 3), "own_s": r(self.own_s, 3),
                "others_s": r(self.others_s, 3), "share": r(self.share, 4),
                "steal_share": r(self.steal_share, 4), "unknown": self.unknown}


def others_cpu(before: str | None, after: str | None, cpus: Collection[int] | None, own_cpu_s: float,
               wall_s: float, ticks_per_s: float) -> OthersCpu:
    """Others' share of the probe's CPUs between two readings of /proc/stat (its text; None
    where it could not be read).

    cpus: the CPUs the probe could use (None: every CPU the file lists); own_cpu_s: the
    probe's own CPU time (user + system, children included) over the same stretch;
    ticks_per_s: the kernel's USER_HZ (os.sysconf("SC_CLK_TCK")). The own time is taken
    off the busy time (never below zero: the ticks are coarser than the process's clock)."""
    if before is None or after is None:
        return OthersCpu(cpus=len(cpus) if cpus else 0, wall_s=wall_s, own_s=own_cpu_s,
                         unknown="no /proc/stat to read")
    first, last = parse_proc_stat(before), parse_proc_stat(after)
    wanted = sorted(cpus) if cpus else sorted(k for k in last if k is not None)
    missing = [c for c in wanted if c not in first or c not in last]
    if not wanted or missing:
        why = f"/proc/stat does not list CPU(s) {','.join(map(str, missing))}" if missing else \
            "/proc/stat lists no CPU"
        return OthersCpu(cpus=len(wanted), wall_s=wall_s, own_s=own_cpu_s, unknown=why)
    if wall_s <= 0 or ticks_per_s <= 0:
        return OthersCpu(cpus=len(wanted), wall_s=wall_s, own_s=own_cpu_s, unknown="no time passed")
    busy_s = sum(last[c].busy - first[c].busy for c in wanted) / ticks_per_s
    steal_s = sum(last[c].steal - first[c].steal for c in wanted) / ticks_per_s
    capacity = wall_s * len(wanted)
    others = max(busy_s - own_cpu_s, 0.0)
    return OthersCpu(cpus=len(wanted), wall_s=wall_s, own_s=own_cpu_s, others_s=others,
                     share=min(others / capacity, 1.0), steal_share=min(max(steal_s, 0.0) / capacity, 1.0))


# ---------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Steadiness:
    """The verdict on one probe, its reasons, and what it was judged on."""

    verdict: str                        # STEADY | BUSY
    reasons: tuple[str, ...]            # why BUSY (empty when steady)
    spreads: dict[str, Spread]          # per figure
    others: OthersCpu
    limits: dict[str, float] = field(default_factory=dict)
    unjudged: tuple[str, ...] = ()      # figures whose passes were too short to judge

    @property
    def busy(self) -> bool:
        return self.verdict == BUSY

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": list(self.reasons),
                "spreads": {name: s.to_dict() for name, s in self.spreads.items()},
                "unjudged": list(self.unjudged), "others_cpu": self.others.to_dict(), "limits": dict(self.limits)}


def judge(spreads: Mapping[str, Spread], others: OthersCpu, *, spread_limit: float = SPREAD_LIMIT,
          others_limit: float = OTHERS_SHARE_LIMIT, steal_limit: float = STEAL_SHARE_LIMIT,
          shortest_pass_s: float = SHORTEST_JUDGED_PASS_S) -> Steadiness:
    """STEADY, or BUSY with a reason for every figure whose spread passed `spread_limit` and
    for others' (or the hypervisor's) share past its limit. A figure whose best pass is under
    `shortest_pass_s` is not judged; an unknown share is no reason: the spreads decide then."""
    unjudged = tuple(name for name, s in spreads.items() if s.best_s < shortest_pass_s)
    reasons = [f"{name}: the median of {s.passes} passes ran {_pct(s.spread)} slower than the best "
               f"(limit {_pct(spread_limit)})" for name, s in spreads.items()
               if name not in unjudged and s.spread > spread_limit]
    if others.share is not None and others.share > others_limit:
        reasons.append(f"other processes took {_pct(others.share)} of the {_cpus(others.cpus)} the probe "
                       f"ran on (limit {_pct(others_limit)})")
    if others.steal_share is not None and others.steal_share > steal_limit:
        reasons.append(f"the hypervisor took {_pct(others.steal_share)} of the {_cpus(others.cpus)} the probe "
                       f"ran on as steal time (limit {_pct(steal_limit)})")
    return Steadiness(verdict=BUSY if reasons else STEADY, reasons=tuple(reasons), spreads=dict(spreads),
                      others=others, unjudged=unjudged,
                      limits={"spread": spread_limit, "others_share": others_limit, "steal_share": steal_limit,
                              "shortest_pass_s": shortest_pass_s})


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%" if x < 0.1 else f"{x * 100:.0f}%"


def _cpus(n: int) -> str:
    return f"{n} CPU" + ("" if n == 1 else "s")


# ---------------------------------------------------------------- reading a recorded verdict back


@dataclass(frozen=True)
class Recorded:
    """A verdict as a probe file or a run recorded it (`steadiness` of a probe object)."""

    verdict: str
    reasons: tuple[str, ...]
    summary: str            # one line: the verdict and what it rests on

    @property
    def busy(self) -> bool:
        return self.verdict == BUSY


def recorded(probe: Any) -> Recorded | None:
    """The verdict in a probe object (a node of `vcfslm probe -o json`, a rank's `probe`
    fact); None when it has none (a probe older than the check) or it is not readable."""
    data = probe.get("steadiness") if isinstance(probe, dict) else None
    if not isinstance(data, dict) or data.get("verdict") not in VERDICTS:
        return None
    reasons = data.get("reasons")
    reasons = tuple(str(r) for r in reasons) if isinstance(reasons, list) else ()
    return Recorded(verdict=data["verdict"], reasons=reasons, summary=summary_line(data))


def summary_line(data: Mapping[str, Any]) -> str:
    """`steady: spreads gemm 1.2%, ... (passes too short to judge: read 9.0%); others took 0.4%
    of 2 CPUs`, or `busy: <reasons>` (a steadiness object as to_dict writes it)."""
    if data.get("verdict") == BUSY:
        return "busy: " + "; ".join(str(r) for r in data.get("reasons") or ())
    spreads = data.get("spreads") if isinstance(data.get("spreads"), dict) else {}
    unjudged = data.get("unjudged") if isinstance(data.get("unjudged"), list) else []
    parts = {name: f"{name} {_pct(s['spread'])}" for name, s in spreads.items()
             if isinstance(s, dict) and _number(s.get("spread"))}
    judged = [text for name, text in parts.items() if name not in unjudged]
    text = "steady: spreads " + (", ".join(judged) if judged else "none judged")
    short = [text for name, text in parts.items() if name in unjudged]
    if short:
        text += f" (passes too short to judge: {', '.join(short)})"
    others = data.get("others_cpu") if isinstance(data.get("others_cpu"), dict) else {}
    if _number(others.get("share")):
        text += f"; others took {_pct(others['share'])} of {_cpus(int(others.get('cpus') or 0))}"
    else:
        text += f"; others' CPU time unknown ({others.get('unknown') or 'not recorded'})"
    return text


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def rank_verdicts(ranks: Any) -> list[tuple[str, str | None, Recorded]]:
    """(rank, its node, its probe's verdict) for every rank of a run's meta.json `ranks` whose
    probe recorded one, by rank number; a run older than the check gives none."""
    out = []
    items = ranks.items() if isinstance(ranks, dict) else ()
    for rank, facts in sorted(items, key=lambda kv: (len(str(kv[0])), str(kv[0]))):
        verdict = recorded(facts.get("probe")) if isinstance(facts, dict) else None
        if verdict is not None:
            node = facts.get("node")
            out.append((str(rank), str(node) if node not in (None, "") else None, verdict))
    return out
