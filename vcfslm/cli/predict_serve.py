"""`vcfslm predict --serve`: the serving answer simulated from the fitted step costs, for the
measured machine or a target platform: per load the predicted attainment and TTFT/TPOT
tails, per SLO the threshold with its intervals, the nodes for a peak and the fleet's
scale-out efficiency (vcfslm.sim; docs/predict.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import click

from ..errors import Problem, UsageError
from ..serving.decisions import ServeSpec
from .bench_options import SERVE_FLAGS
from .bench_serve import serve_of, server_of
from .bench_spec import flag_values
from .common import print_json

# Fleet sizes of the scale-out table (nodes), up to the largest asked for.
SCALE_NODES = (1, 2, 4, 8, 16, 32, 64)


def serve_command(opts, options: dict[str, Any], load_measured, build_target, latest_run) -> None:
    """Fit on the measured runs, build the step costs on the target, simulate, print."""
    from ..analysis.calibration import KNOWN_DIMS
    from ..analysis.perfmodel import fit_model
    from ..analysis.report import known_slos
    from ..analysis.slo_spec import resolve_slos
    from ..sim import answer as A

    if options.get("server_python") or options.get("time_scales"):
        raise UsageError("--server-python and --time-scale do not apply to predict --serve")
    if opts.validate_runs:
        raise UsageError("--validate checks the static model; drop --serve")
    sources = list(opts.results) or [latest_run(opts.runs_dir)]
    inputs = load_measured(sources, opts.measured_on)
    server = server_of(options.get("server") or "vcfslm", None)
    fitted_on = {recorded_server(m) for m in inputs.metas} or {"vcfslm"}
    if fitted_on != {server.name}:
        raise UsageError([Problem(", ".join(map(str, sources)), None, None, "--server",
                                  f"predicting {server.name} needs a fit on {server.name}'s own runs; these "
                                  f"measured {', '.join(sorted(fitted_on))}")])
    try:
        model = fit_model(inputs.observations)
    except ValueError as exc:
        raise UsageError(f"cannot fit the performance model: {exc}") from None
    target = build_target(inputs, opts.target)
    inputs_tokens = opts.input_tokens or [128]
    given = {name: options[name] for name in SERVE_FLAGS if options.get(name) not in (None, False)}
    fields = {f.partition(".")[2]: v for f, v in flag_values(given).items() if f.startswith("serve.")}
    spec = serve_of(fields, given, {}, input_tokens=inputs_tokens[:1], output_tokens=opts.output_tokens or 128,
                    repeats=options.get("serve_repeats") or 1, seed=options.get("seed") or 0)
    known, _ = known_slos(inputs.metas)
    slos = tuple(resolve_slos(opts.slos, known))
    name = opts.model_name or next(iter(inputs.models))
    dims = KNOWN_DIMS[opts.model_name] if opts.model_name else inputs.models[name]
    setup, notes, calibration = simulation(Basis(model, inputs, target, dims), spec, slos, server,
                                           router=options.get("router") or "power_of_two",
                                           calibrate=not options.get("no_calibrate"))
    peaks = tuple(options.get("peak_rps") or ())
    most = options.get("scale_nodes") or 0
    follows = spec.load_kind == "users" or (spec.workload is not None and spec.workload.multi_turn)
    if follows and most:
        raise UsageError([Problem("", None, None, "--scale-nodes", "closed loops (--users) and conversations plan "
                                  "their next request as a reply ends: they are simulated on one server only")])
    nodes = tuple(n for n in SCALE_NODES if n <= most)
    result = A.answer(setup, spec.loads, peaks, nodes)
    if opts.model_name and dims not in inputs.models.values():
        notes.append(f"{opts.model_name} is predicted from a fit on {', '.join(inputs.models)}: another model "
                     "shape, an extrapolation")
    if opts.output == "json":
        print_json(_json(result, sources, target, model, notes, server.name, name, calibration))
        return
    _text(result, sources, target, model, notes, server.name)


@dataclass(frozen=True)
class Basis:
    """What a simulation rests on: the fitted model, the measurements it was fitted on (with
    their serving runs), the target it is evaluated on and the model shape it runs."""

    model: Any
    inputs: Any
    target: Any
    dims: Any


def simulation(basis: Basis, spec: ServeSpec, slos, server, *, router: str = "power_of_two", calibrate: bool = True):
    """What a simulated answer needs (sim.answer.Setup): the step costs on the target from the
    fitted model (calibrated on the serving runs among the inputs unless `calibrate` is off),
    at the middle and at the fit interval's ends, and the scheduler as the bench sets it up;
    with the notes that say what it rests on, and the calibration (None: none made)."""
    from ..sim import answer as A
    from ..sim.cost import relative_half_widths, scaled, step_model

    model, inputs, target, dims = basis.model, basis.inputs, basis.target, basis.dims

    max_lanes = max(spec.slots, 1)
    calibration = _calibration(model, inputs.serve_runs) if calibrate else None
    mid = _calibrated(step_model(model, dims, target.rates, max_lanes), calibration)
    longest = max(spec.input_tokens) if spec.workload is None else spec.workload.max_input
    d_rel, p_rel = relative_half_widths(model, dims, target.rates, spec.slots, longest, spec.output_tokens)
    costs = {A.MID: mid}
    for end in (A.OPTIMISTIC, A.PESSIMISTIC):
        m = scaled(model, dims, target.rates, max_lanes, d_rel, p_rel, end)
        if m is not None:
            costs[end] = _calibrated(m, calibration)
    policy, chunk_note = _policy(server, spec, slos, mid, dims, target.rates, _growth(inputs.metas))
    notes = [chunk_note, _interval_note(d_rel, p_rel)]
    if calibration is not None:
        notes.append(calibration.statement())
    return A.Setup(costs, policy, spec, slos, target.ranks_per_node, router), notes, calibration


def _calibration(model, serve_runs):
    """The ratios of the serving runs' measured steps to the fit's step costs on the machine
    each ran on (sim/calibrate.py); None when no run kept its steps."""
    from ..sim.calibrate import calibrate, measured_steps
    from ..sim.cost import step_model

    windows = []
    for cal, records in serve_runs:
        steps = measured_steps(records)
        if steps:
            lanes = max(max(r.slots for r in records), 1)
            m = step_model(model, cal.dims, cal.rates, lanes)
            windows += [(m, w) for w in steps]
    return calibrate(windows) if windows else None


def _calibrated(m, calibration):
    from ..sim.calibrate import apply

    return m if calibration is None else apply(m, calibration)


def recorded_server(meta) -> str:
    s = (meta.spec or {}).get("server") if isinstance(meta.spec, dict) else None
    if isinstance(s, dict) and s.get("name"):
        return str(s["name"])
    m = (meta.matrix or {}).get("server")
    return str(m.get("name")) if isinstance(m, dict) and m.get("name") else "vcfslm"


def _growth(metas) -> int:
    """The decode lanes' growth (the kernel's row padding, its pack's min_rows) the measured
    engine ran at; 2 where the run does not say."""
    for meta in metas:
        for rank in (meta.ranks or {}).values():
            pack = rank.get("pack") if isinstance(rank, dict) else None
            rows = pack.get("min_rows") if isinstance(pack, dict) else None
            if isinstance(rows, int) and rows >= 1:
                return max(2, rows)
    return 2


def _policy(server, spec: ServeSpec, slos, mid, dims, rates, growth: int):
    """The scheduler as the bench would set it up on the target: vLLM's budget and sequences,
    or vcfslm's chunk (a flag's, else the SLO rule's from the tightest TPOT limit on the
    modelled decode steps, else the probes')."""
    from ..engine.step_cost import (
        StepCost,
        chunk_for_probes,
        chunk_rule,
        decode_buckets,
        slo_chunks,
    )
    from ..sim.server import Policy

    if server.name == "vllm":
        budget = spec.batched_tokens if server.chunked_prefill else max(spec.batched_tokens, spec.max_context)
        return (Policy("vllm", spec.slots, budget),
                f"vLLM: max_num_seqs {spec.slots}, max_num_batched_tokens {budget}, decodes first"
                + (", chunked prefill" if server.chunked_prefill else ""))
    curve = (rates.decode_rows or None, rates.decode_gbs or None)
    chunk = spec.chunk_tokens or chunk_for_probes(dims.step_weight_bytes, rates.read_gbs, rates.gemm_tflops, *curve)
    batched = max(spec.batched_tokens, chunk)
    lanes = decode_buckets(spec.slots, growth)
    tpots = [s.tpot_ms for s in slos if s.tpot_ms]
    tpot = None if spec.chunk_tokens or not tpots else min(tpots)
    if tpot is not None:
        context = max(spec.input_tokens)
        cost = StepCost({n: mid.decode_s(n, n * context) for n in lanes}, dims.step_weight_bytes, rates.gemm_tflops,
                        rates.read_gbs, *(tuple(c) if c else None for c in curve))
        chunks = slo_chunks(cost, tpot, most=batched)
        capped = True
    else:
        chunks, capped = {n: chunk for n in lanes}, False
    rule = chunk_rule(tpot, spec.chunk_tokens)
    text = ", ".join(f"{v} beside {k}" for k, v in chunks.items())
    return (Policy("vcfslm", spec.slots, batched, tuple(chunks.items()), lanes, capped),
            f"vcfslm: chunk rule {rule} ({text} lanes), {batched} tokens under a backlog, lanes {lanes}")


