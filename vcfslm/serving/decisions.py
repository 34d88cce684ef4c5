"""Serving mode's decisions, pure: what a load is, when requests arrive, how long they
are, whether a load meets an SLO, and which load to measure next in a sweep.

Shared by the rank worker (which generates the arrivals and runs the sweep inside the
run) and the analysis (which judges the recorded windows the same way), so a threshold
read off a report is the one the sweep bisected towards.

Definitions (after vLLM's `bench serve` and guidellm, on one rank instead of an HTTP
server):
- Open loop, `rate` requests/s per rank: inter-arrival gaps are exponential (Poisson)
  or gamma with shape `burstiness` and the same mean 1/rate, so burstiness 1 is
  Poisson, below 1 burstier (the gaps' coefficient of variation is 1/sqrt(burstiness)),
  above 1 more regular. Requests arrive whether or not the rank keeps up. Each process
  and its gaps is one entry of vcfslm.serving.arrivals.
- Closed loop, `users` per rank: each user sends a request, waits for its last token,
  thinks (exponential, mean `think_s`; 0 = not at all) and sends the next.
- A window generates arrivals over [0, duration_s). Only requests arriving inside the
  measured span [warmup_s, duration_s - cooldown_s] count: the first fill an empty
  batch, the last see it draining. The window runs until every counted request is done
  or the cutoff (duration_s + drain_s) passes; a counted request unfinished by then has
  missed every SLO (its latency is taken as infinite).
- A load meets an SLO when at least the stated share (`attainment`, default 90 %) of the
  counted requests of every rank met every limit at once: TTFT (queue included) and TPOT
  (`vcfslm.serving.judging`, which also says how sure that is).
- A sweep whose smallest load fails first measures lower loads (vcfslm.serving.lowering) until one
  passes, or stops and says why (a request alone misses the SLO, too few requests, the
  budget). It bisects between the largest passing and the first failing load, then refines
  until the threshold's interval (`vcfslm.serving.judging`: from the replicates' thresholds up to
  their first failing loads, exclusive) is narrower than `sweep_precision` (relative to the
  threshold) or `sweep_budget_s` is spent: a new load inside the bracket while the gap
  between the passing and the failing load alone is wider than that, else more windows
  at the loads the replicates disagree about.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vcfslm.serving import arrivals, judging
from vcfslm.serving.workloads import Workload

LOAD_KINDS = arrivals.LOAD_KINDS
LENGTH_DISTS = ("fixed", "uniform")
SERVE_PERCENTILE = 90.0                 # the tails the progress lines and tables show
DEFAULT_SLOTS = 16
# Prompt tokens one step takes under a backlog: vLLM's CPU server's max_num_batched_tokens
# (its engine/arg_utils.py), so both schedulers admit a queue alike.
DEFAULT_BATCHED_TOKENS = 2048
# A sweep stops narrowing when the passing and failing loads are this close (relative).
SWEEP_TOLERANCE = 0.05


# ------------------------------------------------------------------ the settings


@dataclass(frozen=True)
class ServeSpec:
    """How a serving run loads each rank (meta.json keeps it as matrix["serve"])."""

    load_kind: str = "rate"                 # "rate" | "users"
    loads: tuple[float, ...] = (1.0,)       # per rank: requests/s, or users
    input_tokens: tuple[int, ...] = (512,)  # one context per value (nominal prompt length)
    output_tokens: int = 128
    slots: int = DEFAULT_SLOTS
    chunk_tokens: int = 0                   # prompt tokens per step at most; 0: from the rank's probes
    batched_tokens: int = DEFAULT_BATCHED_TOKENS   # ... under a backlog (several prompts per step)
    arrival: str = arrivals.DEFAULT         # open loop only: one of arrivals.OPEN_LOOP
    burstiness: float = 1.0
    think_s: float = 0.0                    # closed loop only
    lengths: str = "fixed"                  # "fixed" | "uniform" (in [low x nominal, nominal])
    length_low: float = 0.5
    duration_s: float = 60.0
    warmup_s: float = 5.0
    cooldown_s: float = 5.0
    drain_s: float | None = None            # after duration_s; None: duration_s (then unfinished)
    warmup_windows: int = 1                 # discarded windows before the first measured load
    repeats: int = 1
    sweep: bool = False
    sweep_steps: int = 3                    # loads added below the grid and by bisection, per SLO and context
    seed: int = 0
    attainment: float = judging.DEFAULT_ATTAINMENT   # share of requests that must meet every limit
    sweep_precision: float = 0.25           # stop refining once the interval is this narrow (relative)
    sweep_budget_s: float = 600.0           # ... or once the added windows took this long (0: none)
    # What the requests look like (vcfslm.serving.workloads); None: `lengths` at the contexts and
    # output length above (a fixed workload is that). With a workload the one context is its
    # longest prompt and output_tokens its longest reply, which size the servers' KV cache.
    workload: Workload | None = None

    def __post_init__(self):
        problems = spec_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def arrival_kind(self) -> str:
        """What the records call the arrival process: closed for users."""
        return arrivals.recorded_name(self.load_kind, self.arrival)

    @property
    def span_s(self) -> float:
        return self.duration_s - self.warmup_s - self.cooldown_s

    @property
    def cutoff_s(self) -> float:
        return self.duration_s + (self.duration_s if self.drain_s is None else self.drain_s)

    @property
    def max_context(self) -> int:
        return max(self.input_tokens) + self.output_tokens

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["loads"] = list(self.loads)
        out["input_tokens"] = list(self.input_tokens)
        out["workload"] = None if self.workload is None else self.workload.to_dict()
        return out

    @classmethod
    def of_record(cls, data: Mapping[str, Any]) -> ServeSpec:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for key in ("loads", "input_tokens"):
            if key in known:
                known[key] = tuple(known[key])
        if isinstance(known.get("workload"), Mapping):
            known["workload"] = Workload.of_record(dict(known["workload"]))
        return cls(**known)

    def with_loads(self, loads: Iterable[float]) -> ServeSpec:
        return replace(self, loads=tuple(loads))


def spec_problems(spec: ServeSpec) -> list[str]:
    """What makes a ServeSpec unusable (empty: fine); each says which setting and why."""
    out = []
    if spec.load_kind not in LOAD_KINDS:
        out.append(f"load kind must be one of {', '.join(LOAD_KINDS)}, got {spec.load_kind!r}")
    if not spec.loads or any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)
                             for v in spec.loads):
        out.append(f"loads must be positive numbers, got {list(spec.loads)}")
    elif spec.load_kind == "users" and any(float(v) != int(v) for v in spec.loads):
        out.append(f"users must be whole numbers, got {list(spec.loads)}")
    if not spec.input_tokens or any(v < 1 for v in spec.input_tokens):
        out.append(f"input tokens must be positive, got {list(spec.input_tokens)}")
    if spec.output_tokens < 2:
        out.append(f"output tokens must be at least 2 (TPOT needs two), got {spec.output_tokens}")
    if spec.slots < 1:
        out.append(f"slots must be at least 1, got {spec.slots}")
    if spec.chunk_tokens < 0:
        out.append(f"chunk tokens must not be negative (0: from the probes), got {spec.chunk_tokens}")
    if spec.batched_tokens < max(1, spec.chunk_tokens):
        out.append(f"batched tokens must be at least 1 and the chunk tokens ({spec.chunk_tokens}), "
                   f"got {spec.batched_tokens}")
    if spec.arrival not in arrivals.OPEN_LOOP:
        out.append(f"arrival must be one of {', '.join(arrivals.OPEN_LOOP)}, got {spec.arrival!r}")
    if not spec.burstiness > 0:
        out.append(f"burstiness must be positive, got {spec.burstiness}")
    if spec.think_s < 0:
        out.append(f"think time must not be negative, got {spec.think_s}")
    if spec.lengths not in LENGTH_DISTS:
        out.append(f"lengths must be one of {', '.join(LENGTH_DISTS)}, got {spec.lengths!r}")
    if not 0 < spec.length_low <= 1:
        out.append(f"length_low must be in (0, 1], got {spec.length_low}")
    if min(spec.warmup_s, spec.cooldown_s) < 0 or spec.duration_s <= 0:
        out.append("duration must be positive and warm-up/cool-down not negative")
    elif spec.span_s <= 0:
        out.append(f"warm-up {spec.warmup_s:g} s + cool-down {spec.cooldown_s:g} s leave nothing of the "
                   f"{spec.duration_s:g} s window to measure")
    if spec.drain_s is not None and spec.drain_s < 0:
        out.append(f"drain must not be negative, got {spec.drain_s}")
    if spec.repeats < 1 or spec.warmup_windows < 0 or spec.sweep_steps < 0:
        out.append("repeats must be at least 1, warm-up windows and sweep steps not negative")
    if not 0 < spec.attainment < 1:
        out.append(f"attainment must be a share in (0, 1), e.g. 0.9, got {spec.attainment}")
    if not spec.sweep_precision > 0 or spec.sweep_budget_s < 0:
        out.append("sweep precision must be positive and the sweep budget not negative")
    w = spec.workload
    if w is not None and spec.load_kind == "users" and (w.replay or w.multi_turn):
        out.append(f"the workload {w.name} sets its own arrivals (a replay or conversations): give its load "
                   "in requests/s, not users")
    return out


# ------------------------------------------------------------------ arrivals


@dataclass(frozen=True)
class Planned:
    """A request as the load generator plans it (open loop: its arrival is fixed)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Piece:
    """A step's prompt chunk, the scheduler's decision and the engine's input: tokens
    [start, stop) of a `length`-token prompt being admitted into `slot`."""

    slot: int
    prompt: Any
    start: int
    stop: int
    length: int

    @property
    def last(self) -> bool:
        return self.stop >= self.length


