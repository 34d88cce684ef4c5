"""A flat CSV of window records, for spreadsheets."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable

from .files import atomic_write_text
from .metrics import percentile
from .records import WindowRecord

CSV_FIELDS = [
    "node", "rank", "local_rank", "batch_per_rank", "input_tokens", "output_tokens", "window",
    "ttft_p50_s", "tpot_p50_ms", "rank_tps", "wall_s", "valid",
]


def records_to_csv(path: str | os.PathLike[str], records: Iterable[WindowRecord]) -> None:
    """A flat CSV of records (one row per rank x scenario x window), for spreadsheets."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_FIELDS)
    for r in records:
        w.writerow([r.node, r.rank, r.local_rank, r.batch_per_rank, r.input_tokens, r.output_tokens,
                    r.window, f"{percentile(r.ttft_s, 50):.6f}", f"{percentile(r.tpot_ms, 50):.3f}",
                    f"{r.rank_tps:.3f}", f"{r.wall_s:.6f}", r.valid])
    atomic_write_text(path, buf.getvalue())
