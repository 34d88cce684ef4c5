"""Serving's tables (no plotting, no file I/O): the serving threshold beside the static
crossover (with the nodes it asks for), every series' loads, every series' thresholds,
sizing from them; a workload series (or one whose prompts varied) split by prompt length,
as a table and a CSV; through one endpoint, the scale-out curve (threshold at N nodes,
N x one node's, their ratio) and the windows that took a fault."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence

from vcfslm.analysis import below
from vcfslm.analysis.cells import (
    CLUSTER,
    model_text,
)
from vcfslm.analysis.endpoint import (
    FaultWindow,
    ScaleOut,
    deployment_text,
    failing_text,
    load_text,
    seconds_text,
    share_text,
    shares_text,
)
from vcfslm.analysis.lengths import HISTORY_BRIEF, LengthSplit, SeriesLengths
from vcfslm.analysis.serve import ServeComparison
from vcfslm.analysis.serve_points import (
    PCT,
    UNITS,
    ServeKey,
    ServePoint,
    describe_key,
    fmt_load,
    history_of,
    key_dict,
)
from vcfslm.analysis.serve_sizing import ServeSizing
from vcfslm.analysis.serve_threshold import ServeThreshold
from vcfslm.analysis.slo import law_formula
from vcfslm.analysis.tables import Table, fmt, raw

# What a serving threshold's node count divides by.
PER_VM_STREAMS = "streams per VM at threshold"
PREFIX_CACHE = "prefix cache (prompt tokens)"
CACHE_NOTE = ("Prefix cache: the prompt tokens the server's prefix cache held over the prompt tokens sent, "
              "as the server counted them per request.")


def _serve_fmt(value: float | None, digits: int) -> str:
    if value is not None and math.isinf(value):
        return "∞"
    return fmt(value, digits)


def context_column(keys: Sequence[ServeKey]) -> str:
    """The input column's name: a workload series is named by its workload, not a length."""
    return "input tokens or workload" if any(k.workload for k in keys) else "input tokens"


def several_outputs_of(keys: Sequence[ServeKey]) -> bool:
    """Do the fixed contexts differ in output length (a workload's is only its longest reply)?"""
    return len({k.output_tokens for k in keys if not k.workload}) > 1


def _share(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, 1, " %")


def serve_answer_table(comparisons: Sequence[ServeComparison], sizings: Sequence[ServeSizing],
                       headroom: float = 0.0) -> Table:
    """Per SLO x context (or workload, a row each): the serving threshold, the static crossover
    beside it, their ratio and the nodes the serving threshold asks for."""
    peaks = list(dict.fromkeys(s.peak_streams for s in sizings if s.peak_streams is not None))
    keys = [c.threshold.key for c in comparisons]
    several_outputs = several_outputs_of(keys)
    several_servers = len({c.threshold.key.server for c in comparisons}) > 1
    several_models = len({c.threshold.key.model for c in comparisons}) > 1
    notes_of = {id(c): "; ".join(x for x in (_serve_note(c), _curve_note(c.threshold, sizings)) if x)
                for c in comparisons}
    with_notes = any(notes_of.values())
    cols = ["model"] if several_models else []
    cols += ["SLO", context_column(keys)] + (["output tokens"] if several_outputs else [])
    cols += ["server"] if several_servers else []
    cols += ["load", "threshold (per VM)", "first failing (per VM)", "binding", "streams/VM at threshold",
             "static crossover (streams/VM)", "serving / static"]
    cols += [f"nodes for {p} streams" for p in peaks] + (["note"] if with_notes else [])
    rows = []
    for c in comparisons:
        t = c.threshold
        mine = {s.peak_streams: s for s in sizings if s.threshold is t}
        row = [model_text(t.key.model)] if several_models else []
        row += [t.slo.title, t.key.context_text] + ([t.key.output_text] if several_outputs else [])
        row += [t.key.server] if several_servers else []
        streams = t.streams_text + (f" {t.streams_interval.text(lambda v: f'{v:.1f}')}"
                                    if t.streams_interval and t.status in ("threshold", "above") else "")
        row += [UNITS[t.key.load_kind], " ".join(x for x in (t.threshold_text, t.interval_text) if x),
                t.first_failing_text, t.binding or "–", streams, c.static_text, c.ratio_text]
        row += [" ".join(x for x in (mine[p].nodes_text(), mine[p].interval_text()) if x) if p in mine else "–"
                for p in peaks]
        row += [notes_of[id(c)]] if with_notes else []
        rows.append(row)
    rules = ", ".join(dict.fromkeys(c.threshold.rule for c in comparisons)) or "attainment"
    title = f"Serving threshold per SLO and {'context or workload' if any(k.workload for k in keys) else 'context'} "
    title += f"(continuous batching, {rules}"
    title += f", headroom {headroom:.0%})" if headroom else ")"
    notes = ["Threshold: the largest load tried at which the stated share of requests met every limit at once "
             "(TTFT with the queue, and TPOT), before the first failing load; an unfinished request met none. "
             "“< n”: even the smallest load tried fails, and the note says why none lower was found: a single "
             "request misses the SLO (none meets it), or the sweep's budget ran out; “≥ n”: every load tried "
             "meets it. [a–<b]: the 95 % bootstrap interval (windows within ranks, requests within windows): "
             "at least a and below b, the first failing load of the replicates.",
             "Streams/VM at threshold: time-averaged busy slots × ranks per VM (Little's law, measured). "
             "Serving / static: those streams over the static-batch crossover, given only where the static "
             "percentile is the same share as the attainment (p90 beside 90 %). "
             f"Nodes = {law_formula(PER_VM_STREAMS, 'headroom' if headroom else None)}."]
    return Table(title, cols, rows, notes)


