"""A vCenter refusing calls for load: what counts as throttling, the jittered backoff (a pure
decision), the session asking again for any call, a task restarted after a throttling fault,
and the error that names the throttling and a lower --parallel when it persists."""

from __future__ import annotations

import http.client
import logging
from unittest.mock import MagicMock

import pytest
from pyVmomi import vim
from test_vsphere_support import inventory
from test_vsphere_tasks import ERROR, SUCCESS, update, waiter

from vcfslm.vsphere import session as S
from vcfslm.vsphere import tasks
from vcfslm.vsphere import throttle as T
from vcfslm.vsphere.credentials import Secret

FAST = T.Backoff(first=0.01, cap=0.04, attempts=3, budget=10.0)


@pytest.mark.parametrize("exc, reason", [
    (http.client.HTTPException("503 Service Unavailable"), "HTTP 503 Service Unavailable"),
    (http.client.HTTPException("429 Too Many Requests"), "HTTP 429 Too Many Requests"),
    (vim.fault.TooManyConcurrentNativeClones(), "TooManyConcurrentNativeClones"),
    (http.client.HTTPException("502 Bad Gateway"), None),
    (http.client.HTTPException("404 Not Found"), None),
    (http.client.RemoteDisconnected("503 in the text is not a status"), None),  # a broken connection
    (vim.fault.InvalidPowerState(), None),
    (ConnectionResetError(), None),
    (None, None),
])
def test_what_counts_as_vcenter_refusing_for_load(exc, reason):
    assert T.throttle_reason(exc) == reason


@pytest.mark.parametrize("attempt, rand, wait", [
    (1, 0.0, 0.5),    # half the step at least ...
    (1, 1.0, 1.0),    # ... the whole step at most
    (2, 0.5, 1.5),    # steps double: 2 s -> between 1 and 2
    (5, 0.0, 8.0),    # 16 s step
    (6, 1.0, 16.0),   # capped at 16 s
])
def test_backoff_doubles_with_equal_jitter_up_to_the_cap(attempt, rand, wait):
    assert T.next_wait(T.Backoff(), attempt, 0.0, rand=lambda: rand) == pytest.approx(wait)


@pytest.mark.parametrize("policy, attempt, waited", [
    (T.Backoff(attempts=6), 7, 0.0),              # out of attempts
    (T.Backoff(budget=10.0), 4, 9.0),             # this wait would overrun the budget
    (T.Backoff(), 0, 0.0),                        # nothing refused yet: nothing to wait for
])
def test_backoff_gives_up(policy, attempt, waited):
    assert T.next_wait(policy, attempt, waited, rand=lambda: 0.5) is None


def test_default_backoff_gives_a_throttled_vcenter_about_half_a_minute():
    waits = [T.next_wait(T.DEFAULT_BACKOFF, n, 0.0, rand=lambda: 0.5) for n in range(1, 8)]
    assert waits[-1] is None
    assert 20 < sum(waits[:-1]) < 60


def test_jitter_spreads_workers_refused_together():
    import random

    rng = random.Random(7)
    waits = {round(T.next_wait(T.Backoff(), 3, 0.0, rand=rng.random), 3) for _ in range(16)}
    assert len(waits) > 8 and min(waits) >= 2.0 and max(waits) <= 4.0


@pytest.fixture
def session(mocker):
    s = S.Session(inventory().vcenter, Secret("pw"), options=S.SessionOptions(backoff=0, throttle=FAST),
                  parallel=16)
    s.si = MagicMock()
    s.si.RetrieveContent.return_value = s.si.content
    return s


def test_throttled_call_is_asked_again_after_a_wait_even_when_not_idempotent(session, mocker, caplog):
    caplog.set_level(logging.DEBUG, logger=S.__name__)
    sleep = mocker.patch.object(S.time, "sleep")
    refused = http.client.HTTPException("503 Service Unavailable")
    clone = MagicMock(side_effect=[refused, refused, "task-1"], __name__="CloneVM_Task")
    assert session.call(clone, idempotent=False) == "task-1"
    assert clone.call_count == 3 and sleep.call_count == 2
    assert all(0.005 <= c.args[0] <= 0.02 for c in sleep.call_args_list)
    assert "CloneVM_Task: vCenter throttling (HTTP 503 Service Unavailable), refusal 1" in caplog.text


