"""CLI skeleton: validate/schema/--version, exit codes, no heavy imports at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from vcfslm import __version__
from vcfslm.cli import LAZY_COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"
HEAVY = ("torch", "transformers", "pyVmomi", "paramiko", "matplotlib", "vmware", "com.vmware")


def run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and __version__ in r.output


def test_validate_ok_text_and_json():
    r = run("validate", str(BRIEF))
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "valid" in flat and "72-95" in flat and "[4, 16, 32, 64] streams/VM" in flat
    r = run("validate", str(BRIEF), "--output", "json")
    data = json.loads(r.output)
    assert data["valid"] and data["bench"]["scenarios"] == 12
    assert [x["cpus"] for x in data["ranks"]] == ["0-23", "24-47", "48-71", "72-95"]


def test_validate_bad_inventory_exit_2_no_traceback(tmp_path):
    bad = tmp_path / "cluster.yaml"
    bad.write_text(BRIEF.read_text().replace("vnuma_nodes: 4 ", "vnuma_nodes: 5 "))
    proc = subprocess.run([sys.executable, "-m", "vcfslm.cli", "validate", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{bad}:" in proc.stderr and "vm.vnuma_nodes: 96 vCPUs cannot split into 5 vNUMA nodes" in proc.stderr
    assert proc.stdout == ""


def test_inventory_from_env(tmp_path):
    r = run("validate", env={"VCFSLM_INVENTORY": str(BRIEF), "VCFSLM_STATE": str(tmp_path / "s.json")})
    assert r.exit_code == 0, r.output


def test_no_inventory_anywhere_is_exit_2(tmp_path):
    r = run("validate", env={"VCFSLM_INVENTORY": "", "VCFSLM_STATE": str(tmp_path / "none.json")})
    assert r.exit_code == 2 and "no inventory given" in r.output


def test_schema_is_json_schema_with_descriptions():
    r = run("schema")
    schema = json.loads(r.output)
    assert schema["title"] == "vcfslm inventory"
    assert set(schema["required"]) >= {"name", "vcenter", "placement", "vm", "nodes"}
    vm = schema["$defs"]["VMSpec"]["properties"]
    assert "vNUMA" in vm["vnuma_nodes"]["description"]
    assert schema["$defs"]["VMSpec"]["additionalProperties"] is False


def test_help_and_validate_import_nothing_heavy():
    code = ("import sys, runpy; sys.argv=['vcfslm','validate',%r];\n"
            "from vcfslm.cli import main\n"
            "try: main()\nexcept SystemExit: pass\n"
            "bad=[m for m in sys.modules if m.split('.')[0] in %r]; print(bad); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code % (str(BRIEF), HEAVY)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import sys; from vcfslm.cli import main\n"
                           "sys.argv=['vcfslm','--help']\ntry: main()\nexcept SystemExit: pass\n"
                           f"bad=[m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]; assert not bad, bad"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _commands():
    """Every command of the group, loaded (its module imported)."""
    with click.Context(main) as ctx:
        return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}


def test_every_command_has_help_with_examples():
    for name, command in _commands().items():
        r = run(name, "--help")
        assert r.exit_code == 0, (name, r.output)
        if not getattr(command, "commands", None):  # leaf commands show examples
            assert "Example" in r.output or "example" in r.output, name


def test_the_group_lists_each_command_with_its_own_line_without_loading_it():
    commands = _commands()
    assert set(commands) == set(LAZY_COMMANDS) and all(commands.values())
    for name, command in commands.items():
        # The line `vcfslm --help` shows is the command's own first sentence.
        assert click.Command(name, help=LAZY_COMMANDS[name][1]).get_short_help_str(1000) == \
            command.get_short_help_str(1000), name
    page = run("--help").output
    assert "  plan       Show what provision would change in vCenter; change nothing." in page.splitlines()
    # ... so that `vcfslm --help` imports none of the command modules (they import at their top).
    code = ("import sys; from vcfslm.cli import main, LAZY_COMMANDS\n"
            "sys.argv=['vcfslm','--help']\ntry: main()\nexcept SystemExit: pass\n"
            "loaded=[m for m, _ in LAZY_COMMANDS.values() if 'vcfslm.cli.' + m in sys.modules]\n"
            "assert not loaded, loaded")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
