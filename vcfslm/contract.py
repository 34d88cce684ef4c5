"""The run contract: the terms the worker, the operator and the analysis must read alike,
each stated once.

- compile modes of the decode step, and their legacy names;
- the default SLOs and the named presets;
- the rendezvous budget of a cluster run (torchrun's and the workers' process group);
- the progress-line format the worker writes and the operator parses.

The rest of what stages agree on has a module of its own: where things are on a guest
(vcfslm.guest_layout), which nodes a run takes (vcfslm.node_selection), the scenario
matrix (vcfslm.matrix), and a run's id and meta.json (vcfslm.run_meta).

Pure: no I/O, no third-party imports."""

from __future__ import annotations

import json
import math
from typing import Any

# The decode step's compile modes, as runs record them (meta.json matrix.compile, each
# record's placement.compile_mode). Earlier versions offered Inductor freezing and GEMM
# autotuning, which held a second copy of the weights; those names now mean "compile".
COMPILE_MODES = ("compile", "eager")
LEGACY_COMPILE_MODES = {"autotune": "compile", "freezing": "compile", "default": "compile"}
# Every name a user or an old run may give (the CLI's and the worker's choices).
ACCEPTED_COMPILE_MODES = (*COMPILE_MODES, *LEGACY_COMPILE_MODES)
# Modes whose figures are the instrument's: eager leaves every op between the linears
# unfused, so its TPOT carries per-op overhead and is a baseline, not a measurement.
MEASUREMENT_MODES = ("compile",)


def normalize_compile_mode(mode: str) -> str:
    """A compile mode by its current name ('autotune' -> 'compile'); ValueError if unknown."""
    mode = LEGACY_COMPILE_MODES.get(mode, mode)
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; known: {', '.join(COMPILE_MODES)}")
    return mode


# ------------------------------------------------------------------ SLOs

# The brief's two service levels per user: SLO-A (interactive chat) and SLO-B (relaxed).
# The inventory's default `slos` and the report's default when a run names none.
DEFAULT_SLOS: dict[str, dict[str, float]] = {"A": {"tpot_ms": 130.0, "ttft_s": 3.0},
                                             "B": {"tpot_ms": 200.0, "ttft_s": 5.0}}

# Named SLOs a user may ask for by name (`--slo mlperf-server`) beside the inventory's.
# Each carries the percentile its source judges at: static cells are judged there, and a
# serving load by that share of its requests. `source` is what `--help` cites.
SLO_PRESETS: dict[str, dict[str, object]] = {
    "A": {**DEFAULT_SLOS["A"], "source": "the brief's SLO-A: low-latency conversational workloads"},
    "B": {**DEFAULT_SLOS["B"], "source": "the brief's SLO-B: streaming assistants (5 tokens/s per user)"},
    "mlperf-server": {"tpot_ms": 100.0, "ttft_s": 2.0, "percentile": "p99",
                      "source": "MLPerf Inference (datacenter) Llama-3.1-8B Server scenario: "
                                "TTFT 2 s, TPOT 100 ms at p99"},
    "mlperf-interactive": {"tpot_ms": 30.0, "ttft_s": 0.5, "percentile": "p99",
                           "source": "MLPerf Inference (datacenter) Llama-3.1-8B Interactive scenario: "
                                     "TTFT 0.5 s, TPOT 30 ms at p99"},
}


def presets_help() -> str:
    """One line per preset for `--help`: its name, limits and source."""
    return "; ".join(f"{name} ({p['source']})" for name, p in SLO_PRESETS.items())


# ------------------------------------------------------------------ the rendezvous

# How long the ranks of a cluster run may take to meet grows with the cluster: torchrun's
# static rendezvous waits for every node's agent at node 0's store, and each worker's gloo
# group then reads every other rank's address from that store. The launcher hands the
# budget to torchrun (--rdzv-conf timeout=) and to the workers (--timeout); the operator
# reports it.
#
# The base is torch's own static-rendezvous default (a cold guest importing torch, a slow
# VM): small runs wait no less than torchrun would by itself.
RDZV_BASE_S = 600
# Per node: its torchrun starts only after the operator's SSH launch reaches it, and the
# launches go out in waves of the guest fan-out; a loaded guest starts later still.
RDZV_PER_NODE_S = 5
# Per rank pair: gloo's full mesh makes every rank read every other rank's key from
# node 0's one store (world_size^2 reads, each ~8 bytes x world_size), then connect.
RDZV_PER_RANK_PAIR_S = 0.002
# The worker's process-group timeout also bounds every collective, and a barrier waits
# for the slowest rank's window: it never drops below the worker's own default.
COLLECTIVE_TIMEOUT_S = 1800


def rendezvous_timeout_s(nodes: int, ranks_per_node: int = 1) -> int:
    """Seconds the ranks of a `nodes` x `ranks_per_node` run may take to meet (whole seconds:
    torchrun's static rendezvous reads its `timeout` as an int)."""
    world = max(1, nodes) * max(1, ranks_per_node)
    return math.ceil(RDZV_BASE_S + RDZV_PER_NODE_S * max(1, nodes) + RDZV_PER_RANK_PAIR_S * world * world)


def process_group_timeout_s(nodes: int, ranks_per_node: int = 1) -> int:
    """The worker's gloo timeout: its init waits for every rank (the rendezvous budget), its
    collectives for the slowest window (never less than COLLECTIVE_TIMEOUT_S)."""
    return max(COLLECTIVE_TIMEOUT_S, rendezvous_timeout_s(nodes, ranks_per_node))


# ------------------------------------------------------------------ progress lines

# The worker writes one line per event, this prefix then one JSON object; the operator
# finds it anywhere in a line (torchrun prefixes teed lines with "[defaultN]:").
PROGRESS_PREFIX = "VCFSLM-PROGRESS "


def format_progress(event: dict[str, Any]) -> str:
    """One progress line (no newline) for `event`."""
    return PROGRESS_PREFIX + json.dumps(event, sort_keys=True, default=str)


def parse_progress(text: str) -> dict[str, Any] | None:
    """The progress event on a line, if any (a broken one is ignored, not fatal)."""
    i = text.find(PROGRESS_PREFIX)
    if i < 0:
        return None
    try:
        event = json.loads(text[i + len(PROGRESS_PREFIX):])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