def test_persistent_throttling_names_itself_and_a_lower_parallel(session, mocker):
    mocker.patch.object(S.time, "sleep")
    clone = MagicMock(side_effect=http.client.HTTPException("503 Service Unavailable"),
                      __name__="CloneVM_Task")
    with pytest.raises(T.Throttled) as err:
        session.call(clone, idempotent=False)
    assert clone.call_count == FAST.attempts + 1
    text = str(err.value)
    assert text.startswith("vCenter is throttling: CloneVM_Task refused 4 time(s) over 0 s "
                           "(HTTP 503 Service Unavailable); ")
    assert text.endswith("retry with a lower --parallel (this run: 16 at once)")


def test_other_http_errors_are_not_retried(session, mocker):
    sleep = mocker.patch.object(S.time, "sleep")
    fn = MagicMock(side_effect=http.client.HTTPException("404 Not Found"), __name__="Fetch")
    with pytest.raises(http.client.HTTPException):
        session.call(fn)
    assert fn.call_count == 1 and not sleep.called


def test_method_name_of_a_pyvmomi_method():
    assert S.method_name(vim.VirtualMachine("vm-1").CloneVM_Task) == "CloneVM_Task"
    assert S.method_name(lambda: None) == "a vCenter call"


def test_task_failed_for_too_many_clones_is_started_again(mocker):
    mocker.patch.object(S.time, "sleep")
    w = waiter([update(info__state=ERROR, info__error=vim.fault.TooManyConcurrentNativeClones()),
                update(info__state=SUCCESS, info__result="vm-9")])
    w.session.throttle = FAST
    start = MagicMock(side_effect=[vim.Task("task-1"), vim.Task("task-2")])
    assert w.run("clone t -> slm-01", start) == "vm-9"
    assert start.call_count == 2


def test_task_failed_for_another_reason_is_not_started_again(mocker):
    w = waiter([update(info__state=ERROR, info__error=vim.fault.InvalidPowerState())])
    start = MagicMock(return_value=vim.Task("task-1"))
    with pytest.raises(tasks.TaskFailed):
        w.run("power on slm-01", start)
    assert start.call_count == 1


def test_connect_keeps_one_connection_per_worker(mocker):
    stub = MagicMock(poolSize=5)
    mocker.patch.object(S, "SmartConnect", return_value=MagicMock(_stub=stub))
    S.Session(inventory().vcenter, Secret("pw"), pool_size=65).connect()
    assert stub.poolSize == 65


# ------------------------------------------------------------------ the lab's injection


def test_vcsim_throttle_option_and_its_log(tmp_path):
    from pathlib import Path

    from vcfslm.lab import vcsim

    opts = vcsim.VcsimOptions(throttle={"CloneVM_Task": 1, "Destroy_Task": 0})
    argv = vcsim.command_line(Path("vcsim"), tmp_path, opts)
    assert argv[argv.index("-throttle") + 1] == "CloneVM_Task=1,Destroy_Task=0"
    assert "-throttle" not in vcsim.command_line(Path("vcsim"), tmp_path, vcsim.VcsimOptions())
    log = tmp_path / "vcsim.log"
    log.write_text("2026/12/01 vcsim: throttled CloneVM_Task (1 in flight, limit 1): refusal 1 answered 503\n"
                   "2026/12/01 other line\n"
                   "2026/12/01 vcsim: throttled CloneVM_Task (1 in flight, limit 1): refusal 2 answered 503\n")
    running = vcsim.Vcsim(url="u", host="h", port=1, user="x", ca_file="c", hosts=1, template="t",
                          api_version="6.5", log=str(log), process=None, throttle={"CloneVM_Task": 1})
    assert vcsim.throttled(running) == {"CloneVM_Task": 2}
