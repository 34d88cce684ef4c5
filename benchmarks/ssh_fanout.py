"""Fan-out of the guest stage: the same playbooks on 1 guest vs N guests (real sshd, loopback).

If hosts run in parallel and the operator is not the bottleneck, N guests take about as
long as one. Two workloads:

  guest-bound   steps whose time is spent on the guest (`sleep`, standing in for package
                installs and downloads that each VM does on its own CPUs and network)
  converged     every shipped playbook on converged guests (facts only: the re-run case);
                all "guests" share this machine's CPUs, so this one also measures the
                guest-side CPU of N converged checks, not only the operator's

Prints the wall times (median of --repeats), the ratios (target: guest-bound <= 1.5,
converged <= 2) and the SSH connections each host opened per run.

    .venv/bin/python benchmarks/ssh_fanout.py [--guests 32] [--repeats 5] [--sleep 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vcfslm.cli.guest_stage import ssh_connector  # noqa: E402
from vcfslm.guest.playbook import DEFAULT_PLAYBOOKS  # noqa: E402
from vcfslm.guest.provision import GuestRun, provision_guests  # noqa: E402
from vcfslm.guest.wheel import ProjectWheel  # noqa: E402
from vcfslm.inventory_load import load_inventory  # noqa: E402
from vcfslm.lab import generate, guests  # noqa: E402
from vcfslm.lab.lab import seed_guest_venv  # noqa: E402

FIRST_INDEX = 80  # 127.0.0.91.. : away from the lab's and the tests' guests
# Per guest while it runs: its sshd's listening socket and log, and on the operator one TCP
# socket, the SFTP/shell channels share it; plus a few per guest for starting sshd.
FDS_PER_GUEST = 8

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


def ensure_fds(guests_n: int) -> None:
    """Raise the soft open-files limit when N guests could exhaust it (SystemExit if the hard
    limit is too low)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 256 + FDS_PER_GUEST * guests_n
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"{guests_n} guests need about {need} open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class CountingConnector:
    """The CLI's SSH connector, counting the connections opened per host."""

    def __init__(self, inv):
        self.inner = ssh_connector(inv, None)
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, node, **kw):
        with self.lock:
            self.counts[node.name] += 1
        return self.inner(node, **kw)


def operator_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def guests_cpu(started) -> float:
    """CPU seconds of the guests' finished SSH sessions (reaped children of each sshd)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for g in started:
        try:
            fields = Path(f"/proc/{g.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[13]) + int(fields[14])) / tick  # cutime + cstime
    return total


def timed(inv, playbooks, wheel, logs: Path, repeats: int, converged: bool,
          started) -> tuple[float, list[float], int, float, float]:
    """(median wall time, every wall time, most connections one host opened in one run,
    operator CPU-s and guests' CPU-s per run, medians)."""
    times, most, ops, gcs = [], 0, [], []
    for _ in range(repeats):
        connect = CountingConnector(inv)
        cpu0, guest0 = operator_cpu(), guests_cpu(started)
        t0 = time.perf_counter()
        summary = provision_guests(inv, connect,
                                   options=GuestRun(playbooks=playbooks, wheel=wheel, run_dir=logs))
        times.append(time.perf_counter() - t0)
        ops.append(operator_cpu() - cpu0)
        time.sleep(0.2)  # the sessions' processes are reaped by their sshd
        gcs.append(guests_cpu(started) - guest0)
        if not summary.ok:
            raise SystemExit("run failed:\n" + "\n".join(f"{h.host}: {h.error}" for h in summary.failed_hosts))
        if converged and summary.changed:
            raise SystemExit("the converged run changed steps: " + ", ".join(
                f"{h.host}: {s.playbook}/{s.name}" for h in summary.hosts for s in h.steps
                if s.status == "changed"))
        most = max([most, *connect.counts.values()])
    return statistics.median(times), times, most, statistics.median(ops), statistics.median(gcs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=2.0, help="seconds per guest-bound step")
    args = parser.parse_args()
    if not 1 <= args.guests < guests.MAX_NODES - FIRST_INDEX:
        raise SystemExit(f"--guests must be 1..{guests.MAX_NODES - FIRST_INDEX - 1}")
    ensure_fds(args.guests)
    with tempfile.TemporaryDirectory(prefix="vcfslm-fanout-") as tmp:
        base = Path(tmp)
        client = guests.ensure_client_keys(base / "ssh")
        started = []
        try:
            # One guest more than --guests: the single-guest runs get their own, with its own
            # work folder (lab guests share one), so neither inventory re-renders the other's
            # launch files (the hosts file lists every node).
            for i in range(args.guests + 1):
                started.append(guests.start_guest(FIRST_INDEX + i, base / "guests", client))
            guests.write_known_hosts(client.known_hosts, started)
            for work in (base / "work", base / "work-one"):
                work.mkdir()
                seed_guest_venv(work / "venv")
            one = load_inventory(write_inventory(started[-1:], base / "work-one", base / "one.yaml"))
            many = load_inventory(write_inventory(started[:-1], base / "work", base / "many.yaml"))
            book = base / "guest-bound.yaml"
            book.write_text(GUEST_BOUND.format(sleep=args.sleep))
            wheel = ProjectWheel()
            wheel.get()
            # Converge (first install of the project's wheel etc.), then once more: the first
            # converged check after an install reads the venv in full and records it.
            for inv in (one, many, one, many):
                first = provision_guests(inv, ssh_connector(inv, None),
                                         options=GuestRun(wheel=wheel, run_dir=base / "logs"))
                if not first.ok:
                    raise SystemExit("provisioning failed:\n"
                                     + "\n".join(f"{h.host}: {h.error}" for h in first.failed_hosts))
            rows = []
            for label, playbooks in (("guest-bound", [str(book)]), ("converged", list(DEFAULT_PLAYBOOKS))):
                converged = label == "converged"
                t1, all1, c1, op1, g1 = timed(one, playbooks, wheel, base / "logs", args.repeats,
                                              converged, started)
                tn, alln, cn, opn, gn = timed(many, playbooks, wheel, base / "logs", args.repeats,
                                              converged, started)
                rows.append((label, t1, tn, tn / t1, max(c1, cn), all1, alln, (op1, g1, opn, gn)))
        finally:
            for g in started:
                guests.stop_guest(g)
    print(f"guest stage fan-out: 1 vs {args.guests} guests (real sshd on loopback, "
          f"median of {args.repeats}, this machine: {generate.machine_shape().cpus} CPUs)")
    print(f"{'workload':<14}{'1 guest':>10}{f'{args.guests} guests':>12}{'ratio':>8}{'SSH connections/host/run':>27}")
    for label, t1, tn, ratio, conns, *_ in rows:
        print(f"{label:<14}{t1:>9.2f}s{tn:>11.2f}s{ratio:>8.2f}{conns:>27}")
    for label, _, _, _, _, all1, alln, (op1, g1, opn, gn) in rows:
        print(f"  {label}: 1 guest {', '.join(f'{t:.2f}' for t in all1)} s; "
              f"{args.guests} guests {', '.join(f'{t:.2f}' for t in alln)} s")
        print(f"  {label}: CPU-s per run, operator / guests: 1 guest {op1:.2f} / {g1:.2f}; "
              f"{args.guests} guests {opn:.2f} / {gn:.2f} ({1000 * gn / args.guests:.0f} ms per guest)")
    print("target: guest-bound ratio <= 1.5, converged ratio <= 2")


if __name__ == "__main__":
    main()
