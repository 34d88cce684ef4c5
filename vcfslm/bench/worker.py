"""The rank worker: the process torchrun starts for each rank (through rank.sh).

    python -m vcfslm.bench.worker --spec FILE --node NAME

FILE is the node's worker spec as the launcher writes it into the run folder
(vcfslm.runspec.WorkerSpec, one JSON object): the run's whole spec (model, matrix,
scenarios, seed, compile mode, probes, serving settings, SLOs) and where this node runs it
(the run folder, the model as this machine names it, the number of nodes, resume, the
process group's timeout, an HTTP server's address).

It reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR/PORT), joins a gloo process group (bounded timeout), loads one
model replica, probes its memory bandwidth, and runs every scenario (batch per rank x
input length): `warmup` discarded windows, then `repeats` measured ones.

The windows go through the window loop (bench/windows.py) with `Ranks` (bench/rank.py)
as its coordinator: every window, warmup included, starts right after a `dist.barrier()`
across all ranks of the run, and each records its start skew (its wall clock as it left
the barrier, minus the earliest rank's; across nodes it also holds the clock offset
between them: NTP-synchronised guests, well under a millisecond).

Output (see vcfslm/results.py for the record schema):
- DIR/ranks/rank-<RANK>.jsonl   each measured window's WindowRecord, appended atomically
                                as the window ends;
- DIR/ranks/rank-<RANK>.json    this rank's facts (placement, probe, model, engine);
- DIR/results.jsonl             written by rank 0 at the end: every rank's records,
                                gathered over gloo, sorted;
- DIR/ranks.json                written by rank 0: every rank's facts;
- DIR/logs/<node>/rank-<RANK>.log  this rank's event log.

Progress: one machine-readable line per event on stdout,

    VCFSLM-PROGRESS {"rank": 0, "phase": "measure", "scenario": 2, "scenarios": 6,
                     "window": 1, "batch": 4, "input_tokens": 128, "output_tokens": 128, ...}

phase is one of start | loaded | probed | gated | skip | warmup | measure | serve |
swept | done | finished | failed (swept: a serving sweep stopped for one SLO, and why).
`scenario` counts from 1 (k of `scenarios`); `window` counts from 0 within its phase.
warmup/measure lines come as each window ends and carry tpot_ms_p50, ttft_s_p50,
rank_tps, wall_s, valid; done closes a scenario; finished closes the run (rank 0 adds
results_path).

`--resume` reads this rank's own file and skips the scenarios every rank finished (`repeats`
windows), so their barriers still line up; a scenario a rank re-runs loses its old partial
records.

The serving loops (bench/serve_worker.py, bench/http_worker.py) are started from here;
what they share with this module (the rank's coordinates, record identity, the window
barriers, files, progress lines) lives in bench/rank.py, so none imports another back.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from .. import results, roofline
from ..runspec import WorkerSpec
from ..serving.decisions import ServeSpec
from ..serving.servers import ServerSpec
from .rank import (
    RankArgs,
    Ranks,
    TorchrunEnv,
    facts_file,
    progress,
    rank_base,
    rank_file,
    serve_windows,
)
from .windows import StaticWindows, Window

log = logging.getLogger("vcfslm.bench.worker")


# ------------------------------------------------------------------ arguments


def spec_arg(path: str) -> WorkerSpec:
    """`--spec`: the launcher's WorkerSpec file, read back typed."""
    try:
        return WorkerSpec.from_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read --spec {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad --spec {path}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vcfslm.bench.worker",
                                description="One benchmark rank (started by torchrun).")
    p.add_argument("--spec", type=spec_arg, required=True, metavar="FILE",
                   help="the node's worker spec, as the launcher writes it (vcfslm.runspec.WorkerSpec)")
    p.add_argument("--node", "--node-name", dest="node", required=True, help="node name for the records")
    return p


