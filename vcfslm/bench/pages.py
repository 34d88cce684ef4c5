"""2 MiB pages under a rank's weights.

A decode step streams every weight once; with 4 KiB pages that is a TLB miss every 4 KiB
of a multi-GB stream. PyTorch's CPU allocator advises transparent huge pages for every
allocation of 2 MiB or more when THP_MEM_ALLOC_ENABLE=1, and oneDNN's packed weights come
from that allocator too. On the CPUs measured, packed weights on 2 MiB pages read ~0.1 of
the read probe faster than on 4 KiB ones.
The variable is read once, at the process's first allocation: rank.sh exports it, and the
benchmarks set it before they import torch. The kernel's THP mode decides whether the
advice is taken (`madvise` or `always`: yes; `never`: no), so ranks record both.

No torch here: importable before torch is.
"""

from __future__ import annotations

import os
from pathlib import Path

HUGE_PAGES_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def ask_for_huge_pages(environ=os.environ) -> None:
    """Put this process's large allocations on 2 MiB pages, as rank.sh does for a rank (a
    value already set wins). Call before torch is imported: torch reads it once."""
    for key, value in HUGE_PAGES_ENV.items():
        environ.setdefault(key, value)


def thp_mode(text: str | None = None) -> str | None:
    """The bracketed choice of the kernel's THP setting ("always [madvise] never" -> "madvise")."""
    if text is None:
        try:
            text = THP_ENABLED.read_text()
        except OSError:
            return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def huge_pages_facts(environ=os.environ) -> dict:
    mode = thp_mode()
    asked = all(environ.get(k) == v for k, v in HUGE_PAGES_ENV.items())
    return {"thp_mem_alloc": asked, "thp_mode": mode, "huge_pages": asked and mode in ("madvise", "always")}
