"""The cluster mode of `vcfslm bench` (`--nodes N`, `--hosts a,b`, `--resume RUN`).

Builds the real drivers (SSH transports, the guest preflight) and renders progress;
the work itself is `vcfslm.bench.cluster.ClusterBench`. The inventory is read here only:
the bench gets the run's spec and one `NodeTarget` per node (`contract.targets_of`).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import Problem, UsageError
from ..matrix import Matrix, serve_matrix
from ..node_selection import NodeTarget, select_nodes, targets_of
from ..run_meta import new_run_id
from ..runspec import ProbeSpec, RunSpec
from .bench_summary import print_run_summary
from .common import RichReporter, console, err_console, load, print_json, to_jsonable
from .guest_stage import bench_connector


def run_cluster(inventory: str | None, opts: dict[str, Any], slos: dict | None = None, verbose: int = 0) -> None:
    """Build the run's spec (a resumed run's own, the flags over it), then preflight, launch,
    watch and collect the cluster run.

    opts: the bench command's flags (--nodes/--hosts select, --probe-mib/--no-probe the
    workers' probes, --serve and its flags serving mode, resolved against the inventory's
    bench.serve). slos: --slo, instead of the inventory's SLOs.
    """
    from ..bench import cluster as C

    inv = load(inventory)
    runs_root = Path(opts["runs_dir"])
    if opts["resume"]:
        run_path = Path(opts["resume"]) if Path(opts["resume"]).is_dir() else runs_root / opts["resume"]
        spec = resumed_spec(run_path, opts)
        runs_root = run_path.parent
        if spec.timeout_s is None:            # a run recorded before runs kept their timeout
            spec = spec.replaced(timeout_s=inv.bench.timeout_s)
    else:
        spec = cluster_spec(inv, opts, slos)
    _refuse_a_server_without_a_folder(inv, spec.server if spec.serve is not None else None)
    # Every node the run has is in the inventory (InventoryError names the flag if not).
    targets = targets_of(inv, spec.nodes, spec.ranks, spec.threads)
    drive = C.ClusterOptions(runs_root=runs_root, resume=bool(opts["resume"]),
                             inventory_sha256=inventory_sha256(inv.source))
    if opts["dry_run"]:
        launches = C.plan_launches(targets, spec, drive)
        if opts["output"] == "json":
            print_json([{"node": la.name, "address": la.address, "run_dir": la.run_dir,
                         "torchrun": list(la.torchrun_argv), "command": la.launch_command,
                         "spec": la.spec.model_dump(mode="json") if la.spec else None}
                        for la in launches])
            return
        for la in launches:
            console.print(f"[bold]{la.name}[/bold] ({la.address}), ranks {la.global_ranks[0]}-{la.global_ranks[-1]}:")
            console.print("  " + shlex.join(la.torchrun_argv), soft_wrap=True)
        return

    log_dir = runs_root / spec.run_id / "logs" / "ssh"
    with RichReporter(err_console, verbose=verbose > 0) as reporter:
        meta, records, local_dir = _run(inv, targets, spec, drive, reporter, log_dir, opts["trust_new_hosts"])
    print_run_summary(meta, records, local_dir, opts["output"],
                      f"run {meta.run_id} ({len(meta.nodes)} node(s), {meta.ranks_per_node} ranks each)")


def cluster_spec(inv, opts: dict[str, Any], slos: dict | None = None) -> RunSpec:
    """A new cluster run's spec: the flags over the inventory's bench settings."""
    serve = server = None
    if opts.get("serve"):
        from ..inventory_load import serve_settings
        from .bench_serve import serve_spec, server_spec

        serve = serve_spec(opts, inventory=serve_settings(inv), previous=None,
                           input_tokens=inv.bench.input_tokens,
                           output_tokens=opts.get("output_tokens") or inv.bench.output_tokens,
                           repeats=opts.get("repeats") or inv.bench.repeats, attainment=inv.slo.attainment)
        server = server_spec(opts, inventory=inv.bench.serve.model_dump(), previous=None)
        _refuse_a_server_without_a_folder(inv, server)
    names = [h for h in (opts.get("hosts") or "").split(",") if h.strip()] or None
    selected = select_nodes(inv, opts.get("nodes"), names)
    matrix = serve_matrix(serve) if serve is not None else Matrix.of_inventory(
        inv.bench, output_tokens=opts.get("output_tokens"), repeats=opts.get("repeats"))
    changes: dict[str, Any] = {"matrix": matrix, "serve": serve, "server": server, "scenarios": opts.get("scenarios"),
                               "label": opts.get("label"), "probe": ProbeSpec.of_flags(_probe_mib(opts)),
                               "command": ["vcfslm", *sys.argv[1:]]}
    for field, flag in (("compile_mode", "compile_mode"), ("percentile", "percentile"), ("timeout_s", "timeout")):
        if opts.get(flag) is not None:
            changes[field] = opts[flag]
    if slos:
        changes["slos"] = slos
    run_id = opts.get("run_id") or new_run_id(inv.name, len(selected))
    return RunSpec.of_inventory(inv, [n.name for n in selected], run_id, **changes)


def resumed_spec(run_path: Path, opts: dict[str, Any]) -> RunSpec:
    """The spec a cluster run recorded, with the flags a resume may still give over it
    (--repeats, --output-tokens, --scenarios, --label, --compile, --timeout, the probes)."""
    from ..results import read_meta

    if not (run_path / "meta.json").exists():
        raise UsageError(f"--resume: no run at {run_path} (expected {run_path}/meta.json)")
    spec = RunSpec.of_meta(read_meta(run_path), str(run_path / "meta.json"))
    changes: dict[str, Any] = {"run_id": run_path.name, "command": ["vcfslm", *sys.argv[1:]]}
    if spec.serve is None and (opts.get("repeats") or opts.get("output_tokens")):
        changes["matrix"] = replace(spec.matrix, repeats=opts.get("repeats") or spec.matrix.repeats,
                                    output_tokens=opts.get("output_tokens") or spec.matrix.output_tokens)
    for field, flag in (("scenarios", "scenarios"), ("label", "label"), ("compile_mode", "compile_mode"),
                        ("timeout_s", "timeout")):
        if opts.get(flag):
            changes[field] = opts[flag]
    if _probe_mib(opts) is not None:
        changes["probe"] = ProbeSpec.of_flags(_probe_mib(opts))
    return spec.replaced(**changes)


def _probe_mib(opts: dict[str, Any]) -> int | None:
    return 0 if opts.get("no_probe") else opts.get("probe_mib")


def _refuse_a_server_without_a_folder(inv, server) -> None:
    """An HTTP server loads a model folder: a synthetic guest.model cannot be served."""
    if server is None or server.in_process:
        return
    if inv.guest.model.startswith("synthetic:"):
        from ..inventory_load import SERVER_NEEDS_FOLDER

        raise UsageError([Problem(inv.source, None, None, "guest.model",
                                  SERVER_NEEDS_FOLDER.format(server=server.name, model=inv.guest.model))])


def _run(inv, targets: tuple[NodeTarget, ...], spec: RunSpec, drive, reporter, log_dir: Path,
         trust_new_hosts: bool):
    """Preflight, launch, watch and collect; (meta, records, the local run folder).

    The bench gets the targets, and drivers bound to the inventory here, never the
    inventory itself."""
    from ..bench import cluster as C

    open_node = bench_connector(inv, reporter, log_dir, trust_new_hosts)

    def connect(target: NodeTarget):
        return open_node(inv.node(target.name))

    def inspect(target: NodeTarget, transport):
        return inspect_guest(inv, transport)

    bench = C.ClusterBench(targets, connect, spec, drive, reporter=reporter, inspect_guest=inspect,
                           vcenter_facts=lambda names: _observed_vms(inv, names))
    reporter.log(f"run {spec.run_id}: {len(bench.nodes)} node(s) x {spec.ranks} rank(s), "
                 f"rendezvous {bench.nodes[0].bench_ip}:{bench.nodes[0].rdzv_port} "
                 f"(timeout {bench.rendezvous_timeout_s} s)")
    meta, records = bench.run()
    return meta, records, bench.local_dir


def inventory_sha256(path: str) -> str | None:
    """The inventory file's sha256 (meta.json's `inventory_sha256`), None if unreadable."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def inspect_guest(inv, transport):
    """The guest's NUMA topology, interfaces and versions, read once: checked for the
    preflight, kept for meta.json."""
    from ..bench.cluster import GuestReport
    from ..guest.provision import guest_check

    facts, problems = guest_check(inv, transport)
    return GuestReport(problems, to_jsonable(facts))


def _observed_vms(inv, names: list[str]) -> dict:
    """The VMs' configuration as vCenter reports it, when vCenter can be reached without a prompt."""
    try:
        from ..vsphere.credentials import resolve_password
        from ..vsphere.driver import PyVmomiVCenter
        from ..vsphere.session import SessionOptions

        with PyVmomiVCenter(inv.vcenter, resolve_password(inv.vcenter, prompt=None),
                            options=SessionOptions(retries=0)) as vc:
            snapshot = vc.observe(inv)
        return {"api_version": snapshot.api_version,
                "vms": {n: to_jsonable(snapshot.vms[n]) for n in names if n in snapshot.vms}}
    except Exception as exc:  # noqa: BLE001 - best effort: the run does not need vCenter
        return {"unreachable": str(exc).splitlines()[0][:300]}
