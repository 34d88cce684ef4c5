"""`vcfslm bench` (local mode here; cluster mode in cli/cluster.py) and `vcfslm probe`.

`bench` validates its options, then dispatches: `--local` to
`vcfslm.bench.local.run_local`, otherwise (`--nodes N` / `--hosts a,b` / `--resume RUN`
with an inventory) to `vcfslm.cli.cluster.run_cluster`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ..contract import ACCEPTED_COMPILE_MODES
from ..errors import BenchError, Problem, UsageError
from ..matrix import Matrix, serve_matrix
from ..run_meta import new_run_id
from ..runspec import ProbeSpec, RunSpec
from ..steadiness import recorded
from .bench_endpoint import endpoint_options, endpoint_run
from .bench_serve import check_serve_flags, serve_options, serve_spec, server_spec
from .bench_summary import print_run_summary
from .common import (
    RichReporter,
    console,
    err_console,
    int_list,
    inventory_option,
    output_option,
    print_json,
)

LOCAL_ONLY = ("model", "ranks", "threads", "batch_sizes", "input_tokens", "warmup", "no_numactl", "seed")
CLUSTER_ONLY = ("nodes", "hosts", "dry_run", "trust_new_hosts")


@click.command("bench")
@click.option("--local", "local", is_flag=True,
              help="Run on this machine (torchrun standalone, numactl pinning), no VM needed.")
@inventory_option
@click.option("--model", default=None, metavar="SRC",
              help="Model: folder, hub id, synthetic:PRESET[,layers=N] (phi-3-mini, llama-3.2-3b, "
                   "qwen2.5-7b, ...: `vcfslm model presets`), synthetic:config=PATH, synthetic:tiny "
                   "(local; default: the inventory's guest.model, else synthetic:tiny).")
@click.option("--ranks", type=click.IntRange(min=1), default=None,
              help="Ranks (model replicas) on this machine (local; default 1 or the inventory's).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Threads per rank (local; default: the CPUs shared evenly).")
@click.option("--batch-sizes", callback=int_list, default=None, metavar="LIST",
              help="Streams per rank, comma-separated (default 1,4,8,16).")
@click.option("--input-tokens", callback=int_list, default=None, metavar="LIST",
              help="Prompt lengths, comma-separated (default 128,512,1024).")
@click.option("--output-tokens", type=click.IntRange(min=2), default=None,
              help="Generated tokens per stream (default 128).")
@click.option("--warmup", type=click.IntRange(min=0), default=None, help="Discarded windows per scenario (default 1).")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Measured windows per scenario (default 3).")
@click.option("--scenarios", default=None, metavar="PATTERNS",
              help="Only these BATCHxINPUT scenarios, '*' wildcard (e.g. '1x*,16x128').")
@click.option("--run-id", default=None, help="Run folder name (default: timestamp).")
@click.option("--runs-dir", default="runs", show_default=True, type=click.Path(file_okay=False),
              help="Where run folders go.")
@click.option("--resume", default=None, metavar="RUN",
              help="Continue run RUN (an id under --runs-dir, or its folder); finished scenarios are kept.")
@click.option("--label", default=None, help="Free-text label stored in meta.json.")
@click.option("--slo", "slo_specs", multiple=True, metavar="SLO",
              help="The run's SLOs instead of the inventory's, e.g. 'B:tpot<=200ms,ttft<=5s' (repeatable): "
                   "recorded in meta.json; a serving run's goodput and sweep judge by them.")
@click.option("--percentile", type=click.Choice(["p50", "p90", "p99"]), default=None,
              help="The static rule the run records, the report's default: the percentile of streams "
                   "that must meet each limit (default: the inventory's slo.percentile, else p90).")
@click.option("--attainment", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
              metavar="SHARE", help="Serve: the share of requests that must meet every limit at once; the "
                                    "sweep bisects on it (default: the inventory's slo.attainment, else 0.9).")
@click.option("--no-numactl", is_flag=True, help="Do not pin ranks with numactl (local).")
@click.option("--seed", type=int, default=None, help="Weights/prompt seed (local; default 0).")
@click.option("--compile", "compile_mode", type=click.Choice(ACCEPTED_COMPILE_MODES), default=None,
              help="Decode step: compile (torch.compile over one packed copy of the weights: the "
                   "measurement mode) or eager (a baseline); autotune, freezing and default are older "
                   "names of compile (default: the inventory's bench.compile, else compile).")
@click.option("--no-probe", is_flag=True, help="Skip the rank probes: no roofline, no performance model.")
@click.option("--probe-mib", type=click.IntRange(min=16), default=None,
              help="Bandwidth probe buffer in MiB per rank (default 1024; the cluster's workers' own default).")
@click.option("--timeout", type=float, default=None, help="Whole-run timeout in seconds.")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Cluster mode: the first N inventory nodes.")
@click.option("--hosts", default=None, metavar="A,B", help="Cluster mode: these inventory nodes.")
@click.option("--dry-run", is_flag=True, help="Cluster mode: print the torchrun commands and stop.")
@click.option("--trust-new-hosts", is_flag=True, help="Cluster mode: record unknown SSH host keys.")
@serve_options
@endpoint_options
@output_option
@click.pass_context
def bench(ctx: click.Context, local: bool, inventory: str | None, **opts: Any) -> None:
    """Measure TTFT, TPOT and rank throughput for each (batch per rank, input length).

    \b
    Examples:
      vcfslm bench --local                                   tiny model, 1 rank
      vcfslm bench --local --model synthetic:phi-3-mini --ranks 2 --batch-sizes 1,4 \\
          --input-tokens 128 --output-tokens 64
      vcfslm bench --local -i cluster.yaml --model synthetic:tiny   matrix from the inventory
      vcfslm bench --local --resume 20250101-120000-local    finish an interrupted run
      vcfslm bench --nodes 4                                 the cluster (inventory nodes)
      vcfslm bench --local --serve --rates 0.5,1,2 --input-tokens 512   serving: continuous batching
      vcfslm bench --nodes 2 --serve --users 4,8,16 --sweep  closed loop, bisect to each SLO
      vcfslm bench --serve --endpoint http://10.0.0.11:8000 --key-file slm.key --rates 1,2,4
                                                             through a deployment's endpoint
    """
    given = {name for name in opts if ctx.get_parameter_source(name) not in
             (click.core.ParameterSource.DEFAULT, None)}
    verbose = (ctx.find_root().obj or {}).get("verbose", 0)
    check_serve_flags(opts["serve"], given, resume=bool(opts["resume"]))
    if opts["resume"] and (opts["slo_specs"] or "percentile" in given or "attainment" in given):
        raise UsageError("--resume continues a run with its own SLOs and rule; drop --slo, --percentile "
                         "and --attainment")
    if not opts["serve"] and "attainment" in given:
        raise UsageError("--attainment only applies to --serve runs (static cells are judged by --percentile)")
    slos = _parse_slos(opts.pop("slo_specs"))
    if endpoint_run(opts, given):
        from .bench_endpoint import run_endpoint_bench

        run_endpoint_bench(inventory, {**opts, "local": local}, given | ({"local"} if local else set()),
                           slos, verbose)
        return
    if local:
        bad = sorted(given & set(CLUSTER_ONLY))
        if bad:
            raise UsageError(f"--local cannot be combined with {_flags(bad)}")
        _bench_local(inventory, opts, given, slos, verbose)
        return
    bad = sorted(given & set(LOCAL_ONLY))
    if bad:
        raise UsageError(f"{_flags(bad)} only apply to --local runs")
    if not (opts["nodes"] or opts["hosts"] or opts["resume"]):
        raise UsageError("choose a mode: --local (this machine) or --nodes N / --hosts A,B (the cluster)")
    from .cluster import run_cluster

    run_cluster(inventory, opts, slos, verbose)


def _flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-").replace("compile-mode", "compile") for n in names)


def _parse_slos(specs) -> dict[str, Any] | None:
    """--slo texts as meta.json records SLOs ({name: {tpot_ms, ttft_s}}); None when none given."""

    from ..analysis.slo_spec import PRESETS, resolve_slos

    parsed = resolve_slos(specs, list(PRESETS.values())) if specs else []
    return {s.name: s.limits() for s in parsed} or None


def _bench_local(inventory: str | None, opts: dict[str, Any], given: set[str],
                 slos: dict[str, Any] | None = None, verbose: int = 0) -> None:
    """Build the local run's spec (flags > resumed run > inventory > defaults) and run it."""
    from ..bench.local import LocalLaunch, run_local
    from ..guest.templates import render_template

    runs_dir, resume = opts["runs_dir"], False
    if opts["resume"]:
        run_dir = Path(opts["resume"]) if Path(opts["resume"]).is_dir() else Path(opts["runs_dir"]) / opts["resume"]
        spec = _resumed_local_spec(run_dir, opts, given)
        runs_dir, resume = str(run_dir.parent), True
    else:
        spec = _new_local_spec(inventory, opts, slos)
    launch = LocalLaunch(runs_dir=runs_dir, resume=resume,
                         server_python=_server_python(opts.get("server_python"),
                                                      spec.server if spec.serve is not None else None))
    quiet = opts["output"] == "json"
    with RichReporter(err_console, quiet=quiet, verbose=verbose > 0) as reporter:
        run = run_local(spec, launch, render_template=render_template, reporter=reporter)
    print_run_summary(run.meta, run.records, run.run_dir, opts["output"],
                      f"run {run.meta.run_id}: {run.meta.ranks_per_node} rank(s) x "
                      f"{run.meta.threads_per_rank} thread(s), {run.meta.model}")


