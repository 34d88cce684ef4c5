"""A serving series in the JSON layout of `vllm bench serve --save-result --save-detailed`.

vLLM's serving benchmark writes one JSON object per run: a header (`main_async` in
vllm/benchmarks/serve.py), the `result` dict of `benchmark()` (generation branch) with
one entry per request in its arrays, and mean/median/std/p99 of each percentile metric.
Tools built around that file (plots, dashboards, comparisons between harnesses) read a
vcfslm run through this module: `vllm_result` turns the valid records of one series at
one load into that object, `write_vllm_results` writes one file per series and load
under `runs/<id>/vllm-results/`.

What maps how, where vcfslm and vllm measure differently:
- A series is every valid window of one (server, endpoint, endpoint nodes, load kind,
  load, context, output length, workload), all ranks and windows pooled, as if one vllm
  client had offered the whole series' traffic.
- `duration` is the measured span of one rank: the span of every pooled window summed,
  over the ranks pooled. N ranks each measured for S seconds in each of W windows give
  W x S, so `request_throughput` = completed / duration is the series' whole rate (the
  ranks' servers together), which is what vllm reports for the one server it loads.
  `request_rate` and `max_concurrency` are therefore the series' whole offered load too:
  the per-rank load times the ranks (an endpoint series has one rank: its load already
  is the deployment's). The per-rank load is under `vcfslm`.
- Times are on each window's clock (seconds from its start); `start_times` is each
  request's planned arrival. vcfslm times a request from its arrival, so `ttfts` and
  `latencies` include the client's send lag, which `queue_times` holds (sent - arrival;
  0 for the in-process engine). vllm's client queue comes before its latencies instead.
- `itls` are the gaps between a streamed request's consecutive token times; the
  in-process engine keeps no token times, so its requests have empty lists there.
- Requests counted but not finished (failed on the server, or cut by the window's end)
  are vllm's failed requests: output 0, ttft 0, no itl, latency 0, and an error. The
  records keep their count and the distinct errors, not which request had which: the
  failed ones carry the window's first error, the rest "unfinished by the window's cutoff".
- `request_goodput` is the requests/s that met one SLO (the run's first; null without
  one), from the records' own goodput: vcfslm judges TTFT and TPOT per request as vllm's
  `--goodput` does.
- `max_output_tokens_per_s` and `max_concurrent_requests` bucket token and request times
  by second as vllm does, per window index with the ranks' windows overlaid (they run
  together between barriers); an in-process request's tokens are spread evenly between
  its first and last token, the steady step its TPOT says.

Standard library only: the statistics match numpy's (`np.percentile`'s linear
interpolation, `np.std`'s population deviation, 0 for an empty list as vllm's `or 0` gives).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from .files import atomic_write_text, read_serve_records
from .metrics import percentile
from .records import ServeRecord
from .runs import SERVE_RESULTS, read_meta

VLLM_RESULTS = "vllm-results"          # the folder under runs/<id>/
METRICS = ("ttft", "tpot", "itl", "e2el")   # vllm's defaults (ttft,tpot,itl) and e2el
PERCENTILES = (99.0,)                  # vllm's default --metric-percentiles
UNFINISHED = "unfinished by the window's cutoff"
DATE_FORMAT = "%Y%m%d-%H%M%S"          # vllm's `date` and file-name stamp


@dataclass(frozen=True, order=True)
class SeriesKey:
    """What one vllm-results file stands for: one series at one load."""

    server: str
    endpoint: str
    endpoint_nodes: int
    load_kind: str
    load: float
    input_tokens: int
    output_tokens: int
    workload: str


@dataclass(frozen=True)
class Request:
    """One counted request as vllm lists it (its RequestFuncOutput), plus where it ran."""

    input_len: int
    output_len: int
    ttft: float
    itl: list[float]
    latency: float
    start_time: float
    queue_time: float
    error: str
    window: int
    token_times: tuple[float, ...]     # for the peak rates only; not written

    @property
    def success(self) -> bool:
        return not self.error


# ------------------------------------------------------------------ series


def series_key(record: ServeRecord) -> SeriesKey:
    return SeriesKey(record.server, record.endpoint, record.endpoint_nodes, record.load_kind,
                     float(record.load), record.input_tokens, record.output_tokens, record.workload)


def group_series(records: Iterable[ServeRecord]) -> dict[SeriesKey, list[ServeRecord]]:
    """The valid records by series, series in a stable order (so file names are stable)."""
    groups: dict[SeriesKey, list[ServeRecord]] = defaultdict(list)
    for record in records:
        if record.valid:
            groups[series_key(record)].append(record)
    return {key: groups[key] for key in sorted(groups)}


def ranks_pooled(records: Sequence[ServeRecord]) -> int:
    return len({(r.node, r.rank) for r in records})


def measured_duration(records: Sequence[ServeRecord]) -> float:
    """One rank's measured seconds: the pooled spans over the ranks (see the module's docstring)."""
    ranks = ranks_pooled(records)
    return sum(r.span_s for r in records) / ranks if ranks else 0.0


# ------------------------------------------------------------------ requests


def series_requests(records: Sequence[ServeRecord]) -> list[Request]:
    """Every counted request of the series, window by window and rank by rank, each
    window's finished requests in arrival order and then its unfinished ones."""
    ordered = sorted(records, key=lambda r: (r.window, r.node_rank, r.rank))
    return [request for r in ordered for request in (*finished_requests(r), *unfinished_requests(r))]


