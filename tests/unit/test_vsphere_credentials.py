"""The password: where it comes from, and that it never shows in reprs, errors, logs or output."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.errors import VCenterError
from vcfslm.inventory import VCenter
from vcfslm.inventory_load import parse_inventory
from vcfslm.progress import RecordingReporter
from vcfslm.vsphere.credentials import MASK, Secret, resolve_password

PASSWORD = "Pa55-w0rd-that-must-not-leak"
BRIEF = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"
CFG = VCenter(host="vcsa01", user="administrator@vsphere.local", password_env="VC_PW_TEST")


def no_keyring(user, host):
    return None


def test_environment_first():
    got = resolve_password(CFG, environ={"VC_PW_TEST": PASSWORD},
                           keyring_lookup=lambda u, h: "from-keyring")
    assert got.reveal() == PASSWORD


def test_keyring_second():
    seen = []

    def lookup(user, host):
        seen.append((user, host))
        return PASSWORD

    assert resolve_password(CFG, environ={}, keyring_lookup=lookup).reveal() == PASSWORD
    assert seen == [("administrator@vsphere.local", "vcsa01")]


def test_prompt_last():
    questions = []

    def prompt(q):
        questions.append(q)
        return PASSWORD

    assert resolve_password(CFG, prompt, environ={}, keyring_lookup=no_keyring).reveal() == PASSWORD
    assert questions == ["Password for administrator@vsphere.local on vcsa01"]


def test_nowhere_is_an_error_that_says_where_it_looked():
    with pytest.raises(VCenterError) as err:
        resolve_password(CFG, None, environ={}, keyring_lookup=no_keyring)
    assert "$VC_PW_TEST" in str(err.value) and "keyring" in str(err.value)


def test_missing_keyring_package_is_no_password(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "keyring":
            raise ImportError("no keyring")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    from vcfslm.vsphere.credentials import _from_keyring

    assert _from_keyring("u", "h") is None


def test_secret_is_masked_everywhere():
    s = Secret(PASSWORD)
    for text in (repr(s), str(s), f"{s}", "%s" % s, "{}".format(s), repr([s]), repr({"pw": s})):  # noqa: UP031, UP032
        assert PASSWORD not in text and MASK in text
    with pytest.raises(TypeError):
        pickle.dumps(s)
    with pytest.raises(TypeError):
        json.dumps({"pw": s})
    with pytest.raises(AttributeError):
        s._value = "x"
    assert s.scrub(f"login {PASSWORD} refused") == f"login {MASK} refused"


def test_driver_login_errors_never_contain_the_password(mocker, caplog):
    from pyVmomi import vim

    from vcfslm.vsphere import driver, session

    caplog.set_level(logging.DEBUG)
    reporter = RecordingReporter()
    for exc in (vim.fault.InvalidLogin(msg=f"bad password {PASSWORD}"),
                OSError(f"connection to user:{PASSWORD}@vcsa01 refused"),
                vim.fault.NoPermission(msg=f"echo {PASSWORD}")):
        mocker.patch.object(session, "SmartConnect", side_effect=exc)
        vc = driver.PyVmomiVCenter(CFG, Secret(PASSWORD), reporter)
        with pytest.raises(VCenterError) as err:
            vc.connect()
        assert PASSWORD not in str(err.value)
        assert PASSWORD not in repr(vc.__dict__)
    assert PASSWORD not in caplog.text
    assert not any(PASSWORD in m for m in reporter.messages)


def test_cli_output_never_contains_the_password(mocker, tmp_path):
    from pyVmomi import vim

    from vcfslm.cli import main
    from vcfslm.vsphere import session

    data = yaml.safe_load(BRIEF.read_text())
    data["vcenter"].update(password_env="VC_PW_TEST", insecure=True)
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(data))
    parse_inventory(path.read_text())  # valid
    connect = mocker.patch.object(session, "SmartConnect",
                                  side_effect=vim.fault.InvalidLogin(msg=PASSWORD))
    env = {"VC_PW_TEST": PASSWORD, "VCFSLM_STATE": str(tmp_path / "state.json")}
    for cmd in (["plan", str(path)], ["plan", str(path), "-o", "json"],
                ["provision", str(path), "--stage", "vms"], ["destroy", str(path), "--yes"]):
        res = CliRunner().invoke(main, cmd, env=env)
        assert res.exit_code == 1, res.output
        assert PASSWORD not in res.output
        assert "refused the login" in res.output
        assert "TLS certificate verification is OFF" in res.output  # insecure: true warns
    assert connect.call_args.kwargs["pwd"] == PASSWORD  # it did reach the login, masked elsewhere
