"""Shared pytest setup: the local lab's fixtures (vcsim, sshd guests) as a plugin, and the
groups that keep shared fixtures on one worker when the suite runs in parallel."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["lab_fixtures"] if importlib.util.find_spec("lab_fixtures") else []

# The session-scoped lab (vcsim, four sshd guests, one provisioning of them): every module
# that uses it runs on the worker of its lab group, so each lab is started and provisioned
# once, not once per worker.
LAB_FIXTURES = frozenset({"vcsim_server", "ssh_guests", "lab", "provisioned_lab"})
# Two labs, each on a worker of its own: the lab's modules one after another took ~16 of the
# suite's 19.5 minutes on a 2-core AVX2 machine while the cores sat half idle (a lab test
# mostly waits on its guests and servers), and two labs coexist (free ports, folders of their
# own). The modules that run vLLM on the lab (its servers, the router, a deployment) get the
# second; the benches, playbooks and the lab's own life cycle the first.
SECOND_LAB_MODULES = frozenset({"test_serve_deploy.py", "test_endpoint_bench.py", "test_workloads_lab.py"})


def xdist_group_for(module_fixtures: list[tuple[str, str]], module: str = "") -> str | None:
    """The xdist group of a module's tests from the (name, scope) of the fixtures they use
    (pure): "lab" or "lab-2" for lab users (by the module's file name), the module itself when
    any fixture is module-scoped (one worker then builds it once), none otherwise (each test
    goes where a worker is free)."""
    if any(name in LAB_FIXTURES for name, _ in module_fixtures):
        return "lab-2" if Path(module).name in SECOND_LAB_MODULES else "lab"
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
            group = xdist_group_for([f for item in module_items for f in _fixtures(item)], module)
            if group is not None:
                for item in module_items:
                    item.add_marker(pytest.mark.xdist_group(module if group == "module" else group))
    return (yield)