def window_seed(seed: int, rank: int, load: float, input_tokens: int, window: int) -> int:
    """A seed per (run seed, rank, load, context, window): ranks draw independent streams,
    and a resumed or repeated run draws the same ones."""
    return (seed * 1_000_003 + rank * 7919 + int(round(load * 1000)) * 104_729
            + input_tokens * 31 + window * 15_485_863) % (2 ** 63)


def arrival_times(rate: float, duration_s: float, rng: random.Random, burstiness: float = 1.0,
                  arrival: str = arrivals.DEFAULT) -> list[float]:
    """Open-loop arrival times in [0, duration_s) at `rate` per second, the gaps drawn by
    the `arrival` process."""
    draw = arrivals.process(arrival).gaps
    if draw is None:
        raise ValueError(f"{arrival} is a closed loop: its requests follow replies, not a clock")
    out: list[float] = []
    t = 0.0
    while True:
        t += draw(rate, 1, rng, burstiness)[0]
        if t >= duration_s:
            return out
        out.append(t)


def counted_arrival_times(rate: float, count: int, rng: random.Random, burstiness: float = 1.0,
                          arrival: str = arrivals.DEFAULT, *, stretch: bool = True) -> list[float]:
    """Exactly `count` open-loop arrival times at `rate` per second, drawn the way `vllm bench
    serve --num-prompts count --request-rate rate` draws them: `count` gaps from the
    `arrival` process, the first request one gap after 0. With `stretch` (vllm bench's
    default) the times are scaled so the last arrival is at count/rate: a run of a fixed
    count then offers exactly `rate`, where `count` raw gaps sum to count/rate only on
    average (±1/sqrt(count) for Poisson)."""
    draw = arrivals.process(arrival).gaps
    if draw is None:
        raise ValueError(f"{arrival} is a closed loop: its requests follow replies, not a clock")
    if count < 1:
        raise ValueError(f"a count of arrivals must be at least 1, got {count}")
    out: list[float] = []
    t = 0.0
    for _ in range(count):
        t += draw(rate, 1, rng, burstiness)[0]
        out.append(t)
    if stretch and out[-1] > 0:
        factor = (count / rate) / out[-1]
        out = [v * factor for v in out]
    return out


