"""Fan-out of provision: 1 VM vs N VMs on a vcsim with ~1 s latency per vCenter call.

Every VM needs the same chain of slow calls (clone, migrate off the template's
host, reconfigure, customize, mark, power on), so if VMs are handled in
parallel, N VMs take about as long as one. Workers are resolved as `vcfslm provision` resolves them (--parallel,
else every VM up to node_selection.VCENTER_PARALLEL_CAP). Prints both wall times,
their ratio (target <= 1.5) and the parallelism used.

    .venv/bin/python benchmarks/provision_fanout.py [--vms 64] [--delay-ms 1000] [--parallel N]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vcfslm import node_selection  # noqa: E402
from vcfslm.inventory_load import load_inventory  # noqa: E402
from vcfslm.lab import vcsim  # noqa: E402
from vcfslm.vsphere import reconcile  # noqa: E402
from vcfslm.vsphere.credentials import Secret  # noqa: E402
from vcfslm.vsphere.driver import PyVmomiVCenter  # noqa: E402

SLOW_METHODS = ("CloneVM_Task", "ReconfigVM_Task", "CustomizeVM_Task", "PowerOnVM_Task",
                "PowerOffVM_Task", "RelocateVM_Task", "Destroy_Task")


def inventory(server: vcsim.Vcsim, name: str, count: int, workdir: Path, first: int = 0) -> Path:
    """The brief's VM shape on `count` simulated hosts from host `first` on (one VM per host)."""
    data = yaml.safe_load((ROOT / "inventories" / "vx650v4-4node.yaml").read_text())
    data["name"] = name
    data["vcenter"].update(host=server.host, port=server.port, user=server.user,
                           password_env="VCFSLM_BENCH_VC_PASSWORD", ca_bundle=server.ca_file)
    data["placement"].update(datacenter=vcsim.DATACENTER, cluster=vcsim.CLUSTER,
                             datastore=vcsim.DATASTORE, folder=f"bench/{name}",
                             template=server.template)
    data["placement"]["networks"]["management"]["portgroup"] = vcsim.MANAGEMENT_PORTGROUP
    data["placement"]["networks"]["bench"]["portgroup"] = vcsim.BENCH_PORTGROUP
    data["nodes"] = [{"name": f"{name}-{i:02d}", "host": vcsim.host_name(i),
                      "management_ip": f"192.168.10.{21 + i}", "bench_ip": f"172.16.25.{21 + i}",
                      "advanced": {"SET.guest.ipAddress": f"192.168.10.{21 + i}"}}
                     for i in range(first, first + count)]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def provision_time(path: Path, password: Secret, workers: int) -> tuple[float, float]:
    """Wall time and operator CPU time (s) of one full provision (connect, observe, apply)
    of a fresh inventory; the CPU time is this process's, where TLS handshakes and SOAP
    (de)serialization of every worker land."""
    inv = load_inventory(path)
    cpu = time.process_time()
    started = time.perf_counter()
    with PyVmomiVCenter(inv.vcenter, password, max_workers=workers) as vc:
        result = reconcile.provision(inv, vc)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu
    if result.failed:
        raise SystemExit(f"provision failed: {[(o.name, o.message) for o in result.failed]}")
    return elapsed, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=16)
    parser.add_argument("--delay-ms", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=None,
                        help="VMs at once, as provision --parallel (default: every VM up to "
                             f"the cap, {node_selection.VCENTER_PARALLEL_CAP})")
    args = parser.parse_args()
    if args.vms < 1 or args.delay_ms < 0 or (args.parallel is not None and args.parallel < 1):
        parser.error("--vms and --parallel must be at least 1, --delay-ms at least 0")
    workers = node_selection.parallelism(args.parallel, args.vms, node_selection.VCENTER_PARALLEL_CAP)
    password = secrets.token_urlsafe(12)
    with tempfile.TemporaryDirectory(prefix="vcfslm-fanout-") as tmp:
        workdir = Path(tmp)
        opts = vcsim.VcsimOptions(hosts=max(args.vms, 2),
                                  method_delay={m: args.delay_ms for m in SLOW_METHODS})
        server = vcsim.start(workdir / "vcsim", password, opts)
        try:
            secret = Secret(password)
            # Not on host 0: vcsim clones onto the template's host (0) and provision then
            # migrates the VM where it belongs, one more slow call that every VM but host 0's
            # pays. The lone VM pays it too, so both runs time the same chain of calls.
            (one, one_cpu) = provision_time(inventory(server, "fan-one", 1, workdir, first=1),
                                            secret, 1)
            (many, many_cpu) = provision_time(inventory(server, "fan-many", args.vms, workdir), secret, workers)
        finally:
            vcsim.stop(server)
    ratio = many / one
    how = (f"--parallel {args.parallel}" if args.parallel is not None
           else f"the default: every VM up to the cap of {node_selection.VCENTER_PARALLEL_CAP}")
    print(f"vcsim latency {args.delay_ms} ms on {', '.join(SLOW_METHODS)}")
    print(f"parallelism {workers} VMs at once ({how})")
    print(f"{'VMs':>4}  {'wall time (s)':>13}  {'operator CPU (s)':>16}")
    print(f"{1:>4}  {one:13.2f}  {one_cpu:16.2f}")
    print(f"{args.vms:>4}  {many:13.2f}  {many_cpu:16.2f}")
    print(f"ratio {args.vms} VMs / 1 VM = {ratio:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