def _new_local_spec(inventory: str | None, opts: dict[str, Any], slos: dict[str, Any] | None) -> RunSpec:
    """A new local run's spec: the flags over the inventory's settings over the defaults."""
    from ..bench.local import NODE_NAME

    settings = _local_defaults()
    if inventory:
        settings.update(_from_inventory(inventory))
    for key in ("model", "ranks", "threads", "batch_sizes", "input_tokens", "output_tokens", "warmup",
                "repeats", "seed", "compile_mode", "probe_mib", "scenarios", "label", "percentile"):
        if opts.get(key) is not None:
            settings[key] = opts[key]
    if slos:
        settings["slos"] = slos
    _check_model(settings["model"])
    matrix = Matrix(tuple(settings["batch_sizes"]), tuple(settings["input_tokens"]),
                    settings["output_tokens"], settings["warmup"], settings["repeats"])
    _refuse_what_does_not_fit(settings["model"], settings["ranks"], matrix)
    serve = server = None
    if opts["serve"]:
        serve = serve_spec(opts, inventory=settings.get("serve"), previous=None,
                           input_tokens=settings["input_tokens"], output_tokens=settings["output_tokens"],
                           repeats=settings["repeats"], seed=settings["seed"],
                           attainment=settings.get("attainment"))
        matrix = serve_matrix(serve)
        server = server_spec(opts, inventory=settings.get("serve"), previous=None)
    spec = RunSpec.from_cli({
        "run_id": opts["run_id"] or new_run_id(NODE_NAME, 1), "mode": "local", "model": settings["model"],
        "matrix": matrix, "compile_mode": settings["compile_mode"], "scenarios": settings["scenarios"],
        "seed": settings["seed"], "ranks": settings["ranks"], "threads": settings["threads"],
        "nodes": (NODE_NAME,), "label": settings["label"], "slos": settings.get("slos") or {},
        "percentile": settings["percentile"],
        "probe": ProbeSpec(enabled=not opts["no_probe"], mib=settings["probe_mib"]),
        "serve": serve, "server": server, "timeout_s": opts["timeout"], "numactl": not opts["no_numactl"],
        "command": ["vcfslm", *sys.argv[1:]]})
    if server is not None and not server.in_process and spec.model.startswith("synthetic:"):
        spec = spec.replaced(model=_checkpoint_for(spec.model, settings["seed"], err_console))
    return spec