def _curve_note(t: ServeThreshold, sizings: Sequence[ServeSizing]) -> str:
    curves = {s.curve for s in sizings if s.threshold is t and s.curve}
    return f"nodes on the measured cluster curve ({'; '.join(sorted(curves))})" if curves else ""


def _serve_note(c: ServeComparison) -> str:
    t = c.threshold
    notes = []
    if t.non_monotonic:
        notes.append("not monotonic: passes again at " + ", ".join(
            fmt_load(v * t.key.per_vm) for v in t.non_monotonic))
    if t.status == "below":
        notes.append(below.note(t.below_why, t.slo.title, t.key))
    if t.key.scope == CLUSTER:
        notes.append("read from cluster series")
    if t.few_samples:
        notes.append("few samples: " + "; ".join(t.few_samples))
    if c.note:
        notes.append(c.note)
    if history_of(t.key, t.points):
        notes.append(HISTORY_BRIEF)
    return "; ".join(notes)


def serve_points_table(points: Sequence[ServePoint], slos: Sequence, with_model: bool = False) -> Table:
    """One series' loads: latency tails, goodput per SLO, concurrency, requests, validity
    (with_model: its title names the model, for inputs of several)."""
    key = points[0].key
    unit = key.unit
    # Through one endpoint the load is the whole deployment's, not a rank's.
    offered = f"load at the endpoint ({unit})" if key.endpoint_nodes else f"load/rank ({unit})"
    cols = [offered, f"load/VM ({unit})", "requests", "unfinished", "TTFT p50 (s)",
            f"TTFT {PCT} (s)", "TPOT p50 (ms)", f"TPOT {PCT} (ms)", "streams/VM", "completed (req/s/VM)"]
    cols += [f"goodput {s.title} (req/s/VM)" for s in slos]
    cols += [f"attainment {s.title}" for s in slos]
    # Only where the server said what its prefix cache held: a column of dashes says nothing.
    cached = any(p.cached_share is not None for p in points)
    cols += [PREFIX_CACHE] if cached else []
    flagged = any(p.flags for p in points)
    cols += ["windows"] + (["flags"] if flagged else [])
    rows = []
    for p in sorted(points, key=lambda p: p.load):
        row = [fmt_load(p.load), fmt_load(p.load_per_vm), str(p.requests), str(p.unfinished),
               _serve_fmt(p.ttft_p50_s, 2), _serve_fmt(p.ttft_p90_s, 2), _serve_fmt(p.tpot_p50_ms, 1),
               _serve_fmt(p.tpot_p90_ms, 1), fmt(p.streams_per_vm, 1), fmt(p.completed_per_vm, 2)]
        row += [fmt(p.goodput_per_vm.get(s.name), 2) for s in slos]
        row += [_attainment_text(p, s) for s in slos]
        row += [_share(p.cached_share)] if cached else []
        row += [f"{p.windows - p.invalid_windows}/{p.windows}"] + (["; ".join(p.flags)] if flagged else [])
        rows.append(row)
    title = f"Serving, {model_text(key.model) + ', ' if with_model else ''}{describe_key(key)}"
    notes = ["Tails pool every counted request of every rank and valid window; ∞: the tail reaches an "
             "unfinished request. Goodput: requests per second per VM that met every limit of the SLO; "
             "attainment: the share of counted requests that did (unfinished ones met none)."]
    notes += [CACHE_NOTE] if cached else []
    history = history_of(key, points)
    notes += [history + "."] if history else []
    return Table(title, cols, rows, notes)


