"""DESIGN.md's import rules, checked with ast: one module per third-party library,
nothing heavy in analysis code, no printing below the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

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
