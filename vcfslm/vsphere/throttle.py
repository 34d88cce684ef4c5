"""vCenter refusing work for load: how to recognise it and how long to wait before asking again.

vCenter's SOAP API has no "slow down" fault for ordinary calls: its resource manager
queues provisioning tasks past a host's or datastore's cost limit instead of failing
them. What a client does see when vCenter sheds load is an HTTP answer from the
reverse proxy in front of vpxd (rhttpproxy, Envoy since 8.0): 503 Service Unavailable
when it takes no more requests, 429 Too Many Requests from rate-limited endpoints.
pyVmomi raises those as a bare `http.client.HTTPException("503 Service Unavailable")`.
A clone can also fail with TooManyConcurrentNativeClones when the array behind a
datastore takes no more native clones at once. Every one of these answers means the
call was not carried out, so any call (even a clone) is safe to repeat after a wait.

Pure: no pyVmomi here, so the decision is unit-tested without a server.
"""

from __future__ import annotations

import http.client
import random
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import VCenterError

# HTTP statuses vCenter's front end answers when it sheds load
THROTTLE_STATUS = {429: "Too Many Requests", 503: "Service Unavailable"}
# SOAP faults (the type's last name) meaning "too many at once, try later"
THROTTLE_FAULTS = frozenset({"TooManyConcurrentNativeClones"})


class Throttled(VCenterError):
    """vCenter kept refusing a call for load after every backoff; the message says so."""


@dataclass(frozen=True)
class Backoff:
    """How long to keep asking a throttling vCenter.

    first: the first wait (s), doubled per attempt up to `cap`; attempts: retries before
    giving up; budget: seconds of waiting in all before giving up, whichever comes first.
    """

    first: float = 1.0
    cap: float = 16.0
    attempts: int = 6
    budget: float = 90.0


# Waits of about 1, 2, 4, 8, 16, 16 s (each between half and all of that): a throttled
# vCenter gets about half a minute to recover before the run names it and stops.
DEFAULT_BACKOFF = Backoff()


def throttle_reason(exc: BaseException | None) -> str | None:
    """What the refusal said ("HTTP 503 Service Unavailable", a fault's name), or None when
    `exc` is not vCenter refusing for load."""
    if exc is None:
        return None
    # Only the bare class: its subclasses (RemoteDisconnected, IncompleteRead) are broken
    # connections, which are retried elsewhere and only for calls safe to repeat.
    if type(exc) is http.client.HTTPException:
        code, _, _ = str(exc).partition(" ")
        if code.isdigit() and int(code) in THROTTLE_STATUS:
            return f"HTTP {int(code)} {THROTTLE_STATUS[int(code)]}"
        return None
    name = type(exc).__name__.rsplit(".", 1)[-1]
    return name if name in THROTTLE_FAULTS else None


def next_wait(policy: Backoff, attempt: int, waited: float,
              rand: Callable[[], float] = random.random) -> float | None:
    """Seconds to wait before retry number `attempt` (1 = the first retry), or None: give up.

    waited: seconds already spent waiting on this call. The wait is half the doubled
    step plus a random part of the other half ("equal jitter"): every worker backs off
    at least that much, and workers refused together come back spread out instead of
    hitting vCenter again in the same instant.
    """
    if attempt < 1 or attempt > policy.attempts:
        return None
    step = min(policy.cap, policy.first * 2 ** (attempt - 1))
    wait = step / 2 + rand() * step / 2
    if waited + wait > policy.budget:
        return None
    return wait


def throttled_message(what: str, reason: str, refusals: int, waited: float,
                      parallel: int | None) -> str:
    """The error of a call vCenter kept refusing: it names the throttling and the way out."""
    now = f" (this run: {parallel} at once)" if parallel else ""
    return (f"vCenter is throttling: {what} refused {refusals} time(s) over {waited:.0f} s "
            f"({reason}); retry with a lower --parallel{now}")
