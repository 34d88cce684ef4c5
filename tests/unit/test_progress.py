"""The progress records and their pure helpers (vcfslm.progress, vcfslm.guest.meter)."""

from __future__ import annotations

import pytest

from vcfslm.guest.meter import Heartbeat, TransferMeter, heartbeat_due
from vcfslm.progress import (
    NullReporter,
    Progress,
    RecordingReporter,
    describe,
    due,
    emit_detail,
    emit_progress,
    format_bytes,
    format_duration,
    transfer_eta,
)

MIB = 1024 * 1024
GIB = 1024 * MIB


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                     (7.6 * GIB, "7.6 GiB"), (112 * MIB, "112 MiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("s, text", [(0, "0s"), (9.4, "9s"), (65, "1m05s"), (3725, "1h02m")])
def test_format_duration(s, text):
    assert format_duration(s) == text


def test_transfer_eta_is_the_rest_at_the_average_rate():
    assert transfer_eta(0, 100, 10) is None
    assert transfer_eta(25, 100, 10) == pytest.approx(30)
    assert transfer_eta(100, 100, 10) == 0
    assert transfer_eta(5, None, 10) is None


def test_due_first_then_by_time_or_fraction():
    assert due(None, None, 0, 0.0, every_s=5)
    assert not due(0, 0.0, 4.9, 0.05, every_s=5, every_fraction=0.1)
    assert due(0, 0.0, 5.0, 0.05, every_s=5, every_fraction=0.1)
    assert due(0, 0.0, 1.0, 0.1, every_s=5, every_fraction=0.1)
    assert not due(0, None, 1.0, None, every_s=5, every_fraction=0.1)


def test_describe_a_transfer_and_a_duration():
    p = Progress("slm-01", "model: push 3 file(s)", 3 * GIB, 7.6 * GIB, "B", 30.0, eta_s=46)
    assert describe(p) == "model: push 3 file(s), 3 GiB / 7.6 GiB, 39%, 102 MiB/s, elapsed 30s, ETA 46s"
    running = Progress("slm-01", "pytorch: torch", 95, None, "s", 95)
    assert describe(running) == "pytorch: torch, elapsed 1m35s"
    over = Progress("slm-01", "pytorch: torch", 190, None, "s", 190, final=True)
    assert describe(over) == "pytorch: torch, done in 3m10s"


def test_reporters_without_progress_get_a_status_line():
    class Plain:
        def __init__(self):
            self.lines = []

        def update(self, subject, status):
            self.lines.append((subject, status))

        def log(self, message):
            pass

    plain = Plain()
    emit_progress(plain, Progress("h", "x", 1, 2, "windows", 1.0))
    emit_detail(plain, "rank 0", "loaded")
    assert plain.lines == [("h", "x, 1/2 windows, 50%, elapsed 1s"), ("rank 0", "loaded")]
    emit_progress(NullReporter(), Progress("h", "x", 1, 2, "B", 1.0))  # accepted, dropped


def test_transfer_meter_counts_across_files_and_throttles():
    clock, rec = Clock(), RecordingReporter()
    meter = TransferMeter(rec, "slm-01", "model: push 2 file(s)", 300, clock=clock)
    first = meter.file_callback()
    first(50)                       # the first record always goes
    clock.t += 0.1
    first(100)                      # too soon after the last
    meter.file_done(100)
    clock.t += 1.0
    meter.file_callback()(150)      # second file: counted on top of the first
    meter.file_done(200)
    meter.finish()
    assert [(p.done, p.final) for p in rec.progresses] == [(50, False), (250, False), (300, True)]
    assert all(p.total == 300 and p.unit == "B" and p.subject == "slm-01" for p in rec.progresses)
    assert rec.progresses[1].eta_s == pytest.approx(50 * 1.1 / 250)


def test_heartbeat_is_silent_for_short_commands():
    assert not heartbeat_due(9.9)
    assert heartbeat_due(10.0)
    clock, rec = Clock(), RecordingReporter()
    with Heartbeat(rec, "slm-01", "base: apt", clock=clock, every_s=3600) as beat:
        beat._tick()                 # 0 s in: nothing yet
        clock.t += 12
        beat._tick()
        clock.t += 1
    assert [(p.done, p.total, p.unit, p.final) for p in rec.progresses] == [(12, None, "s", False),
                                                                              (13, None, "s", True)]
    quiet = RecordingReporter()
    with Heartbeat(quiet, "slm-01", "base: apt", clock=clock, every_s=3600) as beat:
        beat._tick()
    assert quiet.progresses == []


def test_a_step_pushing_a_folder_reports_its_bytes_per_host(tmp_path):
    from types import SimpleNamespace

    from vcfslm.guest.context import HostContext
    from vcfslm.guest.fake import FakeTransport
    from vcfslm.guest.ops import Shell, Upload
    from vcfslm.guest.playbook import execute_ops

    (tmp_path / "a.safetensors").write_bytes(b"a" * (3 * MIB))
    (tmp_path / "b.safetensors").write_bytes(b"b" * (2 * MIB))
    rec = RecordingReporter()
    t = FakeTransport("slm-02", {"mkdir -p /m": ""})
    ctx = HostContext(None, SimpleNamespace(name="slm-02"), {}, t, reporter=rec)
    ops = [Shell("mkdir -p /m"), Upload("/m/a", local=str(tmp_path / "a.safetensors")),
           Upload("/m/b", local=str(tmp_path / "b.safetensors")), Upload("/m/.marker", data=b"x")]
    execute_ops(ops, ctx, "model: stage", None)
    assert t.files["/m/a"] == b"a" * (3 * MIB) and t.files["/m/.marker"] == b"x"
    done = [p.done for p in rec.progresses]
    assert done == sorted(done) and done[-1] == 5 * MIB and rec.progresses[-1].final
    assert {(p.subject, p.label, p.total) for p in rec.progresses} == {
        ("slm-02", "model: stage: push 2 file(s)", 5 * MIB)}


def test_small_pushes_are_not_metered(tmp_path):
    from types import SimpleNamespace

    from vcfslm.guest.context import HostContext
    from vcfslm.guest.fake import FakeTransport
    from vcfslm.guest.ops import Upload
    from vcfslm.guest.playbook import execute_ops

    (tmp_path / "w.whl").write_bytes(b"w" * 1000)
    rec = RecordingReporter()
    ctx = HostContext(None, SimpleNamespace(name="h"), {}, FakeTransport("h"), reporter=rec)
    execute_ops([Upload("/w.whl", local=str(tmp_path / "w.whl"))], ctx, "wheel", None)
    assert rec.progresses == []