def finished_requests(record: ServeRecord) -> list[Request]:
    out = []
    for i, arrival in enumerate(record.arrival_s):
        ttft, latency = record.ttft_s[i], record.e2e_s[i]
        output_len = record.request_output_tokens[i]
        streamed = record.token_s[i] if i < len(record.token_s) else None
        times = (tuple(streamed) if streamed else
                 spread_token_times(arrival + ttft, arrival + latency, output_len))
        sent = record.sent_s[i] if i < len(record.sent_s) else None
        out.append(Request(
            input_len=record.request_input_tokens[i], output_len=output_len, ttft=ttft,
            itl=gaps(streamed) if streamed else [], latency=latency, start_time=arrival,
            queue_time=max(0.0, sent - arrival) if sent is not None else 0.0, error="",
            window=record.window, token_times=times))
    return out


def unfinished_requests(record: ServeRecord) -> list[Request]:
    """vllm's failed entries for the requests the record counts but did not finish.

    `failed` (refused, dropped, never answered) is part of `unfinished` (every counted
    request not done by the cutoff); max() keeps a record that says otherwise whole.
    """
    total = max(record.unfinished, record.failed)
    failed = min(record.failed, total)
    first_error = record.errors[0] if record.errors else UNFINISHED
    errors = [first_error] * failed + [UNFINISHED] * (total - failed)
    # The prompt's own length is not kept for an unfinished request: its nominal one is.
    return [Request(input_len=record.input_tokens, output_len=0, ttft=0.0, itl=[], latency=0.0,
                    start_time=0.0, queue_time=0.0, error=error, window=record.window, token_times=())
            for error in errors]


def gaps(times: Sequence[float]) -> list[float]:
    """The inter-token latencies of one stream: differences of consecutive token times."""
    return [b - a for a, b in pairwise(times)]


def spread_token_times(first: float, last: float, tokens: int) -> tuple[float, ...]:
    """`tokens` times evenly from the first token to the last (a stream without token times)."""
    if tokens <= 1:
        return (first,)
    step = (last - first) / (tokens - 1)
    return tuple(first + k * step for k in range(tokens))


# ------------------------------------------------------------------ statistics


def summary_ms(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p99 of `values_s` in ms, keyed as vllm's process_one_metric keys them."""
    values = list(values_s) or [0.0]          # vllm's `values or 0`: an empty metric reads 0
    out = {f"mean_{name}_ms": statistics.fmean(values) * 1000,
           f"median_{name}_ms": statistics.median(values) * 1000,
           f"std_{name}_ms": statistics.pstdev(values) * 1000}
    for p in PERCENTILES:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = percentile(values, p) * 1000
    return out


def metric_values(requests: Sequence[Request]) -> dict[str, list[float]]:
    """Each percentile metric's values in seconds, over the successful requests as vllm takes them:
    TPOT only where there is a second token, ITL every gap pooled."""
    done = [r for r in requests if r.success]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }


def peak_rates(requests: Sequence[Request]) -> tuple[float, int]:
    """(max output tokens per second, max concurrent requests) by vllm's one-second buckets,
    the ranks' windows of one index overlaid; the highest of the windows."""
    by_window: dict[int, list[Request]] = defaultdict(list)
    for r in requests:
        if r.success:
            by_window[r.window].append(r)
    peaks = [window_peaks(done) for done in by_window.values()]
    return (max((t for t, _ in peaks), default=0.0), max((c for _, c in peaks), default=0))