def _resumed_local_spec(run_dir: Path, opts: dict[str, Any], given: set[str]) -> RunSpec:
    """The spec the run recorded in its meta.json, whole (whatever the inventory says now),
    with the flags a resume may still give over it (a longer matrix, more repeats, ...)."""
    from ..results import read_meta

    if not (run_dir / "meta.json").exists():
        raise UsageError(f"--resume: no run at {run_dir} (expected {run_dir}/meta.json)")
    meta = read_meta(run_dir)
    if meta.mode != "local":
        raise UsageError(f"--resume: {run_dir} is a {meta.mode} run; resume it without --local")
    spec = RunSpec.of_meta(meta, str(run_dir / "meta.json"))
    changes: dict[str, Any] = {"run_id": run_dir.name, "command": ["vcfslm", *sys.argv[1:]]}
    for key in ("model", "ranks", "threads", "seed", "compile_mode", "scenarios", "label"):
        if opts.get(key) is not None:
            changes[key] = opts[key]
    if opts.get("probe_mib") is not None or "no_probe" in given:
        changes["probe"] = ProbeSpec(enabled=not opts["no_probe"], mib=opts.get("probe_mib") or spec.probe.mib)
    if opts.get("timeout") is not None:
        changes["timeout_s"] = opts["timeout"]
    if "no_numactl" in given:
        changes["numactl"] = not opts["no_numactl"]
    m = spec.matrix
    if spec.serve is None:
        changes["matrix"] = Matrix(tuple(opts.get("batch_sizes") or m.batch_sizes),
                                   tuple(opts.get("input_tokens") or m.input_tokens),
                                   opts.get("output_tokens") or m.output_tokens,
                                   m.warmup if opts.get("warmup") is None else opts["warmup"],
                                   opts.get("repeats") or m.repeats)
    spec = spec.replaced(**changes)
    _check_model(spec.model)
    _refuse_what_does_not_fit(spec.model, spec.ranks, spec.matrix)
    return spec


