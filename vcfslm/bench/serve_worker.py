"""The serving half of the rank worker (`worker --serve JSON`): windows at each load,
barrier-aligned across ranks, and the sweep that bisects towards each SLO's threshold.

Each window starts right after a `dist.barrier()`, as static windows do; every rank
generates its own arrivals (its own seed) and serves them on its own slots. After each
window the ranks all_gather their records, so every rank holds the same history and
takes the same decision about the next load (vcfslm.lowering.lower_load below the grid,
vcfslm.serving.next_load inside a bracket), and about the windows added once bisection
is done (vcfslm.serving.refine: a seeded bootstrap over that shared history, its time
budget counted from the recorded windows' wall times, not from any rank's clock): no
rank leads, and the barriers stay aligned whatever the sweep decides.

Records go to `ranks/serve-<rank>.jsonl` as each window ends. `--resume` keeps every
load all ranks finished (and feeds its records to the sweep, which then reaches the
same decisions without measuring them again); a load a rank had only partly measured
is measured again.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import lowering, results, serving
from ..results import ServeRecord
from ..serve.scheduler import record_fields, run_window
from ..serving import ServeSpec
from ..verdicts import recompiled
from .rank import (
    RankArgs,
    agreed_skips,
    drop_scenarios,
    progress,
    rank_base,
    rank_window,
    serve_file,
)

log = logging.getLogger("vcfslm.bench.worker")
# A bound on the sweep's extra windows whatever the budget: windows that come out invalid
# add no requests but still cost time.
MAX_REFINE_ROUNDS = 20


class SlotDriver:
    """The in-process backend: vcfslm's own engine (TokenSlots) under serve/scheduler.py's scheduler.

    chunk_tokens: the most prompt tokens a step takes beside running streams (the spec's, else
    the probes'); batched_tokens: under a backlog (the worker's, at least the chunk).
    gate: (prompt, forced tokens, the unpacked model's logits on them or None), 1-D, 1-D and
    [1, steps, vocab]: priming then gates every slot graph it compiles (`gates`, one per
    graph), the one-lane decode also against the unpacked model. None: no gate.
    slo: (the tightest TPOT limit in ms, the rank's StepCost without decode times) for the
    SLO rule: the decode step is timed at each lane count, each lane count's chunk is what
    fits under the limit (engine.step_cost.slo_chunks), and after priming a step with each
    chunk is timed against its estimate (`sizing`). None: `chunk_tokens` for every step."""

    def __init__(self, engine, spec: ServeSpec, vocab: int, chunk_tokens: int, batched_tokens: int,
                 gate: tuple | None = None, slo: tuple | None = None):
        from ..engine.decode import synthetic_prompt
        from ..engine.numerics import slot_gates
        from ..engine.slots import TokenSlots

        engine.release()                  # a static store and its graph are not used here
        self.slots = TokenSlots(engine, spec.slots, spec.max_context, chunk_tokens, batched_tokens)
        self.vocab, self._prompt = vocab, synthetic_prompt
        self.sizing: dict[str, Any] = {}
        sample = synthetic_prompt(1, min(spec.input_tokens), vocab, seed=spec.seed + 11)[0]
        if slo is not None:
            self._size_chunks(sample, *slo)
        # Compile every token count before any window (a compile inside one marks it invalid),
        # and gate each graph on the way.
        if gate is None:
            self.slots.prime(sample)
            self.gates = []
        else:
            prompt, forced, reference = gate
            self.gates = slot_gates(self.slots.prime(prompt, forced), reference)
        if slo is not None:
            measured = self.slots.time_steps(sample, pieces=True)
            self.sizing["piece_step_s"] = {str(k): round(v, 4) for k, v in measured.items()}

    def _size_chunks(self, sample, tpot_limit_ms: float, cost) -> None:
        """The SLO rule's chunks, from decode steps timed on this engine at each lane count."""
        from dataclasses import replace

        from ..engine.step_cost import SLO_MARGIN, chunk_rule, slo_chunks

        cost = replace(cost, decode_s=self.slots.time_steps(sample))
        chunks = slo_chunks(cost, tpot_limit_ms, most=self.slots.batched_tokens)
        self.slots.set_chunks(chunks, chunk_rule(tpot_limit_ms))
        self.sizing = {"rule": self.slots.rule, "margin": SLO_MARGIN, "chunks": {str(k): v for k, v in chunks.items()},
                       "decode_step_s": {str(k): round(v, 4) for k, v in cost.decode_s.items()},
                       "estimated_step_s": {str(k): round(cost.step_s(k, v), 4) for k, v in chunks.items()}}

    @property
    def compiles(self) -> int:
        return self.slots.compiles

    def window(self, spec: ServeSpec, load: float, input_tokens: int, rng: random.Random, seed: int,
               limits: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        def prompt_for(req, _seed=seed):
            return self._prompt(1, req.input_tokens, self.vocab, seed=_seed + req.index)[0]

        outcome = run_window(self.slots, spec, load, input_tokens, rng, prompt_for)
        return record_fields(outcome, spec, limits), []

    def rss(self) -> tuple[int, int]:
        """(peak, current) resident bytes of the replica: this process."""
        from ..engine.decode import current_rss_bytes, peak_rss_bytes

        return peak_rss_bytes(), current_rss_bytes()

    def stop(self) -> None:
        self.slots.release()


def serve_windows(args: RankArgs, env, dist, driver, placement: dict, rank_invalid: list[str], *,
                  allowed_cpus: str | None = None, stops: list | None = None) -> list[ServeRecord]:
    """Run every load of the spec (and the sweep's) for each context; this rank's records.

    driver: the backend (SlotDriver, or bench.http_backend.HttpDriver): its window()
    measures one window and returns the record's fields and why it is invalid.
    allowed_cpus: the rank's binding (numactl's), to catch a thread that left it.
    stops: gets one {slo, input_tokens, reason} per SLO and context the sweep finished."""
    from .placement import placement_problems, thread_cpus

    spec = args.spec.run.serve
    if spec is None:
        raise ValueError("serve_windows: the run's spec has no serving settings")
    limits: dict[str, Any] = args.spec.run.serve_limits()
    out, base, resume = Path(args.spec.out), rank_base(args, env), args.spec.resume
    server_checks = getattr(driver, "thread_problems", None)

    my_file = serve_file(out, env.rank)
    kept = results.read_serve_records(my_file) if resume and my_file.exists() else []
    finished = results.finished_scenarios(kept, spec.repeats)
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, sorted(finished))
    skip = agreed_skips([{tuple(s) for s in g} for g in gathered])
    if resume:
        drop_scenarios(my_file, {r.scenario for r in kept} - skip, kind=ServeRecord)
    elif my_file.exists():
        my_file.unlink()
    # Every rank's kept records of the agreed loads: the sweep's history starts from them.
    shared: list[Any] = [None] * env.world_size
    dist.all_gather_object(shared, [asdict(r) for r in kept if r.scenario in skip])
    history = [ServeRecord.from_dict(d) for recs in shared for d in recs]
    mine = [r for r in kept if r.scenario in skip]

    counter = {"windows": 0}

    def measure(load: float, input_tokens: int, extra: int | None = None) -> None:
        """The load's repeats (skipped when resumed), or with `extra` that one more window."""
        scenario = (spec.load_kind, float(load), input_tokens, spec.output_tokens)
        if extra is None and scenario in skip:
            progress({**base, "phase": "skip", "load": load, "load_kind": spec.load_kind,
                      "input_tokens": input_tokens, "window": 0})
            return
        windows = (range(extra, extra + 1) if extra is not None else
                   range(-spec.warmup_windows if counter["windows"] == 0 else 0, spec.repeats))
        for window in windows:
            seed = serving.window_seed(spec.seed, env.rank, load, input_tokens, window)
            rng = random.Random(seed)

            dist.barrier()
            released = time.time()
            compiles = driver.compiles
            measured, driver_reasons = driver.window(spec, load, input_tokens, rng, seed, limits)
            stamps: list[Any] = [None] * env.world_size
            dist.all_gather_object(stamps, released)
            moved = placement_problems(process_cpus=allowed_cpus, process_mems=None, intended_cpus=None,
                                       intended_node=None, threads=thread_cpus())
            reasons = list(rank_invalid) + list(moved) + list(driver_reasons)
            if server_checks is not None:
                reasons += server_checks()
            if driver.compiles != compiles:
                reasons.append(recompiled(driver.compiles - compiles))
            peak, rss = driver.rss()
            record = ServeRecord(
                **rank_window(args, env), load_kind=spec.load_kind,
                load=float(load), arrival=spec.arrival_kind, slots=spec.slots,
                input_tokens=input_tokens, output_tokens=spec.output_tokens, window=max(window, 0),
                seed=seed, burstiness=spec.burstiness, think_s=spec.think_s,
                start_skew_s=released - min(stamps), peak_rss_bytes=peak,
                rss_bytes=rss, recompiles=driver.compiles - compiles,
                valid=not reasons, invalid_reasons=reasons, placement=placement, **measured)
            warm = window < 0
            if not warm:
                results.append_record(my_file, record)
                mine.append(record)
                counter["windows"] += 1
            everyone: list[Any] = [None] * env.world_size
            dist.all_gather_object(everyone, None if warm else asdict(record))
            history.extend(ServeRecord.from_dict(d) for d in everyone if d is not None)
            progress({**base, "phase": "warmup" if warm else "serve", "window": max(window, 0),
                      "load": load, "load_kind": spec.load_kind, "input_tokens": input_tokens,
                      "output_tokens": spec.output_tokens, "offered": record.offered,
                      "completed": record.completed, "unfinished": record.unfinished,
                      "ttft_s_p90": _rounded(serving.tail(record.ttft_s, record.unfinished), 4),
                      "tpot_ms_p90": _rounded(serving.tail(record.tpot_ms, record.unfinished), 3),
                      "mean_active": round(record.mean_active, 3), "max_queue": record.max_queue,
                      "rank_tps": round(record.rank_tps, 3), "goodput": record.goodput,
                      "valid": record.valid, "wall_s": round(record.wall_s, 3)})

    for input_tokens in spec.input_tokens:
        def mine_of(_input=input_tokens) -> list[ServeRecord]:
            return [r for r in history if r.input_tokens == _input and r.output_tokens == spec.output_tokens
                    and r.load_kind == spec.load_kind]

        def stopped(name: str, why: str, _input=input_tokens) -> None:
            log.info("sweep %s, input %d: stopped: %s", name, _input, why)
            if stops is not None:
                stops.append({"slo": name, "input_tokens": _input, "reason": why})
            progress({**base, "phase": "swept", "slo": name, "input_tokens": _input, "reason": why})

        sweep_input(spec, limits, input_tokens, measure, mine_of, stopped)
        progress({**base, "phase": "done", "input_tokens": input_tokens, "window": spec.repeats})
    return mine


def sweep_input(spec: ServeSpec, limits: dict[str, dict], input_tokens: int,
                measure: Callable[[float, int, int | None], None],
                records_of: Callable[[], list[ServeRecord]], stopped: Callable[[str, str], None]) -> None:
    """One context's loads: the spec's grid (ending once every SLO failed: higher loads only
    fail more), then with --sweep per SLO: lower loads while even the smallest fails
    (vcfslm.lowering), bisection and refinement, `stopped(slo, why)` as each SLO's sweep ends.
    measure(load, input_tokens, extra): the load's repeats, or with `extra` that one more
    window. The rank workers and the endpoint client sweep alike through this."""

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
    import math

    return round(value, digits) if math.isfinite(value) else None
