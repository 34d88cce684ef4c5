"""The guest stage's entry points: run playbooks on inventory nodes over SSH, verify guests.

`provision_guests` is what `vcfslm provision --stage guests|all` and `vcfslm guests`
call; it never raises for a failed host (the summary says which failed and why),
only for bad input (unknown playbook or host: InventoryError).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import InventoryError, Problem
from ..progress import NullReporter, Reporter
from .facts import GuestFacts, gather_guest_facts
from .playbook import DEFAULT_PLAYBOOKS, GuestPaths, guest_paths, load_playbooks
from .runner import MAX_WORKERS, HostSummary, RunSummary, run_hosts
from .transport import Transport, open_node
from .verify import verify_guest
from .wheel import ProjectWheel

__all__ = ["DEFAULT_PLAYBOOKS", "GuestPaths", "HostSummary", "RunSummary", "guest_paths",
           "guest_facts", "preflight_problems", "provision_guests", "select_nodes", "verify_guests"]


def default_run_dir() -> Path:
    return Path("~/.vcfslm/guest-runs").expanduser() / time.strftime("%Y%m%d-%H%M%S")


def select_nodes(inventory, hosts: Sequence[str] | None) -> list:
    """The inventory's nodes named in `hosts` (all when None), in inventory order."""
    if not hosts:
        return list(inventory.nodes)
    known = {n.name for n in inventory.nodes}
    unknown = [h for h in hosts if h not in known]
    if unknown:
        raise InventoryError([Problem(inventory.source, None, None, "--hosts",
                                      f"unknown node(s) {', '.join(unknown)}; the inventory has "
                                      + ", ".join(sorted(known)))])
    wanted = set(hosts)
    return [n for n in inventory.nodes if n.name in wanted]


def provision_guests(inventory, reporter: Reporter | None = None, *,
                     playbooks: Sequence[str | Path] | None = None, dry_run: bool = False,
                     trust_new_hosts: bool = False, run_dir: str | Path | None = None,
                     hosts: Sequence[str] | None = None, max_workers: int = MAX_WORKERS,
                     connect_wait_s: float = 60.0, connect: Callable[[Any], Transport] | None = None,
                     wheel: ProjectWheel | None = None) -> RunSummary:
    """Run playbooks (default: base, pytorch, model, launch, verify) on the inventory's guests.

    playbooks: shipped names or YAML paths; hosts: node names (default all); run_dir: folder of
    the per-host command logs (default ~/.vcfslm/guest-runs/<time>); dry_run: gather facts and
    return the commands each host would run, running none; connect_wait_s: how long to keep
    retrying SSH to a guest that does not answer yet (a booting VM); connect: Transport factory per node
    (tests); wheel: the project wheel to push (default: built from this checkout once).
    """
    reporter = reporter or NullReporter()
    nodes = select_nodes(inventory, hosts)
    books = load_playbooks(list(playbooks or DEFAULT_PLAYBOOKS), inventory)
    log_dir = Path(run_dir).expanduser() if run_dir else default_run_dir()
    if connect is None:
        def connect(node) -> Transport:
            # A dry run does not wait for booting VMs: unreachable hosts are planned as fresh.
            return open_node(inventory, node, log_dir=log_dir, trust_new_hosts=trust_new_hosts,
                             reporter=reporter, wait_s=0 if dry_run else connect_wait_s)
    reporter.log(f"guests: {', '.join(b.name for b in books)} on {', '.join(n.name for n in nodes)}"
                 + (" (dry run)" if dry_run else "") + f"; command logs in {log_dir}")
    return run_hosts(inventory, books, nodes, connect, reporter=reporter, dry_run=dry_run,
                     wheel=wheel or ProjectWheel(), max_workers=max_workers, log_dir=log_dir)


def verify_guests(inventory, reporter: Reporter | None = None, *, trust_new_hosts: bool = False,
                  run_dir: str | Path | None = None, hosts: Sequence[str] | None = None,
                  connect_wait_s: float = 60.0,
                  connect: Callable[[Any], Transport] | None = None) -> RunSummary:
    """In-guest verification only (the verify playbook); each host's facts land in its records."""
    return provision_guests(inventory, reporter, playbooks=["verify"], trust_new_hosts=trust_new_hosts,
                            run_dir=run_dir, hosts=hosts, connect_wait_s=connect_wait_s,
                            connect=connect)


def guest_facts(inventory, transport: Transport, node_name: str | None = None) -> GuestFacts:
    """Gather one guest's verification facts over an open transport (for run metadata)."""
    cache: dict[str, Any] = {}

    def get(fact):
        if fact.key not in cache:
            result = transport.run(fact.command, timeout=fact.timeout, sudo=fact.sudo, check=False,
                                   input=fact.input)
            cache[fact.key] = fact.parse(result)
        return cache[fact.key]

    return gather_guest_facts(get, inventory, node_name or transport.host)


def preflight_problems(inventory, transport: Transport) -> list[str]:
    """In-guest verification problems of the node behind `transport` (named by transport.host)."""
    return verify_guest(inventory, transport.host, guest_facts(inventory, transport))