def _attainment_text(p: ServePoint, slo) -> str:
    if not p.has_data:
        return "–"
    return f"{p.result.attainment(slo.tpot_ms, slo.ttft_s, slo.ttft_per_token_ms).share * 100:.1f} %"


def serve_thresholds_table(thresholds: Sequence[ServeThreshold]) -> Table:
    """Every series x SLO (the answer reads one per SLO and context)."""
    several_models = len({t.key.model for t in thresholds}) > 1
    cols = (["model"] if several_models else []) + [
        "SLO", "series", "rule", "threshold (per VM)", "95% interval", "first failing (per VM)", "binding",
        "streams/VM at threshold"]
    rows = [([model_text(t.key.model)] if several_models else [])
            + [t.slo.title, describe_key(t.key), t.rule, f"{t.threshold_text} {t.key.unit}", t.interval_text or "–",
               t.first_failing_text, t.binding or "–", t.streams_text] for t in thresholds]
    return Table("Serving threshold of every series", cols, rows)


def serve_sizing_table(sizings: Sequence[ServeSizing]) -> Table:
    """Sizing from serving thresholds; the by-rate columns only when a peak rate was given."""
    by_rate = any(s.peak_rps is not None for s in sizings)
    cols = ["SLO", context_column([s.threshold.key for s in sizings]), "load", "peak streams"]
    cols += ["peak req/s"] if by_rate else []
    cols += ["rule", "streams/VM at threshold", "threshold (per VM)", "headroom", "nodes by streams"]
    cols += ["nodes by rate"] if by_rate else []
    rows = []
    for s in sizings:
        t = s.threshold
        row = [t.slo.title, t.key.context_text, UNITS[t.key.load_kind],
               "–" if s.peak_streams is None else str(s.peak_streams)]
        row += ["–" if s.peak_rps is None else f"{s.peak_rps:g}"] if by_rate else []
        row += [t.rule, t.streams_text, " ".join(x for x in (t.threshold_text, t.interval_text) if x),
                f"{s.headroom:.0%}", " ".join(x for x in (s.nodes_text("streams"), s.interval_text("streams")) if x)]
        row += [" ".join(x for x in (s.nodes_text("rate"), s.interval_text("rate")) if x)] if by_rate else []
        rows.append(row)
    return Table("Sizing from the serving threshold", cols, rows,
                 [f"Nodes by streams = {law_formula(PER_VM_STREAMS, 'headroom')}; "
                  f"by rate = {law_formula('threshold req/s per VM', 'headroom', 'peak req/s')}. “≤ n”: every load "
                  "tried met the SLO, so fewer nodes may do. [a–b]: the 95 % bootstrap interval, from the "
                  "threshold's ends."])


# ------------------------------------------------------------------ through one endpoint


