"""Loopback sshd guests: addresses, sshd_config, known_hosts lines, ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from vcfslm.lab import guests


def test_addresses_and_names():
    assert [guests.node_name(i) for i in (0, 1, 9)] == ["slm-01", "slm-02", "slm-10"]
    assert [guests.management_address(i) for i in (0, 3)] == ["127.0.0.11", "127.0.0.14"]
    assert guests.bench_address(0) == "127.0.1.11"
    with pytest.raises(ValueError):
        guests.management_address(guests.MAX_NODES)


def test_sshd_config_is_key_only_for_one_user_with_lab_paths(tmp_path: Path):
    text = guests.sshd_config(name="slm-01", address="127.0.0.11", port=2222, user="slm",
                              host_key=tmp_path / "hk", authorized_keys=tmp_path / "ak",
                              pid_file=tmp_path / "pid")
    lines = set(text.splitlines())
    for expected in ("ListenAddress 127.0.0.11:2222", f"HostKey {tmp_path / 'hk'}",
                     f"AuthorizedKeysFile {tmp_path / 'ak'}", f"PidFile {tmp_path / 'pid'}",
                     "AllowUsers slm", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                     "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no",
                     "SetEnv VCFSLM_LAB_NODE=slm-01 SHLVL=1", "Subsystem sftp internal-sftp"):
        assert expected in lines, expected
    assert "/etc/ssh" not in text


def test_known_hosts_lines():
    key = "ssh-ed25519 AAAAC3Nza comment here"
    assert guests.known_hosts_line("127.0.0.11", 2222, key) == "[127.0.0.11]:2222 ssh-ed25519 AAAAC3Nza"
    assert guests.known_hosts_line("127.0.0.11", 22, key) == "127.0.0.11 ssh-ed25519 AAAAC3Nza"


def test_write_known_hosts_replaces_the_file(tmp_path: Path):
    from vcfslm.lab.process import ProcessRecord

    def guest(i: int, port: int) -> guests.Guest:
        return guests.Guest(name=guests.node_name(i), address=guests.management_address(i),
                            bench_address=guests.bench_address(i), port=port, user="u", key="k",
                            known_hosts="kh", workdir="w", host_public_key=f"ssh-ed25519 KEY{i} c",
                            config="c", log="l", process=ProcessRecord(1, 1, "m"))

    path = tmp_path / "known_hosts"
    path.write_text("stale line\n")
    guests.write_known_hosts(path, [guest(0, 2001), guest(1, 2002)])
    assert path.read_text() == ("[127.0.0.11]:2001 ssh-ed25519 KEY0\n"
                                "[127.0.0.12]:2002 ssh-ed25519 KEY1\n")
    assert guests.Guest.from_json(guest(0, 2001).to_json()) == guest(0, 2001)


def test_free_port_prefers_the_given_port_when_free():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        assert guests.free_port("127.0.0.1", busy) != busy
    assert guests.free_port("127.0.0.1", 0) > 0


def test_ensure_key_generates_once(tmp_path: Path):
    try:
        guests.tools()
    except guests.GuestsUnavailable as exc:
        pytest.skip(str(exc))
    first = guests.ensure_key(tmp_path / "id", "c")
    assert first.startswith("ssh-ed25519 ")
    assert guests.ensure_key(tmp_path / "id", "c") == first
    assert (tmp_path / "id").stat().st_mode & 0o777 == 0o600


def test_a_port_bound_later_is_picked_outside_the_ephemeral_range():
    assert guests.ports_for_later((32768, 60999)) == range(10000, 32768)
    assert guests.ports_for_later((10500, 60999)) == range(61000, 65536)   # the larger side
    assert not guests.ports_for_later((1024, 65535))   # none: port_for_later lets the kernel pick


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path):
    assert guests.ephemeral_range(tmp_path / "nope") == guests.DEFAULT_EPHEMERAL
    (tmp_path / "range").write_text("40000\t60999\n")
    assert guests.ephemeral_range(tmp_path / "range") == (40000, 60999)
    (tmp_path / "bad").write_text("40000\n")
    assert guests.ephemeral_range(tmp_path / "bad") == guests.DEFAULT_EPHEMERAL


def test_port_for_later_is_free_and_outside_this_machines_ephemeral_range():
    low, high = guests.ephemeral_range()
    port = guests.port_for_later("127.0.0.1")
    assert port in guests.ports_for_later((low, high)) and guests.port_is_free("127.0.0.1", port)


def test_port_for_later_skips_a_busy_pick_and_falls_back_to_the_kernel(monkeypatch):
    picks = iter([20001, 20002])

    class Rng:
        def choice(self, candidates):
            return next(picks)

    monkeypatch.setattr(guests, "port_is_free", lambda address, port: port != 20001)
    assert guests.port_for_later("127.0.0.1", rng=Rng()) == 20002
    monkeypatch.setattr(guests, "port_is_free", lambda address, port: False)
    monkeypatch.setattr(guests, "free_port", lambda address: 45678)
    assert guests.port_for_later("127.0.0.1", tries=3) == 45678
