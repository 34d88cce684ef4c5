"""Where a bench run is, from the workers' VCFSLM-PROGRESS events: scenario k of n,
windows done, elapsed, ETA from the windows so far (one Progress for the whole run).

The ranks of a run are barrier-aligned, so one rank's events (global rank 0) tell the
run's position; the other ranks' events are detail. Pure apart from the clock the
caller passes in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..progress import Progress

SUBJECT = "bench"
WINDOW_PHASES = ("warmup", "measure", "serve")


def bench_eta(window_time_s: float, windows_done: int, windows_total: int) -> float | None:
    """Seconds left at the mean time per window so far (None before the first window).

    window_time_s: time spent in windows since the first began (model load excluded).
    """
    if windows_done <= 0 or window_time_s < 0:
        return None
    return window_time_s / windows_done * max(0, windows_total - windows_done)


@dataclass
class BenchTracker:
    """Folds progress events into the run's Progress.

    windows_per_scenario: warmup + measured windows of one scenario.
    started: the run's start (clock seconds); lead_rank: whose events set the position.
    """

    windows_per_scenario: int
    started: float
    lead_rank: int = 0
    scenarios: int | None = None
    skipped: int = 0
    windows_done: int = 0
    first_window_at: float | None = None   # when windows began: load and compile-free setup end
    label: str = "starting"
    finished: bool = False
    serving: bool = False                  # a serving run: its sweep decides the loads as it goes

    def windows_total(self) -> int | None:
        if self.scenarios is None or self.serving:
            return None
        return max(0, self.scenarios - self.skipped) * self.windows_per_scenario

    def feed(self, event: dict, now: float) -> Progress | None:
        """The run's Progress after `event` (None when the event does not move it)."""
        if event.get("rank", self.lead_rank) != self.lead_rank:
            return None
        phase = event.get("phase")
        if isinstance(event.get("scenarios"), int):
            self.scenarios = event["scenarios"]
        if phase in ("loaded", "probed") or (phase in WINDOW_PHASES + ("skip",)
                                             and self.first_window_at is None):
            # windows begin once the model is loaded (and probed): time before is not theirs
            self.first_window_at = now
        if phase in WINDOW_PHASES + ("skip", "done") and ("load" in event or self.serving):
            self.serving = True            # no "k of n": the loads are not known ahead
            self.label = f"serving input {event.get('input_tokens')}, " + (
                f"load {event['load']:g} {event.get('load_kind')}" if "load" in event else "done")
        elif phase in WINDOW_PHASES + ("skip", "done"):
            self.label = (f"scenario {event.get('scenario')}/{event.get('scenarios', self.scenarios)} "
                          f"(batch {event.get('batch')}, input {event.get('input_tokens')})")
        if phase == "swept":
            # Which of precision and budget stopped the sweep: said on the run's own line.
            self.label = (f"serving input {event.get('input_tokens')}, sweep {event.get('slo')} stopped: "
                          f"{event.get('reason')}")
        elif phase == "skip":
            self.skipped += 1
            self.label += " skipped (resumed)"
        elif phase in WINDOW_PHASES:
            self.windows_done += 1
        elif phase == "finished":
            self.finished = True
            self.label = "finished"
        elif phase not in ("done",):
            return None
        return self.progress(now)

    def progress(self, now: float) -> Progress:
        total = self.windows_total()
        window_time = now - self.first_window_at if self.first_window_at is not None else 0.0
        eta = bench_eta(window_time, self.windows_done, total) if total is not None else None
        return Progress(SUBJECT, self.label, self.windows_done, total, "windows", now - self.started,
                        eta_s=None if self.finished else eta, final=self.finished)
