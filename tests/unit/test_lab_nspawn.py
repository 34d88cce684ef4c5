"""The systemd-booted guest's plans (lab/nspawn.py): how nspawn is started without a
systemd on the operator's side, what the guest boots into, and its sshd."""

from __future__ import annotations

import shlex
from pathlib import Path

from vcfslm.lab import nspawn
from vcfslm.lab.guests import SSHD_POLICY


def test_the_boot_runs_nspawn_without_machined_or_a_scope_and_with_a_tmpfs_of_its_own():
    script = nspawn.boot_script(Path("/tmp/g 1"), "slm-01", [("/srv/site", "/opt/site")])
    prelude, _, command = script.partition(" && exec ")
    assert prelude == ("mkdir -p /run/systemd/nspawn && "
                       "mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn")
    argv = shlex.split(command)
    assert argv[:4] == ["systemd-nspawn", "--quiet", "-D", "/tmp/g 1/root"]
    for flag in ("--machine=slm-01", "--register=no", "--keep-unit", "--link-journal=no",
                 "--bind-ro=/srv/site:/opt/site"):
        assert flag in argv
    assert argv[-3:] == ["-b", "--", f"systemd.unit={nspawn.TARGET}"]


def test_the_guest_boots_its_sshd_and_nothing_of_the_operators_services():
    target = nspawn.target_unit()
    assert f"Wants={nspawn.SSHD_UNIT}" in target.splitlines() and "Requires=basic.target" in target.splitlines()
    assert "multi-user" not in target
    unit = nspawn.sshd_unit().splitlines()
    assert f"ExecStart=/usr/sbin/sshd -D -e -f {nspawn.SSHD_CONFIG}" in unit


def test_the_guests_sshd_listens_on_its_loopback_address_only_and_takes_keys_only():
    lines = nspawn.sshd_config("slm-01", "127.0.2.11", 2300).splitlines()
    assert "ListenAddress 127.0.2.11:2300" in lines
    assert f"AuthorizedKeysFile {nspawn.AUTHORIZED_KEYS}" in lines and "AllowUsers root" in lines
    assert all(rule in lines for rule in SSHD_POLICY)


def test_a_guest_needs_root(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert nspawn.unavailable_reason() == "booting a guest with systemd-nspawn needs root"
