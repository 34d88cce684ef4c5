"""Shared pytest setup: the local lab's fixtures (vcsim, sshd guests) as a plugin, and the
groups that keep shared fixtures on one worker when the suite runs in parallel."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["lab_fixtures"] if importlib.util.find_spec("lab_fixtures") else []

# The session-scoped lab (vcsim, four sshd guests, one provisioning of them): every module
# that uses it runs on one worker, so the lab is started and provisioned once, not once
# per worker.
LAB_FIXTURES = frozenset({"vcsim_server", "ssh_guests", "lab", "provisioned_lab"})


def xdist_group_for(module_fixtures: list[tuple[str, str]]) -> str | None:
    """The xdist group of a module's tests from the (name, scope) of the fixtures they use
    (pure): "lab" for lab users, the module itself when any fixture is module-scoped (one
    worker then builds it once), none otherwise (each test goes where a worker is free)."""
    if any(name in LAB_FIXTURES for name, _ in module_fixtures):
        return "lab"
    if any(scope == "module" for _, scope in module_fixtures):
        return "module"
    return None


def _fixtures(item) -> list[tuple[str, str]]:
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    return [(name, d[-1].scope) for name, d in defs.items() if d]


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist's `--dist loadgroup` (make test), mark each test's group: before
    every other implementation (a wrapper), as xdist's own reads the marks to name groups."""
    if config.pluginmanager.hasplugin("xdist"):
        by_module: dict[str, list] = {}
        for item in items:
            by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
        for module, module_items in by_module.items():
            group = xdist_group_for([f for item in module_items for f in _fixtures(item)])
            if group is not None:
                for item in module_items:
                    item.add_marker(pytest.mark.xdist_group("lab" if group == "lab" else module))
    return (yield)
