"""Fan-out of the guest stage: the same playbooks on 1 guest vs 8 guests (real sshd, loopback).

If hosts run in parallel, 8 guests take about as long as one. Two workloads:

  guest-bound   steps whose time is spent on the guest (`sleep`, standing in for package
                installs and downloads that each VM does on its own CPUs and network)
  shipped       every shipped playbook on converged guests (facts only: the re-run case);
                all "guests" share this machine's CPUs, so this one also measures how the
                machine copes with 8x the guest-side CPU work

Prints the wall times (median of --repeats) and the ratio (target <= 1.5).

    .venv/bin/python benchmarks/ssh_fanout.py [--guests 8] [--repeats 3] [--sleep 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vcfslm.cli.guest_stage import ssh_connector  # noqa: E402
from vcfslm.guest.playbook import DEFAULT_PLAYBOOKS  # noqa: E402
from vcfslm.guest.provision import provision_guests  # noqa: E402
from vcfslm.guest.wheel import ProjectWheel  # noqa: E402
from vcfslm.inventory import load_inventory  # noqa: E402
from vcfslm.lab import generate, guests  # noqa: E402
from vcfslm.lab.lab import seed_guest_venv  # noqa: E402

FIRST_INDEX = 80  # 127.0.0.91.. : away from the lab's and the tests' guests

GUEST_BOUND = """\
name: guest-bound
steps:
  - name: work on the guest
    command: {{cmd: "sleep {sleep}"}}
  - name: more work on the guest
    command: {{cmd: "sleep {sleep}"}}
  - name: facts
    verify: {{}}
"""


def write_inventory(started, workdir: Path, path: Path) -> Path:
    doc = generate.guests_inventory(started, str(workdir))
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def timed(inv, playbooks, wheel, logs: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        summary = provision_guests(inv, ssh_connector(inv, None), playbooks=playbooks, wheel=wheel, run_dir=logs)
        times.append(time.perf_counter() - started)
        if not summary.ok:
            raise SystemExit("run failed:\n" + "\n".join(f"{h.host}: {h.error}" for h in summary.failed_hosts))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=2.0, help="seconds per guest-bound step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vcfslm-fanout-") as tmp:
        base = Path(tmp)
        client = guests.ensure_client_keys(base / "ssh")
        started = []
        try:
            for i in range(args.guests):
                started.append(guests.start_guest(FIRST_INDEX + i, base / "guests", client))
            guests.write_known_hosts(client.known_hosts, started)
            work = base / "work"
            work.mkdir()
            seed_guest_venv(work / "venv")
            one = load_inventory(write_inventory(started[:1], work, base / "one.yaml"))
            many = load_inventory(write_inventory(started, work, base / "many.yaml"))
            book = base / "guest-bound.yaml"
            book.write_text(GUEST_BOUND.format(sleep=args.sleep))
            wheel = ProjectWheel()
            wheel.get()
            # Converge once (first install of the project's wheel etc.), not measured.
            first = provision_guests(many, ssh_connector(many, None), wheel=wheel, run_dir=base / "logs")
            if not first.ok:
                raise SystemExit("provisioning failed:\n"
                                 + "\n".join(f"{h.host}: {h.error}" for h in first.failed_hosts))
            rows = []
            for label, playbooks in (("guest-bound", [str(book)]), ("shipped", list(DEFAULT_PLAYBOOKS))):
                t1 = timed(one, playbooks, wheel, base / "logs", args.repeats)
                tn = timed(many, playbooks, wheel, base / "logs", args.repeats)
                rows.append((label, t1, tn, tn / t1))
        finally:
            for g in started:
                guests.stop_guest(g)
    print(f"guest stage fan-out: 1 vs {args.guests} guests (real sshd on loopback, "
          f"median of {args.repeats}, this machine: {generate.machine_shape().cpus} CPUs)")
    print(f"{'workload':<14}{'1 guest':>10}{f'{args.guests} guests':>12}{'ratio':>8}")
    for label, t1, tn, ratio in rows:
        print(f"{label:<14}{t1:>9.2f}s{tn:>11.2f}s{ratio:>8.2f}")
    print("target: ratio <= 1.5")


if __name__ == "__main__":
    main()
