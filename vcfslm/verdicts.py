"""The invalid-window reasons a rank writes that the report reads back: for each, one
function that writes its text and one predicate that recognises it.

The bench writes these into a record's `invalid_reasons`; the analysis picks them out
again (a failed numerics gate is named per rank, not only counted). Both sides call
the same functions, so the text written is the text looked for. Torch-free and
dependency-free: the analysis imports it too (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

# A compiled graph that disagrees with the eager model measured another computation:
# every window that ran it carries this prefix, the graph's name and the gate's own
# explanation after it.
NUMERICS_GATE_PREFIX = "numerics gate: "
# Recognised without the trailing space and in any case, as records written by hand or
# by earlier versions spell it.
_NUMERICS_GATE_MARK = NUMERICS_GATE_PREFIX.strip().lower()


def numerics_gate_failed(detail: str, graph: str | None = None) -> str:
    """The reason a window whose compiled graph (`graph`, when named) failed the numerics
    gate is invalid."""
    return NUMERICS_GATE_PREFIX + (f"{graph}: {detail}" if graph else detail)


def is_numerics_gate(reason: str) -> bool:
    """Is this invalid reason a failed numerics gate?"""
    return reason.strip().lower().startswith(_NUMERICS_GATE_MARK)


def numerics_gate_detail(reason: str) -> str:
    """What the gate said, without its prefix (empty when it said nothing)."""
    return reason.strip()[len(_NUMERICS_GATE_MARK):].strip()


def recompiled(count: int) -> str:
    """The reason a window in which the decode step compiled `count` times is invalid
    (the compile time sits inside its latencies)."""
    return f"{count} compilation(s) inside the window"