def scale_out_table(curves: Sequence[ScaleOut]) -> Table:
    """Per SLO and context: the threshold at N nodes behind one endpoint, N × the single node's,
    their ratio (the scale-out efficiency) and how the router split the requests."""
    several_models = len({c.key.model for c in curves}) > 1
    several_servers = len({c.key.server for c in curves}) > 1
    cols = (["model"] if several_models else []) + ["SLO", context_column([c.key for c in curves])]
    cols += ["server"] if several_servers else []
    cols += ["nodes", "threshold (deployment)", "N × 1 node", "efficiency [95 %]", "first failing", "binding",
             "streams at threshold", "requests per server"]
    rows = []
    for c in curves:
        for r in c.rows:
            t = r.threshold
            row = [model_text(c.key.model)] if several_models else []
            row += [c.slo.title, c.key.context_text] + ([c.key.server] if several_servers else [])
            ideal = r.ideal
            row += [str(r.nodes), f"{deployment_text(t)} {c.key.unit}",
                    "–" if ideal is None else f"{'≥ ' if r.single.status == 'above' else ''}{load_text(ideal)}",
                    r.efficiency_text, failing_text(t), t.binding or "–", fmt(r.streams, 1),
                    shares_text(r.split())]
            rows.append(row)
    notes = ["Threshold (deployment): the largest load offered at the endpoint, the whole deployment's, at which "
             "the stated share of requests met every limit at once, with its 95 % bootstrap interval. "
             "Efficiency: the threshold at N nodes over N × the single node's; its interval pairs the two "
             "intervals the cautious way, low(N) / (N × high(1)) to high(N) / (N × low(1)). “≥”: every load "
             "tried passed at N (the efficiency may be higher); “≤”: at one node.",
             "Requests per server: the smallest and largest share of the requests the servers' own counters "
             "finished at the threshold load (vllm:request_success_total), how evenly the router spread them."]
    return Table("Scale-out under serving (through one endpoint)", cols, rows, notes)


def fault_table(faults: Sequence[FaultWindow], slos: Sequence) -> Table:
    """Each window that took a fault: what was killed, when it came back, what failed, and
    the attainment during the fault and after it."""
    cols = ["run", "nodes", "load", "window", "killed", "at (s)", "down (s)", "back (s)", "restart (s)",
            "detect (s)", "failed (counted / all)"]
    names = [s.name for s in slos]
    cols += [f"{s.title} during / after" for s in slos]
    rows = []
    for f in faults:
        d = f.fault
        row = [f.run_id, str(f.nodes), f"{fmt_load(f.load)} {UNITS[f.load_kind]}", str(f.window),
               str(d.get("target", "–")), seconds_text(d.get("at_s"))]
        if "error" in d:
            row += ["–", "–", "–", "–", f"did not happen: {d['error']}"] + ["–"] * len(names)
        else:
            row += [seconds_text(d.get("start_s")), seconds_text(d.get("end_s")) if d.get("end_s") is not None
                    else "not back", seconds_text(d.get("restart_s")), seconds_text(d.get("detect_s")),
                    f"{d.get('failed', 0)} / {d.get('failed_all', 0)}"]
            during, after = d.get("attainment_during") or {}, d.get("attainment_after") or {}
            row += [f"{share_text(during.get(n))} / {share_text(after.get(n))}" for n in names]
        rows.append(row)
    notes = ["Times in seconds from the window's start. Down: the kill; back: the server answered /health "
             "again (polled every 0.5 s from the client); restart = back − down; detect: the kill to the last "
             "failed request sent after it (the router stopped sending to the dead server, or took it back; 0: "
             "only streams in flight at the kill failed). Failed: requests "
             "that failed (5xx, dropped or stalled streams) from the kill on, each a miss, counted ones / "
             "every one. During / after: attainment of the counted requests that arrived from the kill "
             "until it was back, and after."]
    return Table("Faults through the router", cols, rows, notes)


# ------------------------------------------------------------------ by prompt length

UNFINISHED_ROW = "unfinished (length not recorded)"