def _check_model(model: str) -> None:
    """The model source parses, and a synthetic family is built and runnable, before anything starts."""
    from ..engine.model import ModelSourceError, parse_model_spec, synthetic_config

    try:
        spec = parse_model_spec(model)
        if spec.kind == "synthetic":
            synthetic_config(spec)
    except ModelSourceError as exc:
        raise UsageError([Problem("", None, None, "--model", str(exc))]) from None


def _refuse_what_does_not_fit(model: str, ranks: int, matrix: Matrix) -> None:
    """A local run whose replicas cannot fit this machine's NUMA nodes is refused before a
    rank starts (building a 15 GB replica only to be killed by the OOM killer helps no one)."""
    from .. import footprint
    from ..lab.generate import machine_shape

    shape = footprint.shape_of(model)
    machine = machine_shape()
    if shape is None or not machine.memory_gib:
        return
    per_node = -(-ranks // machine.numa_nodes)
    batch, context = max(matrix.batch_sizes), max(matrix.input_tokens) + matrix.output_tokens
    node_bytes = machine.memory_gib * 1024**3 / machine.numa_nodes
    short = footprint.node_shortfall(shape, per_node, batch, context, node_bytes)
    if short is not None:
        raise UsageError([Problem("", None, None, "--model",
                                  f"{model} does not fit this machine: {per_node} replica(s) per NUMA node x "
                                  f"({footprint.replica_breakdown(shape, batch, context)}) = "
                                  f"{short / 1024**3:.1f} GiB, and a NUMA node has {node_bytes / 1024**3:.1f} GiB "
                                  f"(fewer --ranks, smaller --batch-sizes or --input-tokens, or fewer layers)")])


def _local_defaults() -> dict[str, Any]:
    return {"model": "synthetic:tiny", "ranks": 1, "threads": None, "batch_sizes": [1, 4, 8, 16],
            "input_tokens": [128, 512, 1024], "output_tokens": 128, "warmup": 1, "repeats": 3,
            "seed": 0, "compile_mode": "compile", "probe_mib": 1024, "scenarios": None, "label": None,
            "percentile": "p90"}


def _from_inventory(path: str) -> dict[str, Any]:
    from ..inventory_load import serve_settings
    from .common import load

    inv = load(path)
    b = inv.bench
    return {"model": inv.guest.model, "ranks": b.ranks_per_node, "batch_sizes": list(b.batch_sizes),
            "input_tokens": list(b.input_tokens), "output_tokens": b.output_tokens, "warmup": b.warmup,
            "repeats": b.repeats, "compile_mode": b.compile, "serve": serve_settings(inv),
            "slos": {k: v.model_dump(exclude_none=True) for k, v in inv.slos.items()},
            "percentile": inv.slo.percentile, "attainment": inv.slo.attainment}


def _checkpoint_for(source: str, seed: int, console_) -> str:
    """A synthetic model as the checkpoint folder a server loads: written once per source and
    seed into vcfslm's cache, then reused."""
    import os
    import re

    from ..engine.checkpoint import write_checkpoint

    cache = Path(os.environ.get("VCFSLM_MODEL_CACHE") or "~/.cache/vcfslm/models").expanduser()
    folder = cache / f"{re.sub(r'[^A-Za-z0-9.=-]+', '-', source)}-seed{seed}"
    if not (folder / "config.json").exists():
        console_.print(f"writing {source} (seed {seed}) as a checkpoint for the server: {folder}")
        partial_folder = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial_folder, ignore_errors=True)
        write_checkpoint(source, partial_folder, seed=seed)
        partial_folder.rename(folder)
    return str(folder)


def _server_python(given: str | None, server) -> str | None:
    """The local server's interpreter: --server-python, $VCFSLM_<NAME>_PYTHON, else
    .venv-<name>/bin/python here or beside the project (what `make <name>` installs)."""
    import os

    if server is None or server.in_process:
        return None
    if given:
        return given
    named = os.environ.get(f"VCFSLM_{server.name.upper()}_PYTHON")
    if named:
        return named
    project = Path(__file__).resolve().parents[2]
    for root in (Path.cwd(), project):
        candidate = root / f".venv-{server.name}" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


