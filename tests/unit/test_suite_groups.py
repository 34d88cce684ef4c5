"""The parallel suite's grouping (tests/conftest.py): shared fixtures stay on one worker."""

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import LONGEST_FIRST, start_rank, xdist_group_for


def test_the_provisioned_labs_users_share_one_group_whatever_else_they_use():
    assert xdist_group_for([("tmp_path", "function"), ("provisioned_lab", "session")]) == "lab"
    assert xdist_group_for([("walkthrough", "module"), ("provisioned_lab", "session")]) == "lab"


def test_a_module_on_the_unprovisioned_lab_is_a_unit_of_its_own():
    # vcsim and the sshd guests start in seconds: a worker that takes such a module starts its own.
    assert xdist_group_for([("tmp_path", "function"), ("ssh_guests", "session")]) == "module"
    assert xdist_group_for([("vcsim_server", "session")], "tests/integration/test_serve_deploy.py") == "module"


def test_the_modules_that_run_vllm_on_the_lab_share_a_second_lab():
    lab = [("tmp_path", "function"), ("provisioned_lab", "session")]
    assert xdist_group_for(lab, "tests/integration/test_workloads_lab.py") == "lab-2"
    assert xdist_group_for(lab, "tests/integration/test_bench_cluster.py") == "lab"
    # A module that is not a lab user is grouped by its fixtures alone, whatever its name.
    assert xdist_group_for([("engine", "module")], "tests/integration/test_serve_deploy.py") == "module"


def test_the_longest_units_start_first_then_the_integration_tests_then_the_rest():
    first = start_rank("tests/integration/test_bench_cluster.py", "lab")
    assert first < len(LONGEST_FIRST)
    assert start_rank("tests/integration/test_peers_equivalence.py", "tests/integration/test_peers_equivalence.py") \
        < len(LONGEST_FIRST)
    integration = start_rank("tests/integration/test_worker_torchrun.py", None)
    unit = start_rank("tests/unit/test_layering.py", None)
    assert first < integration < unit
    assert start_rank("tests/unit/test_bench_numerics.py", "tests/unit/test_bench_numerics.py") == unit


def test_a_module_scoped_fixture_keeps_its_module_together():
    assert xdist_group_for([("tmp_path", "function"), ("engine", "module")]) == "module"


def test_tests_with_function_fixtures_only_go_wherever_a_worker_is_free():
    assert xdist_group_for([("tmp_path", "function"), ("monkeypatch", "function")]) is None
    assert xdist_group_for([]) is None


def test_xdist_keeps_a_marked_group_on_one_worker(tmp_path):
    """The mechanism make test relies on, run for real: a module-scoped fixture's tests land
    on one worker under `-n 2 --dist loadgroup` (a pytest or xdist release that drops the
    group spreads them, and every worker would build the fixture again)."""
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_shared.py").write_text(
        "import os, pytest\n"
        "@pytest.fixture(scope='module')\ndef shared():\n    return 1\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_one(shared, i):\n    print('WORKER', os.environ['PYTEST_XDIST_WORKER'])\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider", str(tmp_path / "test_shared.py")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {line.split()[0] for line in done.stdout.splitlines() if " PASSED " in line}
    assert len(workers) == 1, done.stdout


def test_xdist_starts_the_integration_tests_before_the_rest(tmp_path):
    """The order make test relies on, run for real: collected first, `apps/` would run first;
    under `--dist loadgroup` the integration test does (xdist's own order, by the number of
    tests per unit, is off)."""
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tmp_path / "conftest.py")
    for folder, name in (("apps", "test_first_collected"), ("integration", "test_integration")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{name}.py").write_text(
            "import pytest\n"
            "@pytest.fixture(scope='module')\ndef shared():\n    return 1\n"
            f"@pytest.mark.parametrize('i', range(3))\ndef {name}(shared, i):\n    pass\n")
    (tmp_path / "apps" / "test_single.py").write_text("def test_one():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line for line in done.stdout.splitlines() if " PASSED " in line]
    assert len(ran) == 7 and all("test_integration" in line for line in ran[:3]), done.stdout
