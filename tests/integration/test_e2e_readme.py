"""End to end: the documented lab walkthrough, command by command, on a fresh lab; and every
command README.md and docs/*.md show, checked as written.

Every command of docs/operations.md's "The local lab" block runs as written (the benches
get a smaller matrix so CI stays quick), then the outputs are checked: the VMs in vcsim
carry the inventory's configuration, the guests pass verification, both run directories
are complete (tests/run_checks.py: every rank, window and gate; nothing left running), the
report holds the crossover table, and `lab down` leaves nothing running. The README's
"From the demo to your vCenter" block and every other bash block of the README and docs/
are parsed by the CLI, make and the benchmark scripts (tests/doc_commands.py).
"""

from __future__ import annotations

import json
import os
import shlex
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from doc_commands import README, ROOT, block_commands, check_command, check_text, doc_files
from run_checks import assert_complete, run_processes

from vcfslm.lab import generate

pytestmark = pytest.mark.integration

# The lab walkthrough lives in the operations page; the README links to it.
LAB_DOC = ROOT / "docs" / "operations.md"
LAB_HEADING = "## The local lab"
VCENTER_HEADING = "## From the demo to your vCenter"
# Smaller matrix for CI: one input length, one measured window, 64 MiB probe buffers (a
# probe of the default 1 GiB per rank is half of a lab run and no check reads it); the
# 4-node run eager and without probes (its 8 ranks' GEMM probes on 2 cores were half its
# time; the report's performance model calibrates on the 1-node run's).
FAST = ["--scenarios", "*x16", "--repeats", "1", "--probe-mib", "64"]


def lab_commands() -> list[str]:
    """The lab walkthrough's commands, each as one shell line."""
    return [shlex.join(argv) for argv in block_commands(LAB_DOC, LAB_HEADING)]


def test_lab_block_is_the_pipeline():
    subcommands = [argv[1] for argv in block_commands(LAB_DOC, LAB_HEADING) if argv[0] == "vcfslm"]
    assert subcommands == ["lab", "validate", "plan", "provision", "bench", "bench", "report", "size",
                           "lab", "lab"]


def test_readme_links_the_lab_walkthrough():
    assert "docs/operations.md" in README.read_text()


def test_readme_vcenter_block_commands_parse():
    """The own-vCenter walkthrough: every vcfslm command in it is a real command with real options."""
    cmds = block_commands(README, VCENTER_HEADING)
    vcfslm_cmds = [argv for argv in cmds if argv[0] == "vcfslm"]
    assert len(vcfslm_cmds) >= 8, cmds
    for argv in vcfslm_cmds:
        assert check_command(argv) == [], argv


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_commands_work_as_written(doc):
    """Every vcfslm command, make target and benchmark script a doc shows exists, with its options."""
    assert check_text(doc.read_text()) == []


