"""The guest stage's entry points: run playbooks on inventory nodes over SSH, verify guests.

`provision_guests` is what `vcfslm provision --stage guests|all` and `vcfslm guests`
call; it never raises for a failed host (the summary says which failed and why),
only for bad input (unknown playbook: PlaybookSpecError; unknown host: InventoryError).
The SSH connections come from the caller's `Connector`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..node_selection import GUEST_PARALLEL_CAP, parallelism, select_nodes
from ..progress import NullReporter, Reporter
from . import batch
from .host_facts import GuestFacts, gather_guest_facts
from .playbook import DEFAULT_PLAYBOOKS, default_playbooks, load_playbooks
from .runner import HostSummary, RunSummary, StepSettings, run_hosts
from .transport import Transport
from .verify import verify_guest
from .wheel import ProjectWheel

__all__ = ["DEFAULT_PLAYBOOKS", "Connector", "GuestRun", "default_playbooks", "HostSummary", "RunSummary",
           "guest_check",
           "guest_facts", "preflight_problems", "provision_guests", "verify_guests"]


class Connector(Protocol):
    """Opens one node's Transport; built by the CLI (the only place real drivers are built)."""

    def __call__(self, node: Any, *, log_dir: Path, wait_s: float) -> Transport: ...


def default_run_dir() -> Path:
    return Path("~/.vcfslm/guest-runs").expanduser() / time.strftime("%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class GuestRun:
    """What one guest run does, on which guests, and how (the `guests` command's options).

    playbooks: shipped names or YAML paths (None: `default_playbooks`); dry_run: gather
    facts and return the commands each host would run, running none; run_dir: folder of
    the per-host command logs (None: ~/.vcfslm/guest-runs/<time>); hosts: node names
    (None: all); max_workers: guests prepared at once (`--parallel`; None: the inventory's
    guest.parallel, else every selected guest up to GUEST_PARALLEL_CAP); connect_wait_s:
    how long to keep retrying SSH to a guest that does not answer yet (a booting VM);
    wheel: the project wheel to push (None: built from this checkout once).
    """

    playbooks: Sequence[str | Path] | None = None
    dry_run: bool = False
    run_dir: str | Path | None = None
    hosts: Sequence[str] | None = None
    max_workers: int | None = None
    connect_wait_s: float = 60.0
    wheel: ProjectWheel | None = None


def provision_guests(inventory, connect: Connector, reporter: Reporter | None = None,
                     options: GuestRun | None = None) -> RunSummary:
    """Run playbooks (default: base, pytorch, model, launch, verify; with vllm before verify
    when bench.serve.server is vllm: `default_playbooks`) on the inventory's guests.

    connect: opens a node's Transport (the CLI's SSH connector; a fake in tests), called as
    connect(node, log_dir=..., wait_s=...); options: the playbooks, hosts, dry run, log
    folder, parallelism, SSH wait and wheel of the run (GuestRun; None: its defaults).
    """
    reporter = reporter or NullReporter()
    options = options or GuestRun()
    dry_run = options.dry_run
    nodes = select_nodes(inventory, names=options.hosts)
    books = load_playbooks(list(options.playbooks or default_playbooks(inventory)), inventory)
    log_dir = Path(options.run_dir).expanduser() if options.run_dir else default_run_dir()
    # A dry run does not wait for booting VMs: unreachable hosts are planned as fresh.
    wait_s = 0 if dry_run else options.connect_wait_s

    def open_host(node) -> Transport:
        return connect(node, log_dir=log_dir, wait_s=wait_s)

    requested = options.max_workers if options.max_workers is not None else inventory.guest.parallel
    workers = parallelism(requested, len(nodes), GUEST_PARALLEL_CAP)
    reporter.log(f"guests: {', '.join(b.name for b in books)} on {', '.join(n.name for n in nodes)}"
                 + (" (dry run)" if dry_run else "") + f", {workers} at once; command logs in {log_dir}")
    settings = StepSettings(dry_run=dry_run, wheel=options.wheel or ProjectWheel())
    return run_hosts(inventory, books, nodes, open_host, reporter=reporter, settings=settings,
                     max_workers=workers, log_dir=log_dir)


def verify_guests(inventory, connect: Connector, reporter: Reporter | None = None, *,
                  run_dir: str | Path | None = None, hosts: Sequence[str] | None = None,
                  connect_wait_s: float = 60.0, max_workers: int | None = None) -> RunSummary:
    """In-guest verification only (the verify playbook); each host's facts land in its records."""
    return provision_guests(inventory, connect, reporter,
                            options=GuestRun(playbooks=["verify"], run_dir=run_dir, hosts=hosts,
                                             connect_wait_s=connect_wait_s, max_workers=max_workers))


def guest_facts(inventory, transport: Transport, node_name: str | None = None) -> GuestFacts:
    """Gather one guest's verification facts over an open transport, in one round trip
    (for run metadata)."""
    name = node_name or transport.host
    wanted: list = []
    gather_guest_facts(wanted.append, inventory, name)
    values, _ = batch.gather(transport, wanted)
    return gather_guest_facts(lambda fact: values[fact.key], inventory, name)


def guest_check(inventory, transport: Transport) -> tuple[GuestFacts, list[str]]:
    """The node behind `transport` (named by transport.host): its facts, gathered once, and
    the in-guest verification problems found in them (the bench preflight needs both)."""
    facts = guest_facts(inventory, transport)
    return facts, verify_guest(inventory, transport.host, facts)


def preflight_problems(inventory, transport: Transport) -> list[str]:
    """In-guest verification problems of the node behind `transport` (named by transport.host)."""
    return guest_check(inventory, transport)[1]