def counted_window(rate: float, count: int, rng: random.Random, burstiness: float = 1.0,
                   arrival: str = arrivals.DEFAULT, *, stretch: bool = True) -> tuple[float, float]:
    """(rate, duration_s) of the open-loop window whose plan (`arrival_times`, so
    `open_loop_plan` and the windows built on it) drawn from `rng` is
    `counted_arrival_times(rate, count, rng, ...)`: exactly `count` requests at the same
    times, to rounding. `rng` is not advanced.

    The window ends halfway between the count-th arrival and the next one the generator
    would draw. The stretch is a change of rate: every registered process draws its gaps
    as the generator's unit draws times 1/rate, so scaling the times by a factor is drawing
    at rate / factor."""
    probe = random.Random()
    probe.setstate(rng.getstate())
    times = counted_arrival_times(rate, count + 1, probe, burstiness, arrival, stretch=False)
    window_rate = rate * times[count - 1] * rate / count if stretch else rate
    scale = rate / window_rate
    return window_rate, (times[count - 1] + times[count]) / 2 * scale


def draw_length(nominal: int, rng: random.Random, dist: str = "fixed", low: float = 0.5) -> int:
    """A request's length: the nominal one, or uniform on [low x nominal, nominal]."""
    if dist == "fixed":
        return nominal
    return rng.randint(max(1, math.ceil(low * nominal)), nominal)


