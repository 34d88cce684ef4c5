"""`vcfslm bench` and `vcfslm probe`.

`bench` takes the options bench_options declares, checks them for the run they make
(bench_spec), then runs it: `--local` here (vcfslm.bench.local.run_local), the cluster
(`--nodes N` / `--hosts a,b`, with an inventory) in cli/cluster.py, one endpoint
(`--serve --endpoint URL | --deployment INV`) in cli/bench_endpoint.py. `--resume RUN`
continues a run of any of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.table import Table

from .. import footprint
from ..bench.local import LocalLaunch, machine_node_cpus, run_local
from ..engine.checkpoint import write_checkpoint
from ..engine.model import TEST_CONFIGS, ModelSourceError, parse_model_spec, synthetic_config
from ..errors import BenchError, Problem, UsageError
from ..guest.templates import render_template
from ..lab import generate
from ..matrix import Matrix
from ..steadiness import recorded
from .bench_endpoint import run_endpoint_bench
from .bench_options import GroupedCommand, bench_options
from .bench_spec import Resumed, check_flags, check_resume_flags, resolve, run_mode
from .bench_summary import print_run_summary
from .cluster import run_cluster
from .common import RichReporter, console, err_console, load, output_option, print_json


@click.command("bench", cls=GroupedCommand)
@bench_options
@click.pass_context
def bench(ctx: click.Context, **opts: Any) -> None:
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
    flags = {name: value for name, value in opts.items()
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}
    verbose = (ctx.find_root().obj or {}).get("verbose", 0)
    resumed = None
    if opts["resume"]:
        check_resume_flags(flags)
        resumed = Resumed.read(opts["resume"], opts["runs_dir"])
    mode = run_mode(flags, resumed)
    kind = resumed.kind if resumed is not None else ("serve" if flags.get("serve") else "static")
    check_flags(flags, mode, kind, resumed)
    if mode == "endpoint":
        run_endpoint_bench(flags, opts, resumed, verbose)
    elif mode == "local":
        _bench_local(flags, opts, resumed, verbose)
    else:
        run_cluster(flags, opts, resumed, verbose)


def _bench_local(flags: dict[str, Any], opts: dict[str, Any], resumed: Resumed | None, verbose: int = 0) -> None:
    """Resolve the local run's spec, check it fits this machine, and run it."""
    inventory = load(opts["inventory"]) if opts["inventory"] and resumed is None else None
    spec = resolve(flags, inventory, resumed, "local", command=["vcfslm", *sys.argv[1:]])
    _check_model(spec.model)
    _refuse_what_does_not_fit(spec.model, spec.ranks, spec.matrix)
    server = spec.server if spec.serve is not None else None
    if resumed is None and server is not None and not server.in_process and spec.model.startswith("synthetic:"):
        spec = spec.replaced(model=_checkpoint_for(spec.model, spec.seed or 0, err_console))
    runs_dir = str(resumed.run_dir.parent) if resumed is not None else opts["runs_dir"]
    launch = LocalLaunch(runs_dir=runs_dir, resume=resumed is not None,
                         server_python=_server_python(opts["server_python"], server))
    quiet = opts["output"] == "json"
    with RichReporter(err_console, quiet=quiet, verbose=verbose > 0) as reporter:
        run = run_local(spec, launch, render_template=render_template, reporter=reporter)
    print_run_summary(run.meta, run.records, run.run_dir, opts["output"],
                      f"run {run.meta.run_id}: {run.meta.ranks_per_node} rank(s) x "
                      f"{run.meta.threads_per_rank} thread(s), {run.meta.model}")


def _check_model(model: str) -> None:
    """The model source parses, and a synthetic family is built and runnable, before anything starts."""
    try:
        spec = parse_model_spec(model)
        # The suite's built-in tiny models always build; checking one would import transformers
        # in this process for nothing (2 CPU-s of every `bench` that runs them).
        if spec.kind == "synthetic" and spec.name not in TEST_CONFIGS:
            synthetic_config(spec)
    except ModelSourceError as exc:
        raise UsageError([Problem("", None, None, "--model", str(exc))]) from None


def _refuse_what_does_not_fit(model: str, ranks: int, matrix: Matrix) -> None:
    """A local run whose replicas cannot fit this machine's NUMA nodes is refused before a
    rank starts (building a 15 GB replica only to be killed by the OOM killer helps no one)."""
    shape = footprint.shape_of(model)
    machine = generate.machine_shape()
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


def _checkpoint_for(source: str, seed: int, console_) -> str:
    """A synthetic model as the checkpoint folder a server loads: written once per source and
    seed into vcfslm's cache, then reused."""
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
    # Each node's CPUs this process may use: a probe in a lab guest of its own cores runs a
    # thread per CPU of its cpuset, not per CPU of the machine's node.
    nodes = machine_node_cpus()
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
