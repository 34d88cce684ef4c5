"""Per-stream latencies from timestamps, and the percentile the report reads them with."""

from __future__ import annotations

import math
from collections.abc import Iterable


def stream_metrics(request_start: float, first_token: Iterable[float], last_token: Iterable[float],
                   output_tokens: int) -> tuple[list[float], list[float], list[float]]:
    """Per-stream (ttft_s, tpot_ms, e2e_s) from timestamps.

    TTFT is first token - request start; end-to-end is last token - request start; TPOT is
    the time per generated token after the first, (e2e - ttft) / (output_tokens - 1), in ms
    (NaN for one output token: there is no second token to time).

    request_start: when the window's requests were issued; first_token/last_token:
    per-stream times the first and last generated token were available.
    """
    ttft, tpot, e2e = [], [], []
    for first, last in zip(first_token, last_token, strict=True):
        t = first - request_start
        e = last - request_start
        ttft.append(t)
        e2e.append(e)
        tpot.append((e - t) / (output_tokens - 1) * 1000.0 if output_tokens > 1 else float("nan"))
    return ttft, tpot, e2e


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of finite values; NaN when empty."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