@click.command("probe")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Threads per probe (default: the CPUs of each NUMA node).")
@click.option("--mib", type=click.IntRange(min=16), default=1024, show_default=True, help="Read buffer in MiB.")
@click.option("--no-numactl", is_flag=True, help="One probe over the whole machine, unpinned.")
@output_option
def probe(threads: int | None, mib: int, no_numactl: bool, output: str) -> None:
    """Memory bandwidth, bf16 GEMM rate and decode-batch linear rates per NUMA node, as ranks see them.

    \b
    Each probe runs in its own process pinned with numactl to one node (CPUs and
    memory), with that node's CPU count as threads unless --threads is given. The
    decode floor of a model is bytes read per step / read bandwidth (or its FLOPs at
    the GEMM rate, when longer); the prefill floor is prompt FLOPs / GEMM rate. The
    decode-batch curve (the engine's linear kernel at 1..64 rows over streamed weights) is
    the knee `vcfslm predict` models decode with; its JSON is a --platform for predict.
    Each node's probe also says whether the machine was quiet while it ran (`steadiness`:
    steady, or busy with the reasons: a figure whose passes scattered, other processes'
    share of its CPUs); a busy probe reads low, so probe again on a quiet machine.
    Example: vcfslm probe --mib 2048
             vcfslm probe -o json > this-host.json
    """
    from ..bench.placement import node_cpu_lists

    nodes = node_cpu_lists()
    numactl = None if no_numactl else shutil.which("numactl")
    plans = [(node, cpus) for node, cpus in nodes.items()] if numactl else [(None, None)]
    rows = []
    for node, cpus in plans:
        n_threads = threads or (len(cpus) if cpus else None)
        cmd = [sys.executable, "-m", "vcfslm.bench.probe", "--mib", str(mib)]
        if n_threads:
            cmd += ["--threads", str(n_threads)]
        if numactl and node is not None:
            cmd = [numactl, f"--cpunodebind={node}", f"--membind={node}", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"probe failed (exit {done.returncode}): {' '.join(cmd)}\n"
                             + "\n".join(f"  | {line}" for line in done.stderr.strip().splitlines()[-10:]))
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["numa_node"] = node
        rows.append(result)
    verdicts = [(_where(r), recorded(r)) for r in rows]
    busy = [where for where, verdict in verdicts if verdict is not None and verdict.busy]
    if output == "json":
        print_json(rows)   # each node's `steadiness` says it too
        if busy:
            err_console.print(f"warning: {_busy_text(busy)}", markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title="memory bandwidth (GB/s = 1e9 bytes/s, best of 5) and bf16 GEMM rate")
    for col in ("NUMA node", "CPUs", "threads", "read GB/s", "read kernel", "triad GB/s", "buffer MiB",
                "GEMM TFLOP/s", "GEMM kernel", "decode linears GB/s by rows", "machine"):
        table.add_column(col, justify="right")
    for r, (_, verdict) in zip(rows, verdicts, strict=True):
        gemm = r.get("gemm") or {}
        curve = r.get("decode_linears") or {}
        knee = " ".join(f"{n}:{g:.0f}" for n, g in zip(curve.get("rows", ()), curve.get("gbs", ()), strict=False))
        table.add_row("all" if r["numa_node"] is None else str(r["numa_node"]), r.get("cpu_affinity", "?"),
                      str(r["threads"]), f"{r['read_gbs']:.1f}", str(r.get("read_kernel", "?")),
                      f"{r['triad_gbs']:.1f}", str(r["buffer_bytes"] // (1024 * 1024)),
                      f"{gemm['tflops']:.3f}" if gemm else "-", str(gemm.get("kernel", "-")), knee or "-",
                      "-" if verdict is None else verdict.verdict)
    console.print(table)
    for where, verdict in verdicts:
        if verdict is not None:
            click.echo(f"{where}: {verdict.summary}")
    if busy:
        click.echo(f"warning: {_busy_text(busy)}")
    click.echo("Save `vcfslm probe -o json > host.json` on a target machine for `vcfslm predict --platform host.json`.")


def _where(row: dict) -> str:
    """What one probe row measured: `NUMA node N`, or `the whole machine` (--no-numactl)."""
    return "the whole machine" if row.get("numa_node") is None else f"NUMA node {row['numa_node']}"


def _busy_text(where: list[str]) -> str:
    return (f"the probe of {', '.join(where)} was taken on a busy machine: its figures are likely low; "
            "rerun `vcfslm probe` on a quiet machine before scaling SLOs or predicting from them")


COMMANDS = [bench, probe]
