"""Each step type as data: one YAML file per case under cases/steps/ (arguments + facts ->
the exact commands still needed), in pyinfra's style.

A case file holds: step, args, sudo (default false), user (default root), facts
({fact key: value}; every fact the step asks for must be given), and either
commands (the operations as a dry run prints them) or error (a regex). Optional:
uploads ({remote path: regex the uploaded text must match}), wheel (the project
wheel the run would push). A fact value of "<rendered>" for sha256 stands for the
hash of what the step itself renders (a template already in place).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import yaml

from vcfslm.errors import PlaybookError
from vcfslm.guest import facts as F
from vcfslm.guest import host_facts as H
from vcfslm.guest.context import HostContext
from vcfslm.guest.ops import Upload, describe
from vcfslm.guest.playbook import host_variables
from vcfslm.guest.steps import STEP_TYPES
from vcfslm.guest.wheel import BuiltWheel
from vcfslm.inventory_load import load_inventory

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CASES = sorted((HERE / "cases" / "steps").glob("*.yaml"))
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"


def fact_value(key: str, value, rendered_sha: str | None):
    """A case's plain YAML fact value as the typed value the fact's parser would return."""
    kind = key.split(":", 1)[0]
    if kind == "packages":
        return F.Packages(value["manager"], frozenset(value.get("installed", [])))
    if kind == "file":
        if value is None:
            return F.FileState(None)
        value = dict(value)
        if value.get("sha256") == "<rendered>":
            value["sha256"] = rendered_sha
        return F.FileState(**value)
    if kind == "venv":
        return F.VenvState(**value) if value else F.VenvState(False)
    if kind == "pip":
        return F.PipState(value["venv_exists"], tuple(value.get("missing", [])))
    if kind == "versions":
        return F.Versions(**value)
    if kind == "interfaces":
        return H.parse_ip_addr_json(value)
    if kind == "dists":
        return frozenset(value)
    if kind == "output":
        return F.CommandOutput(**value)
    return value  # content (str | None), exists / ok (bool), ls (dict)


class CaseContext(HostContext):
    """A host context whose facts come from the case file."""

    def __init__(self, case: dict, inventory, node):
        super().__init__(inventory, node, host_variables(inventory, node), transport=None,
                         base_dir=HERE / "cases" / "steps")
        self.case_facts = case.get("facts") or {}
        self.user_name = case.get("user", "root")
        self.asked: list[str] = []
        self.rendered_sha: str | None = None
        w = case.get("wheel")
        self.wheel = _Wheel(BuiltWheel(Path(w["path"]), w["version"], w["sha256"])) if w else None

    @property
    def user(self) -> str:
        return self.user_name

    @property
    def offline(self) -> bool:
        return False

    def fact(self, fact: F.Fact):
        self.asked.append(fact.key)
        if fact.key not in self.case_facts:
            raise AssertionError(f"the case gives no fact {fact.key!r}")
        return fact_value(fact.key, self.case_facts[fact.key], self.rendered_sha)


class _Wheel:
    def __init__(self, built: BuiltWheel):
        self.built = built

    def get(self) -> BuiltWheel:
        return self.built


@pytest.fixture(scope="module")
def inventory():
    return load_inventory(BRIEF)


def test_there_are_cases_for_every_step_type():
    kinds = {yaml.safe_load(p.read_text())["step"] for p in CASES}
    assert kinds >= set(STEP_TYPES) - {"verify"}  # verify: tests/unit/test_guest_verify.py


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_step_case(path: Path, inventory):
    case = yaml.safe_load(path.read_text())
    step = STEP_TYPES[case["step"]].model_validate(case.get("args") or {})
    ctx = CaseContext(case, inventory, inventory.node(case.get("node", "slm-01")))
    if case["step"] == "template" and "error" not in case:
        ctx.rendered_sha = hashlib.sha256(step.render(ctx).encode()).hexdigest()
        ctx.asked.clear()
    if "error" in case:
        with pytest.raises(PlaybookError, match=case["error"]):
            step.plan(ctx, case.get("sudo", False))
        return
    ops = step.plan(ctx, case.get("sudo", False))
    lines = [describe(op, ctx.user).replace(f"{HERE}/cases/steps/", "") for op in ops]
    assert len(lines) == len(case["commands"]), lines
    for line, want in zip(lines, case["commands"], strict=True):
        if want.startswith("re:"):
            assert re.fullmatch(want[3:], line), line
        else:
            assert line == want
    uploads = {op.remote: (op.data or b"").decode() for op in ops if isinstance(op, Upload)}
    for remote, pattern in (case.get("uploads") or {}).items():
        assert remote in uploads, f"no upload to {remote}"
        assert re.search(pattern, uploads[remote], re.M), uploads[remote]
    unused = set(ctx.case_facts) - set(ctx.asked)
    assert not unused, f"facts the step never asked for: {unused}"


@pytest.mark.parametrize("bad", [
    ("file", {"path": "relative/x", "content": "a"}, "absolute"),
    ("file", {"path": "/x"}, "exactly one of content or src"),
    ("file", {"path": "/x", "content": "a", "mode": 644}, "string"),
    ("file", {"path": "/x", "content": "a", "mode": "0999"}, "pattern"),
    ("file", {"path": "/x", "state": "directory", "content": "a"}, "takes no content"),
    ("packages", {}, "apt and/or dnf"),
    ("pip", {"venv": "/v", "packages": []}, "at least 1"),
    ("wheel", {"venv": "/v", "dest": "/w", "extras": ["a b"]}, "pattern"),
    ("venv", {"path": "/v", "pythn": "python3"}, "Extra inputs"),
])
def test_bad_arguments_are_refused(bad):
    kind, args, message = bad
    with pytest.raises(Exception, match=message):
        STEP_TYPES[kind].model_validate(args)


def test_local_model_folder_is_pushed_then_unchanged(tmp_path, inventory):
    model = tmp_path / "phi3"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "w.safetensors").write_bytes(b"x" * 10)
    step = STEP_TYPES["model"].model_validate(
        {"model": str(model), "models_dir": "/opt/vcfslm/models", "python": "/opt/vcfslm/venv/bin/python"})
    marker = "/opt/vcfslm/models/phi3/.vcfslm-model"
    ctx = CaseContext({"facts": {f"content:{marker}": None}}, inventory, inventory.nodes[0])
    lines = [describe(op, "root") for op in step.plan(ctx, False)]
    assert lines[0] == "mkdir -p /opt/vcfslm/models/phi3 /opt/vcfslm/models/phi3/sub"
    assert lines[1:3] == [f"put {model}/config.json -> /opt/vcfslm/models/phi3/config.json",
                          f"put {model}/sub/w.safetensors -> /opt/vcfslm/models/phi3/sub/w.safetensors"]
    assert lines[3].startswith("put <") and lines[3].endswith(f"-> {marker}")
    manifest = [op for op in step.plan(ctx, False) if isinstance(op, Upload) and op.remote == marker][0].data
    ctx = CaseContext({"facts": {f"content:{marker}": manifest.decode()}}, inventory, inventory.nodes[0])
    assert step.plan(ctx, False) == []


def test_a_synthetic_config_is_staged_where_the_worker_reads_it(tmp_path, inventory):
    """synthetic:config=PATH: the guest gets the file, and the worker's source names the
    staged copy; once there (same sha256) nothing is sent again."""
    from vcfslm.guest_layout import model_ref

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}\n')
    model = f"synthetic:config={config},layers=2"
    step = STEP_TYPES["model"].model_validate(
        {"model": model, "models_dir": "/opt/vcfslm/models", "python": "/opt/vcfslm/venv/bin/python"})
    slug = "synthetic-config-" + str(config).strip("/").replace("/", "-") + "-layers-2"
    marker, staged = f"/opt/vcfslm/models/{slug}/.vcfslm-model", f"/opt/vcfslm/models/{slug}/config.json"
    ctx = CaseContext({"facts": {f"file:{marker}": None, f"file:{staged}": None}}, inventory, inventory.nodes[0])
    uploads = [op for op in step.plan(ctx, False) if isinstance(op, Upload)]
    assert [op.remote for op in uploads] == [marker, staged]
    assert uploads[1].data == config.read_bytes()
    moved = inventory.model_copy(update={"guest": inventory.guest.model_copy(update={"model": model})})
    assert model_ref(moved) == f"synthetic:config={staged},layers=2"
    sha = hashlib.sha256(config.read_bytes()).hexdigest()
    ctx = CaseContext({"facts": {f"file:{marker}": None, f"file:{staged}": {"kind": "file", "sha256": sha}}},
                      inventory, inventory.nodes[0])
    assert [op.remote for op in step.plan(ctx, False) if isinstance(op, Upload)] == [marker]
    config.unlink()
    with pytest.raises(PlaybookError, match="does not exist on this machine"):
        step.plan(ctx, False)