def open_loop_plan(spec: ServeSpec, rate: float, input_tokens: int, rng: random.Random) -> list[Planned]:
    """Every request of one open-loop window, in arrival order."""
    return [Planned(t, draw_length(input_tokens, rng, spec.lengths, spec.length_low),
                    draw_length(spec.output_tokens, rng, spec.lengths, spec.length_low))
            for t in arrival_times(rate, spec.duration_s, rng, spec.burstiness, spec.arrival)]


def think_time(mean_s: float, rng: random.Random) -> float:
    """A closed-loop user's pause between a reply and its next request."""
    return rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0


def in_span(arrival_s: float, spec: ServeSpec) -> bool:
    """Does a request arriving then count (inside the measured span)?"""
    return spec.warmup_s <= arrival_s <= spec.duration_s - spec.cooldown_s


# ------------------------------------------------------------------ judging a load


def tail(values: Sequence[float], unfinished: int, q: float = SERVE_PERCENTILE) -> float:
    """The q-th percentile of the finished requests' values with `unfinished` more taken as
    infinite (nearest rank above the linear position, so a tail that reaches an unfinished
    request is infinite); NaN when there are no requests at all."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v)) + [math.inf] * unfinished
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if math.isinf(xs[hi]):
        return math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class LoadResult:
    """Every counted request of one load (all ranks, all repeats) and what they sum to."""

    load: float
    ttft_s: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    unfinished: int
    span_s: float                       # measured seconds summed over ranks x repeats
    ranks: int = 1
    mean_active: float = 0.0            # per rank, averaged over windows
    invalid: tuple[str, ...] = field(default_factory=tuple)
    # The valid windows pooled here, for the bootstrap (resampled within ranks).
    windows: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    input_tokens: tuple[int, ...] = ()  # each finished request's prompt, aligned with ttft_s

    @property
    def requests(self) -> int:
        return len(self.ttft_s) + self.unfinished

    def ttft_tail(self, q: float = SERVE_PERCENTILE) -> float:
        return tail(self.ttft_s, self.unfinished, q)

    def tpot_tail(self, q: float = SERVE_PERCENTILE) -> float:
        return tail(self.tpot_ms, self.unfinished, q)

    def attainment(self, tpot_ms: float | None, ttft_s: float | None,
                   ttft_per_token_ms: float | None = None) -> judging.Attainment:
        """How its counted requests fared against these limits, every limit at once."""
        return judging.attainment(self.ttft_s, self.tpot_ms, self.unfinished, tpot_ms, ttft_s,
                                  input_tokens=self.input_tokens, ttft_per_token_ms=ttft_per_token_ms)


def load_results(records: Iterable[Any]) -> dict[float, LoadResult]:
    """ServeRecords (any ranks and repeats of one context) pooled per load.

    Only valid windows are pooled (as static mode judges only valid windows): an invalid
    one adds its reasons, and a load with none valid has no requests (no verdict)."""
    pooled: dict[float, dict[str, Any]] = {}
    for r in records:
        p = pooled.setdefault(float(r.load), {"ttft": [], "tpot": [], "unfinished": 0, "span": 0.0, "inputs": [],
                                              "ranks": set(), "active": [], "invalid": [], "windows": []})
        if not r.valid:
            p["invalid"].extend(f"rank {r.rank} window {r.window}: {why}" for why in r.invalid_reasons)
            continue
        p["ttft"].extend(r.ttft_s)
        p["tpot"].extend(r.tpot_ms)
        p["inputs"].extend(request_inputs(r))
        p["unfinished"] += r.unfinished
        p["span"] += r.span_s
        p["ranks"].add(r.rank)
        p["active"].append(r.mean_active)
        p["windows"].append(r)
    return {load: LoadResult(load, tuple(p["ttft"]), tuple(p["tpot"]), p["unfinished"], p["span"],
                             len(p["ranks"]), sum(p["active"]) / len(p["active"]) if p["active"] else 0.0,
                             tuple(p["invalid"]), tuple(p["windows"]), tuple(p["inputs"]))
            for load, p in sorted(pooled.items())}


def request_inputs(record: Any) -> list[int]:
    """A window's per-request prompt lengths, aligned with its TTFTs (records written before
    they were kept: the nominal context for each)."""
    got = list(getattr(record, "request_input_tokens", ()) or ())
    return got if len(got) == len(record.ttft_s) else [getattr(record, "input_tokens", 0)] * len(record.ttft_s)


def share_for(limit: Mapping[str, Any], attainment: float = judging.DEFAULT_ATTAINMENT) -> float:
    """The share of requests an SLO's limits must be met by: its own percentile's, else `attainment`."""
    return judging.Rule(attainment=attainment).attainment_for(limit.get("percentile"))


def meets(result: LoadResult, tpot_ms: float | None, ttft_s: float | None,
          share: float = judging.DEFAULT_ATTAINMENT, ttft_per_token_ms: float | None = None) -> bool | None:
    """Does the load meet the limits: did at least `share` of its requests meet every one at
    once? None: no request to judge."""
    return judging.attains(result.attainment(tpot_ms, ttft_s, ttft_per_token_ms), share)


def meets_limit(result: LoadResult, limit: Mapping[str, Any], share: float) -> bool | None:
    """`meets` for an SLO's limits as the workers keep them ({tpot_ms, ttft_s[, ttft_per_token_ms]})."""
    return meets(result, limit.get("tpot_ms"), limit.get("ttft_s"), share, limit.get("ttft_per_token_ms"))