def length_table(lengths: SeriesLengths, slos: Sequence, with_model: bool = False) -> Table:
    """One series' loads split by prompt length: per bucket the finished requests, their TTFT and
    TPOT tails and each SLO's share; the unfinished requests on a row of their own."""
    key = lengths.key
    roles = any(split.roles for split in lengths.splits)
    cached = any(split.cached_share is not None for split in lengths.splits)
    cols = [f"load/VM ({key.unit})"] + (["read at"] if roles else [])
    cols += ["prompt tokens", "requests", "TTFT p50 (s)", f"TTFT {PCT} (s)", "TPOT p50 (ms)", f"TPOT {PCT} (ms)"]
    cols += [f"meets {s.title}" for s in slos] + ([PREFIX_CACHE] if cached else [])
    rows = []
    for split in lengths.splits:
        head = [fmt_load(split.load * key.per_vm)] + (["; ".join(split.roles) or "–"] if roles else [])
        rows += [head + _bucket_cells(b, slos) + ([_share(b.cached_share)] if cached else [])
                 for b in split.buckets]
        if split.unfinished:
            rows.append(head + [UNFINISHED_ROW, str(split.unfinished)] + ["–"] * (4 + len(slos))
                        + (["–"] if cached else []))
    title = f"TTFT and TPOT by prompt length, {model_text(key.model) + ', ' if with_model else ''}{describe_key(key)}"
    return Table(title, cols, rows, _length_notes(lengths, cached))


def _bucket_cells(b, slos: Sequence) -> list[str]:
    return ([b.label, str(b.requests), fmt(b.ttft_p50_s, 2), fmt(b.ttft_p90_s, 2), fmt(b.tpot_p50_ms, 1),
             fmt(b.tpot_p90_ms, 1)] + [_share(b.meets.get(s.name)) for s in slos])


def _length_notes(lengths: SeriesLengths, cached: bool) -> list[str]:
    which = ("every load tried" if lengths.every_load
             else "the loads the thresholds are read at (each SLO's threshold and first failing load)")
    notes = [f"Loads: {which}. Prompt tokens: each request's whole prompt, a conversation's history included. "
             f"Tails over the bucket's finished requests; meets: the share of them within every limit of the "
             "SLO at once.",
             "Unfinished requests have no length on record (a window keeps per-request lengths for finished "
             "requests only), so they sit on a row of their own; each met no SLO, and the load's attainment "
             "counts them where these shares do not."]
    notes += [CACHE_NOTE] if cached else []
    return notes + [n + "." for n in lengths.notes]


LENGTH_CSV_KEY = ("model", "scope", "vms", "ranks_per_vm", "server", "workload", "load_kind", "arrival", "slots",
                  "input_tokens", "output_tokens", "endpoint_nodes", "faulted")


def length_buckets_csv(series: Sequence[SeriesLengths], slos: Sequence) -> str:
    """Every split series' buckets as raw numbers, one row per load and bucket (the unfinished
    requests as bucket `unfinished`): what serve-length-buckets.csv holds."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*LENGTH_CSV_KEY, "load", "load_per_vm", "read_at", "bucket", "requests", "ttft_p50_s",
                "ttft_p90_s", "tpot_p50_ms", "tpot_p90_ms", *[f"meets_{s.name}" for s in slos],
                "prompt_tokens", "cached_tokens", "cached_share"])
    for lengths in series:
        keys = key_dict(lengths.key)
        head = [keys[k] for k in LENGTH_CSV_KEY]
        for split in lengths.splits:
            w.writerows(_split_csv_rows(head, split, lengths.key.per_vm, slos))
    return buf.getvalue()


def _split_csv_rows(head: list, split: LengthSplit, per_vm: float, slos: Sequence) -> list[list]:
    at = [raw(split.load), raw(split.load * per_vm), "; ".join(split.roles)]
    rows = [head + at + [b.label, b.requests, raw(b.ttft_p50_s), raw(b.ttft_p90_s), raw(b.tpot_p50_ms),
                         raw(b.tpot_p90_ms), *[raw(b.meets.get(s.name)) for s in slos], b.prompt_tokens,
                         "" if b.cached_tokens is None else b.cached_tokens, raw(b.cached_share)]
            for b in split.buckets]
    if split.unfinished:
        rows.append(head + at + ["unfinished", split.unfinished] + [""] * (7 + len(slos)))
    return rows
