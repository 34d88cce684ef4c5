"""`vcfslm provision` stages: the guest stage is called through vcfslm.guest.provision."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.cli import vcenter as cli
from vcfslm.guest.provision import GuestRun

BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"


def vm_result(failed=(), pending=(), throttled=()):
    outcomes = [SimpleNamespace(name=f"slm-0{i}", ok=f"slm-0{i}" not in failed,
                                status="failed" if f"slm-0{i}" in failed else "ok", message="",
                                step="", ip=None, moref=None, throttled=f"slm-0{i}" in throttled,
                                pending=["numCPUs: 8 -> 96"] if f"slm-0{i}" in pending else [])
                for i in range(1, 5)]
    return SimpleNamespace(
        outcomes=outcomes, failed=[o for o in outcomes if not o.ok],
        pending=[o for o in outcomes if o.ok and o.pending], warnings=[],
        throttled=[o for o in outcomes if o.throttled],
        plan=SimpleNamespace(change_count=3, path_lines=lambda: ["vCenter API 8.0.3.0, session API 8.0.3.0"]),
        to_dict=lambda: {"changes": 3, "vms": [o.name for o in outcomes]})


@pytest.fixture
def env(tmp_path):
    return {"VCFSLM_STATE": str(tmp_path / "state.json"), "VCFSLM_INVENTORY": ""}


@pytest.fixture
def guest_calls(mocker):
    calls = []

    def provision_guests(inventory, connect, reporter, **kw):
        calls.append((inventory.name, connect, kw))
        return SimpleNamespace(ok=True, hosts=[], failed_hosts=[], log_dir=None, dry_run=False,
                               duration=0.0)

    mocker.patch.object(cli, "_load_guest_stage",
                        return_value=SimpleNamespace(provision_guests=provision_guests, GuestRun=GuestRun))
    # the CLI builds the SSH connector (with the trust flag); the guest stage only uses it
    mocker.patch("vcfslm.cli.vcenter.ssh_connector", side_effect=lambda inv, rep, trust: ("ssh", trust))
    mocker.patch("vcfslm.cli.vcenter.summary_table", return_value="guests table")
    mocker.patch("vcfslm.cli.vcenter.summary_json", return_value={"ok": True})
    return calls


def test_stage_all_runs_vms_then_guests_and_remembers_the_inventory(mocker, env, guest_calls):
    mocker.patch.object(cli, "_run_vm_stage", return_value=vm_result())
    res = CliRunner().invoke(main, ["provision", str(BRIEF), "--trust-new-hosts", "-o", "json"], env=env)
    assert res.exit_code == 0, res.output
    # every guest at once: the brief's 4 nodes are under the SSH cap
    assert guest_calls == [("phi3-vx650v4", ("ssh", True), {"options": GuestRun(max_workers=4)})]
    doc = json.loads(res.stdout)
    assert doc["changes"] == 3 and doc["guests"] == {"ok": True}
    state = json.loads(Path(env["VCFSLM_STATE"]).read_text())
    assert state["inventory"] == str(BRIEF.resolve())


def test_failed_vm_skips_the_guest_stage(mocker, env, guest_calls):
    mocker.patch.object(cli, "_run_vm_stage", return_value=vm_result(failed=("slm-02",)))
    res = CliRunner().invoke(main, ["provision", str(BRIEF)], env=env)
    assert res.exit_code == 1
    assert "1 of 4 VM(s) failed: slm-02; the guest stage was skipped" in res.output
    assert guest_calls == []


def test_pending_restart_runs_guests_but_exits_1(mocker, env, guest_calls):
    mocker.patch.object(cli, "_run_vm_stage", return_value=vm_result(pending=("slm-03",)))
    res = CliRunner().invoke(main, ["provision", str(BRIEF)], env=env)
    assert res.exit_code == 1
    assert len(guest_calls) == 1
    assert "slm-03" in res.output and "--allow-restart" in res.output


def test_stage_vms_never_calls_guests(mocker, env, guest_calls):
    mocker.patch.object(cli, "_run_vm_stage", return_value=vm_result())
    res = CliRunner().invoke(main, ["provision", str(BRIEF), "--stage", "vms"], env=env)
    assert res.exit_code == 0, res.output
    assert guest_calls == []


def test_without_a_guest_module_stage_all_notes_it(mocker, env):
    mocker.patch.object(cli, "_load_guest_stage", return_value=None)
    mocker.patch.object(cli, "_run_vm_stage", return_value=vm_result())
    res = CliRunner().invoke(main, ["provision", str(BRIEF)], env=env)
    assert res.exit_code == 0 and "guest stage is not part of this build" in res.output
    res = CliRunner().invoke(main, ["provision", str(BRIEF), "--stage", "guests"], env=env)
    assert res.exit_code == 2


def test_bad_inventory_is_exit_2_before_any_connection(mocker, env, tmp_path):
    run = mocker.patch.object(cli, "_run_vm_stage")
    bad = tmp_path / "bad.yaml"
    bad.write_text(BRIEF.read_text().replace("vnuma_nodes: 4", "vnuma_nodes: 5"))
    for cmd in ("plan", "provision", "destroy"):
        res = CliRunner().invoke(main, [cmd, str(bad)], env=env)
        assert res.exit_code == 2 and "vm.vnuma_nodes" in res.output
    run.assert_not_called()


# ------------------------------------------------------------------ --parallel


def brief_with(tmp_path, **vcenter) -> Path:
    import yaml

    data = yaml.safe_load(BRIEF.read_text())
    data["vcenter"].update(vcenter)
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("parallel, setting, workers", [
    (None, None, 4),    # every VM: 4 nodes are under the cap
    (None, 2, 2),       # the inventory's vcenter.parallel
    (3, 2, 3),          # --parallel overrides it
    (64, None, 4),      # never more workers than VMs
])
def test_vcenter_workers_follow_flag_then_inventory_then_cap(tmp_path, parallel, setting, workers):
    from vcfslm.inventory_load import load_inventory

    inv = load_inventory(brief_with(tmp_path, parallel=setting))
    assert cli.vcenter_workers(inv, parallel) == workers


def test_parallel_reaches_the_driver_and_the_guest_stage(mocker, env, guest_calls):
    built = {}

    class Driver:
        def __init__(self, cfg, password, reporter, **kw):
            built.update(kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    mocker.patch("vcfslm.vsphere.driver.PyVmomiVCenter", Driver)
    mocker.patch("vcfslm.vsphere.credentials.resolve_password", return_value="pw")
    mocker.patch("vcfslm.vsphere.reconcile.provision", return_value=vm_result())
    mocker.patch.object(cli, "_print_summary")
    res = CliRunner().invoke(main, ["provision", str(BRIEF), "--parallel", "2"], env=env)
    assert res.exit_code == 0, res.output
    assert built["max_workers"] == 2
    assert guest_calls[0][2] == {"options": GuestRun(max_workers=2)}


@pytest.mark.parametrize("cmd", ["provision", "destroy"])
def test_parallel_below_one_is_exit_2(env, cmd):
    res = CliRunner().invoke(main, [cmd, str(BRIEF), "--parallel", "0"], env=env)
    assert res.exit_code == 2
    assert "Invalid value for '--parallel': 0 is not in the range x>=1." in res.output


def test_throttled_vms_name_the_throttling_and_a_lower_parallel(mocker, env, guest_calls):
    mocker.patch.object(cli, "_run_vm_stage",
                        return_value=vm_result(failed=("slm-02", "slm-03"), throttled=("slm-02", "slm-03")))
    res = CliRunner().invoke(main, ["provision", str(BRIEF)], env=env)
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert "error: 2 of 4 VM(s) failed: slm-02, slm-03; the guest stage was skipped" in lines
    assert ("vCenter is throttling: it kept refusing calls for 2 VM(s) (slm-02, slm-03) with 4 at once"
            in lines)
    assert "retry with a lower --parallel, e.g. --parallel 2" in lines
    assert guest_calls == []