def parse_args(argv: list[str] | None = None) -> RankArgs:
    """Parse worker arguments; a leading "--" is dropped.

    torchrun's own parser rejects `--node` after the script as an ambiguous
    abbreviation of its `--node-rank`, so launchers write `torchrun ... rank.sh -- --node X`;
    torchrun passes the "--" through.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    args = parser.parse_args(argv)
    return RankArgs(args.spec, args.node)


# ------------------------------------------------------------------ scenarios


class StaticDriver:
    """The static engine as the window loop's driver (bench/windows.WindowDriver): a scenario's
    batch of equal prompts decoded together. `begin` readies a scenario: its prompt and its
    roofline floors from the rank's probed rates (None: not probed)."""

    def __init__(self, engine, loaded, seed: int, read_gbs: float | None, tflops: float | None):
        self.engine, self.loaded, self.seed, self.rates = engine, loaded, seed, (read_gbs, tflops)
        self.compiles = 0
        self.prompt, self.floors = None, (None, None)

    def begin(self, scenario: tuple[int, int, int]) -> None:
        from ..engine.decode import synthetic_prompt

        batch, input_tokens, output_tokens = scenario
        loaded = self.loaded
        self.prompt = synthetic_prompt(batch, input_tokens, loaded.config.vocab_size,
                                       seed=self.seed * 1_000_003 + batch * 7919 + input_tokens)
        self.floors = roofline.scenario_floors(loaded.config, loaded.step_weight_bytes, loaded.kv_bytes_per_token,
                                               batch, input_tokens, output_tokens, *self.rates)

    def window(self, w: Window) -> tuple[dict[str, Any], list[str]]:
        gen = self.engine.generate(self.prompt, w.scenario[2])
        self.compiles += gen.compiles
        return static_fields(w.scenario, gen, self.floors)

    def rss(self) -> tuple[int, int]:
        from ..engine.decode import current_rss_bytes, peak_rss_bytes

        return peak_rss_bytes(), current_rss_bytes()


def static_fields(scenario: tuple[int, int, int], gen, floors: tuple = (None, None)) -> tuple[dict[str, Any], list[str]]:
    """A static window's measured fields from its generation's timestamps, and why it is
    invalid (pure). floors: the scenario's roofline TPOT (ms) and TTFT (s)."""
    batch, input_tokens, output_tokens = scenario
    first = [gen.first_token] * batch  # a batch's streams get their tokens together
    last = [gen.last_token] * batch
    ttft, tpot, e2e = results.stream_metrics(gen.request_start, first, last, output_tokens)
    wall = gen.last_token - gen.request_start
    generated = int(gen.tokens.shape[0] * gen.tokens.shape[1])
    shape = tuple(gen.tokens.shape)
    return ({"batch_per_rank": batch, "input_tokens": input_tokens, "output_tokens": output_tokens,
             "wall_s": wall, "generated_tokens": generated, "rank_tps": generated / wall if wall > 0 else 0.0,
             "ttft_s": ttft, "tpot_ms": tpot, "e2e_s": e2e, "roofline_tpot_ms": floors[0],
             "roofline_ttft_s": floors[1]},
            [] if shape == (batch, output_tokens) else [f"generated shape {shape} != ({batch}, {output_tokens})"])


# ------------------------------------------------------------------ output


def _setup_logging(out: Path, node: str, rank: int) -> None:
    path = out / "logs" / node / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # The whole package's loggers: the engine's compile events land in the rank's log too.
    package = logging.getLogger("vcfslm")
    package.addHandler(handler)
    package.setLevel(logging.DEBUG)


# ------------------------------------------------------------------ the run


