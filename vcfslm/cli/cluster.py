"""The cluster mode of `vcfslm bench` (`--nodes N`, `--hosts a,b`, `--resume RUN`).

Builds the real drivers (SSH transports, the guest preflight) and renders progress;
the work itself is `vcfslm.bench.cluster.ClusterBench`. The inventory is read here only:
the bench gets the run's spec and one `NodeTarget` per node (`contract.targets_of`).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from pathlib import Path
from typing import Any

from ..bench.cluster import ClusterBench, ClusterOptions, GuestReport, plan_launches
from ..contract import NodeTarget, targets_of
from ..errors import Problem, UsageError
from ..guest.provision import guest_check
from ..inventory import SERVER_NEEDS_FOLDER
from ..runspec import RunSpec
from ..vsphere.credentials import resolve_password
from .bench_spec import Resumed, resolve
from .bench_summary import print_run_summary
from .common import RichReporter, console, err_console, load, print_json, to_jsonable
from .guest_stage import bench_connector


def run_cluster(flags: dict[str, Any], opts: dict[str, Any], resumed: Resumed | None = None,
                verbose: int = 0) -> None:
    """Resolve the run's spec (a resumed run's own, the flags over it; else the flags over the
    inventory's bench settings), then preflight, launch, watch and collect the cluster run.

    flags: the bench command's flags given; opts: all of its options (--runs-dir, --dry-run, -o)."""
    inv = load(opts["inventory"])
    spec = resolve(flags, inv, resumed, "cluster", command=["vcfslm", *sys.argv[1:]])
    runs_root = Path(opts["runs_dir"])
    if resumed is not None:
        runs_root = resumed.run_dir.parent
        if spec.timeout_s is None:            # a run recorded before runs kept their timeout
            spec = spec.replaced(timeout_s=inv.bench.timeout_s)
    _refuse_a_server_without_a_folder(inv, spec.server if spec.serve is not None else None)
    # Every node the run has is in the inventory (InventoryError names the flag if not).
    targets = targets_of(inv, spec.nodes, spec.ranks, spec.threads)
    drive = ClusterOptions(runs_root=runs_root, resume=resumed is not None,
                           inventory_sha256=inventory_sha256(inv.source))
    if opts["dry_run"]:
        launches = plan_launches(targets, spec, drive)
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


def _refuse_a_server_without_a_folder(inv, server) -> None:
    """An HTTP server loads a model folder: a synthetic guest.model cannot be served."""
    if server is None or server.in_process:
        return
    if inv.guest.model.startswith("synthetic:"):
        raise UsageError([Problem(inv.source, None, None, "guest.model",
                                  SERVER_NEEDS_FOLDER.format(server=server.name, model=inv.guest.model))])


def _run(inv, targets: tuple[NodeTarget, ...], spec: RunSpec, drive, reporter, log_dir: Path,
         trust_new_hosts: bool):
    """Preflight, launch, watch and collect; (meta, records, the local run folder).

    The bench gets the targets, and drivers bound to the inventory here, never the
    inventory itself."""
    open_node = bench_connector(inv, reporter, log_dir, trust_new_hosts)

    def connect(target: NodeTarget):
        return open_node(inv.node(target.name))

    def inspect(target: NodeTarget, transport):
        return inspect_guest(inv, transport)

    bench = ClusterBench(targets, connect, spec, drive, reporter=reporter, inspect_guest=inspect,
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
    facts, problems = guest_check(inv, transport)
    return GuestReport(problems, to_jsonable(facts))


def _observed_vms(inv, names: list[str]) -> dict:
    """The VMs' configuration as vCenter reports it, when vCenter can be reached without a prompt."""
    try:
        # pyVmomi costs about 0.3 s of CPU to import: only a cluster run's vCenter facts need it.
        from ..vsphere.driver import PyVmomiVCenter
        from ..vsphere.session import SessionOptions

        with PyVmomiVCenter(inv.vcenter, resolve_password(inv.vcenter, prompt=None),
                            options=SessionOptions(retries=0)) as vc:
            snapshot = vc.observe(inv)
        return {"api_version": snapshot.api_version,
                "vms": {n: to_jsonable(snapshot.vms[n]) for n in names if n in snapshot.vms}}
    except Exception as exc:  # noqa: BLE001 - best effort: the run does not need vCenter
        return {"unreachable": str(exc).splitlines()[0][:300]}
