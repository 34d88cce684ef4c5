"""Which nodes a run takes (`--nodes N` / `--hosts A,B`), how many hosts a stage works on at
once, and a cluster run's nodes as the bench drives them (`NodeTarget`, sliced from the
inventory by `targets_of`, in the CLI). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import topology
from .errors import InventoryError, Problem
from .guest_layout import GuestPaths, guest_paths

# How many hosts one stage works on at once. Both caps are raised or lowered per run
# (`--parallel`) or per inventory (`vcenter.parallel`, `guest.parallel`).
#
# vCenter: each worker keeps one call or task in flight, all on one session, so the cap is
# this run's share of vCenter's concurrency:
# - vCenter executes about 640 concurrent operations before it queues incoming requests and
#   holds 2,000 sessions before it refuses logins (VMware performance blog, "vCenter Limits
#   for Tasks Running at the Same Time", 2021-02; the same SOAP limits in "Endpoint Limits
#   for Concurrent REST Requests from vCenter APIs", 2022-07). 64 is a tenth of the 640,
#   the rest left to the other tenants of a shared vCenter.
# - vpxd's resource manager charges clones and migrations against a cost limit per host
#   (vpxd.ResourceManager.maxCostPerEsx6xHost = 16; 8 before ESXi 6.0) and per datastore
#   (maxCostPerEsx6xDs = 128) (Broadcom KB 326281; a provisioning operation costs a host 1,
#   vSphere 6.x "Limits on Simultaneous Migrations") and queues, never fails, what is over
#   them. One VM per host keeps every destination host far below its limit; the template's
#   host and datastore are charged by every clone, and vCenter itself queues the surplus,
#   so more workers only move that wait into vCenter's queue while the other steps
#   (reconfigure, customize, power on) run on all hosts at once.
# - 64 takes a 64-host workload domain in one wave instead of four.
# SSH to guests has no such shared server: the operator's file descriptors and CPU are
# the limit.
VCENTER_PARALLEL_CAP = 64
GUEST_PARALLEL_CAP = 64


def parallelism(requested: int | None, items: int, cap: int) -> int:
    """Workers for `items` hosts: what was asked for, else every host up to `cap`; at least 1."""
    wanted = requested if requested is not None else min(items, cap)
    return max(1, min(wanted, max(items, 1)))


def select_nodes(inventory, count: int | None = None, names: Iterable[str] | None = None) -> list:
    """The inventory's nodes named in `names` (in inventory order), else its first `count`
    (all when None). InventoryError names the flag and the nodes the inventory has."""
    nodes = list(inventory.nodes)
    known = [n.name for n in nodes]
    wanted = [n.strip() for n in names or () if n.strip()]
    if wanted:
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise InventoryError([Problem(inventory.source, None, None, "--hosts",
                                          f"unknown node(s) {', '.join(unknown)}; the inventory has "
                                          + ", ".join(sorted(known)))])
        return [n for n in nodes if n.name in set(wanted)]
    count = len(nodes) if count is None else count
    if count < 1 or count > len(nodes):
        raise InventoryError([Problem(inventory.source, None, None, "--nodes",
                                      f"{count} nodes asked, the inventory has {len(nodes)}")])
    return nodes[:count]


@dataclass(frozen=True)
class NodeTarget:
    """One node of a cluster run as the bench drives it: where SSH reaches it, where its
    ranks meet, the guest layout the guest stage left on it, and where each of its local
    ranks runs (what the rendered rank.sh must apply, which the preflight checks). The CLI
    slices these from the inventory (`targets_of`); nothing below it reads the inventory."""

    name: str
    address: str                         # management IP (SSH)
    ssh_port: int
    bench_ip: str                        # the bench network; node 0's is the rendezvous
    rdzv_port: int                       # torchrun's static rendezvous, on node 0's bench IP
    paths: GuestPaths
    slots: tuple[topology.RankSlot, ...]


def targets_of(inventory, names: Sequence[str], ranks: int | None = None,
               threads: int | None = None) -> tuple[NodeTarget, ...]:
    """The inventory's nodes named in `names` (inventory order) as NodeTargets, each with
    `ranks` ranks of `threads` threads placed on the VM's vNUMA nodes (default: the
    inventory's bench settings). InventoryError when a name is unknown (select_nodes) or
    the ranks do not fit the VM the inventory describes."""
    vm, bench = inventory.vm, inventory.bench
    ranks = ranks or bench.ranks_per_node
    threads = threads or bench.threads_per_rank
    try:
        slots = tuple(topology.rank_slots(vm.vcpus, vm.vnuma_nodes, ranks, threads))
    except ValueError as exc:
        raise InventoryError([Problem(inventory.source, None, None, "vm",
                                      f"{ranks} rank(s) of {threads} thread(s) per node: {exc}")]) from None
    paths = guest_paths(inventory)
    return tuple(NodeTarget(n.name, str(n.management_ip), int(n.ssh_port), str(n.bench_ip), int(bench.port),
                            paths, slots)
                 for n in select_nodes(inventory, names=names))
