"""The rules docs/ARCHITECTURE.md states, checked with ast: which room may import which,
each third-party library imported by its one owner, no import cycle (lazy imports
counted), nothing heavy in analysis code, no printing below the CLI.

The room and owner tables are read from the document itself, so the map and the checks
cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "vcfslm"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"


def doc_table(heading: str, text: str | None = None) -> list[list[str]]:
    """The body rows of the first markdown table under `## heading`, cells stripped."""
    text = ARCHITECTURE.read_text() if text is None else text
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def ticked(cell: str) -> list[str]:
    """The `code` spans of a table cell."""
    return re.findall(r"`([^`]+)`", cell)


def owners_from_doc(text: str | None = None) -> dict[str, set[str]]:
    """Library root -> the only modules or folders (relative to vcfslm/) that may import it."""
    out: dict[str, set[str]] = {}
    for libs, owners in doc_table("Third-party libraries and their one owner", text):
        for lib in ticked(libs):
            out[lib] = set(ticked(owners))
    return out


def rooms_from_doc(text: str | None = None) -> dict[str, tuple[list[str], set[str]]]:
    """Room -> (its paths relative to the repository, the rooms it may import)."""
    out = {}
    for room, paths, _job, may in doc_table("Rooms and what each may import", text):
        out[room] = (ticked(paths), {r.strip() for r in may.split(",")} | {room})
    return out


OWNERS = owners_from_doc()
ROOMS = rooms_from_doc()


def test_the_document_states_the_rules_this_file_checks():
    assert {"pyVmomi", "paramiko", "click", "matplotlib", "jinja2", "torch"} <= set(OWNERS)
    assert {"core", "vsphere", "guest", "engine", "serve", "bench", "analysis", "deploy", "lab", "cli"} == set(ROOMS)
    text = ARCHITECTURE.read_text()
    for question in ("A new decode kernel.", "A new vCenter VM setting.", "A new report figure.",
                     "A new load pattern", "A new serving backend."):
        assert f"**{question}" in text, question


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


def test_worker_never_imports_ssh_or_vcenter():
    for rel, path in modules():
        if rel.startswith(("bench/", "engine/", "serve/")):
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

# The real drivers: built only by the CLI (docs/ARCHITECTURE.md), and by their own module.
DRIVERS = {"SSHTransport": "guest/transport.py", "open_node": "guest/transport.py",
           "PyVmomiVCenter": "vsphere/driver.py", "AutomationClient": "vsphere/tags.py"}


def absolute(rel: str, node: ast.ImportFrom) -> str:
    """The dotted module an ImportFrom names, relative imports resolved against `rel`."""
    if node.level == 0:
        return node.module or ""
    package = ["vcfslm", *rel.split("/")[:-1]]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


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


BOUNDARIES = (driver_constructions, private_cli_imports)


@pytest.mark.parametrize("check", BOUNDARIES, ids=lambda c: c.__name__)
def test_stage_boundaries_hold_on_the_tree(check):
    wrong = [w for rel, path in modules() for w in check(rel, path.read_text())]
    assert not wrong, wrong


@pytest.mark.parametrize(("check", "rel", "source", "expected"), [
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
    (driver_constructions, "cli/guest_stage.py", "open_node(inv, node)"),
    (driver_constructions, "guest/transport.py", "SSHTransport(name, host)"),
    (private_cli_imports, "cli/bench.py", "from .common import console, __all__"),
    (private_cli_imports, "cli/guests.py", "from ..guest.provision import _helper"),
])
def test_stage_boundaries_allow_what_the_design_allows(check, rel, source):
    assert check(rel, source) == []


# ---------------------------------------------------------------- rooms and cycles


def module_name(rel: str) -> str:
    """`bench/worker.py` -> `vcfslm.bench.worker`; a package's `__init__.py` -> the package."""
    parts = ["vcfslm", *rel[:-3].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the vcfslm modules it imports anywhere in its body (lazy imports too).

    `from pkg import name` depends on `pkg.name` when that is a module, else on `pkg`."""
    known = {module_name(rel) for rel in sources}

    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for rel, source in sources.items():
        me = module_name(rel)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.Import):
                deps |= {nearest(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = absolute(rel, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.add(sub if sub in known else nearest(base))
        graph[me] = {d for d in deps if d and d != me}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room_of(module: str, rooms: dict[str, tuple[list[str], set[str]]]) -> str:
    """The room a dotted vcfslm module lives in, by the document's paths."""
    parts = module.split(".")[1:]
    best, best_len = None, -1
    for room, (paths, _may) in rooms.items():
        for p in paths:
            p = p.removeprefix("vcfslm/")
            if p == "*.py":
                hit, length = len(parts) <= 1, 0
            else:
                prefix = p.removesuffix(".py").rstrip("/").split("/")
                hit, length = parts[: len(prefix)] == prefix, len(prefix)
            if hit and length > best_len:
                best, best_len = room, length
    assert best is not None, f"{module} is in no room of docs/ARCHITECTURE.md"
    return best


def room_leaks(graph: dict[str, set[str]], rooms: dict[str, tuple[list[str], set[str]]]) -> list[str]:
    out = []
    for me, deps in sorted(graph.items()):
        mine = room_of(me, rooms)
        out += [f"{me} ({mine}) imports {d} ({room_of(d, rooms)})" for d in sorted(deps)
                if room_of(d, rooms) not in rooms[mine][1]]
    return out


def tree_sources() -> dict[str, str]:
    return {rel: path.read_text() for rel, path in modules()}


def test_no_import_cycle_counting_lazy_imports():
    assert cycles(import_graph(tree_sources())) == []


def test_each_room_imports_only_what_the_document_allows():
    assert room_leaks(import_graph(tree_sources()), ROOMS) == []


def test_a_lazy_import_cycle_is_found():
    sources = {"bench/__init__.py": "", "bench/a.py": "from .b import f\n",
               "bench/b.py": "def f():\n    from .a import g\n", "bench/c.py": "from . import a\n"}
    assert cycles(import_graph(sources)) == [["vcfslm.bench.a", "vcfslm.bench.b"]]


def test_a_room_leak_is_found_and_the_allowed_import_is_not():
    sources = {"__init__.py": "", "errors.py": "", "analysis/__init__.py": "",
               "analysis/cells.py": "from ..errors import X\nfrom ..bench import engine\n",
               "bench/__init__.py": "", "bench/engine.py": "from .. import errors\n"}
    assert room_leaks(import_graph(sources), ROOMS) == [
        "vcfslm.analysis.cells (analysis) imports vcfslm.bench.engine (bench)"]


def test_the_owner_table_is_read_from_the_document():
    text = ("## Third-party libraries and their one owner\n\n| library | imported only by |\n|---|---|\n"
            "| `a`, `b` | `x/y.py`, `z/` |\n\n## Next\n| `c` | `q.py` |\n")
    assert owners_from_doc(text) == {"a": {"x/y.py", "z/"}, "b": {"x/y.py", "z/"}}


def test_a_room_leak_names_an_import_the_room_table_forbids():
    sources = {"__init__.py": "", "bench/__init__.py": "", "bench/launch.py": "from ..guest import transport\n",
               "guest/__init__.py": "", "guest/transport.py": ""}
    assert room_leaks(import_graph(sources), ROOMS) == [
        "vcfslm.bench.launch (bench) imports vcfslm.guest.transport (guest)"]


# ---------------------------------------------------------------- allowances in use
#
# A rule that allows what nothing does is a stale map: every room a room may import, and
# every owner of a library, must be used by the tree.


def unused_room_allowances(graph: dict[str, set[str]], rooms: dict[str, tuple[list[str], set[str]]]
                           ) -> list[str]:
    used = {(room_of(me, rooms), room_of(d, rooms)) for me, deps in graph.items() for d in deps}
    return [f"{room} may import {other}, and nothing in {room} does" for room, (_p, may) in sorted(rooms.items())
            for other in sorted(may - {room}) if (room, other) not in used]


def unused_owners(sources: dict[str, set[str]], owners: dict[str, set[str]]) -> list[str]:
    """sources: module path (relative to vcfslm/) -> the library roots it imports."""
    out = []
    for lib, places in sorted(owners.items()):
        for place in sorted(places):
            if not any(allowed(rel, {place}) and lib in libs for rel, libs in sources.items()):
                out.append(f"{place} owns {lib} and does not import it")
    return out


def test_every_room_allowance_is_used():
    assert unused_room_allowances(import_graph(tree_sources()), ROOMS) == []


def test_every_library_owner_imports_its_library():
    assert unused_owners({rel: imports(path) for rel, path in modules()}, OWNERS) == []


def test_an_unused_allowance_is_found():
    rooms = {"core": (["vcfslm/*.py"], {"core"}), "lab": (["vcfslm/lab/"], {"lab", "core", "guest"}),
             "guest": (["vcfslm/guest/"], {"guest", "core"})}
    graph = {"vcfslm.lab.a": {"vcfslm.errors"}, "vcfslm.guest.b": set(), "vcfslm.errors": set()}
    assert unused_room_allowances(graph, rooms) == ["guest may import core, and nothing in guest does",
                                                    "lab may import guest, and nothing in lab does"]
    assert unused_owners({"bench/a.py": {"torch"}}, {"torch": {"bench/", "engine/"}}) == [
        "engine/ owns torch and does not import it"]


# ---------------------------------------------------------------- what only one room does

# torch's compiled paths: the engine builds and calls compiled graphs; nothing else does.
COMPILED_PATHS = ("torch.compile", "torch.compiler", "torch._dynamo", "torch._inductor")


def compiled_path_uses(rel: str, source: str) -> list[str]:
    if rel.startswith("engine/"):
        return []
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted.startswith(COMPILED_PATHS) and dotted.split(".")[1] == node.attr or \
                    dotted in COMPILED_PATHS:
                out.append(f"{rel}:{node.lineno} uses {dotted}")
        elif isinstance(node, ast.Import):
            out += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith(COMPILED_PATHS)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(COMPILED_PATHS):
            out.append(f"{rel}:{node.lineno} imports {node.module}")
    return out


def test_only_the_engine_uses_torchs_compiled_paths():
    wrong = [w for rel, path in modules() for w in compiled_path_uses(rel, path.read_text())]
    assert not wrong, wrong


def test_a_compiled_path_outside_the_engine_is_found():
    assert compiled_path_uses("bench/worker.py", "import torch\nf = torch.compile(g)\n") == [
        "bench/worker.py:2 uses torch.compile"]
    assert compiled_path_uses("serve/x.py", "from torch._inductor import config\n") == [
        "serve/x.py:1 imports torch._inductor"]
    assert compiled_path_uses("engine/decode.py", "import torch\nf = torch.compile(g)\n") == []


# ---------------------------------------------------------------- benchmarks/
#
# The scripts under benchmarks/ import each other (one CPU line for all) and vcfslm. They
# hold the same two rules as the package: no import cycle, and vcfslm's private names
# (`_name`) stay private: a script measures through the public API, which tests keep.

BENCHMARKS = REPO / "benchmarks"


def benchmark_sources() -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted(BENCHMARKS.glob("*.py"))}


