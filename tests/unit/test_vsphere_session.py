"""The vCenter session: TLS (verified, or insecure with a warning), expiry healed by a
new login, connection resets retried only when safe; retries logged at DEBUG."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from unittest.mock import MagicMock

import pytest
from pyVmomi import vim
from test_vsphere_support import inventory

from vcfslm.progress import RecordingReporter
from vcfslm.vsphere import session as S
from vcfslm.vsphere.credentials import Secret

PASSWORD = "s3cr3t-Pw!"

@pytest.fixture
def session():
    s = S.Session(inventory().vcenter, Secret(PASSWORD), RecordingReporter(),
                  S.SessionOptions(backoff=0))
    s.si = MagicMock()
    s.si.RetrieveContent.return_value = s.si.content
    return s


def test_session_expiry_logs_in_again_and_retries(session, caplog):
    caplog.set_level(logging.DEBUG, logger=S.__name__)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise vim.fault.NotAuthenticated()
        return "ok"

    session.si.content.sessionManager.currentSession = None
    assert session.call(flaky, idempotent=False) == "ok"
    session.si.content.sessionManager.Login.assert_called_once_with(session.cfg.user, PASSWORD)
    assert session.reporter.messages == ["vCenter session expired: logging in again"]
    assert any("logging in again" in r.getMessage() for r in caplog.records)
    assert PASSWORD not in caplog.text


def test_renewed_session_is_not_logged_in_twice(session):
    session.si.content.sessionManager.currentSession = object()  # another worker already did
    fn = MagicMock(side_effect=[vim.fault.NotAuthenticated(), "ok"])
    assert session.call(fn) == "ok"
    session.si.content.sessionManager.Login.assert_not_called()


@pytest.mark.parametrize("side_effect, idempotent, calls, result", [
    ([ConnectionResetError(), ConnectionResetError(), "ok"], True, 3, "ok"),
    ([ConnectionResetError()], False, 1, ConnectionResetError),
    ([ConnectionResetError()] * 5, True, 5, ConnectionResetError),  # retries=4: five attempts
    ([BrokenPipeError(), "ok"], True, 2, "ok"),
])
def test_connection_reset_is_retried_only_when_safe(session, caplog, side_effect, idempotent,
                                                    calls, result):
    caplog.set_level(logging.DEBUG, logger=S.__name__)
    fn = MagicMock(side_effect=side_effect)
    if isinstance(result, type):
        with pytest.raises(result):
            session.call(fn, idempotent=idempotent)
    else:
        assert session.call(fn, idempotent=idempotent) == result
    assert fn.call_count == calls
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == calls - 1


def test_insecure_connect_warns(mocker):
    cfg = inventory().vcenter.model_copy(update={"insecure": True})
    connect = mocker.patch.object(S, "SmartConnect")
    reporter = RecordingReporter()
    S.Session(cfg, Secret("pw"), reporter).connect()
    assert any("verification is OFF" in m for m in reporter.messages)
    ctx = connect.call_args.kwargs["sslContext"]
    assert ctx.verify_mode.name == "CERT_NONE"


def test_verified_connect_uses_the_ca_bundle(mocker):
    create = mocker.patch.object(ssl, "create_default_context", wraps=ssl.create_default_context)
    mocker.patch.object(S, "SmartConnect")
    bundle = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    cfg = inventory().vcenter.model_copy(update={"ca_bundle": str(bundle)})
    reporter = RecordingReporter()
    S.Session(cfg, Secret("pw"), reporter).connect()
    create.assert_called_with(cafile=str(bundle))
    assert reporter.messages == []


def test_close_logs_out_once_even_when_the_session_is_gone(mocker, session):
    disconnect = mocker.patch.object(S, "Disconnect", side_effect=ConnectionResetError())
    session.close()
    session.close()
    disconnect.assert_called_once()
    assert session.si is None


@pytest.mark.parametrize("exc, text", [
    (vim.fault.InvalidPowerState(msg="The VM is off"), "InvalidPowerState: The VM is off"),
    (vim.fault.NotAuthenticated(), "NotAuthenticated"),
    (OSError("no route"), "no route"),
    (TimeoutError(), "TimeoutError"),
])
def test_fault_text_is_one_line(exc, text):
    assert S.fault_text(exc) == text
