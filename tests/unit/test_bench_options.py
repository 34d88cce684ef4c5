"""`vcfslm bench`'s options are declared once (cli/bench_options.py): each declaration is the
command's flag, the inventory key the run reads, the default and the rule a --resume follows."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.cli.bench import bench
from vcfslm.cli.bench_options import BY_NAME, GROUPS, SETTINGS
from vcfslm.cli.bench_spec import Resumed, check_flags, check_resume_flags, resolve
from vcfslm.errors import UsageError
from vcfslm.inventory import load_inventory
from vcfslm.results import atomic_write_json, read_meta
from vcfslm.runspec import RunSpec

LAB = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"


def _inventory(tmp_path: Path, **bench_settings):
    doc = yaml.safe_load(LAB.read_text())
    doc["bench"].update(bench_settings)
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_inventory(path)


def _recorded(tmp_path: Path, spec: RunSpec) -> Resumed:
    """A run folder whose meta.json recorded `spec`, as --resume reads it."""
    run_dir = tmp_path / spec.run_id
    run_dir.mkdir()
    atomic_write_json(run_dir / "meta.json", {
        "run_id": spec.run_id, "created": "2026-01-01T00:00:00Z", "command": ["vcfslm"], "mode": spec.mode,
        "nodes": list(spec.nodes), "ranks_per_node": spec.ranks, "threads_per_rank": spec.threads or 1,
        "model": spec.model, "matrix": spec.matrix_record(), "spec": spec.record()})
    return Resumed(run_dir, read_meta(run_dir))


def test_a_field_declared_once_is_a_flag_an_inventory_key_and_a_resume_rule(tmp_path):
    setting = BY_NAME["repeats"]
    assert (setting.flags, setting.spec, setting.inventory, setting.resume) == (
        ("--repeats",), "matrix.repeats", "bench.repeats", True)

    # The flag: the command has it, with the declared help, in the declared --help section.
    [param] = [p for p in bench.params if p.name == "repeats"]
    assert param.opts == ["--repeats"] and param.help == setting.help
    page = CliRunner().invoke(main, ["bench", "--help"]).output
    section = page.split(f"{setting.group}:\n", 1)[1].split("\n\n", 1)[0]
    assert "--repeats" in section

    # The inventory key, under the flag, over the one default (whatever the mode).
    inventory = _inventory(tmp_path, repeats=5)
    assert resolve({"local": True}, inventory, None, "local").matrix.repeats == 5
    assert resolve({"local": True, "repeats": 7}, inventory, None, "local").matrix.repeats == 7
    assert resolve({"nodes": 1}, inventory, None, "cluster").matrix.repeats == 5
    assert resolve({"local": True}, None, None, "local").matrix.repeats == setting.default == 3
    endpoint = {"serve": True, "rates": [1.0], "endpoint": "http://h:1", "key_file": "k", "model": "m"}
    assert resolve(endpoint, None, None, "endpoint").serve.repeats == setting.default

    # The resume rule: a resumed static run takes a new --repeats over what it recorded ...
    first = resolve({"local": True, "run_id": "r1"}, inventory, None, "local")
    resumed = _recorded(tmp_path, first)
    check_resume_flags({"repeats": 9})
    check_flags({"local": True, "repeats": 9}, "local", resumed.kind, resumed)
    again = resolve({"local": True, "repeats": 9}, None, resumed, "local")
    assert again.matrix.repeats == 9 and again.replaced(matrix=first.matrix) == first.replaced(command=())
    # ... and refuses what its declaration keeps (--percentile: resume=False).
    assert BY_NAME["percentile"].resume is False
    with pytest.raises(UsageError, match="its own SLOs and rule"):
        check_resume_flags({"percentile": "p50"})


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_declaration_is_whole(setting):
    """Its flag is the command's, its inventory key is the inventory's, its section is shown."""
    assert setting.group in GROUPS
    if setting.flags:
        [param] = [p for p in bench.params if p.name == setting.name]
        assert set(param.opts) == set(setting.flags)
    if setting.inventory:
        value = load_inventory(LAB).model_dump()
        for part in setting.inventory.split("."):
            assert isinstance(value, dict) and part in value, setting.inventory
            value = value[part]