def window_peaks(done: Sequence[Request]) -> tuple[float, int]:
    origin = min(r.start_time for r in done)
    buckets = math.ceil(max(r.start_time + r.latency for r in done) - origin) + 1
    tokens, active = [0] * buckets, [0] * buckets
    for r in done:
        for at in r.token_times:
            second = int(at - origin)
            if 0 <= second < buckets:
                tokens[second] += 1
        for second in range(int(r.start_time - origin), int(r.start_time + r.latency - origin) + 1):
            active[second] += 1
    return float(max(tokens)), max(active)


# ------------------------------------------------------------------ the object


def vllm_result(records: Sequence[ServeRecord], *, model: str, run_id: str = "", slo: str | None = None,
                date: str = "") -> dict[str, Any]:
    """One series at one load (valid records of one SeriesKey) as `vllm bench serve
    --save-result --save-detailed` would have written it.

    `slo`: the SLO whose goodput is `request_goodput` (None: the first the records carry);
    `date`: vllm's `date` stamp (DATE_FORMAT; empty: now).
    """
    requests = series_requests(records)
    duration = measured_duration(records)
    result = {**header(records, model, len(requests), date),
              **benchmark_fields(requests, duration, request_goodput(records, slo, duration))}
    values = metric_values(requests)
    for name in METRICS:
        result.update(summary_ms(name, values[name]))
    if result["max_concurrency"] is not None:
        # vllm adds its client-queue metric whenever a concurrency cap is set.
        result.update(summary_ms("client_queue_time", [r.queue_time for r in requests if r.success]))
    result["vcfslm"] = vcfslm_extras(records, run_id, slo_name(records, slo), duration)
    return result


def header(records: Sequence[ServeRecord], model: str, prompts: int, date: str) -> dict[str, Any]:
    """main_async's keys: what was run, against what, at which load."""
    first = records[0]
    backend = backend_name(first.server)
    rate, users = offered_load(records)
    return {"date": date or datetime.now().strftime(DATE_FORMAT), "endpoint_type": backend,
            "backend": backend, "label": first.server, "model_id": model, "tokenizer_id": model,
            "num_prompts": prompts, "request_rate": rate, "burstiness": first.burstiness,
            "max_concurrency": users}


def backend_name(server: str) -> str:
    """vllm bench's backend for a server: vLLM's own completions client, else the generic
    OpenAI one (vcfslm streams the completions API from every server; its label says which)."""
    return "vllm" if server == "vllm" else "openai"


def offered_load(records: Sequence[ServeRecord]) -> tuple[float | str, int | None]:
    """(request_rate, max_concurrency) of the whole series: the per-rank load times the ranks.
    A closed loop of users is vllm's unlimited rate under a concurrency cap."""
    first = records[0]
    whole = float(first.load) * ranks_pooled(records)
    if first.load_kind == "rate":
        return round(whole, 9), None
    return "inf", round(whole)


def benchmark_fields(requests: Sequence[Request], duration: float,
                     goodput: float | None) -> dict[str, Any]:
    """benchmark()'s `result` literal, generation branch, in its order."""
    done = [r for r in requests if r.success]
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_len for r in requests)
    max_tokens_per_s, max_concurrent = peak_rates(requests)
    return {
        "duration": duration, "completed": len(done), "failed": len(requests) - len(done),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": per_second(len(done), duration), "request_goodput": goodput,
        "output_throughput": per_second(total_output, duration),
        "total_token_throughput": per_second(total_input + total_output, duration),
        "input_lens": [r.input_len for r in requests], "output_lens": [r.output_len for r in requests],
        "ttfts": [r.ttft for r in requests], "itls": [r.itl for r in requests],
        "latencies": [r.latency for r in requests], "start_times": [r.start_time for r in requests],
        "queue_times": [r.queue_time for r in requests],
        "generated_texts": ["" for _ in requests],          # vcfslm keeps no text
        "errors": [r.error for r in requests],
        "max_output_tokens_per_s": max_tokens_per_s, "max_concurrent_requests": max_concurrent,
        "rtfx": 0.0,                                        # no audio input
    }


