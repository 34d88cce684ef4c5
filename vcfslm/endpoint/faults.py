"""What breaks in a window through one endpoint: a fault the run injects, and a front door
that stops answering.

A fault (`--fault kill:NODE/PROGRAM@SECONDS`): in every measured window the caller's `kill`
crashes that server SECONDS after the window starts, and /health is polled every half second
until it answers again: the fault's end. The window keeps the fault's start and end, the
requests that failed after the kill (each a miss, none lost), the time to detect (the kill
to the last failed request) and to restart (the kill to healthy), and the attainment of
the requests that arrived during [start, end] and after it. A front door that stops
answering (requests refused or answered 502/504 one after another, outside a fault) stops
the run: that window is not kept, every earlier one is, and `--resume` measures it again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..runspec import Fault
from ..serve.http_backend import healthy
from ..serve.http_serve import HttpOutcome
from ..serve.openai_client import Endpoint
from ..serve.scheduler import Request
from ..serving import judging

# Failed requests in a row, outside a fault, that say the front door stopped answering.
OUTAGE_RUN = 5
# What a front door or router that stopped answering leaves: a refused connection, or the
# gateway errors nginx gives when the router behind it does not answer. Not 503: that is the
# router answering that it has no healthy server (a fault's aftermath, until it takes the
# restarted one back), a failed request like any other.
UNREACHABLE = ("ConnectionRefusedError", "HTTP 502", "HTTP 504")
# After the kill, how long the server may keep answering /health before the fault is said
# not to have taken it down (a kill is immediate; its socket closes within this).
DOWN_GRACE_S = 5.0


def unreachable(error: str | None) -> bool:
    """Did this failure come from nothing answering at the door (not from a server's stream)?"""
    return error is not None and any(mark in error for mark in UNREACHABLE)


def endpoint_outage(requests: Sequence[Request], spans: Sequence[tuple[float, float | None]] = (),
                    run: int = OUTAGE_RUN) -> str | None:
    """Why the window says the endpoint stopped answering (None: it did not): `run` requests
    in a row, in the order they went out, refused or answered 502/504, none of them sent
    inside a fault's [start, end] (`spans`; an open end: to the window's end)."""

    def in_fault(at: float) -> bool:
        return any(start <= at and (end is None or at <= end) for start, end in spans)

    sent = sorted((r for r in requests if r.started_s is not None),
                  key=lambda r: (r.started_s, r.index))
    streak: list[Request] = []
    for r in sent:
        if unreachable(r.error) and not in_fault(r.started_s):
            streak.append(r)
            if len(streak) >= run:
                break
        else:
            streak = []
    if len(streak) < run:
        return None
    return (f"the endpoint stopped answering: {len(streak)} requests in a row from {streak[0].started_s:.1f} s "
            f"into the window failed at the door ({streak[0].error})")


def fault_accounting(requests: Sequence[Request], failed_at: Mapping[int, float], start_s: float,
                     end_s: float | None, limits: Mapping[str, Mapping[str, Any]], cutoff_s: float
                     ) -> dict[str, Any]:
    """One fault's account from its window's requests (times on the window's clock).

    failed_at: when each request's stream came back to the client (its failure time for a
    failed one; a request still out at the cutoff failed then). Failed requests: every one
    sent that failed from the kill on, also after the server is back (the router may still
    have it out of rotation: a 503 from it is the fault's too); counted ones are judged as
    misses, none dropped. A request the window never sent (due in the cool-down after every
    counted one was done) is no failure. Detection: the kill to the last failed request sent
    after it (the router's last pick of a server that could not serve; 0 when every failure
    was already in flight at the kill). Attainment per SLO: the share of the counted requests
    arriving in [start, end] (during) or after end (after) that met every limit at once."""
    until = cutoff_s if end_s is None else end_s
    failures = [(failed_at.get(r.index, cutoff_s), r) for r in requests
                if not r.done and (r.started_s is not None or r.error is not None)]
    hit = [(at, r) for at, r in failures if at >= start_s]
    sent_after = [r.started_s for _, r in hit if r.started_s is not None and r.started_s >= start_s]
    counted = [r for r in requests if r.counted]
    during = [r for r in counted if start_s <= r.arrival_s <= until]
    after = [] if end_s is None else [r for r in counted if r.arrival_s > end_s]
    errors: list[str] = []
    for _, r in hit:
        if r.error and r.error not in errors and len(errors) < 3:
            errors.append(r.error)
    return {"start_s": round(start_s, 3), "end_s": None if end_s is None else round(end_s, 3),
            "restart_s": None if end_s is None else round(end_s - start_s, 3),
            "detect_s": (round(max(sent_after) - start_s, 3) if sent_after else 0.0) if hit else None,
            "failed": sum(1 for _, r in hit if r.counted), "failed_all": len(hit),
            "requests_during": len(during), "requests_after": len(after),
            "attainment_during": _attainment(during, limits), "attainment_after": _attainment(after, limits),
            "errors": errors}


def _attainment(requests: Sequence[Request], limits: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Per SLO: the share of these requests that met every limit at once (None: no request)."""
    done = [r for r in requests if r.done]
    ttft = [r.first_s - r.arrival_s for r in done]
    tpot = [(r.last_s - r.first_s) / (r.produced - 1) * 1000.0 if r.produced > 1 else 0.0 for r in done]
    unfinished = len(requests) - len(done)
    out: dict[str, float | None] = {}
    inputs = [r.input_tokens for r in done]
    for name, lim in limits.items():
        a = judging.attainment(ttft, tpot, unfinished, lim.get("tpot_ms"), lim.get("ttft_s"), input_tokens=inputs,
                               ttft_per_token_ms=lim.get("ttft_per_token_ms"))
        out[name] = round(a.share, 4) if requests else None
    return out


class FaultRun:
    """One fault in one window: the kill at its time, then /health polled until it answers."""

    def __init__(self, fault: Fault, health: Endpoint | None, kill: Callable[[Fault], int | None],
                 poll_s: float, timeout_s: float):
        self.fault, self.health, self.kill = fault, health, kill
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.pid: int | None = None
        self.error: str | None = None
        self.note: str | None = None
        self._stop = threading.Event()
        # Orders the kill's start against the window's end: either the window ended first and
        # no kill is sent, or the kill was sent and the end waits for the server (finish).
        self._started = threading.Lock()
        self._thread: threading.Thread | None = None

    def begin(self, t0: float) -> None:
        """Arm the kill at t0 + at_s (t0: the window's start on time.perf_counter)."""
        self._thread = threading.Thread(target=self._run, args=(t0,), daemon=True, name="fault")
        self._thread.start()

    def _run(self, t0: float) -> None:
        wait = t0 + self.fault.at_s - time.perf_counter()
        if wait > 0 and self._stop.wait(wait):
            return
        # The fault starts when the kill is sent, not when it returns: over SSH the server dies
        # somewhere in between, and a stream it cut then is the fault's failure too. It counts
        # as started from then on, so a window that ends while the kill is still on its way
        # waits for the server to come back (on a busy machine an SSH kill can outlast it).
        with self._started:
            if self._stop.is_set():
                return
            self.start_s = time.perf_counter() - t0
        try:
            self.pid = self.kill(self.fault)
        except Exception as exc:  # any failure of the caller's kill is the fault's, said in its record
            self.error = f"{type(exc).__name__}: {exc}"
            return
        returned_s = time.perf_counter() - t0
        if self.health is None:
            self.note = "no /health to poll: its server's URL is not known"
            return
        seen_down = False
        while not self._stop.is_set():
            now = time.perf_counter() - t0
            if now - self.start_s > self.timeout_s:
                return
            if healthy(self.health):
                if seen_down:
                    self.end_s = time.perf_counter() - t0
                    return
                if now - returned_s > DOWN_GRACE_S:
                    self.note = f"its /health kept answering for {DOWN_GRACE_S:g} s: the kill did not take it down"
                    self.end_s = self.start_s
                    return
            else:
                seen_down = True
            self._stop.wait(self.poll_s)

    def shift(self, seconds: float) -> None:
        """Move the fault's times onto the window's own clock (`seconds` later than its t0's)."""
        if self.start_s is not None:
            self.start_s += seconds
        if self.end_s is not None:
            self.end_s += seconds

    def finish(self) -> None:
        """Wait for the server to answer again (at most the restart timeout after the kill)."""
        if self._thread is None:
            return
        with self._started:
            if self.start_s is None:
                self._stop.set()                # the window ended before the kill was due
        self._thread.join(self.timeout_s + 5.0)
        self._stop.set()

    def account(self, outcome: HttpOutcome, failed_at: Mapping[int, float], limits, cutoff_s: float
                ) -> tuple[dict[str, Any], list[str]]:
        """The record's `fault` and the reasons it makes the window invalid."""
        base: dict[str, Any] = {"kill": self.fault.text, "target": self.fault.target, "at_s": self.fault.at_s,
                                "pid": self.pid}
        if self.health is not None:
            base["health"] = f"http://{self.health.host}:{self.health.port}/health"
        if self.error is not None or self.start_s is None:
            why = self.error or "the window ended before it was due"
            return {**base, "error": why}, [f"the fault {self.fault.text} did not happen: {why}"]
        out = {**base, **fault_accounting(outcome.requests, failed_at, self.start_s, self.end_s, limits, cutoff_s)}
        reasons = []
        if self.note:
            out["note"] = self.note
        if self.end_s is None and self.health is not None:
            reasons.append(f"{self.fault.target} did not answer /health within {self.timeout_s:g} s of the kill")
        return out, reasons
