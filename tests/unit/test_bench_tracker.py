"""The run's position from worker progress events (vcfslm.bench.tracker)."""

from __future__ import annotations

import pytest

from vcfslm.bench.launch import report_event
from vcfslm.bench.tracker import BenchTracker, bench_eta
from vcfslm.progress import RecordingReporter


def test_bench_eta_is_the_mean_window_time_times_the_windows_left():
    assert bench_eta(0.0, 0, 48) is None
    assert bench_eta(120.0, 4, 48) == pytest.approx(30 * 44)
    assert bench_eta(120.0, 48, 48) == 0
    assert bench_eta(10.0, 5, 3) == 0   # a resumed run can do more than it planned


def ev(phase, scenario=None, rank=0, **extra):
    e = {"rank": rank, "phase": phase, "scenarios": 4, **extra}
    if scenario is not None:
        e.update(scenario=scenario, batch=[1, 1, 4, 4][scenario - 1], input_tokens=[128, 512][(scenario - 1) % 2])
    return e


def test_a_run_of_four_scenarios_with_one_resumed():
    t = BenchTracker(windows_per_scenario=3, started=0.0)
    assert t.feed(ev("start"), 1.0) is None
    assert t.feed(ev("loaded", load_s=4), 5.0) is None        # windows start after the load
    p = t.feed(ev("skip", 1), 5.0)
    assert p.label == "scenario 1/4 (batch 1, input 128) skipped (resumed)" and p.total == 9
    p = t.feed(ev("warmup", 2, window=0), 25.0)               # the compile window
    assert (p.label, p.done, p.total, p.elapsed_s) == ("scenario 2/4 (batch 1, input 512)", 1, 9, 25.0)
    assert p.eta_s == pytest.approx(20.0 * 8)
    assert t.feed(ev("measure", 2, rank=1, window=0), 26.0) is None  # other ranks: same barrier
    t.feed(ev("measure", 2, window=0), 30.0)
    p = t.feed(ev("measure", 2, window=1), 35.0)
    assert (p.done, p.eta_s) == (3, pytest.approx(10.0 * 6))
    assert t.feed(ev("done", 2), 35.0).label == "scenario 2/4 (batch 1, input 512)"
    for k in (3, 4):
        for w in range(3):
            p = t.feed(ev("warmup" if w == 0 else "measure", k, window=w), 40.0 + 5 * (3 * (k - 3) + w))
    assert (p.label, p.done, p.eta_s) == ("scenario 4/4 (batch 4, input 512)", 9, 0)
    p = t.feed(ev("finished"), 80.0)
    assert p.final and p.label == "finished" and p.eta_s is None and p.elapsed_s == 80.0


def test_report_event_rank_lines_are_detail_failures_are_not():
    rep = RecordingReporter()
    t = BenchTracker(windows_per_scenario=2, started=0.0)
    report_event(rep, t, "rank 1", ev("measure", 1, rank=1, window=0, tpot_ms_p50=12.5), now=3.0)
    report_event(rep, t, "rank 0", ev("measure", 1, window=0, tpot_ms_p50=12.5), now=3.0)
    report_event(rep, t, "rank 1", {"rank": 1, "phase": "failed", "error": "OOM"}, now=4.0)
    assert [s for s, _ in rep.details] == ["rank 1", "rank 0"]
    assert rep.updates == [("rank 1", "failed: OOM")]
    assert [(p.subject, p.done, p.total) for p in rep.progresses] == [("bench", 1, 8)]
