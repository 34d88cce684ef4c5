"""DESIGN.md's import rules, checked with ast: one module per third-party library,
nothing heavy in analysis code, no printing below the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "vcfslm"

# library root -> the only module(s) (relative to vcfslm/) allowed to import it
OWNERS = {
    "pyVmomi": {"vsphere/session.py", "vsphere/tasks.py", "vsphere/specs.py", "vsphere/driver.py"},
    "pyVim": {"vsphere/session.py"},
    "paramiko": {"guest/transport.py"},
    "click": {"cli/"},
    "matplotlib": {"analysis/figures.py"},
    "com": {"vsphere/tags.py"},
    "vmware": {"vsphere/tags.py"},
    "jinja2": {"guest/templates.py"},
}
TORCH_ALLOWED = "bench/"


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), path


def allowed(rel: str, owners: set[str]) -> bool:
    return any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in owners)


def test_each_library_has_one_owner():
    wrong = [(rel, lib) for rel, path in modules() for lib in imports(path)
             if lib in OWNERS and not allowed(rel, OWNERS[lib])]
    assert not wrong, wrong


def test_torch_only_in_bench():
    wrong = [rel for rel, path in modules()
             if imports(path) & {"torch", "transformers", "safetensors"} and not rel.startswith(TORCH_ALLOWED)]
    assert not wrong, wrong


def test_worker_never_imports_ssh_or_vcenter():
    for rel, path in modules():
        if rel.startswith("bench/") and rel != "bench/launch.py":
            assert not imports(path) & {"paramiko", "pyVmomi", "click"}, rel


def test_nothing_below_cli_prints():
    wrong = []
    for rel, path in modules():
        if rel.startswith(("cli/", "lab/vcsim/")) or rel in ("bench/worker.py",) or rel.endswith("__main__.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                wrong.append(f"{rel}:{node.lineno}")
    assert not wrong, wrong


# ---------------------------------------------------------------- stage boundaries
#
# Each check is a function of (module path, source) so that it can be shown to fail on a
# deliberate leak as well as to pass on the tree.

# What bench/ may take from the guest stage: the Transport protocol (it drives one) and
# nothing else; the layout and the other shared facts come from the run contract.
BENCH_MAY_IMPORT_FROM_GUEST = {"vcfslm.guest.transport": {"Transport"}}
# The real drivers: built only by the CLI (DESIGN.md), and by their own module.
DRIVERS = {"SSHTransport": "guest/transport.py", "open_node": "guest/transport.py",
           "PyVmomiVCenter": "vsphere/driver.py", "AutomationClient": "vsphere/tags.py"}


def absolute(rel: str, node: ast.ImportFrom) -> str:
    """The dotted module an ImportFrom names, relative imports resolved against `rel`."""
    if node.level == 0:
        return node.module or ""
    package = ["vcfslm", *rel.split("/")[:-1]]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def bench_guest_leaks(rel: str, source: str) -> list[str]:
    if not rel.startswith("bench/"):
        return []
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = absolute(rel, node)
            names = {a.name for a in node.names}
            if module == "vcfslm.guest" and names:
                modules = {f"vcfslm.guest.{n}" for n in names}
                out += [f"{rel}:{node.lineno} imports {m}" for m in sorted(modules)
                        if m not in BENCH_MAY_IMPORT_FROM_GUEST]
            elif module.startswith("vcfslm.guest."):
                extra = names - BENCH_MAY_IMPORT_FROM_GUEST.get(module, set())
                if extra:
                    out.append(f"{rel}:{node.lineno} imports {', '.join(sorted(extra))} from {module}")
        elif isinstance(node, ast.Import):
            out += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                    if a.name.startswith("vcfslm.guest")]
    return out


def driver_constructions(rel: str, source: str) -> list[str]:
    if rel.startswith("cli/"):
        return []
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in DRIVERS and DRIVERS[name] != rel:
                out.append(f"{rel}:{node.lineno} builds {name}")
    return out


def private_cli_imports(rel: str, source: str) -> list[str]:
    if not rel.startswith("cli/"):
        return []
    own = "vcfslm." + rel[:-3].replace("/", ".")
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = absolute(rel, node)
            if module.startswith("vcfslm.cli") and module != own:
                out += [f"{rel}:{node.lineno} imports {a.name} from {module}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return out


BOUNDARIES = (bench_guest_leaks, driver_constructions, private_cli_imports)


@pytest.mark.parametrize("check", BOUNDARIES, ids=lambda c: c.__name__)
def test_stage_boundaries_hold_on_the_tree(check):
    wrong = [w for rel, path in modules() for w in check(rel, path.read_text())]
    assert not wrong, wrong


@pytest.mark.parametrize(("check", "rel", "source", "expected"), [
    (bench_guest_leaks, "bench/local.py", "from ..guest.templates import render_template",
     "bench/local.py:1 imports render_template from vcfslm.guest.templates"),
    (bench_guest_leaks, "bench/cluster.py", "from ..guest import playbook",
     "bench/cluster.py:1 imports vcfslm.guest.playbook"),
    (bench_guest_leaks, "bench/cluster.py", "import vcfslm.guest.steps",
     "bench/cluster.py:1 imports vcfslm.guest.steps"),
    (bench_guest_leaks, "bench/launch.py", "from ..guest.transport import Transport, open_node",
     "bench/launch.py:1 imports open_node from vcfslm.guest.transport"),
    (driver_constructions, "guest/provision.py",
     "from .transport import open_node\ndef f(inv, n):\n    return open_node(inv, n)",
     "guest/provision.py:3 builds open_node"),
    (driver_constructions, "bench/cluster.py", "import x\nvc = x.PyVmomiVCenter(cfg, pw)",
     "bench/cluster.py:2 builds PyVmomiVCenter"),
    (private_cli_imports, "cli/vcenter.py", "from .guests import _fail_if_any, LiveHosts",
     "cli/vcenter.py:1 imports _fail_if_any from vcfslm.cli.guests"),
])
def test_stage_boundaries_catch_a_deliberate_leak(check, rel, source, expected):
    assert check(rel, source) == [expected]


@pytest.mark.parametrize(("check", "rel", "source"), [
    (bench_guest_leaks, "bench/launch.py", "from ..guest.transport import Transport"),
    (bench_guest_leaks, "guest/provision.py", "from .templates import render_template"),
    (driver_constructions, "cli/guest_stage.py", "open_node(inv, node)"),
    (driver_constructions, "guest/transport.py", "SSHTransport(name, host)"),
    (private_cli_imports, "cli/bench.py", "from .common import console, __all__"),
    (private_cli_imports, "cli/guests.py", "from ..guest.provision import _helper"),
])
def test_stage_boundaries_allow_what_the_design_allows(check, rel, source):
    assert check(rel, source) == []
