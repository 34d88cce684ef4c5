"""`vcfslm guests` (run guest playbooks over SSH on existing hosts) and `vcfslm verify`
(in-guest NUMA and bench-network verification only)."""

from __future__ import annotations

import threading

import click
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ..contract import GUEST_PARALLEL_CAP
from ..guest import provision
from ..guest.verify import describe_numa
from ..progress import Progress, describe
from .common import (
    RichReporter,
    console,
    err_console,
    inventory_argument,
    load,
    output_option,
    print_json,
)
from .guest_stage import fail_if_any, ssh_connector, summary_json, summary_table
from .progress_view import bar


class LiveHosts:
    """A live table, one row per host ("host: step k/n ...", a bar while a transfer runs);
    plain whole lines when not a terminal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, str] = {}
        self._bars: dict[str, Progress] = {}
        self._live: Live | None = None
        self._plain = RichReporter(err_console) if not err_console.is_terminal else None

    def __enter__(self) -> LiveHosts:
        if self._plain is None:
            self._live = Live(self._table(), console=err_console, refresh_per_second=8, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def _table(self) -> Table:
        table = Table(show_header=False, box=None, pad_edge=False)
        for host, status in self._rows.items():
            p = self._bars.get(host)
            if p is None:
                table.add_row(f"[bold]{escape(host)}[/bold]", escape(status))
            else:
                table.add_row(f"[bold]{escape(host)}[/bold]", escape(status), bar(p), escape(describe(p)))
        return table

    def update(self, subject: str, status: str) -> None:
        if self._plain is not None:
            self._plain.update(subject, status)
            return
        with self._lock:
            self._rows[subject] = status
            self._bars.pop(subject, None)  # a new step: its transfer (if any) is over
            if self._live is not None:
                self._live.update(self._table())

    def detail(self, subject: str, status: str) -> None:
        self.update(subject, status)

    def progress(self, p: Progress) -> None:
        if self._plain is not None:
            self._plain.progress(p)
            return
        with self._lock:
            self._rows.setdefault(p.subject, "")
            if p.final:
                self._bars.pop(p.subject, None)
            else:
                self._bars[p.subject] = p
            if self._live is not None:
                self._live.update(self._table())

    def log(self, message: str) -> None:
        if self._plain is not None:
            self._plain.log(message)
        elif self._live is not None:
            self._live.console.print(message, markup=False, soft_wrap=True)


parallel_option = click.option(
    "--parallel", type=click.IntRange(min=1), default=None, metavar="N",
    help=f"Guests worked on at once (overrides the inventory's guest.parallel; default: every "
         f"guest up to {GUEST_PARALLEL_CAP}).")


def _hosts(value: str | None) -> list[str] | None:
    return [h.strip() for h in value.split(",") if h.strip()] if value else None


def guest_run(options: dict):
    """The guest run the `guests` command's options ask for (click's names -> GuestRun)."""
    return provision.GuestRun(playbooks=list(options["playbooks"]) or None, dry_run=options["dry_run"],
                    run_dir=options["log_dir"], hosts=_hosts(options["hosts"]),
                    connect_wait_s=options["wait_s"], max_workers=options["parallel"])


@click.command("guests")
@inventory_argument
@click.option("--playbook", "-p", "playbooks", multiple=True, metavar="NAME|FILE",
              help="Playbook to run (repeatable; shipped: base, pytorch, model, launch, vllm, verify, serve). "
                   "Default: all of them in that order, vllm only when bench.serve.server is vllm.")
@click.option("--dry-run", is_flag=True, help="Read facts, print the commands each host would run, run none.")
@click.option("--trust-new-hosts", is_flag=True,
              help="Record unknown host keys in guest.known_hosts (prints their fingerprints). "
                   "A changed key is always refused.")
@click.option("--hosts", "hosts", metavar="A,B", help="Only these nodes (comma-separated names).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the per-host command logs (default ~/.vcfslm/guest-runs/<time>).")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              metavar="SECONDS", help="How long to keep retrying SSH to guests that do not answer yet.")
@parallel_option
@output_option
def guests(inventory: str | None, **options) -> None:
    """Prepare existing guests over SSH with playbooks (no VM changes).

    \b
    Examples:
      vcfslm guests cluster.yaml                          every playbook on every node
      vcfslm guests cluster.yaml -p launch --hosts slm-01 re-render launch scripts on one node
      vcfslm guests cluster.yaml --dry-run                the commands each host would run
      vcfslm guests cluster.yaml --trust-new-hosts        first contact with new VMs
      vcfslm guests cluster.yaml --parallel 8             at most 8 guests at once
    A second run changes nothing. Exit 1 when any host failed (the others still ran).
    """
    inv = load(inventory)
    run = guest_run(options)
    dry_run = run.dry_run
    with LiveHosts() as reporter:
        summary = provision.provision_guests(inv, ssh_connector(inv, reporter, options["trust_new_hosts"]), reporter,
                                   options=run)
    if options["output"] == "json":
        print_json(summary_json(summary))
    else:
        if dry_run:
            for h in summary.hosts:
                cmds = [c for s in h.steps for c in s.commands]
                console.print(f"[bold]{h.host}[/bold]: {len(cmds)} command(s) would run"
                              + (f" ({h.note})" if h.note else ""))
                for c in cmds:
                    console.print(f"  $ {c}", markup=False, highlight=False, soft_wrap=True)
        console.print(summary_table(summary, "guests (dry run)" if dry_run else "guests"))
        if summary.log_dir:
            console.print(f"command logs: {summary.log_dir}")
    fail_if_any(summary)


@click.command("verify")
@inventory_argument
@click.option("--trust-new-hosts", is_flag=True, help="Record unknown host keys (prints fingerprints).")
@click.option("--hosts", "hosts", metavar="A,B", help="Only these nodes (comma-separated names).")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              metavar="SECONDS", help="How long to keep retrying SSH to guests that do not answer yet.")
@parallel_option
@output_option
def verify(inventory: str | None, trust_new_hosts: bool, hosts: str | None, wait_s: float,
           parallel: int | None, output: str) -> None:
    """Check inside each guest that its NUMA topology and bench network match the inventory.

    \b
    Each guest must show vm.vnuma_nodes nodes of vcpus/vnuma_nodes CPUs (numbered
    contiguously), memory per node within 10% of even, its bench IP on an interface
    with the bench MTU, and every other node's bench IP answering.
    Examples:
      vcfslm verify cluster.yaml
      vcfslm verify cluster.yaml --hosts slm-02 --output json
    Exit 1 with expected vs seen for every guest that does not match.
    """
    inv = load(inventory)
    with LiveHosts() as reporter:
        summary = provision.verify_guests(inv, ssh_connector(inv, reporter, trust_new_hosts), reporter,
                                hosts=_hosts(hosts), connect_wait_s=wait_s, max_workers=parallel)
    if output == "json":
        print_json(summary_json(summary))
    else:
        table = Table(title="in-guest verification")
        for col in ("host", "NUMA seen", "result"):
            table.add_column(col)
        for h in summary.hosts:
            facts = h.records.get("facts")
            seen = "-"
            if facts is not None and facts.numa is not None and facts.numa.available:
                seen = describe_numa(facts.numa)
            result = "[green]ok[/green]" if h.succeeded else f"[red]{escape(h.error)}[/red]"
            table.add_row(h.host, seen, result)
        console.print(table)
    fail_if_any(summary)


COMMANDS = [guests, verify]