def main(argv: list[str] | None = None) -> int:
    from .placement import start_binding

    # numactl's binding, read before OpenMP starts and binds the main thread to one core.
    binding = start_binding()
    args = parse_args(argv)
    env = TorchrunEnv.from_environ()
    out = Path(args.spec.out)
    out.mkdir(parents=True, exist_ok=True)
    _setup_logging(out, args.node, env.rank)
    log.info("argv %s env %s spec %s", sys.argv, env, args.spec.to_json())
    base = rank_base(args, env)
    try:
        return run(args, env, out, base, binding)
    except Exception as exc:
        log.error("failed: %s\n%s", exc, traceback.format_exc())
        progress({**base, "phase": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise


def run(args: RankArgs, env: TorchrunEnv, out: Path, base: dict[str, Any],
        binding: dict[str, str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    threads = args.spec.run.threads or _default_threads()
    torch.set_num_threads(threads)
    progress({**base, "phase": "start", "threads": threads, "world_size": env.world_size,
              "pid": os.getpid()})

    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=args.spec.timeout_s))
    try:
        server = args.spec.server or ServerSpec()
        if args.spec.run.serve is not None and not server.in_process:
            from .http_worker import run_http_serving

            return run_http_serving(args, env, dist, binding or {}, _finish)
        return _run_scenarios(args, env, out, base, torch, dist, binding or {})
    finally:
        dist.destroy_process_group()


def _default_threads() -> int:
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return len(os.sched_getaffinity(0))


def _inject_numerics_fault(rank: int, engine) -> None:
    """Fault injection for tests: VCFSLM_FAULT_NUMERICS="RANK:SCALE[:TOKENS]" adds noise of
    SCALE x the largest logit to the logits of that rank's compiled step (the step the
    windows run), at every token count or only at TOKENS: the gate of those graphs must
    fail and invalidate their windows only."""
    who, _, rest = os.environ.get("VCFSLM_FAULT_NUMERICS", "").partition(":")
    scale, _, tokens = rest.partition(":")
    if not (who.strip().isdigit() and int(who) == rank and scale):
        return
    import torch

    step, amount, only = engine.run_step, float(scale), int(tokens) if tokens.strip() else None
    gen = torch.Generator().manual_seed(rank)

    def perturbed(tok, *args, eager=False, **kwargs):
        nxt, logits = step(tok, *args, eager=eager, **kwargs)
        if not eager and (only is None or tok.shape[1] == only):
            noise = torch.randn(logits.shape, generator=gen).to(logits.dtype)
            logits = logits + amount * float(logits.abs().max()) * noise
        return nxt, logits

    engine.run_step = perturbed


def _run_scenarios(args, env: TorchrunEnv, out: Path, base: dict, torch, dist,
                   binding: dict[str, str]) -> int:
    from ..engine.decode import DecodeEngine, current_rss_bytes, peak_rss_bytes
    from ..engine.linear import default_plan
    from ..engine.model import load_model
    from ..topology import parse_cpu_list
    from . import probe as probe_mod
    from .placement import placement_facts

    job = args.spec
    scenarios = job.matrix.scenarios(job.run.scenarios)
    max_context = max((i + o for _, i, o in scenarios), default=0)
    spec = job.run.serve
    gate = reference = None

    def before_pack(model) -> None:
        # The unpacked model's logits, taken before its linears are packed in place (there is
        # no room for two copies; a checkpoint is then still its mapped files).
        nonlocal gate, reference
        gate = _gate_inputs(args, model.config.vocab_size, spec, scenarios)
        reference = _reference(model, gate)

    # Packed as it loads: a checkpoint's tensors go one by one into the kernel's layout.
    loaded = load_model(job.model, seed=job.seed, max_context=max_context or None,
                        plan=default_plan(), before_pack=before_pack)
    engine = DecodeEngine(loaded.model, job.run.compile_mode)   # keeps the load's pack
    _inject_numerics_fault(env.rank, engine)
    progress({**base, "phase": "loaded", "model": loaded.facts["source"], "load_s": loaded.facts["load_s"],
              "params": loaded.facts["params"], "engine": engine.label})

    bandwidth = gemm = decode_linears = None
    if job.run.probe.enabled:
        dist.barrier()  # probe together: ranks of a node share its memory system
        threads = torch.get_num_threads()
        # Watched: each figure's spread, and the CPU time others took on this rank's CPUs.
        probed = probe_mod.measure_probe(threads, job.probe_mib, decode_mib=min(job.probe_mib, probe_mod.DECODE_MIB),
                                         plan=engine.plan,
                                         cpus=parse_cpu_list(binding["cpus"]) if binding.get("cpus") else None)
        bandwidth, gemm, decode_linears = probed.bandwidth, probed.gemm, probed.decode_linears
        torch.set_num_threads(job.run.threads or _default_threads())
        progress({**base, "phase": "probed", "read_gbs": round(bandwidth.read_gbs, 2),
                  "triad_gbs": round(bandwidth.triad_gbs, 2), "gemm_tflops": round(gemm.tflops, 4),
                  "steadiness": probed.steadiness.verdict})

    placement = placement_facts(torch, binding)
    placement["engine"] = engine.label
    placement["compile_mode"] = engine.mode
    placement["measurement_mode"] = engine.is_measurement_mode
    placement["linear_kernel"] = engine.plan.kernel
    greedy = _greedy_text(args, engine)  # before any gate: its eager cache shape drops graphs
    gates: list = []   # every graph's gate, as each graph is compiled

    def numerics_facts() -> dict | None:
        from ..engine.numerics import rank_numerics

        return rank_numerics(gates, greedy) if gate is not None else None

    rank_invalid = list(placement["problems"])
    facts = {"rank": env.rank, "local_rank": env.local_rank, "node": args.node,
             "node_rank": env.group_rank, "placement": placement, "model": loaded.facts,
             "probe": bandwidth.to_dict() if bandwidth else None,
             "gemm": gemm.to_dict() if gemm else None,
             "decode_linears": decode_linears.to_dict() if decode_linears else None, "engine": engine.label,
             "pack": engine.pack.to_dict(),
             "numerics": numerics_facts(),
             "rss_after_load_bytes": current_rss_bytes(), "peak_rss_after_load_bytes": peak_rss_bytes()}
    results.atomic_write_json(facts_file(out, env.rank), facts)
    if spec is not None:
        from .serve_worker import SlotDriver

        facts["sweep"] = []
        from ..engine.step_cost import StepCost, chunk_for_probes, chunk_rule, tightest_tpot_ms

        curve = (decode_linears.rows, decode_linears.gbs) if decode_linears else (None, None)
        read_gbs, tflops = bandwidth.read_gbs if bandwidth else None, gemm.tflops if gemm else None
        chunk = spec.chunk_tokens or chunk_for_probes(loaded.step_weight_bytes, read_gbs, tflops, *curve)
        # A chunk from the probes may outgrow a small batched budget: the budget then follows.
        batched = max(spec.batched_tokens, chunk)
        # The run's own SLOs (not the defaults it is judged by without any) size the chunk
        # from the tightest TPOT limit, unless the inventory or a flag fixed it.
        tpot = None if spec.chunk_tokens else tightest_tpot_ms(args.spec.run.slos and args.spec.run.serve_limits())
        slo = None if tpot is None else (tpot, StepCost({}, loaded.step_weight_bytes, tflops, read_gbs,
                                                        *(tuple(c) if c else None for c in curve)))
        driver = SlotDriver(engine, spec, loaded.config.vocab_size, chunk, batched,
                            gate=None if gate is None else (gate[0][0], gate[1][0], reference), slo=slo,
                            limits=args.spec.run.serve_limits())
        chunk, rule = driver.slots.chunk_tokens, chunk_rule(tpot, spec.chunk_tokens)
        driver.slots.rule = rule          # the records say which rule chose the chunk
        facts["chunk_tokens"], facts["batched_tokens"], facts["chunk_rule"] = chunk, batched, rule
        facts["chunk_sizing"] = driver.sizing
        progress({**base, "phase": "chunked", "chunk_tokens": chunk, "batched_tokens": batched,
                  "from": {"flag": "the inventory/flag", "kernel": "the probes"}.get(rule, f"{rule}, by lanes "
                          + ", ".join(f"{k}:{v}" for k, v in driver.sizing.get("chunks", {}).items()))})
        gates.extend(driver.gates)
        for g in driver.gates:
            progress({**base, "phase": "gated", **g.progress()})
        # Every serving window runs every slot graph: one that failed invalidates them all.
        rank_invalid += [g.invalid_reason for g in driver.gates if not g.passed]
        facts["numerics"] = numerics_facts()
        results.atomic_write_json(facts_file(out, env.rank), facts)
        try:
            mine = serve_windows(args, env, dist, driver, placement, rank_invalid,
                                 allowed_cpus=binding.get("cpus"), stops=facts["sweep"])
        finally:
            driver.stop()
        engine.release()
        # What stopped each SLO's sweep travels with the rank's facts into meta.json.
        results.atomic_write_json(facts_file(out, env.rank), facts)
        return _finish(args, env, dist, mine, facts, results.SERVE_RESULTS, n=len(mine))

    static = StaticDriver(engine, loaded, job.seed, bandwidth.read_gbs if bandwidth else None,
                          gemm.tflops if gemm else None)
    windows = StaticWindows(static, Ranks(args, env, dist, binding.get("cpus")), rank_file(out, env.rank),
                            resume=job.resume, placement=placement, invalid=rank_invalid)

    def begin(scenario: tuple[int, int, int], where: dict) -> list[str]:
        static.begin(scenario)
        if gate is None:
            return []
        # Before the scenario's first window, by the compile its windows reuse.
        checked = _static_gate(args, engine, loaded.config.vocab_size, gate, scenario, reference)
        gates.append(checked)
        progress({**base, **where, "phase": "gated", "window": 0, **checked.progress()})
        facts["numerics"] = numerics_facts()
        results.atomic_write_json(facts_file(out, env.rank), facts)
        return [] if checked.passed else [checked.invalid_reason]

    windows.run(scenarios, job.matrix.warmup, job.matrix.repeats, begin)
    engine.release()
    dist.barrier()
    return _finish(args, env, dist, windows.records, facts, "results.jsonl", n=len(scenarios))


def _finish(args: RankArgs, env: TorchrunEnv, dist, mine: list, facts: dict, merged_name: str, *, n: int) -> int:
    """Rank 0 gathers every rank's records and facts and writes the merged files."""
    out, base = Path(args.spec.out), rank_base(args, env)
    all_records: list[Any] = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, all_records, dst=0)
    all_facts: list[Any] = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(facts, all_facts, dst=0)
    done = {**base, "phase": "finished", "scenarios": n, "records": len(mine)}
    if env.rank == 0:
        merged = results.merge_records(all_records)
        results.write_records(out / merged_name, merged)
        results.atomic_write_json(out / "ranks.json", sorted(all_facts, key=lambda f: f["rank"]))
        done["results_path"] = str(out / merged_name)
        done["total_records"] = len(merged)
    dist.barrier()
    progress(done)
    return 0


def _greedy_text(args, engine) -> dict | None:
    """A greedy continuation of a fixed prompt as text, for models that have a tokenizer."""
    from ..engine.model import load_tokenizer
    from ..engine.numerics import greedy_text

    if args.spec.gate_steps <= 0:
        return None
    tokenizer = load_tokenizer(args.spec.model)
    if tokenizer is None:
        return None
    try:
        return greedy_text(engine, tokenizer)
    except Exception as exc:  # a record for people, never a reason to stop the run
        log.warning("greedy continuation failed: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _gate_inputs(args, vocab: int, spec: ServeSpec | None, scenarios):
    """The numerics gate's prompt and forced tokens (None: no gate). Static: REFERENCE_ROWS
    rows, the first rows of every scenario's gate, within the smallest scenario's context
    (a gate whose store outgrew its scenario's would compile a graph the windows never
    run); serving: one row, sized so the slot step's gate fits a slot's context
    (engine.slot_gate_fit)."""
    from ..engine.numerics import GATE_PROMPT_TOKENS, REFERENCE_ROWS, gate_inputs, static_gate_fit
    from ..engine.slots import slot_gate_fit

    gate_steps, seed = args.spec.gate_steps, args.spec.seed
    if gate_steps <= 0 or not (scenarios or spec):
        return None
    if spec is None:
        prompt_tokens, steps = static_gate_fit(GATE_PROMPT_TOKENS, gate_steps,
                                               min(i + o for _, i, o in scenarios))
        return gate_inputs(REFERENCE_ROWS, steps, vocab, seed, prompt_tokens=prompt_tokens)
    prompt_tokens, steps = slot_gate_fit(GATE_PROMPT_TOKENS, gate_steps, spec.max_context)
    return gate_inputs(1, steps, vocab, seed, prompt_tokens=prompt_tokens) if steps else None


def _reference(model, gate):
    """The unpacked model's teacher-forced logits on the gate's inputs (call before packing)."""
    from ..engine.numerics import reference_logits

    return None if gate is None else reference_logits(model, *gate)


def _static_gate(args, engine, vocab: int, gate, scenario: tuple[int, int, int], reference):
    """Gate the decode graph of one static scenario (its batch at its cache length): the
    graph its windows then run, compiled here once. Its first rows are the reference's."""
    from ..engine.numerics import gate_inputs, run_gate, static_graph

    batch, input_tokens, output_tokens = scenario
    prompt, forced = gate_inputs(batch, int(gate[1].shape[1]), vocab, args.spec.seed,
                                 prompt_tokens=int(gate[0].shape[1]))
    return run_gate(engine, prompt, forced, max_len=input_tokens + output_tokens,
                    reference=reference, graph=static_graph(batch, input_tokens),
                    shape={"batch": batch, "input_tokens": input_tokens, "output_tokens": output_tokens,
                           "context": input_tokens + output_tokens, "decode_rows": batch})


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