def _interval_note(d_rel, p_rel) -> str:
    if d_rel is None or p_rel is None:
        return "the fit has no residual degrees of freedom: no fit interval, only the bootstrap's"
    return (f"fit interval: every decode cost ±{d_rel:.0%}, every prefill cost ±{p_rel:.0%} (the model's 95 % "
            "prediction interval at the slots and the prompt), simulated again at each end")


def _fmt(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _text(result, sources, target, model, notes, server: str) -> None:
    setup = result.setup
    spec = setup.spec
    click.echo(f"fitted on {', '.join(map(str, sources))}: {model.observations} repeats")
    for line in model.statement():
        click.echo(line)
    click.echo(f"target: {target.description}; {setup.servers_per_vm} {server} server(s) per VM, "
               f"router {setup.router}")
    for n in notes:
        click.echo(f"note: {n}")
    what = spec.workload.name if spec.workload is not None else f"fixed {spec.input_tokens[0]}/{spec.output_tokens}"
    click.echo("")
    click.echo(f"Predicted serving per server ({what}, {spec.arrival}, {spec.slots} slots, "
               f"{spec.repeats} × {spec.duration_s:g} s window(s) per load)")
    names = [s.name for s in setup.slos]
    header = ["req/s", "requests", "TTFT p50 s", "TTFT p90 s", "TPOT p50 ms", "TPOT p90 ms",
              *[f"SLO-{n} met" for n in names]]
    rows = []
    for r in result.rows:
        res = r.result
        rows.append([f"{r.load:g}", str(res.requests), _fmt(_finite(res.ttft_tail(50))),
                     _fmt(_finite(res.ttft_tail(90))), _fmt(_finite(res.tpot_tail(50)), 1),
                     _fmt(_finite(res.tpot_tail(90)), 1),
                     *[("–" if r.attained[n] is None else f"{r.attained[n]:.0%}") for n in names]])
    _table(header, rows)
    click.echo("")
    click.echo("Predicted threshold (req/s per server; per VM × servers per VM)")
    rows = []
    for a in result.slos:
        fit = "–" if not a.fit_ends else f"{_fmt(a.fit_ends[0], 3)} to {_fmt(a.fit_ends[1], 3)}"
        per_vm = "–" if not a.threshold else f"{a.threshold * setup.servers_per_vm:g}"
        rows.append([a.slo.title, a.text, a.interval.text() if a.interval else "–", fit, per_vm, a.binding or "–"])
    _table(["SLO", "threshold", "bootstrap 95 %", "fit interval", "per VM", "binding"], rows)
    if result.nodes:
        click.echo("")
        click.echo("Predicted nodes for the peak")
        rows = [[n.slo.title, f"{n.peak_rps:g}", str(n.nodes or "–"),
                 n.interval.text(mark="≤ ") if n.interval else "–",
                 "–" if not n.fit_ends else f"{n.fit_ends[1]} to {n.fit_ends[0]}"] for n in result.nodes]
        _table(["SLO", "peak req/s", "nodes", "bootstrap 95 %", "fit interval"], rows)
    for slo_name, table in result.scale_out.items():
        click.echo("")
        click.echo(f"Scale-out, SLO-{slo_name}: per-server threshold at N nodes behind {setup.router}")
        rows = [[str(s.nodes), str(s.servers), _fmt(s.threshold, 3), s.interval.text() if s.interval else "–",
                 _fmt(s.efficiency), "–" if not s.efficiency_interval else
                 f"{_fmt(s.efficiency_interval[0])} to {_fmt(s.efficiency_interval[1])}"] for s in table]
        _table(["nodes", "servers", "threshold/server", "bootstrap 95 %", "efficiency", "interval"], rows)


def _finite(x):
    return x if x == x and abs(x) != float("inf") else None


def _table(header, rows) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _json(result, sources, target, model, notes, server: str, model_name: str, calibration=None) -> dict[str, Any]:
    setup = result.setup
    return {"results": [str(s) for s in sources], "target": target.description, "target_basis": target.basis,
            "rank_rates": target.rates, "model": model.to_dict(), "model_name": model_name, "server": server,
            "servers_per_vm": setup.servers_per_vm, "router": setup.router,
            "spec": replace(setup.spec, workload=None).to_dict() | {
                "workload": setup.spec.workload.name if setup.spec.workload is not None else None},
            "policy": {"scheduler": setup.policy.scheduler, "slots": setup.policy.slots,
                       "batched_tokens": setup.policy.batched_tokens, "chunks": dict(setup.policy.chunks),
                       "lane_buckets": list(setup.policy.lane_buckets), "capped": setup.policy.capped},
            "loads": [r.to_dict() for r in result.rows],
            "thresholds": [a.to_dict() | {"per_vm": a.threshold * setup.servers_per_vm if a.threshold else None}
                           for a in result.slos],
            "nodes": [n.to_dict() for n in result.nodes],
            "scale_out": {k: [s.to_dict() for s in v] for k, v in result.scale_out.items()},
            "calibration": calibration.to_dict() if calibration is not None else None,
            "notes": notes}