def bootstrap_windows(results: Mapping[float, LoadResult], limits: Mapping[str, Mapping[str, Any]]
                      ) -> dict[float, list[list[judging.ServeWindow]]]:
    """Per load, its valid windows grouped by rank (run, rank), each as the serving bootstrap
    needs it: counted requests, how many met each SLO (name -> limits), busy slots."""
    out: dict[float, list[list[judging.ServeWindow]]] = {}
    for load, res in results.items():
        by_rank: dict[tuple, list[judging.ServeWindow]] = {}
        for r in res.windows:
            good = {name: judging.attainment(r.ttft_s, r.tpot_ms, r.unfinished, lim.get("tpot_ms"), lim.get("ttft_s"),
                                             input_tokens=request_inputs(r),
                                             ttft_per_token_ms=lim.get("ttft_per_token_ms")).good
                    for name, lim in limits.items()}
            by_rank.setdefault((getattr(r, "run_id", ""), r.rank), []).append(
                judging.ServeWindow(len(r.ttft_s) + r.unfinished, good, r.mean_active))
        if by_rank:
            out[load] = [by_rank[k] for k in sorted(by_rank)]
    return out


def goodput(ttft_s: Sequence[float], tpot_ms: Sequence[float], span_s: float,
            limits: Mapping[str, Any], input_tokens: Sequence[int] = ()) -> dict[str, float]:
    """Requests per second that met each SLO (name -> {tpot_ms, ttft_s[, ttft_per_token_ms]}),
    over `span_s`; `input_tokens`: each request's prompt, for a per-token TTFT limit."""
    if span_s <= 0:
        return {name: 0.0 for name in limits}
    out = {}
    for name, limit in limits.items():
        a = judging.attainment(ttft_s, tpot_ms, 0, _limit(limit, "tpot_ms"), _limit(limit, "ttft_s"),
                               input_tokens=input_tokens, ttft_per_token_ms=_limit(limit, "ttft_per_token_ms"))
        out[name] = a.good / span_s
    return out


def _limit(limit: Any, key: str) -> float | None:
    return limit.get(key) if isinstance(limit, Mapping) else getattr(limit, key, None)


# ------------------------------------------------------------------ the sweep


