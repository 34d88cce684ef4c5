"""Rendered launch templates: golden files, and every rendered shell script passes `bash -n`.

Refresh the golden files after an intended template change with
VCFSLM_UPDATE_GOLDEN=1 pytest tests/unit/test_guest_templates.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vcfslm.guest.playbook import host_variables
from vcfslm.guest.templates import render_template
from vcfslm.inventory_load import load_inventory
from vcfslm.resources import resource_dir

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
INVENTORIES = {"brief": (ROOT / "inventories" / "vx650v4-4node.yaml", "ens224"),
               "lab": (ROOT / "inventories" / "lab.yaml", "lo")}
TEMPLATES = ["env.sh.j2", "hosts.j2", "rank.sh.j2"]


def render(template: str, which: str) -> str:
    path, iface = INVENTORIES[which]
    inv = load_inventory(path)
    context = {**host_variables(inv, inv.nodes[0]), "bench_interface": iface}
    return render_template(template, context)


def cases():
    for template in TEMPLATES:
        for which in INVENTORIES:
            yield pytest.param(template, which, id=f"{template}-{which}")


@pytest.mark.parametrize("template,which", list(cases()))
def test_golden(template, which):
    if not (resource_dir("templates") / template).exists():
        pytest.skip(f"{template} is not in templates/ yet")
    text = render(template, which)
    golden = GOLDEN / f"{template.removesuffix('.j2')}.{which}"
    if os.environ.get("VCFSLM_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden} (VCFSLM_UPDATE_GOLDEN=1 writes it)"
    assert text == golden.read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("template,which", [c for c in cases() if c.values[0].endswith(".sh.j2")])
def test_rendered_scripts_pass_bash_n(template, which, tmp_path):
    if not (resource_dir("templates") / template).exists():
        pytest.skip(f"{template} is not in templates/ yet")
    script = tmp_path / "script.sh"
    script.write_text(render(template, which))
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_env_sh_exports(tmp_path):
    script = tmp_path / "env.sh"
    script.write_text(render("env.sh.j2", "brief"))
    out = subprocess.run(["bash", "-c", f". {script}; env"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"]}).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "ens224"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VCFSLM_MODEL"] == "microsoft/Phi-3-mini-128k-instruct"


def test_hosts_lists_every_node_on_the_bench_network():
    lines = [line.split() for line in render("hosts.j2", "brief").splitlines() if not line.startswith("#")]
    assert lines == [["172.16.25.21", "slm-01-bench"], ["172.16.25.22", "slm-02-bench"],
                     ["172.16.25.23", "slm-03-bench"], ["172.16.25.24", "slm-04-bench"]]
