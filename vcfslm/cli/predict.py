"""`vcfslm predict`: TTFT, TPOT, the crossover and the node count for hardware not yet bought,
from a calibrated performance model fitted on measured cells; `--validate` checks the model
on a run's own cells."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import click

from ..errors import Problem, UsageError
from ..presets import PRESET_NAMES
from ..sim.fleet import ROUTERS
from .bench_options import SERVE_FLAGS, float_list, serve_options
from .common import int_list, latest_run, output_option, print_json

# The flags only `predict --serve` reads (beside bench's serving flags).
PREDICT_SERVE_FLAGS = ("peak_rps", "scale_nodes", "router", "serve_repeats", "seed", "no_calibrate")


@click.command("predict")
@click.option("--results", "results", multiple=True, type=click.Path(exists=True, path_type=Path),
              metavar="RUN|CSV", help="Measurements to fit on: run dir(s) or CSV(s) (default: the latest run).")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"),
              show_default=True, help="Where to look for the latest run.")
@click.option("--measured-on", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Platform file (YAML or probe JSON) a CSV was measured on (runs carry their own probes).")
@click.option("--model", "model_name", type=click.Choice(PRESET_NAMES), default=None, metavar="PRESET",
              help="A preset to predict for (" + ", ".join(PRESET_NAMES) + "). Default: each model measured, "
                   "one answer per model (a CSV's is its model column's preset, else phi-3-mini). Another "
                   "shape than the fitted ones is flagged as an extrapolation.")
@click.option("--platform", "platform_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Target: a platform YAML (platforms/*.yaml, or a shipped one by name such as "
                   "vx650v4-6737p) or the JSON `vcfslm probe -o json` printed on the target.")
@click.option("--bandwidth-gbs", type=float, default=None, help="Target: read GB/s of one NUMA node.")
@click.option("--gemm-tflops", type=float, default=None, help="Target: bf16 GEMM TFLOP/s of one rank.")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None, help="Target change: ranks per VM.")
@click.option("--threads-per-rank", type=click.IntRange(min=1), default=None, help="Target change: threads per rank.")
@click.option("--vnuma-nodes", type=click.IntRange(min=1), default=None,
              help="Target change: vNUMA nodes per VM (the host's bandwidth is split among them).")
@click.option("--batch-sizes", callback=int_list, default=None, metavar="LIST",
              help="Batches per rank to predict (default: the measured ones).")
@click.option("--input-tokens", callback=int_list, default=None, metavar="LIST",
              help="Prompt lengths to predict (default: the measured ones).")
@click.option("--output-tokens", type=click.IntRange(min=2), default=None, help="Output length (default: measured).")
@click.option("--slo", "slos", multiple=True, metavar="SLO",
              help="SLO name (A, B, ...) or spec 'name:tpot<=150ms,ttft<=2s'. Repeatable (default: every SLO).")
@click.option("--peak-streams", "peaks", multiple=True, type=click.IntRange(min=1),
              help="Peak concurrent streams to size for. Repeatable.")
@click.option("--headroom", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Fraction of each VM's threshold kept free.")
@click.option("--validate", "validate_runs", multiple=True, type=click.Path(exists=True, file_okay=False,
              path_type=Path), metavar="RUN",
              help="Check the model instead: fit on part of these runs' cells, predict the rest. Repeatable.")
@click.option("--fit-batches", callback=int_list, default=None, metavar="LIST",
              help="--validate: fit on these batches (default: the smaller half).")
@click.option("--fit-threads", type=click.IntRange(min=1), default=None,
              help="--validate: fit on the runs with this many threads per rank, predict the others.")
@serve_options
@click.option("--windows", "serve_repeats", type=click.IntRange(min=1), default=None,
              help="Serve: simulated windows per load, each its own seed (default 1).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Serve: the arrivals' seed (default 0).")
@click.option("--router", type=click.Choice(ROUTERS), default=None,
              help="Serve: how the fleet's router picks a server (default power_of_two).")
@click.option("--peak-rps", "peak_rps", callback=float_list, default=None, metavar="LIST",
              help="Serve: peak requests/s of the service to size nodes for.")
@click.option("--scale-nodes", type=click.IntRange(min=1, max=64), default=None, metavar="N",
              help="Serve: the scale-out table up to N nodes (1, 2, 4, ... N) behind the router.")
@click.option("--no-calibrate", "no_calibrate", is_flag=True, default=None,
              help="Serve: keep the static fit's step costs even where --results hold serving runs "
                   "whose measured steps would calibrate them.")
@output_option
def predict(**options) -> None:
    """Predict TTFT, TPOT, the crossover and the nodes on a target platform, with 95 % intervals.

    \b
    The model (stated with its fitted efficiencies in the output and the report):
      decode step = linears(batch) / eta_w + KV bytes / (bandwidth x eta_kv) + overhead
      TTFT = prompt FLOPs / (GEMM rate x eta_p) + attention / (GEMM x eta_pa) + weights / bandwidth
    fitted on the measured cells, then evaluated with the target's rates. A figure outside
    the fitted regime (larger batch, longer input, the compute-bound side) is flagged.

    \b
    Examples:
      vcfslm predict --results runs/<id> --platform platforms/vx650v4-6737p.yaml --peak-streams 256 --slo B
      vcfslm predict --results runs/<id> --bandwidth-gbs 92 --gemm-tflops 4 --threads-per-rank 24
      vcfslm predict --results runs/<small-model run> --model phi-3-mini --platform vx650v4-6737p
      vcfslm predict --results runs/<phi3> --model qwen2.5-7b --platform vx650v4-6737p --slo B
      vcfslm predict --results runs/<phi3> --results runs/<llama3b> --peak-streams 256
      vcfslm predict --results brief.csv --measured-on platforms/vx650v4-6747p.yaml \\
          --platform platforms/vx650v4-6737p.yaml
      vcfslm predict --validate runs/<id> --fit-batches 1,4
      vcfslm predict --validate runs/<1-thread> --validate runs/<2-thread> --fit-threads 1
      vcfslm predict --serve --results runs/<id> --rates 0.5,1,2 --slo B --peak-rps 100 --scale-nodes 64
      vcfslm predict --serve --results runs/<id> --platform vx650v4-6747p --rates 1,2,4 --input-tokens 128

    \b
    --serve simulates serving instead (docs/predict.md): the fitted step costs drive the
    scheduler (vcfslm's, or vLLM's with --server vllm, fitted on vLLM's own runs) under the
    bench's arrivals and workloads, judged by the bench's code: per load the attainment and
    TTFT/TPOT, per SLO the threshold, the nodes for --peak-rps, and the scale-out table.
    Where --results also holds a serving run of the same server, the step costs are
    calibrated on the steps it measured (--no-calibrate: the static fit only).
    """
    opts = PredictOptions.from_cli(options)
    given = sorted(k for k in (*SERVE_FLAGS, *PREDICT_SERVE_FLAGS) if options.get(k) not in (None, False))
    if options.get("serve"):
        from .predict_serve import serve_command

        serve_command(opts, options, load_measured, build_target, latest_run)
        return
    if given:
        raise UsageError(f"{', '.join('--' + g.replace('_', '-') for g in given)} only apply to predict --serve")
    if opts.validate_runs:
        _validate(opts)
        return
    _predict(opts)


@dataclass(frozen=True)
class TargetSpec:
    """The platform to predict for: a platform file, or a node's read bandwidth and a rank's
    GEMM rate given as flags (else the platform measured on), with its ranks, threads or
    vNUMA nodes changed (None: as they are)."""

    platform_file: Path | None = None
    bandwidth_gbs: float | None = None
    gemm_tflops: float | None = None
    ranks_per_node: int | None = None
    threads_per_rank: int | None = None
    vnuma_nodes: int | None = None


@dataclass(frozen=True)
class PredictOptions:
    """The `predict` command's options: the measurements to fit on, the target, the scenarios
    and SLOs to answer for, and (with --validate) the runs and split to check the model on."""

    results: tuple[Path, ...] = ()
    runs_dir: Path = Path("runs")
    measured_on: Path | None = None
    model_name: str | None = None
    target: TargetSpec = TargetSpec()
    batch_sizes: list[int] | None = None
    input_tokens: list[int] | None = None
    output_tokens: int | None = None
    slos: tuple[str, ...] = ()
    peaks: tuple[int, ...] = ()
    headroom: float = 0.0
    validate_runs: tuple[Path, ...] = ()
    fit_batches: list[int] | None = None
    fit_threads: int | None = None
    output: str = "text"

    @classmethod
    def from_cli(cls, options: dict) -> PredictOptions:
        """From click's parsed options: the target's flags make one TargetSpec, every other
        field is the option of its name."""
        target = TargetSpec(**{f.name: options[f.name] for f in fields(TargetSpec)})
        return cls(target=target, **{f.name: options[f.name] for f in fields(cls) if f.name != "target"})


def _validate(opts: PredictOptions) -> None:
    """--validate: fit on part of the runs' own cells, predict the rest, show the errors."""
    from ..analysis import predict as P
    from ..analysis.perfmodel import fit_model, validate

    t = opts.target
    given = [name for name, v in (("--results", opts.results), ("--platform", t.platform_file),
                                  ("--bandwidth-gbs", t.bandwidth_gbs), ("--gemm-tflops", t.gemm_tflops),
                                  ("--peak-streams", opts.peaks)) if v]
    if given:
        raise UsageError(f"--validate checks the model on its runs' own cells; drop {', '.join(given)}")
    inputs = load_measured(list(opts.validate_runs), None)
    fit, held = P.split(inputs.observations, inputs.threads, opts.fit_batches, opts.fit_threads)
    reasons = P.check_validation(fit, held)
    if reasons:
        raise UsageError([Problem(", ".join(map(str, opts.validate_runs)), None, None, "", r) for r in reasons])
    model = _fit(fit_model, fit)
    check = validate(model, held)
    if opts.output == "json":
        print_json({"model": model.to_dict(), "fit_observations": len(fit),
                    "cells": [_error_dict(c) for c in check.cells],
                    "median_abs_error": {"tpot": check.median_abs("tpot"), "ttft": check.median_abs("ttft")}})
        return
    click.echo(f"fitted on {len(fit)} repeats: {P.median_rates(fit)}")
    for line in model.statement():
        click.echo(line)
    click.echo("")
    for line in P.validation_table(check).text():
        click.echo(line)


def _predict(opts: PredictOptions) -> None:
    """Fit on the measurements, predict on the target, one answer per model."""
    from ..analysis import predict as P
    from ..analysis.calibration import KNOWN_DIMS
    from ..analysis.perfmodel import fit_model

    spec, model_name = opts.target, opts.model_name
    if (spec.bandwidth_gbs is None) != (spec.gemm_tflops is None):
        raise UsageError("give --bandwidth-gbs and --gemm-tflops together (or a --platform file)")
    if spec.platform_file and spec.bandwidth_gbs is not None:
        raise UsageError("give either --platform or --bandwidth-gbs/--gemm-tflops, not both")
    sources = list(opts.results) or [latest_run(opts.runs_dir)]
    inputs = load_measured(sources, opts.measured_on)
    model = _fit(fit_model, inputs.observations)
    target = build_target(inputs, spec)
    from ..analysis.report import known_slos
    from ..analysis.slo_spec import resolve_slos

    known, _ = known_slos(inputs.metas)
    chosen = resolve_slos(opts.slos, known)
    # One answer per model: the one asked for, else each measured model from its own cells' scenarios.
    if model_name:
        targets = [(model_name, KNOWN_DIMS[model_name], inputs.observations)]
    else:
        targets = [(name, dims, [o for o in inputs.observations if o.dims == dims])
                   for name, dims in inputs.models.items()]
    several = len(targets) > 1
    answers = [P.predict_target(model, dims, target,
                                P.scenarios_of(obs, opts.batch_sizes, opts.input_tokens, opts.output_tokens),
                                chosen, opts.peaks, opts.headroom, name if several or model_name else "")
               for name, dims, obs in targets]
    names = [name for name, _, _ in targets]
    notes = target_notes(inputs, target) + model_notes(inputs, model_name)
    if opts.output == "json":
        print_json({"results": [str(s) for s in sources], "target": target.description,
                    "target_basis": target.basis, "rank_rates": target.rates, "model": model.to_dict(),
                    "models": names,
                    "predictions": [{"model": name, **p.to_dict()}
                                    for name, a in zip(names, answers, strict=True) for p in a.predictions],
                    "crossovers": [{"model": name, **_threshold_dict(t)}
                                   for name, a in zip(names, answers, strict=True) for t in a.thresholds],
                    "sizings": [{**n.sizing.to_dict(), "model": name, "nodes_interval": [n.low, n.high]}
                                for name, a in zip(names, answers, strict=True) for n in a.nodes],
                    "notes": notes})
        return
    click.echo(f"fitted on {', '.join(map(str, sources))}: {model.observations} repeats, "
               f"{P.median_rates(inputs.observations)}")
    for line in model.statement():
        click.echo(line)
    r = target.rates
    click.echo(f"target: {target.description}; per rank: read {r.read_gbs:.1f} GB/s, GEMM {r.gemm_tflops:.3f} TFLOP/s")
    for n in notes:
        click.echo(f"note: {n}")
    click.echo("")
    for answer in answers:
        for table in (P.prediction_table(answer), P.threshold_table(answer)) + ((P.nodes_table(answer),)
                                                                                 if answer.nodes else ()):
            for line in table.text():
                click.echo(line)
            click.echo("")


def _fit(fit_model, observations):
    try:
        return fit_model(observations)
    except ValueError as exc:
        raise UsageError(f"cannot fit the performance model: {exc}") from None


@dataclass
class Measured:
    """The measured side: observations, each model's dims, the runs' metadata and calibrations."""

    observations: list = field(default_factory=list)
    threads: dict[str, int] = field(default_factory=dict)    # source -> threads per rank
    metas: list = field(default_factory=list)
    calibrations: list = field(default_factory=list)
    models: dict[str, Any] = field(default_factory=dict)     # model name -> its dims, in the order measured
    measured_platform: Any = None                            # a CSV's --measured-on
    # Serving runs' own steps (predict --serve calibrates on them): (calibration, records).
    serve_runs: list = field(default_factory=list)

    def add_model(self, name: str, dims) -> None:
        """A measured model; a shape already measured under another name keeps its first name."""
        if dims not in self.models.values():
            self.models[name] = dims

    def add_run(self, run) -> None:
        """A loaded run: its cells as observations at its own rates, its metadata, its
        calibration, its model and (serving runs) its records."""
        from ..analysis.calibration import observations, run_calibration
        from ..analysis.cells import aggregate

        cal = run_calibration(run)
        self.observations += observations(aggregate([run]).cells, cal.dims, cal.rates, cal.run_id)
        self.threads[cal.run_id] = cal.threads_per_rank
        self.metas.append(run.meta)
        self.calibrations.append(cal)
        if run.serve_records:
            self.serve_runs.append((cal, run.serve_records))
        self.add_model(run.meta.model, cal.dims)


def load_measured(sources: list[Path], measured_on: Path | None) -> Measured:
    """Observations of every run (each with its own model's facts) and CSV (each row with the
    preset its model column names, else Phi-3-mini)."""
    from ..analysis.calibration import (
        CSV_DEFAULT_MODEL,
        named_dims,
        observations,
        rank_rates,
    )
    from ..analysis.cells import load_runs, models_of
    from ..analysis.csv_import import import_csv
    from ..hardware import load_platform

    out = Measured()
    run_dirs = [p for p in sources if p.is_dir()]
    csvs = [p for p in sources if not p.is_dir()]
    for run in load_runs(run_dirs):
        out.add_run(run)
    if csvs:
        if measured_on is None:
            raise UsageError([Problem(str(csvs[0]), None, None, "", "a CSV carries no probe figures: give "
                                      "--measured-on PLATFORM (the platform file it was measured on)")])
        platform = load_platform(measured_on)
        out.measured_platform = platform
        for path in csvs:
            cells = import_csv(path).cells
            for model in models_of(cells):
                name = model or CSV_DEFAULT_MODEL
                dims = named_dims(name)
                if dims is None:
                    raise UsageError([Problem(str(path), None, None, "model",
                                              f"{model!r} is not a shape known without a run's facts; name a "
                                              f"preset ({', '.join(PRESET_NAMES)})")])
                out.add_model(name, dims)
                mine = [c for c in cells if c.model == model]
                for ranks in sorted({c.ranks_per_vm for c in mine}):
                    rates = rank_rates(platform.with_changes(ranks_per_node=ranks))
                    out.observations += observations([c for c in mine if c.ranks_per_vm == ranks], dims, rates,
                                                     str(path))
                    out.threads[str(path)] = platform.threads
    if not out.observations:
        raise UsageError([Problem(", ".join(map(str, sources)), None, None, "", "no valid measured cells to fit on")])
    return out


def build_target(inputs: Measured, spec: TargetSpec):
    from ..analysis.calibration import rank_rates, stream_transfer
    from ..analysis.predict import Target
    from ..hardware import load_platform, platform_from_flags, platform_from_run

    platform_file, bandwidth_gbs, gemm_tflops = spec.platform_file, spec.bandwidth_gbs, spec.gemm_tflops
    ranks_per_node, threads_per_rank, vnuma_nodes = spec.ranks_per_node, spec.threads_per_rank, spec.vnuma_nodes
    if platform_file:
        platform = load_platform(platform_file)
    elif bandwidth_gbs is not None:
        platform = platform_from_flags(bandwidth_gbs, gemm_tflops, numa_nodes=vnuma_nodes or 1,
                                       threads_per_rank=threads_per_rank or 1, ranks_per_node=ranks_per_node)
    elif inputs.measured_platform is not None:
        platform = inputs.measured_platform
    else:
        cal = inputs.calibrations[0]
        platform = platform_from_run(cal.run_id, cal.rates, cal.threads_per_rank, cal.ranks_per_node)
    platform = platform.with_changes(ranks_per_node=ranks_per_node, threads_per_rank=threads_per_rank,
                                     vnuma_nodes=vnuma_nodes)
    return Target(platform.describe(), rank_rates(platform, stream_transfer(inputs.observations)),
                  platform.ranks, platform.basis)


def target_notes(inputs: Measured, target) -> list[str]:
    from ..analysis.calibration import stream_transfer

    notes = []
    transfer = stream_transfer(inputs.observations)
    if transfer is not None and target.basis == "spec":
        notes.append(transfer.text())
    measured_basis = "measured" if inputs.calibrations else (inputs.measured_platform.basis
                                                             if inputs.measured_platform else "measured")
    if target.basis != measured_basis:
        notes.append(f"the target's figures are {target.basis}, the fit's were {measured_basis}: the fitted "
                     "efficiencies carry a bias between the two; run `vcfslm probe -o json` on the target "
                     "for measured figures")
    if not target.rates.decode_rows and any(o.rates.decode_rows for o in inputs.observations):
        notes.append("the target has no decode-batch curve: its batch knee is the roofline's "
                     "max(bandwidth, GEMM rate), the fit's was probed")
    return notes


def model_notes(inputs: Measured, model_name: str | None) -> list[str]:
    """What `--model` asks of the fit: another shape than any measured one is an extrapolation."""
    if not model_name or inputs.models.get(model_name) is not None:
        return []
    from ..analysis.calibration import KNOWN_DIMS

    if KNOWN_DIMS[model_name] in inputs.models.values():
        return []
    return [f"{model_name} is predicted from a fit on {', '.join(inputs.models)}: another model shape, so every "
            "figure is an extrapolation (flagged per row)"]


def _threshold_dict(t) -> dict:
    c = t.crossover
    return {"slo": c.slo.to_dict(), "input_tokens": c.input_tokens, "output_tokens": c.output_tokens,
            "status": c.status, "threshold_streams_per_vm": c.threshold, "first_failing_streams_per_vm": c.first_failing,
            "binding": c.binding,
            "interval": [x.threshold if x else None for x in (t.pessimistic, t.optimistic)]}


def _error_dict(c) -> dict:
    s = c.scenario
    return {"run": c.source, "batch_per_rank": s.batch, "input_tokens": s.input_tokens,
            "output_tokens": s.output_tokens, "tpot_ms": c.measured_tpot_ms, "predicted_tpot_ms": c.predicted_tpot_ms,
            "tpot_error": c.tpot_error, "ttft_s": c.measured_ttft_s, "predicted_ttft_s": c.predicted_ttft_s,
            "ttft_error": c.ttft_error, "extrapolation": list(c.flags)}


COMMANDS = [predict]
