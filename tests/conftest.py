"""Shared pytest setup: the local lab's fixtures (vcsim, sshd guests) as a plugin, the groups
that keep shared fixtures on one worker when the suite runs in parallel, and the order in
which the workers take the groups (the longest first)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from vcfslm.guest_layout import host_inductor_cache

sys.path.insert(0, str(Path(__file__).parent))

# The tests that compile in their own process use the Inductor cache `vcfslm bench` uses
# (contract.host_inductor_cache, under the user's cache folder) instead of torch's default
# under /tmp: a suite on a fresh clone then reuses the kernels earlier runs built, as it
# reuses vcsim's build and the fresh guests' root, rather than running g++ for every graph
# again (with a cold cache the compiled-step unit tests took 100 to 400 s each on a 2-core
# AVX2 machine). An explicit TORCHINDUCTOR_CACHE_DIR wins.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(host_inductor_cache(None, os.environ))

# The suite's workers outnumber the cores, so an OpenMP thread that spins at a barrier while
# its peer waits for a core burns the CPU the other workers' processes are waiting for: with
# the cores busy, the compiled-step unit tests took a third less CPU time when OpenMP's
# threads sleep at once (PASSIVE) instead. The workers, and the ranks, vLLM servers and
# benchmark children they start here, inherit it; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest_plugins = ["lab_fixtures"] if importlib.util.find_spec("lab_fixtures") else []

# The lab's session fixtures (tests/lab_fixtures.py). Only the provisioning is worth sharing
# between modules (a pass of every guest playbook): the modules that use it run on the worker
# of their lab group, so each provisioned lab is built once. vcsim and four sshd guests start
# in a few seconds, so the modules that use only those are a unit each, like any module with
# a module-scoped fixture, and a worker that takes one starts its own.
LAB_FIXTURES = frozenset({"vcsim_server", "ssh_guests", "lab", "provisioned_lab"})
SHARED_LAB = "provisioned_lab"
# Two provisioned labs, each on a worker of its own (two labs coexist: free ports, folders of
# their own): the cluster benches and the workloads' serving runs on one lab, one after
# another, would be a unit of ~640 s, the provisioning (~30 s) a second time is cheaper.
SECOND_LAB_MODULES = frozenset({"test_serve_deploy.py", "test_endpoint_bench.py", "test_workloads_lab.py"})
# The longest units, which the workers take first, in this order; then the other integration
# tests, then the unit tests, which fill the end. With xdist's own order (the units with the
# most tests first) the lab, vLLM and compiled-step units, a few tests each, started late and
# ran in the suite's tail. Their seconds in one run of the suite on a 2-core AVX2 machine
# shared with other work (cold Inductor cache): the peers' equivalence 541, the compiled token
# steps 583, the README walkthrough 508, the provisioned lab's cluster benches 414, a
# deployment on the lab 297, the engine's compiled steps 277, the second lab's workloads 223,
# the fresh guests 193, two model families 187.
LONGEST_FIRST = ("tests/integration/test_peers_equivalence.py", "tests/integration/test_e2e_readme.py",
                 "tests/unit/test_bench_token_steps.py", "lab", "tests/integration/test_serve_deploy.py",
                 "tests/unit/test_bench_engine.py", "lab-2", "tests/integration/test_fresh_guests.py",
                 "tests/integration/test_two_models.py")


def xdist_group_for(module_fixtures: list[tuple[str, str]], module: str = "") -> str | None:
    """The xdist group of a module's tests from the (name, scope) of the fixtures they use
    (pure): "lab" or "lab-2" for the provisioned lab's users (by the module's file name), the
    module itself when it uses the lab otherwise or any fixture is module-scoped (one worker
    then builds it once), none otherwise (each test goes where a worker is free)."""
    names = {name for name, _ in module_fixtures}
    if SHARED_LAB in names:
        return "lab-2" if Path(module).name in SECOND_LAB_MODULES else "lab"
    if names & LAB_FIXTURES or any(scope == "module" for _, scope in module_fixtures):
        return "module"
    return None


def start_rank(module: str, group: str | None) -> int:
    """Where a test's unit (its group, else its module) stands in the workers' queue (pure):
    the longest units first in LONGEST_FIRST's order, then the integration tests, then the rest."""
    for unit in (group, module):
        if unit in LONGEST_FIRST:
            return LONGEST_FIRST.index(unit)
    return len(LONGEST_FIRST) + (0 if "/integration/" in f"/{module}" else 1)


def _fixtures(item) -> list[tuple[str, str]]:
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    return [(name, d[-1].scope) for name, d in defs.items() if d]


def pytest_configure(config):
    """Under `--dist loadgroup` the workers take the units in collection order (below), not in
    xdist's default order by the number of tests per unit."""
    if getattr(config.option, "dist", "no") == "loadgroup":
        config.option.loadscopereorder = False


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist's `--dist loadgroup` (make test), mark each test's group: before
    every other implementation (a wrapper), as xdist's own reads the marks to name groups;
    then, after pytest's own ordering, put the longest units first (a stable sort: each
    module keeps its tests' order)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return (yield)
    groups: dict[str, str | None] = {}
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for module, module_items in by_module.items():
        group = xdist_group_for([f for item in module_items for f in _fixtures(item)], module)
        groups[module] = module if group == "module" else group
        if group is not None:
            for item in module_items:
                item.add_marker(pytest.mark.xdist_group(groups[module]))
    result = yield
    # A worker sees `loadgroup` (xdist sets it and its `dist` to "no"); a run without -n, the
    # option alone.
    if getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", "no") == "loadgroup":
        items.sort(key=lambda item: start_rank(m := item.nodeid.split("::", 1)[0], groups.get(m)))
    return result
