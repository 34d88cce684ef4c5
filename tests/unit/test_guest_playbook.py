"""Playbook loading (file:line errors at load time), variables, and the shipped playbooks."""

from __future__ import annotations

from pathlib import Path

import pytest

from vcfslm.errors import PlaybookError, PlaybookSpecError
from vcfslm.guest.context import HostContext
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.playbook import (
    DEFAULT_PLAYBOOKS,
    available_playbooks,
    host_variables,
    interpolate,
    load_playbook,
    load_playbooks,
    run_step,
    torch_requirement,
)
from vcfslm.inventory_load import load_inventory

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"
LAB = ROOT / "inventories" / "lab.yaml"


@pytest.fixture(scope="module")
def brief():
    return load_inventory(BRIEF)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def problems(path: Path, inventory=None) -> list[str]:
    with pytest.raises(PlaybookSpecError) as exc:
        load_playbook(path, inventory)
    return [str(p) for p in exc.value.problems]


def test_unknown_step_type_with_file_line(tmp_path):
    path = write(tmp_path, "steps:\n  - name: a\n    file: {path: /x, state: directory}\n"
                           "  - name: b\n    pakages: {apt: [numactl]}\n")
    assert problems(path) == [f"{path}:5:5: steps[1].pakages: unknown step type 'pakages' "
                              "(did you mean 'packages'?); known: packages, file, template, templates, "
                              "command, venv, pip, pip_uninstall, wheel, model, check, verify"]


def test_unknown_argument_with_line(tmp_path):
    path = write(tmp_path, "steps:\n  - venv:\n      path: /v\n      pythn: python3\n")
    [msg] = problems(path)
    assert msg.startswith(f"{path}:4:7: steps[0].venv.pythn: unknown argument for venv "
                          "(did you mean 'python'?)")


def test_bad_value_found_when_validated_with_an_inventory(tmp_path, brief):
    path = write(tmp_path, "steps:\n  - file:\n      path: /x\n      content: hi\n      mode: 644\n")
    [msg] = problems(path, brief)
    assert msg.startswith(f"{path}:5: steps[0].file.mode:") and "string" in msg


def test_unknown_variables(tmp_path):
    path = write(tmp_path, "steps:\n  - file: {path: '{{ gest.workdir }}', state: directory}\n"
                           "  - file:\n      path: '{{ guest.wrkdir }}/x'\n      state: directory\n")
    got = problems(path)
    assert got[0].startswith(f"{path}:2:") and "unknown variable 'gest.workdir' (did you mean 'guest'?)" in got[0]
    assert got[1].startswith(f"{path}:4:") and "(did you mean 'workdir'?)" in got[1]


@pytest.mark.parametrize("text,message", [
    ("- packages: {apt: [x]}\n", "a playbook is a mapping with `steps:`"),
    ("steps: []\n", "`steps` must be a non-empty list"),
    ("stepz: []\nsteps: [{command: {cmd: x}}]\n", "unknown key (did you mean 'steps'?)"),
    ("steps:\n  - name: only a name\n", "no step type given"),
    ("steps:\n  - packages: {apt: [a]}\n    command: {cmd: x}\n", "one step type per step"),
    ("steps:\n  - command: x\n", "the arguments of command must be a mapping"),
    ("steps:\n  - command: {cmd: x}\n    sudo: yes please\n", "sudo must be true or false"),
    ("steps:\n  - command: {cmd: x}\n    timeout: -1\n", "timeout must be a positive number"),
    ("steps:\n  - command: {cmd: x\n", "YAML syntax error"),
])
def test_structural_problems(tmp_path, text, message):
    got = problems(write(tmp_path, text))
    assert any(message in g for g in got), got
    assert all(g.startswith(str(tmp_path)) for g in got)


def test_every_problem_of_every_file_at_once(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text("steps:\n  - nope: {}\n")
    b.write_text("steps:\n  - venv: {bad: 1, path: /v}\n")
    with pytest.raises(PlaybookSpecError) as exc:
        load_playbooks([a, b])
    assert [p.file for p in exc.value.problems] == [str(a), str(b)]


def test_unknown_playbook_name_lists_shipped():
    with pytest.raises(PlaybookSpecError, match="no such playbook .shipped: base, launch, model, pytorch, serve, verify, vllm"):
        load_playbook("nope")


@pytest.mark.parametrize("inventory_path", [BRIEF, LAB], ids=["brief", "lab"])
def test_shipped_playbooks_load_and_validate(inventory_path):
    inv = load_inventory(inventory_path)
    assert set(DEFAULT_PLAYBOOKS) <= set(available_playbooks())
    books = load_playbooks(list(DEFAULT_PLAYBOOKS), inv)
    assert [b.name for b in books] == list(DEFAULT_PLAYBOOKS)
    for book in books:
        for step in book.steps:
            step.resolve(host_variables(inv, inv.nodes[-1]))  # every node's view is valid too


def test_interpolation(brief):
    v = host_variables(brief, brief.nodes[1])
    assert interpolate("{{ guest.workdir }}/x", v) == "/opt/vcfslm/x"
    assert interpolate("{{guest.wheelhouse}}", v) is None          # a whole reference keeps its type
    assert interpolate(["{{ find_links }}", "{{ offline }}"], v) == [[], False]
    assert interpolate({"a": "{{ node.name }}-{{ bench_ip }}"}, v) == {"a": "slm-02-172.16.25.22"}
    with pytest.raises(KeyError, match="it is null"):
        interpolate("x{{ guest.wheelhouse }}", v)
    with pytest.raises(KeyError, match="guest.nope"):
        interpolate("{{ guest.nope }}", v)


def test_values_are_validated_per_host_at_run_time(tmp_path, brief):
    book = load_playbook(write(tmp_path, "steps:\n  - file: {path: '{{ node.name }}', state: directory}\n"))
    step = book.steps[0]
    with pytest.raises(PlaybookError, match=rf"{tmp_path}/p.yaml:2: file: Value error, path must be absolute"):
        step.resolve(host_variables(brief, brief.nodes[0]))


@pytest.mark.parametrize("spec,req", [("2.13.0", "torch==2.13.0"), ("2.11.*", "torch==2.11.*"),
                                      (">=2.8,<3", "torch>=2.8,<3"), ("", "torch")])
def test_torch_requirement(spec, req):
    assert torch_requirement(spec) == req


def test_run_step_dry_run_runs_only_facts(tmp_path, brief):
    book = load_playbook(write(tmp_path, "steps:\n  - command: {cmd: make it, creates: /done}\n"), brief)
    t = FakeTransport("slm-01", {"test -e /done && echo yes || echo no": "no\n"})
    ctx = HostContext(brief, brief.nodes[0], host_variables(brief, brief.nodes[0]), t)
    result = run_step(book, book.steps[0], ctx, dry_run=True)
    assert (result.status, result.commands) == ("changed", ["make it"])
    assert t.calls == ["test -e /done && echo yes || echo no"]  # "make it" never ran