def benchmark_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Script -> the sibling scripts it imports (they put benchmarks/ on sys.path)."""
    graph = {}
    for name, source in sources.items():
        deps = set()
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
        graph[name] = {d for d in deps if d in sources and d != name}
    return graph


def private_vcfslm_uses(name: str, source: str) -> list[str]:
    """`from vcfslm.x import _y`, and `m._y` where m is a vcfslm module or name bound by import."""
    tree = ast.parse(source, name)
    bound: set[str] = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vcfslm":
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{name}.py:{node.lineno} imports {a.name} from {node.module}")
                bound.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "vcfslm"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                out.append(f"{name}.py:{node.lineno} uses {ast.unparse(node)}")
    return out


def test_benchmarks_have_no_import_cycle():
    graph = {f"vcfslm.{k}": {f"vcfslm.{d}" for d in v} for k, v in benchmark_graph(benchmark_sources()).items()}
    assert cycles(graph) == []


def test_benchmarks_use_no_private_name_of_vcfslm():
    wrong = [w for name, source in benchmark_sources().items() for w in private_vcfslm_uses(name, source)]
    assert not wrong, wrong


def test_benchmark_checks_catch_a_deliberate_leak():
    graph = benchmark_graph({"a": "from b import x\n", "b": "import a\n", "c": "import json\n"})
    assert graph == {"a": {"b"}, "b": {"a"}, "c": set()}
    source = ("from vcfslm.engine import linear\nfrom vcfslm.bench.probe import _best\n"
              "import vcfslm.engine.gemv as g\ny = linear._run(x)\nz = g._library()\nw = linear.pack_linears\n")
    assert private_vcfslm_uses("s", source) == [
        "s.py:2 imports _best from vcfslm.bench.probe", "s.py:4 uses linear._run", "s.py:5 uses g._library"]
