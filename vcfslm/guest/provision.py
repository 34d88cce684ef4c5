"""The guest stage's entry points: run playbooks on inventory nodes over SSH, verify guests.

`provision_guests` is what `vcfslm provision --stage guests|all` and `vcfslm guests`
call; it never raises for a failed host (the summary says which failed and why),
only for bad input (unknown playbook: PlaybookSpecError; unknown host: InventoryError).
The SSH connections come from the caller's `Connector`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..contract import GUEST_PARALLEL_CAP, parallelism, select_nodes
from ..progress import NullReporter, Reporter
from . import batch
from .facts import GuestFacts, gather_guest_facts
from .playbook import DEFAULT_PLAYBOOKS, default_playbooks, load_playbooks
from .runner import HostSummary, RunSummary, run_hosts
from .transport import Transport
from .verify import verify_guest
from .wheel import ProjectWheel

__all__ = ["DEFAULT_PLAYBOOKS", "Connector", "default_playbooks", "HostSummary", "RunSummary", "guest_check",
           "guest_facts", "preflight_problems", "provision_guests", "verify_guests"]


class Connector(Protocol):
    """Opens one node's Transport; built by the CLI (the only place real drivers are built)."""

    def __call__(self, node: Any, *, log_dir: Path, wait_s: float) -> Transport: ...


def default_run_dir() -> Path:
    return Path("~/.vcfslm/guest-runs").expanduser() / time.strftime("%Y%m%d-%H%M%S")


def provision_guests(inventory, connect: Connector, reporter: Reporter | None = None, *,
                     playbooks: Sequence[str | Path] | None = None, dry_run: bool = False,
                     run_dir: str | Path | None = None, hosts: Sequence[str] | None = None,
                     max_workers: int | None = None, connect_wait_s: float = 60.0,
                     wheel: ProjectWheel | None = None) -> RunSummary:
    """Run playbooks (default: base, pytorch, model, launch, verify; with vllm before verify
    when bench.serve.server is vllm: `default_playbooks`) on the inventory's guests.

    connect: opens a node's Transport (the CLI's SSH connector; a fake in tests), called as
    connect(node, log_dir=..., wait_s=...); playbooks: shipped names or YAML paths; hosts:
    node names (default all); run_dir: folder of the per-host command logs (default
    ~/.vcfslm/guest-runs/<time>); dry_run: gather facts and return the commands each host
    would run, running none; connect_wait_s: how long to keep retrying SSH to a guest that
    does not answer yet (a booting VM); wheel: the project wheel to push (default: built
    from this checkout once); max_workers: guests prepared at once (`--parallel`; None:
    the inventory's guest.parallel, else every selected guest up to GUEST_PARALLEL_CAP).
    """
    reporter = reporter or NullReporter()
    nodes = select_nodes(inventory, names=hosts)
    books = load_playbooks(list(playbooks or default_playbooks(inventory)), inventory)
    log_dir = Path(run_dir).expanduser() if run_dir else default_run_dir()
    # A dry run does not wait for booting VMs: unreachable hosts are planned as fresh.
    wait_s = 0 if dry_run else connect_wait_s

    def open_host(node) -> Transport:
        return connect(node, log_dir=log_dir, wait_s=wait_s)

    requested = max_workers if max_workers is not None else inventory.guest.parallel
    workers = parallelism(requested, len(nodes), GUEST_PARALLEL_CAP)
    reporter.log(f"guests: {', '.join(b.name for b in books)} on {', '.join(n.name for n in nodes)}"
                 + (" (dry run)" if dry_run else "") + f", {workers} at once; command logs in {log_dir}")
    return run_hosts(inventory, books, nodes, open_host, reporter=reporter, dry_run=dry_run,
                     wheel=wheel or ProjectWheel(), max_workers=workers, log_dir=log_dir)


def verify_guests(inventory, connect: Connector, reporter: Reporter | None = None, *,
                  run_dir: str | Path | None = None, hosts: Sequence[str] | None = None,
                  connect_wait_s: float = 60.0, max_workers: int | None = None) -> RunSummary:
    """In-guest verification only (the verify playbook); each host's facts land in its records."""
    return provision_guests(inventory, connect, reporter, playbooks=["verify"], run_dir=run_dir,
                            hosts=hosts, connect_wait_s=connect_wait_s, max_workers=max_workers)


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
