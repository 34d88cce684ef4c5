"""The first guest stage on fresh roots against the same stage on the converged guests.

A fresh guest (vcfslm/lab/fresh.py: a Debian minbase root in network namespaces of its
own, offline) gets every shipped playbook from the operator: the venv, torch and
vcfslm[bench] from the wheelhouse, the project's wheel, the launch scripts, verification.
The converged run is the same stage right after, on the same guests: facts only. Both are
measured in this run, side by side, on the same machine; the ratio is fresh / converged.

Also prints what setting the guests up cost (root tarball and wheelhouse: cached after the
first run on a machine), and the fresh run's slowest steps. Needs root.

    sudo .venv/bin/python benchmarks/fresh_guests.py [--guests 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vcfslm.cli.guest_stage import ssh_connector  # noqa: E402
from vcfslm.guest.provision import GuestRun, provision_guests  # noqa: E402
from vcfslm.guest.wheel import ProjectWheel  # noqa: E402
from vcfslm.inventory_load import load_inventory  # noqa: E402
from vcfslm.lab import fresh, freshroot, generate, guests, vcsim, wheelhouse  # noqa: E402


def stage(inventory, wheel: ProjectWheel, log_dir: Path):
    """One guest stage over every node; (seconds, summary). Fails loudly when a host fails."""
    started = time.monotonic()
    summary = provision_guests(inventory, ssh_connector(inventory, None),
                               options=GuestRun(run_dir=log_dir, wheel=wheel))
    took = time.monotonic() - started
    if not summary.ok:
        raise SystemExit("guest stage failed: " + "; ".join(f"{h.host}: {h.error}"
                                                            for h in summary.failed_hosts))
    return took, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guests", type=int, default=2, help="fresh guests prepared at once")
    parser.add_argument("--repeats", type=int, default=3, help="converged runs (median)")
    args = parser.parse_args()
    reason = freshroot.unavailable_reason(
        need_debootstrap=not fresh.root_tarball(vcsim.cache_root(), fresh.root_key()).exists())
    if reason:
        raise SystemExit(reason)

    work = Path(tempfile.mkdtemp(prefix="vcfslm-fresh-bench-"))
    plan = fresh.lab_plan(work, args.guests, fresh.pick_net(
        fresh.used_nets(freshroot.operator_addresses())))
    started: list[guests.Guest] = []
    try:
        t0 = time.monotonic()
        cached_root = fresh.root_tarball(vcsim.cache_root(), fresh.root_key()).exists()
        tarball = freshroot.ensure_root_tarball(vcsim.cache_root())
        t_root = time.monotonic() - t0
        t0 = time.monotonic()
        house = wheelhouse.ensure(vcsim.cache_root(), generate.LAB_TORCH,
                                  constraints=ROOT / "constraints.txt")
        t_wheels = time.monotonic() - t0
        t0 = time.monotonic()
        freshroot.ensure_copies_mount(plan)
        freshroot.unpack_lower(tarball, Path(plan.lower))
        freshroot.ensure_bench_switch(plan)
        client = guests.ensure_client_keys(work / "ssh")
        started = [freshroot.start_guest(plan, g, client) for g in plan.guests]
        guests.write_known_hosts(client.known_hosts, started)
        t_guests = time.monotonic() - t0

        doc = generate.fresh_guest_document(
            generate.guests_inventory(started, fresh.GUEST_WORKDIR), wheelhouse=str(house),
            workdir=fresh.GUEST_WORKDIR, management_mtu=fresh.MANAGEMENT_MTU,
            bench_mtu=fresh.BENCH_MTU, bench_netmask=fresh.BENCH_NETMASK)
        path = work / "inventory.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        inventory = load_inventory(path)
        wheel = ProjectWheel()
        wheel.get()  # built before the clock starts: both runs push the same wheel

        t_fresh, summary = stage(inventory, wheel, work / "logs" / "fresh")
        converged = []
        for i in range(args.repeats):
            took, again = stage(inventory, wheel, work / "logs" / f"converged-{i}")
            changed = sum(h.changed for h in again.hosts)
            if changed:
                raise SystemExit(f"converged run {i + 1} changed {changed} step(s)")
            converged.append(took)
        t_conv = statistics.median(converged)

        print(f"fresh guests: {args.guests}, playbooks: every shipped one, "
              f"{len(list(house.iterdir()))} wheels in the wheelhouse")
        print(f"setup: root tarball {t_root:.1f} s ({'cached' if cached_root else 'built'}), "
              f"wheelhouse {t_wheels:.1f} s, guests up {t_guests:.1f} s")
        steps: dict[str, list[float]] = {}
        for host in summary.hosts:
            for s in host.steps:
                steps.setdefault(f"{s.playbook}: {s.name}", []).append(s.duration)
        slowest = sorted(steps.items(), key=lambda kv: -max(kv[1]))[:5]
        print("fresh run, slowest steps (max over guests): "
              + ", ".join(f"{name} {max(times):.1f} s" for name, times in slowest))
        print(f"first guest stage, fresh root:     {t_fresh:7.2f} s")
        print(f"same stage, converged (median of {args.repeats}): {t_conv:7.2f} s  "
              f"(runs: {', '.join(f'{t:.2f}' for t in converged)})")
        print(f"ratio fresh / converged: {t_fresh / t_conv:.1f}x")
    finally:
        freshroot.stop_guests(plan, recorded=[g.process for g in started])
        shutil.rmtree(work)   # keys and logs; nothing is mounted below it any more


if __name__ == "__main__":
    main()
