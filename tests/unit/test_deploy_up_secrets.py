"""serve up's order with the key and the certificates (deploy/service.py's _up, its nodes
stood in by a recording driver): a new key is saved, 0600, before any node changes; a key
file that disagrees with the nodes stops it before anything changes; a dry run saves
nothing; the CA is beside the key and named for clients; the key is in no result field a
command prints."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from test_deploy_support import KEY, inventory

from vcfslm.deploy import keys, service
from vcfslm.deploy.changes import NodeState
from vcfslm.progress import NullReporter


class RecordingNode:
    """A node with nothing deployed (or holding `held`), recording what serve up asks of it."""

    def __init__(self, name: str, log: list, key_file: Path, held: str | None = None):
        self.name, self.log, self.key_file, self.held = name, log, key_file, held

    def manifest(self):
        return {"programs": {}} if self.held else None

    def read_key(self):
        return self.held

    def supervisor_of_guest(self, choice):
        return "supervisord"

    def observe(self, desired):
        return NodeState({f.path: None for f in desired.files}, None, False, {})

    def apply(self, desired, changes):
        saved = self.key_file.is_file() and stat.S_IMODE(self.key_file.stat().st_mode)
        self.log.append(("apply", self.name, saved))

    def down(self):
        self.log.append(("down", self.name))
        return []


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(service, "wait_healthy", lambda *a, **kw: {})
    monkeypatch.setattr(service, "check_front_door", lambda *a, **kw: {"keyless": 401})


def run(tmp_path, key_file: Path, held: str | None = None, **options):
    inv = inventory(tmp_path, {"nodes": ["slm-01", "slm-02"]})
    log: list = []
    drivers = {n.name: RecordingNode(n.name, log, key_file, held if n.name != "slm-03" else None)
               for n in inv.nodes}
    chosen = [inv.node("slm-01"), inv.node("slm-02")]
    result = service._up(inv, drivers, chosen, service.UpOptions(key_file=str(key_file), **options),
                         NullReporter(), "slm")
    return result, log


def test_a_new_key_is_saved_0600_before_any_node_changes(tmp_path, quiet):
    key_file = tmp_path / "keys" / "slm.key"
    result, log = run(tmp_path, key_file)
    # The nodes change in parallel: each found the key saved, 0600, whatever their order.
    assert sorted(e for e in log if e[0] == "apply") == [("apply", "slm-01", 0o600), ("apply", "slm-02", 0o600)]
    assert result.new_key == keys.read_key_file(key_file) and result.key_file == str(key_file)
    assert result.ca_file == str(tmp_path / "keys" / "slm-tls" / "ca.pem") and Path(result.ca_file).is_file()
    assert result.deployment.endpoint.startswith("https://")
    assert result.new_key not in repr(result) and result.new_key not in repr(result.deployment)


def test_a_key_file_that_disagrees_with_the_nodes_changes_nothing(tmp_path, quiet):
    key_file = tmp_path / "slm.key"
    keys.write_key_file(key_file, KEY)
    with pytest.raises(keys.KeyFileError, match="--rotate-key"):
        run(tmp_path, key_file, held="n0des-key-0123456789abcdef")
    result, log = run(tmp_path, key_file, held="n0des-key-0123456789abcdef", rotate_key=True)
    # The nodes take the file's key: first beside their own (a rolling rotation's two phases), then alone.
    assert result.new_key == KEY and [e[0] for e in log].count("apply") == 4
    assert keys.read_key_file(key_file) == KEY and not Path(f"{key_file}.new").exists()


def test_the_nodes_key_is_saved_to_a_missing_key_file_and_not_called_new(tmp_path, quiet):
    key_file = tmp_path / "slm.key"
    held = "n0des-key-0123456789abcdef"
    result, _ = run(tmp_path, key_file, held=held)
    assert keys.read_key_file(key_file) == held and result.new_key is None


def test_a_dry_run_saves_no_key_and_no_certificate(tmp_path, quiet):
    key_file = tmp_path / "keys" / "slm.key"
    result, log = run(tmp_path, key_file, dry_run=True)
    assert log == [] and not key_file.exists() and not (tmp_path / "keys").exists()
    assert result.new_key is not None                     # what the nodes would take; never saved or printed
