"""`vcfslm report`'s predicted column: each measured serving series as `predict --serve`
would have answered it before it ran (the simulation is here, in cli/, because analysis/
may not import sim/; analysis/serve_predicted.py lays the table out)."""

from __future__ import annotations

from dataclasses import replace

from ..errors import UsageError
from ..serving.decisions import ServeSpec
from .bench_serve import server_of
from .predict_serve import Basis, recorded_server, simulation


def report_predictions(runs, slo_specs) -> tuple[list, list[str]]:
    """Every rank series of the serving runs among `runs` as `predict --serve` would have
    answered it before it ran: fitted on the static cells of the same model and server among
    `runs`, on the machine they measured, with the run's own serving spec, loads, seeds and
    SLOs, and not calibrated on the run's own steps (the prediction stays one made without
    them). Returns the predicted series and notes on the series it could not predict."""
    from ..analysis.cells import aggregate, load_runs
    from ..analysis.perfmodel import fit_model
    from ..analysis.report import known_slos
    from ..analysis.serve_points import series_key
    from ..analysis.slo_spec import resolve_slos
    from .predict import TargetSpec, build_target

    loaded = load_runs(list(runs))
    known, _ = known_slos([r.meta for r in loaded])
    slos = tuple(resolve_slos(slo_specs, known))
    out, notes = [], []
    for run in loaded:
        records = [r for r in run.serve_records or () if not r.endpoint_nodes]
        spec = _recorded_spec(run.meta)
        if not records or spec is None:
            continue
        server = recorded_server(run.meta)
        static = [r for r in loaded if r.meta.model == run.meta.model and recorded_server(r.meta) == server
                  and any(c.has_data for c in aggregate([r]).cells)]
        if not static:
            notes.append(f"{run.meta.run_id}: no static cells of {run.meta.model} on {server} among the runs: "
                         "nothing to predict its serving from")
            continue
        try:
            inputs = _measured_of(static)
            model = fit_model(inputs.observations)
        except (ValueError, UsageError) as exc:
            notes.append(f"{run.meta.run_id}: cannot fit the static cells to predict its serving: {exc}")
            continue
        basis = Basis(model, inputs, build_target(inputs, TargetSpec()), next(iter(inputs.models.values())))
        said = (f"simulated from the fit on the static cells of {', '.join(r.meta.run_id for r in static)} "
                f"(not calibrated on this run's own steps), {server}'s scheduler, the run's spec and seeds")
        by_series: dict = {}
        for r in records:
            by_series.setdefault(series_key(run.meta, r), set()).add(float(r.load))
        for key, loads in by_series.items():
            out.append(_predicted_series(key, sorted(loads), spec, slos, server, basis, said))
    return out, notes


def _recorded_spec(meta) -> ServeSpec | None:
    data = (meta.matrix or {}).get("serve")
    try:
        return ServeSpec.of_record(data) if isinstance(data, dict) else None
    except (TypeError, ValueError):
        return None


def _measured_of(static_runs):
    """The fit's inputs from loaded static runs, as predict's load_measured makes them."""
    from .predict import Measured

    inputs = Measured()
    for run in static_runs:
        inputs.add_run(run)
    return inputs


def _finite(x: float | None) -> float | None:
    return x if x is not None and x == x and x not in (float("inf"), float("-inf")) else None


def _predicted_series(key, loads, spec: ServeSpec, slos, server_name: str, basis: Basis, said: str):
    """One series' loads simulated: per load its p50s and attainment, per SLO the threshold."""
    from ..analysis.serve_predicted import PredictedLoad, PredictedSeries
    from ..serving import decisions as serving_decisions
    from ..serving import judging
    from ..sim import answer as A

    mine = replace(spec, input_tokens=(key.input_tokens,), output_tokens=key.output_tokens, loads=tuple(loads),
                   sweep=False)
    setup, _, _ = simulation(basis, mine, slos, server_of(server_name, None), calibrate=False)
    results = A.simulate_loads(setup.costs[A.MID], setup, loads)
    predicted, verdicts = [], {s.name: {} for s in slos}
    for load, r in results.items():
        shares = {}
        for s in slos:
            a = r.attainment(s.tpot_ms, s.ttft_s, s.ttft_per_token_ms)
            shares[s.name] = a.share if a.requests else None
            verdicts[s.name][load] = serving_decisions.meets_limit(r, setup.limit(s), setup.share(s))
        predicted.append(PredictedLoad(load, _finite(r.ttft_tail(50)), _finite(r.tpot_tail(50)), shares))
    thresholds = {name: judging.threshold(v)[0] for name, v in verdicts.items()}
    return PredictedSeries(key, tuple(predicted), thresholds, said)
