"""The cluster mode of `vcfslm bench` (`--nodes N`, `--hosts a,b`, `--resume RUN`).

Builds the real drivers (SSH transports, the guest preflight) and renders progress;
the work itself is `vcfslm.bench.cluster.ClusterBench`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..contract import new_run_id, select_nodes
from ..errors import UsageError
from .bench_summary import print_run_summary
from .common import RichReporter, console, err_console, load, print_json, to_jsonable
from .guest_stage import bench_connector


def run_cluster(*, inventory: str | None, nodes: int | None, hosts: str | None, resume: str | None,
                run_id: str | None, label: str | None, scenarios: str | None, repeats: int | None,
                output_tokens: int | None, timeout: float | None, dry_run: bool, runs_dir: str,
                compile_mode: str | None,
                trust_new_hosts: bool, output: str, verbose: int = 0, probe_mib: int | None = None,
                serve: dict | None = None, slos: dict | None = None, percentile: str | None = None) -> None:
    """Select nodes, then preflight, launch, watch and collect the cluster run.

    probe_mib: the workers' bandwidth probe buffer (None: their default; 0: no probes).
    serve: the --serve flags (serving mode), resolved against the inventory's bench.serve.
    slos: --slo, instead of the inventory's SLOs.
    percentile: --percentile, the static rule recorded (else the inventory's slo.percentile).
    """
    from ..bench import cluster as C

    inv = load(inventory)
    runs_root = Path(runs_dir)
    names = [h for h in (hosts or "").split(",") if h.strip()] or None
    previous_serve = previous_server = None
    if resume:
        run_path = Path(resume) if Path(resume).is_dir() else runs_root / resume
        if not (run_path / "meta.json").exists():
            raise UsageError(f"--resume: no run at {run_path} (expected {run_path}/meta.json)")
        previous = C.resume_options(run_path)
        run_id, runs_root = run_path.name, run_path.parent
        names, nodes = previous["nodes"], None
        repeats = repeats or previous["repeats"]
        output_tokens = output_tokens or previous["output_tokens"]
        scenarios = scenarios or previous["scenarios"]
        label = label or previous["label"]
        compile_mode = compile_mode or previous["compile"]
        previous_serve = previous["serve"]
        previous_server = previous["server"]
        percentile = previous["percentile"]
    spec = server = None
    if serve is not None or previous_serve is not None:
        from .bench_serve import serve_spec, server_spec

        spec = serve_spec(serve or {}, inventory=inv.bench.serve.model_dump(), previous=previous_serve,
                          input_tokens=inv.bench.input_tokens,
                          output_tokens=output_tokens or inv.bench.output_tokens,
                          repeats=repeats or inv.bench.repeats, attainment=inv.slo.attainment)
        server = server_spec(serve or {}, inventory=inv.bench.serve.model_dump(), previous=previous_server)
        if not server.in_process and inv.guest.model.startswith("synthetic:"):
            from ..errors import Problem
            from ..inventory import SERVER_NEEDS_FOLDER

            raise UsageError([Problem(inv.source, None, None, "guest.model",
                                      SERVER_NEEDS_FOLDER.format(server=server.name, model=inv.guest.model))])
    selected = select_nodes(inv, nodes, names)
    opts = C.ClusterOptions(run_id=run_id or new_run_id(inv.name, len(selected)), runs_root=runs_root,
                            label=label, resume=bool(resume), scenarios=scenarios, repeats=repeats,
                            output_tokens=output_tokens, timeout_s=timeout, compile_mode=compile_mode,
                            probe_mib=probe_mib, command=["vcfslm", *sys.argv[1:]], serve=spec,
                            slos=slos, percentile=percentile, server=server)
    if dry_run:
        launches = C.plan_launches(inv, selected, opts)
        if output == "json":
            print_json([{"node": la.name, "address": la.address, "run_dir": la.run_dir,
                         "torchrun": list(la.torchrun_argv), "command": la.launch_command}
                        for la in launches])
            return
        for la in launches:
            console.print(f"[bold]{la.name}[/bold] ({la.address}), ranks {la.global_ranks[0]}-{la.global_ranks[-1]}:")
            console.print("  " + shlex.join(la.torchrun_argv), soft_wrap=True)
        return

    log_dir = runs_root / opts.run_id / "logs" / "ssh"
    with RichReporter(err_console, verbose=verbose > 0) as reporter:
        meta, records, local_dir = _run(inv, selected, opts, reporter, log_dir, trust_new_hosts)
    print_run_summary(meta, records, local_dir, output,
                      f"run {meta.run_id} ({len(meta.nodes)} node(s), {meta.ranks_per_node} ranks each)")


def _run(inv, selected, opts, reporter, log_dir, trust_new_hosts):
    """Preflight, launch, watch and collect; (meta, records, the local run folder)."""
    from ..bench import cluster as C

    connect = bench_connector(inv, reporter, log_dir, trust_new_hosts)
    bench = C.ClusterBench(inv, selected, connect, opts, reporter=reporter, inspect_guest=inspect_guest,
                           vcenter_facts=_observed_vms)
    reporter.log(f"run {opts.run_id}: {len(selected)} node(s) x {inv.bench.ranks_per_node} rank(s), "
                 f"rendezvous {selected[0].bench_ip}:{inv.bench.port} "
                 f"(timeout {bench.rendezvous_timeout_s} s)")
    meta, records = bench.run()
    return meta, records, bench.local_dir


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

        with PyVmomiVCenter(inv.vcenter, resolve_password(inv.vcenter, prompt=None), retries=0) as vc:
            snapshot = vc.observe(inv)
        return {"api_version": snapshot.api_version,
                "vms": {n: to_jsonable(snapshot.vms[n]) for n in names if n in snapshot.vms}}
    except Exception as exc:  # noqa: BLE001 - best effort: the run does not need vCenter
        return {"unreachable": str(exc).splitlines()[0][:300]}
