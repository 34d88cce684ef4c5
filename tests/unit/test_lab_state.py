"""Lab folder bookkeeping and the `vcfslm lab` commands without starting servers."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.errors import UsageError
from vcfslm.lab import lab
from vcfslm.lab.process import ProcessRecord


def test_lab_dir_precedence(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("VCFSLM_LAB_DIR", str(tmp_path / "env"))
    assert lab.lab_dir(tmp_path / "arg") == tmp_path / "arg"
    assert lab.lab_dir() == tmp_path / "env"
    monkeypatch.delenv("VCFSLM_LAB_DIR")
    assert lab.lab_dir() == Path("~/.vcfslm/lab").expanduser().resolve()


def test_state_round_trips(tmp_path: Path):
    from vcfslm.lab import vcsim

    state = lab.LabState(
        dir=tmp_path, nodes=1,
        vcsim=vcsim.Vcsim(url="u", host="h", port=1, user="a", ca_file="c", hosts=4, template="t",
                          api_version="6.5", log="l", process=ProcessRecord(10, 20, "m")),
        guests=[], inventory=tmp_path / "inventory.yaml", env_file=tmp_path / "lab.env",
        bench_port=29500)
    lab.save_state(state)
    again = lab.load_state(tmp_path)
    assert again.to_json() == state.to_json()


def test_no_lab_means_empty_status_and_a_quiet_down(tmp_path: Path):
    assert lab.load_state(tmp_path) is None
    assert lab.status(tmp_path) == []
    assert lab.down(tmp_path) == []


def test_corrupt_state_is_an_error_naming_the_file(tmp_path: Path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(lab.LabError, match="state.json"):
        lab.load_state(tmp_path)


def test_down_with_dead_processes_removes_the_state(tmp_path: Path):
    state = lab.LabState(dir=tmp_path, nodes=0, vcsim=None, guests=[],
                         inventory=tmp_path / "inventory.yaml", env_file=tmp_path / "lab.env",
                         bench_port=1)
    lab.save_state(state)
    state.inventory.write_text("x")
    assert lab.down(tmp_path) == []
    assert not state.state_file.exists() and not state.inventory.exists()


def test_password_is_generated_once_and_private(tmp_path: Path):
    first = lab.vcenter_password(tmp_path)
    assert len(first) >= 16
    assert lab.vcenter_password(tmp_path) == first
    assert (tmp_path / "vcsim" / "password").stat().st_mode & 0o777 == 0o600


def test_up_rejects_a_bad_node_count(tmp_path: Path):
    with pytest.raises(UsageError):
        lab.up(tmp_path, nodes=0)


def test_cli_lab_is_registered_with_examples():
    result = CliRunner().invoke(main, ["lab", "--help"])
    assert result.exit_code == 0
    for command in ("up", "status", "down"):
        assert command in result.output
    assert "vcfslm lab up" in result.output


def test_cli_status_without_a_lab(tmp_path: Path):
    result = CliRunner().invoke(main, ["lab", "status", "--dir", str(tmp_path)])
    assert result.exit_code == 0
    assert "no lab" in result.output


def test_cli_bad_method_delay_is_bad_input(tmp_path: Path):
    result = CliRunner().invoke(main, ["lab", "up", "--dir", str(tmp_path), "--method-delay", "nope"])
    assert result.exit_code == 2
    assert "--method-delay" in result.output


def _venv(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    return path


def test_the_lab_finds_the_operators_vllm_venv(tmp_path: Path):
    checkout = tmp_path / "checkout"
    assert lab.find_vllm_venv({}, checkout) is None                    # not installed
    _venv(checkout / ".venv-vllm")
    assert lab.find_vllm_venv({}, checkout) == checkout / ".venv-vllm"
    other = _venv(tmp_path / "elsewhere")
    assert lab.find_vllm_venv({"VCFSLM_VLLM_VENV": str(other)}, checkout) == other
    assert lab.find_vllm_venv({"VCFSLM_VLLM_VENV": str(tmp_path / "none")}, checkout) is None


@pytest.mark.parametrize("installed", [True, False])
def test_lab_files_name_the_vllm_venv_when_installed(tmp_path: Path, monkeypatch, installed):
    import yaml

    from vcfslm.inventory_load import load_inventory
    from vcfslm.lab import guests, vcsim

    venv = _venv(tmp_path / "vllm") if installed else tmp_path / "missing"
    monkeypatch.setenv("VCFSLM_VLLM_VENV", str(venv))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(lab, "seed_guest_venv", lambda path: None)
    guest = guests.Guest(name="slm-01", address="127.0.0.11", bench_address="127.0.1.11", port=40000,
                         user="me", key="/k", known_hosts="/kh", workdir=str(tmp_path / "g"),
                         host_public_key="", config="", log="", process=ProcessRecord(10, 20, "sshd"))
    state = lab.LabState(
        dir=tmp_path, nodes=1,
        vcsim=vcsim.Vcsim(url="u", host="127.0.0.1", port=8989, user="a", ca_file="/ca.pem", hosts=4,
                          template="t", api_version="6.5", log="l", process=ProcessRecord(10, 20, "m")),
        guests=[guest], inventory=tmp_path / "inventory.yaml", env_file=tmp_path / "lab.env",
        bench_port=29500)
    lab.write_lab_files(state, "pw")
    doc = yaml.safe_load(state.inventory.read_text())
    assert doc["bench"]["serve"]["vllm"]["venv"] == (str(venv) if installed else None)
    assert (tmp_path / "work" / "cache" / "inductor").resolve() == (tmp_path / "inductor").resolve()
    load_inventory(state.inventory)                                 # valid either way


def test_lab_guests_share_this_machines_inductor_cache(tmp_path: Path, monkeypatch):
    host = tmp_path / "host-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(host))
    link = tmp_path / "lab" / "work" / "cache" / "inductor"
    lab.share_inductor_cache(link)
    assert link.is_symlink() and link.resolve() == host.resolve() and host.is_dir()
    (link / "graph").write_text("compiled")                 # a guest's entry lands in the host's cache
    assert (host / "graph").read_text() == "compiled"
    lab.share_inductor_cache(link)                          # a second lab up: unchanged
    assert link.resolve() == host.resolve()
    older = tmp_path / "older" / "cache" / "inductor"       # a lab made before the link: its own folder stays
    older.mkdir(parents=True)
    (older / "graph").write_text("its own")
    lab.share_inductor_cache(older)
    assert not older.is_symlink() and (older / "graph").read_text() == "its own"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    lab.share_inductor_cache(tmp_path / "third")
    assert (tmp_path / "third").resolve() == (tmp_path / "home" / ".cache" / "vcfslm" / "inductor").resolve()
