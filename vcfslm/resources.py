"""Find the data folders (templates/, playbooks/, inventories/, platforms/) shipped with vcfslm.

In a checkout (editable install) they sit next to the package; in a built wheel
they are force-included under `vcfslm/_data/`.
"""

from __future__ import annotations

from pathlib import Path

from .errors import VcfslmError

KINDS = ("templates", "playbooks", "inventories", "platforms")
_PACKAGE = Path(__file__).resolve().parent


def resource_dir(kind: str) -> Path:
    """The folder holding `kind` (one of KINDS), from a wheel or a checkout."""
    if kind not in KINDS:
        raise ValueError(f"unknown resource kind {kind!r}; expected one of {KINDS}")
    for candidate in (_PACKAGE / "_data" / kind, _PACKAGE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise VcfslmError(f"vcfslm's {kind}/ folder is missing from this installation")