def per_second(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def slo_name(records: Sequence[ServeRecord], slo: str | None) -> str | None:
    """The SLO asked for, else the first the records judged (None: they judged none)."""
    if slo is not None:
        return slo
    return next((name for r in records for name in r.goodput), None)


def good_requests(records: Sequence[ServeRecord], slo: str) -> float:
    """Requests that met `slo`: each window's goodput (req/s over its span) back to a count."""
    return sum(float(r.goodput.get(slo, 0.0)) * r.span_s for r in records)


def request_goodput(records: Sequence[ServeRecord], slo: str | None, duration: float) -> float | None:
    name = slo_name(records, slo)
    if name is None or not any(name in r.goodput for r in records):
        return None
    return per_second(good_requests(records, name), duration)


def vcfslm_extras(records: Sequence[ServeRecord], run_id: str, slo: str | None,
                  duration: float) -> dict[str, Any]:
    """What vcfslm knows beyond vllm's keys (vllm's readers ignore an unknown key)."""
    first = records[0]
    slos = sorted({name for r in records for name in r.goodput})
    return {
        "run_id": run_id, "workload": first.workload, "arrival": first.arrival,
        "scope": "endpoint" if first.endpoint else "ranks",
        "endpoint": first.endpoint, "endpoint_nodes": first.endpoint_nodes,
        # An endpoint's load is the deployment's; a rank's load is its own (request_rate: all ranks').
        "load_kind": first.load_kind, "load": float(first.load),
        "load_of": "the deployment" if first.endpoint else "each rank", "ranks": ranks_pooled(records),
        "windows": len({r.window for r in records}), "records": len(records),
        "input_tokens": first.input_tokens, "output_tokens": first.output_tokens,
        "goodput_slo": slo,
        "goodput": {name: per_second(good_requests(records, name), duration) for name in slos},
        "errors": sorted({e for r in records for e in r.errors}),
        "duration_rule": "sum of the pooled windows' span_s over the ranks pooled (one rank's measured time)",
        "times": "seconds on each window's clock, from each request's planned arrival",
    }


# ------------------------------------------------------------------ files


def vllm_results(records: Iterable[ServeRecord], *, model: str, run_id: str = "", slo: str | None = None,
                 date: str = "") -> dict[str, dict[str, Any]]:
    """File name -> vllm_result for every series at every load of a run's records."""
    groups = group_series(records)
    results = [vllm_result(group, model=model, run_id=run_id, slo=slo, date=date)
               for group in groups.values()]
    return dict(zip(unique_names(list(groups), results, model), results, strict=True))


def base_name(result: dict[str, Any], model: str) -> str:
    """vllm's name without its date: {label}-{rate}qps[-concurrency{n}]-{model's last part}."""
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] is not None else ""
    model_part = model.rstrip("/").split("/")[-1] or "model"
    return f"{result['label']}-{result['request_rate']}qps{concurrency}-{model_part}"


def series_suffix(key: SeriesKey) -> str:
    """What tells apart series of one load: context, output, workload, endpoint nodes."""
    parts = [f"in{key.input_tokens}", f"out{key.output_tokens}"]
    if key.workload:
        parts.append(key.workload)
    if key.endpoint_nodes:
        parts.append(f"{key.endpoint_nodes}nodes")
    return "-" + "-".join(parts)


def unique_names(keys: Sequence[SeriesKey], results: Sequence[dict[str, Any]], model: str) -> list[str]:
    """A safe, distinct file name per series; the same series always gets the same name,
    so writing a run again replaces its files (vllm's date stamp is left out for that)."""
    bases = [safe_name(base_name(result, model)) for result in results]
    names = [base if bases.count(base) == 1 else safe_name(base + series_suffix(key))
             for base, key in zip(bases, keys, strict=True)]
    seen: dict[str, int] = defaultdict(int)
    out = []
    for name in names:
        seen[name] += 1
        repeat = seen[name]
        out.append(f"{name}.json" if names.count(name) == 1 else f"{name}-{repeat}.json")
    return out


def safe_name(name: str) -> str:
    """Letters, digits, dot, dash and underscore only: a file name on every filesystem."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "series"


def run_date(created: str) -> str:
    """meta.json's `created` as vllm's date stamp (now when it does not parse)."""
    try:
        return datetime.fromisoformat(created).strftime(DATE_FORMAT)
    except ValueError:
        return datetime.now().strftime(DATE_FORMAT)


def write_vllm_results(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Write runs/<id>/vllm-results/<name>.json for every series and load of the run's
    serving.jsonl, each atomically; the paths written. RunFolderError when the run's
    meta.json or serving.jsonl is missing or bad."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    records = read_serve_records(run_dir / SERVE_RESULTS)
    slo = next(iter(meta.slos), None)
    results = vllm_results(records, model=meta.model, run_id=meta.run_id, slo=slo, date=run_date(meta.created))
    written = []
    for name, result in results.items():
        path = run_dir / VLLM_RESULTS / name
        atomic_write_text(path, json.dumps(result) + "\n")   # vllm's compact dump, its key order
        written.append(path)
    return written