def test_demo_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "demo.sh")], check=True)


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """Run the documented lab block in a fresh folder with its own lab; yield what it left."""
    work = tmp_path_factory.mktemp("readme")
    lab_dir = work / "lab"
    env = {**os.environ, "VCFSLM_LAB_DIR": str(lab_dir), "VCFSLM_STATE": str(work / "state.json"),
           "COLUMNS": "200"}
    env.pop("VCFSLM_INVENTORY", None)
    outputs: dict[str, subprocess.CompletedProcess] = {}
    cmds = lab_commands()
    try:
        for cmd in cmds:
            argv = shlex.split(cmd)
            if argv[0] == ".":  # `. ~/.vcfslm/lab/lab.env`: the lab's env file, in our lab folder
                env.update(generate.parse_env_file((lab_dir / "lab.env").read_text()))
                continue
            if argv[:2] == ["vcfslm", "lab"] and argv[2] == "down":
                continue  # after the checks below
            if argv[1] == "bench":
                argv += FAST + (["--compile", "eager", "--no-probe"] if "4" in argv else [])
            proc = subprocess.run([sys.executable, "-m", "vcfslm.cli", *argv[1:]], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=900)
            outputs[cmd] = proc
            assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
        yield work, env, outputs
    finally:
        down = subprocess.run([sys.executable, "-m", "vcfslm.cli", "lab", "down"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr


def test_vms_exist_in_vcsim_with_the_inventorys_config(walkthrough):
    from pyVim.connect import Disconnect, SmartConnect
    from pyVmomi import vim

    work, env, _ = walkthrough
    inv = yaml.safe_load(Path(env["VCFSLM_INVENTORY"]).read_text())
    vc = inv["vcenter"]
    ctx = ssl.create_default_context(cafile=vc["ca_bundle"])
    si = SmartConnect(host=vc["host"], port=vc["port"], user=vc["user"],
                      pwd=env["VCFSLM_VCENTER_PASSWORD"], sslContext=ctx)
    try:
        view = si.content.viewManager.CreateContainerView(si.content.rootFolder, [vim.VirtualMachine], True)
        vms = {vm.name: vm for vm in view.view}
        for node in inv["nodes"]:
            vm = vms[node["name"]]
            assert vm.config.hardware.numCPU == inv["vm"]["vcpus"]
            assert vm.config.hardware.numCoresPerSocket == inv["vm"]["cores_per_socket"]
            assert vm.config.memoryReservationLockedToMax is True
            extra = {o.key: str(o.value) for o in vm.config.extraConfig}
            assert extra["vcfslm.owner"] == inv["name"]
            assert extra["numa.vcpu.maxPerVirtualNode"] == str(inv["vm"]["vcpus"] // inv["vm"]["vnuma_nodes"])
            assert extra["numa.nodeAffinity"] == ",".join(map(str, inv["vm"]["host_numa_nodes"]))
            assert vm.runtime.powerState == "poweredOn"
    finally:
        Disconnect(si)


def test_guests_verified(walkthrough):
    work, env, _ = walkthrough
    proc = subprocess.run([sys.executable, "-m", "vcfslm.cli", "verify"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_both_runs_complete_and_the_report_answers(walkthrough):
    work, env, outputs = walkthrough
    inv = yaml.safe_load(Path(env["VCFSLM_INVENTORY"]).read_text())
    ranks = inv["bench"]["ranks_per_node"]
    for run, nodes in (("lab-1n", 1), ("lab-4n", 4)):
        # every rank, every scenario, every window, its skew, its numerics gate and its log
        meta, records = assert_complete(work / "runs" / run, nodes, ranks, len(inv["bench"]["batch_sizes"]), 1)
        assert {(r.batch_per_rank, r.input_tokens) for r in records} == {(b, 16) for b in inv["bench"]["batch_sizes"]}
        if nodes > 1:   # a cluster run records what vcsim reports of its VMs
            assert "unreachable" not in meta.vcenter, meta.vcenter
            assert set(meta.vcenter["vms"]) == set(meta.nodes), meta.vcenter
        assert not run_processes(run)
    cluster = next(p.stdout for c, p in outputs.items() if "--run-id lab-4n" in c)
    assert "vcfslm report" in cluster   # the run tells what to do with it next
    report_dir = work / "runs" / "lab-1n"
    for name in ("report.html", "report.md", "tables.csv"):
        assert (report_dir / name).stat().st_size > 0, name
    md = (report_dir / "report.md").read_text()
    # The report opens with the answer table, before any figure.
    assert md.index("## Answer") < md.index("| model | SLO | input tokens | threshold (streams/VM)") < md.index("![")
    assert list(report_dir.glob("fig-*.png"))
    size_out = next(p.stdout for c, p in outputs.items() if c.startswith("vcfslm size"))
    assert "node" in size_out.lower()


def test_lab_down_leaves_nothing(walkthrough):
    work, env, _ = walkthrough
    status = subprocess.run([sys.executable, "-m", "vcfslm.cli", "lab", "status", "-o", "json"], cwd=work,
                            env=env, capture_output=True, text=True, timeout=60)
    services = json.loads(status.stdout)["services"]
    assert len(services) == 5 and all(s["running"] for s in services)
    subprocess.run([sys.executable, "-m", "vcfslm.cli", "lab", "down"], cwd=work, env=env, check=True,
                   capture_output=True, timeout=120)
    for pid in (s["pid"] for s in services):
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", pid
