"""The arrival processes a serving window can load a rank with: one entry each.

An entry names the process (the name the inventory, the `--arrival` flag, the records
and the report use), says what its load counts (`rate`: requests/s per rank; `users`:
closed-loop users per rank) and, for an open loop, draws its inter-arrival gaps. A new
open-loop load pattern is one entry here with its gap function; nothing else lists the
names (docs/ARCHITECTURE.md).

Poisson and gamma draw from one family today: gamma gaps of shape `burstiness` and
mean 1/rate, exponential at shape 1. So `burstiness` alone shapes the gaps and the
name is what the records and the report group runs by; the default shape 1 is Poisson.

No third-party imports: the inventory, the CLI, the records and the bench all read it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

# (rate per second, how many, the window's generator, burstiness) -> that many gaps, mean 1/rate
GapDraw = Callable[[float, int, random.Random, float], list[float]]


def gamma_gaps(rate: float, count: int, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """`count` gaps with mean 1/rate: exponential (burstiness 1) or gamma(shape=burstiness)."""
    if burstiness == 1.0:
        return [rng.expovariate(rate) for _ in range(count)]
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


@dataclass(frozen=True)
class ArrivalProcess:
    """One way requests reach a rank."""

    name: str
    load_kind: str              # what a load counts: "rate" (requests/s) or "users"
    gaps: GapDraw | None        # open loop: the inter-arrival gaps; None: closed loop

    @property
    def open_loop(self) -> bool:
        """Do requests arrive whether or not the rank keeps up?"""
        return self.gaps is not None


PROCESSES = (
    # Open loop: exponential gaps at `load` requests/s (gamma of shape `burstiness` if set).
    ArrivalProcess("poisson", "rate", gamma_gaps),
    # Open loop: gamma gaps of shape `burstiness` at `load` requests/s (below 1 burstier).
    ArrivalProcess("gamma", "rate", gamma_gaps),
    # Closed loop: `load` users, each sending again `think_s` after its reply.
    ArrivalProcess("closed", "users", None),
)
REGISTRY = {p.name: p for p in PROCESSES}

DEFAULT = "poisson"
# What `--arrival` and the inventory's bench.serve.arrival accept: the closed loop is
# chosen by giving users instead of rates, never by name.
OPEN_LOOP = tuple(p.name for p in PROCESSES if p.open_loop)
# What a serving record's `arrival` may say.
RECORDED = tuple(REGISTRY)
# What a serving load may count, in the order the processes list them.
LOAD_KINDS = tuple(dict.fromkeys(p.load_kind for p in PROCESSES))


def process(name: str) -> ArrivalProcess:
    """The registered process of that name (KeyError naming the known ones otherwise)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown arrival process {name!r}; known: {', '.join(RECORDED)}") from None


def recorded_name(load_kind: str, arrival: str) -> str:
    """The arrival a record carries: the closed loop's name for a load of users, else the
    open-loop process the spec chose."""
    closed = [p.name for p in PROCESSES if p.load_kind == load_kind and not p.open_loop]
    return closed[0] if closed else arrival