def next_load(verdicts: Mapping[float, bool | None], load_kind: str, steps_taken: int, steps: int,
              tolerance: float = SWEEP_TOLERANCE) -> float | None:
    """The next load to measure for one SLO (None: the sweep for it is done).

    Bisects between the largest passing and the first failing load; without both there
    is nothing to bisect (the threshold is above the largest load tried, or below the
    smallest, where vcfslm.serving.lowering goes lower first). Users are whole numbers.
    """
    if steps_taken >= steps:
        return None
    passing, failing = judging.threshold(verdicts)
    if passing is None or failing is None:
        return None
    if load_kind == "users":
        if failing - passing <= 1:
            return None
        return float((int(passing) + int(failing)) // 2)
    if (failing - passing) / failing <= tolerance:
        return None
    return round_rate((passing + failing) / 2)


def round_rate(rate: float) -> float:
    """Three significant digits: loads stay readable in tables and stable as dict keys."""
    if rate <= 0:
        return rate
    digits = 2 - math.floor(math.log10(rate))
    return round(rate, digits)


# ------------------------------------------------------------------ sweep precision


@dataclass(frozen=True)
class Refinement:
    """What the sweep does next for one SLO once bisection is done, and why: measure the
    existing `loads` once more, or measure `new_load` (not yet measured, inside the gap
    between the passing and the first failing load); neither: stop."""

    loads: tuple[float, ...]
    interval: judging.Interval | None
    reason: str
    new_load: float | None = None

    @property
    def done(self) -> bool:
        return not self.loads and self.new_load is None


@dataclass(frozen=True)
class RefineRule:
    """How far the sweep narrows a threshold after bisection: until its interval is within
    `precision` of it (relative), within `budget_s` of extra windows; users are whole numbers,
    and the bootstrap is seeded. `steps`: the loads per SLO the sweep adds below the grid
    (vcfslm.serving.lowering) and by bisection, together."""

    precision: float = 0.25
    budget_s: float = 600.0
    load_kind: str = "rate"
    replicates: int = judging.REPLICATES
    seed: int = 0
    steps: int = 3

    @classmethod
    def of_spec(cls, spec: ServeSpec) -> RefineRule:
        return cls(spec.sweep_precision, spec.sweep_budget_s, spec.load_kind, seed=spec.seed, steps=spec.sweep_steps)


def threshold_interval(results: Mapping[float, LoadResult], limit: Mapping[str, Any], share: float,
                       replicates: int = judging.REPLICATES, seed: int = 0) -> judging.Interval | None:
    """The bootstrap interval of one SLO's threshold load (per rank) over these loads."""
    windows = bootstrap_windows(results, {"slo": limit})
    if not windows:
        return None
    reps = judging.serving_replicates(windows, {"slo": share}, replicates, seed)["slo"]
    return judging.interval([r for r, _ in reps])


def refine(results: Mapping[float, LoadResult], limit: Mapping[str, Any], share: float, rule: RefineRule,
           spent_s: float = 0.0) -> Refinement:
    """What narrows the threshold's interval below `rule.precision` (its width, from its low end
    up to its exclusive high end, relative to the threshold), within `rule.budget_s` of extra
    windows (`spent_s` so far).

    While the gap between the largest passing and the first failing load alone is wider than
    the precision, no number of windows can narrow the interval enough: the next step is a new
    load halfway into the gap (rounded as `next_load` does). Otherwise the replicates disagree:
    the loads the interval spans up to the first failing load get one more window each."""
    verdicts = {load: meets_limit(res, limit, share) for load, res in results.items()}
    passing, failing = judging.threshold(verdicts)
    if passing is None or failing is None:
        return Refinement((), None, "no bracket: " + ("even the smallest load fails" if failing is not None
                                                     else "every load passes"))
    iv = threshold_interval(results, limit, share, rule.replicates, rule.seed)
    if iv is None:
        return Refinement((), None, "nothing to resample")
    low = 0.0 if iv.low is None else iv.low
    high = failing if iv.high is None or iv.high_bound else iv.high
    width = (high - low) / passing
    if width <= rule.precision:
        return Refinement((), iv, f"interval {iv.text()} is within {rule.precision:.0%} of the threshold")
    if rule.budget_s <= 0 or spent_s >= rule.budget_s:
        return Refinement((), iv, f"budget of {rule.budget_s:g} s spent ({spent_s:.0f} s of extra windows); "
                                  f"interval {iv.text()} is {width:.0%} of the threshold")
    why = f"interval {iv.text()} is {width:.0%} of the threshold"
    gap = (failing - passing) / passing
    if gap > rule.precision:
        inside = next_load({passing: True, failing: False}, rule.load_kind, 0, 1)
        if inside is not None and inside not in verdicts and passing < inside < failing:
            return Refinement((), iv, f"{why}, the gap {passing:g}–{failing:g} alone {gap:.0%}", inside)
        if iv.low == passing and iv.high_open and iv.high == failing:
            # The replicates agree and no load fits between: more windows would change nothing.
            return Refinement((), iv, f"{why}, and no load to try between {passing:g} and {failing:g}")
    loads = tuple(load for load in sorted(verdicts) if verdicts[load] is not None and low <= load <= failing)
    return Refinement(loads, iv, why)
