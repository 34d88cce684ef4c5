"""`vcfslm plan`, `vcfslm provision` and `vcfslm destroy`: the inventory's VMs on vCenter."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import click
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from .. import contract
from ..errors import UsageError, VCenterError
from ..progress import Progress, describe
from ..vsphere import credentials, driver, reconcile
from ..vsphere.session import SessionOptions
from .common import (
    console,
    err_console,
    inventory_argument,
    load,
    output_option,
    print_json,
    remember_inventory,
    resolve_inventory_path,
)
from .guest_stage import fail_if_any, ssh_connector, summary_json, summary_table
from .progress_view import ProgressLines, bar

GUEST_STAGE_MODULE = "vcfslm.guest.provision"


class VmLinesReporter:
    """One live line per VM with its current step (plain lines when not on a terminal).

    quiet: no progress lines (JSON output); events sent to `log` (warnings) still show.
    """

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.status: dict[str, str] = {}
        self.bars: dict[str, Progress] = {}
        self.lock = threading.Lock()
        self.live: Live | None = None
        self.lines = ProgressLines()

    def __enter__(self) -> VmLinesReporter:
        if not self.quiet and err_console.is_terminal:
            self.live = Live(self._table(), console=err_console, refresh_per_second=8, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(*exc)
            self.live = None

    def _table(self) -> Table:
        table = Table.grid(padding=(0, 2))
        for subject, status in self.status.items():
            style = "red" if status.startswith(("failed", "blocked", "FAILED")) else ""
            text = escape(status)
            cells = [f"[bold]{escape(subject)}[/bold]", f"[{style}]{text}[/{style}]" if style else text]
            p = self.bars.get(subject)
            if p is not None:
                cells += [bar(p), escape(describe(p))]
            table.add_row(*cells)
        return table

    def update(self, subject: str, status: str) -> None:
        with self.lock:
            self.status[subject] = status
            self.bars.pop(subject, None)  # a new step: its transfer (if any) is over
            if self.live is not None:
                self.live.update(self._table())
            elif not self.quiet:
                err_console.print(f"[bold]{escape(subject)}[/bold]: {escape(status)}", soft_wrap=True)

    def detail(self, subject: str, status: str) -> None:
        self.update(subject, status)

    def progress(self, p: Progress) -> None:
        with self.lock:
            if self.live is not None:
                self.status.setdefault(p.subject, "")
                if p.final:
                    self.bars.pop(p.subject, None)
                else:
                    self.bars[p.subject] = p
                self.live.update(self._table())
                return
        line = None if self.quiet else self.lines.take(p)
        if line is not None:
            err_console.print(line, markup=False, soft_wrap=True)

    def log(self, message: str) -> None:
        with self.lock:
            if self.live is not None:
                self.live.console.print(message, markup=False, soft_wrap=True)
            else:
                err_console.print(message, markup=False, soft_wrap=True)


def _prompt(question: str) -> str:
    return click.prompt(question, hide_input=True, err=True)


def api_option(f):
    return click.option(
        "--api-version", "api_pin", default=None, metavar="X.Y[.Z]",
        help="Speak this vSphere API release (e.g. 6.7) instead of the newest both sides know; "
             "below 8.0.0.1 vNUMA takes the extraConfig fallback.")(f)


def parallel_option(help_text: str):
    return click.option("--parallel", type=click.IntRange(min=1), default=None, metavar="N",
                        help=help_text)


PROVISION_PARALLEL_HELP = (
    "Hosts worked on at once, on vCenter and then over SSH (default: vcenter.parallel and "
    f"guest.parallel, else every host up to {contract.VCENTER_PARALLEL_CAP} VMs / "
    f"{contract.GUEST_PARALLEL_CAP} guests); e.g. --parallel 8 when vCenter throttles.")
DESTROY_PARALLEL_HELP = (
    "VMs powered off and deleted at once (default: vcenter.parallel, else every VM up to "
    f"{contract.VCENTER_PARALLEL_CAP}); e.g. --parallel 8 when vCenter throttles.")


def vcenter_workers(inv, parallel: int | None) -> int:
    """VMs worked on at once: --parallel, else vcenter.parallel, else every VM up to the cap."""
    return contract.parallelism(parallel or inv.vcenter.parallel, len(inv.nodes),
                                contract.VCENTER_PARALLEL_CAP)


@contextmanager
def _vcenter(inv, reporter, api_pin: str | None = None, parallel: int | None = None):
    """A connected pyVmomi driver and an Automation API client factory; sessions closed on exit.

    parallel: --parallel (None: the inventory's vcenter.parallel, else the cap).
    """
    password = credentials.resolve_password(inv.vcenter, prompt=_prompt if sys.stdin.isatty() else None)

    def automation():
        # The vSphere Automation SDK (vmware.vapi, requests) costs about 0.3 s of CPU to import,
        # and only a plan or provision that touches tags or folders asks for its client.
        from ..vsphere.tags import AutomationClient

        return AutomationClient(inv.vcenter, password)

    with driver.PyVmomiVCenter(inv.vcenter, password, reporter, options=SessionOptions(api_pin=api_pin),
                        max_workers=vcenter_workers(inv, parallel)) as vc:
        yield vc, automation


def _print_plan(plan) -> None:
    for line in plan.lines():
        text = line.strip()
        style = ("yellow" if text.startswith("~") else "green" if text.startswith("+")
                 else "red" if text.startswith("!") or ": blocked" in line else None)
        # No markup (extraConfig[...] is not a rich tag) and no wrapping (lines are grep-able).
        console.print(line, style=style, markup=False, soft_wrap=True)


@click.command()
@inventory_argument
@click.option("--allow-restart", is_flag=True,
              help="Plan as provision --allow-restart would (restart-needing changes not pending).")
@api_option
@output_option
def plan(inventory: str | None, allow_restart: bool, api_pin: str | None, output: str) -> None:
    """Show what provision would change in vCenter; change nothing.

    \b
    Per VM: create / change fields old -> new / in sync; changes that need the VM
    powered off are marked [restart] (applied only with provision --allow-restart).
    Examples:
      vcfslm plan cluster.yaml
      vcfslm plan cluster.yaml --output json
      vcfslm plan cluster.yaml --api-version 6.7   the path a 6.7 session takes
    Exit 1 when preflight fails (every problem listed), 2 on a bad inventory.
    """
    inv = load(inventory)
    reporter = VmLinesReporter(quiet=True)  # plan observes only; warnings still show
    with _vcenter(inv, reporter, api_pin) as (vc, automation):
        planned = reconcile.make_plan(inv, vc, allow_restart, automation)
    if output == "json":
        print_json(planned.plan.to_dict())
        return
    for w in planned.plan.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {w}")
    _print_path(planned.plan)
    _print_plan(planned.plan)


def _print_path(plan) -> None:
    for line in plan.path_lines():
        console.print(line, markup=False, soft_wrap=True)


def _confirm_restarts(plan) -> bool:
    names = ", ".join(v.name for v in plan.vms if v.restarts)
    return click.confirm(f"Power off and restart running VM(s) {names}?", default=False, err=True)


def _run_vm_stage(inv, allow_restart: bool, yes: bool, output: str, api_pin: str | None = None,
                  parallel: int | None = None):
    with VmLinesReporter(quiet=output == "json") as reporter:
        with _vcenter(inv, reporter, api_pin, parallel) as (vc, automation):
            return reconcile.provision(inv, vc, reporter, allow_restart, automation,
                                       confirm=None if yes else _confirm_restarts)


def _print_summary(result) -> None:
    _print_path(result.plan)
    table = Table(title=f"provision: {result.plan.change_count} change(s) planned")
    for col in ("VM", "outcome", "IP", "detail"):
        table.add_column(col)
    for o in result.outcomes:
        detail = o.message
        if o.pending:
            detail = "pending restart (--allow-restart): " + "; ".join(o.pending)
        status = o.status if o.ok else f"[red]{o.status}[/red]"
        table.add_row(o.name, status, o.ip or "", detail)
    console.print(table)
    for w in result.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {w}")


def _load_guest_stage():
    """The guest stage's module (vcfslm.guest.provision) when this build has it, else None."""
    if importlib.util.find_spec(GUEST_STAGE_MODULE) is None:
        return None
    return importlib.import_module(GUEST_STAGE_MODULE)


def _guest_stage(inv, stage: str, output: str, trust_new_hosts: bool, doc: dict,
                 parallel: int | None = None) -> None:
    """Run the guest stage (provision_guests) when this build has it.

    parallel: --parallel, the guests prepared at once (None: guest.parallel, else the cap).
    """
    module = _load_guest_stage()
    if module is None:
        if stage == "guests":
            raise UsageError("the guest stage is not part of this build (no vcfslm.guest.provision)")
        err_console.print("note: the guest stage is not part of this build; provisioned VMs only")
        return
    with VmLinesReporter(quiet=output == "json") as reporter:
        workers = contract.parallelism(parallel or inv.guest.parallel, len(inv.nodes),
                                       contract.GUEST_PARALLEL_CAP)
        summary = module.provision_guests(inv, ssh_connector(inv, reporter, trust_new_hosts), reporter,
                                          options=module.GuestRun(max_workers=workers))
    # the `guests` command's renderers, so both commands show a run alike
    if output == "json":
        doc["guests"] = summary_json(summary)
    else:
        console.print(summary_table(summary, "guests"))
    fail_if_any(summary)


@click.command()
@inventory_argument
@click.option("--allow-restart", is_flag=True,
              help="Apply changes that need a running VM powered off (power off, change, power on).")
@click.option("--stage", type=click.Choice(["vms", "guests", "all"]), default="all", show_default=True,
              help="vms: vCenter only; guests: SSH playbooks only; all: both.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before restarting running VMs.")
@click.option("--trust-new-hosts", is_flag=True,
              help="Guest stage: record the SSH host keys of guests not yet in known_hosts.")
@parallel_option(PROVISION_PARALLEL_HELP)
@api_option
@output_option
def provision(inventory: str | None, allow_restart: bool, stage: str, yes: bool,
              trust_new_hosts: bool, parallel: int | None, api_pin: str | None, output: str) -> None:
    """Create or converge the inventory's VMs on vCenter, then prepare the guests.

    \b
    Clones one VM per ESXi host (96 vCPUs in four vNUMA nodes in the brief's
    inventory), pins it to the host's NUMA nodes, customizes hostname and IPs,
    powers it on and waits for its IP; every VM at once, up to a cap that is
    safe for a shared vCenter (--parallel or vcenter.parallel set it). A re-run
    changes only what differs. A vCenter refusing calls for load (HTTP 503) is
    asked again with growing, jittered waits; if it keeps refusing, the VM fails
    with "vCenter is throttling" and a lower --parallel is the way out. Examples:
      vcfslm provision cluster.yaml
      vcfslm provision cluster.yaml --allow-restart --yes
      vcfslm provision cluster.yaml --stage vms
      vcfslm provision cluster.yaml --parallel 64      a 64-host domain at once
      vcfslm provision cluster.yaml --parallel 8       a vCenter that throttles
      vcfslm provision cluster.yaml --trust-new-hosts   first contact with new guests
    Exit 1 when any VM failed or changes are pending a restart.
    """
    inv = load(inventory)
    path = resolve_inventory_path(inventory)
    doc: dict = {}  # the JSON form: the VM stage's result, plus "guests"; printed once
    options = ProvisionOptions(stage=stage, allow_restart=allow_restart, yes=yes,
                               trust_new_hosts=trust_new_hosts, output=output, api_pin=api_pin,
                               parallel=parallel)
    try:
        _provision_stages(inv, path, options, doc)
    finally:
        if output == "json" and doc:
            print_json(doc)


@dataclass(frozen=True)
class ProvisionOptions:
    """The `provision` command's options, as its stages read them."""

    stage: str = "all"
    allow_restart: bool = False
    yes: bool = False
    trust_new_hosts: bool = False
    output: str = "text"
    api_pin: str | None = None
    parallel: int | None = None


def _provision_stages(inv, path, options: ProvisionOptions, doc: dict) -> None:
    stage, output, parallel = options.stage, options.output, options.parallel
    result = None
    if stage in ("vms", "all"):
        result = _run_vm_stage(inv, options.allow_restart, options.yes, output, options.api_pin, parallel)
        remember_inventory(path)
        if output == "json":
            doc.update(result.to_dict())
        else:
            _print_summary(result)
        if result.failed:
            raise VCenterError(f"{len(result.failed)} of {len(result.outcomes)} VM(s) failed: "
                               + ", ".join(o.name for o in result.failed)
                               + ("; the guest stage was skipped" if stage == "all" else "")
                               + throttled_hint(result.throttled, vcenter_workers(inv, parallel)))
    else:
        remember_inventory(path)
    if stage in ("guests", "all"):
        _guest_stage(inv, stage, output, options.trust_new_hosts, doc, parallel)
    if result is not None and result.pending:
        raise VCenterError(f"{len(result.pending)} VM(s) have changes pending a restart: "
                           + ", ".join(o.name for o in result.pending)
                           + " (run provision --allow-restart)")


def throttled_hint(throttled: list, workers: int) -> str:
    """The closing lines when vCenter's throttling failed VMs: what happened, what to do."""
    if not throttled:
        return ""
    lower = max(1, workers // 2)
    return (f"\nvCenter is throttling: it kept refusing calls for {len(throttled)} VM(s) "
            f"({', '.join(o.name for o in throttled)}) with {workers} at once"
            f"\nretry with a lower --parallel, e.g. --parallel {lower}")


@click.command()
@inventory_argument
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@parallel_option(DESTROY_PARALLEL_HELP)
@output_option
def destroy(inventory: str | None, yes: bool, parallel: int | None, output: str) -> None:
    """Power off and delete the inventory's VMs (only those carrying its ownership marker).

    \b
    A VM with a node's name but without this inventory's vcfslm.owner marker is
    refused, never deleted. Examples:
      vcfslm destroy cluster.yaml
      vcfslm destroy cluster.yaml --yes
      vcfslm destroy cluster.yaml --yes --parallel 8   gentler on a busy vCenter
    Exit 1 when a VM was refused or failed to be destroyed.
    """
    inv = load(inventory)

    def confirm(dplan) -> bool:
        names = ", ".join(v.name for v in dplan.destroy)
        return click.confirm(f"Destroy {len(dplan.destroy)} VM(s) of '{inv.name}': {names}?",
                             default=False, err=True)

    with VmLinesReporter(quiet=output == "json") as reporter:
        with _vcenter(inv, reporter, parallel=parallel) as (vc, automation):
            result = reconcile.destroy(inv, vc, reporter, automation, None if yes else confirm)
    if output == "json":
        print_json({**result.plan.to_dict(), "warnings": result.warnings,
                    "outcomes": [{"name": o.name, "status": o.status, "message": o.message}
                                 for o in result.outcomes]})
    else:
        for o in result.outcomes:
            console.print(f"{o.name}: {'destroyed' if o.ok else '[red]failed[/red] ' + o.message}")
        for name in result.plan.absent:
            console.print(f"{name}: not present", markup=False)
        for w in result.warnings:
            err_console.print(f"[yellow]warning:[/yellow] {w}")
    if result.plan.refused:
        raise VCenterError("refused to destroy:\n" + "\n".join(f"  - {r}" for r in result.plan.refused))
    failed = [o.name for o in result.outcomes if not o.ok]
    if failed:
        raise VCenterError(f"failed to destroy: {', '.join(failed)}"
                           + throttled_hint([o for o in result.outcomes if o.throttled],
                                            vcenter_workers(inv, parallel)))


COMMANDS = [plan, provision, destroy]
