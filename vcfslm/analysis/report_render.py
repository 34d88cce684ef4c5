"""A report rendered (pure): what the report says (`Report`), as report.md, as report.html and
as the CLI's text, each opening with the answer; the runs' metadata rows close each.

report.html is self-contained: figures are inline base64 data URIs and the
styles are inline, so the file can be mailed."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vcfslm.analysis.cells import Analysis
from vcfslm.analysis.predict import ModelSection, model_table
from vcfslm.analysis.serve import ServeAnalysis
from vcfslm.analysis.serve_points import SERVE_FIGURES, fmt_load
from vcfslm.analysis.serve_threshold import threshold_reason
from vcfslm.analysis.slo import Crossover, Sizing
from vcfslm.analysis.summary import SloReasons
from vcfslm.analysis.tables import (
    Table,
    md_cell,
)
from vcfslm.results import RunMeta
from vcfslm.serving.judging import Rule, percentile_value
from vcfslm.steadiness import rank_verdicts

# The figures that answer the question, shown right under the answer table, in this
# order (the models side by side first, when the inputs hold several); the others
# (throughput, roofline) follow the detail tables.
KEY_FIGURES = ("fig-10-models", "fig-3-tpot-slo", "fig-4-ttft-slo", "fig-2-matched-tpot")


@dataclass
class Report:
    """Everything the report says, before it is written anywhere."""

    title: str
    analysis: Analysis
    sources: list[str]
    percentile: str
    slos: list
    crossovers: list[Crossover]
    sizings: list[Sizing]
    tables: list[Table]
    summary: Table
    reasons: list[SloReasons]
    reasons_intro: str
    warnings: list[str] = field(default_factory=list)
    model: ModelSection | None = None
    serving: ServeAnalysis | None = None        # serving mode's part; None without serve records
    serving_answer: Table | None = None
    serving_tables: list[Table] = field(default_factory=list)
    serving_predicted: list = field(default_factory=list)   # PredictedSeries shown beside the measured
    rule: Rule = field(default_factory=Rule)
    rule_notes: list[str] = field(default_factory=list)


def has_static(report: Report) -> bool:
    """Does the report carry the static sections (always, unless it is serving-only)?"""
    return report.serving is None or any(c.has_data for c in report.analysis.cells)


# ------------------------------------------------------------- metadata


def meta_rows(meta: RunMeta) -> list[tuple[str, str]]:
    m = meta
    rows = [("run id", m.run_id), ("label", m.label or "–"), ("created", m.created), ("mode", m.mode),
            ("nodes", ", ".join(m.nodes) or "–"), ("ranks per node", str(m.ranks_per_node)),
            ("threads per rank", str(m.threads_per_rank)), ("model", m.model),
            ("matrix", _compact(m.matrix)), ("complete", "yes" if m.complete else "NO"),
            ("command", " ".join(m.command) or "–"), ("inventory sha256", m.inventory_sha256 or "–")]
    if m.failure:
        rows.append(("failure", m.failure))
    for key, value in flatten(m.versions, "versions"):
        rows.append((key, value))
    for key, value in flatten(m.probe, "probe"):
        if not key.endswith(".steadiness"):     # said in words below, from every rank
            rows.append((key, value))
    rows.extend(probe_steadiness_rows(m))
    rows.extend(linear_plan_rows(m))
    return rows


def linear_plan_rows(meta: RunMeta) -> list[tuple[str, str]]:
    """("linear kernels", the plan every rank's linears ran on): the label names the path and,
    where the plan holds fp32 (onednn-fp32 on a CPU without bf16), that the weights took twice
    the bf16 memory. One row per distinct plan, with the ranks that ran it when they differ."""
    plans: dict[str, list[str]] = {}
    ranks = meta.ranks if isinstance(meta.ranks, dict) else {}
    for rank, facts in sorted(ranks.items(), key=lambda kv: (len(str(kv[0])), str(kv[0]))):
        pack = facts.get("pack") if isinstance(facts, dict) else None
        label = pack.get("label") if isinstance(pack, dict) else None
        if isinstance(label, str) and label:
            plans.setdefault(label, []).append(str(rank))
    if len(plans) == 1:
        return [("linear kernels", next(iter(plans)))]
    return [(f"linear kernels, ranks {', '.join(r)}", label) for label, r in plans.items()]


def probe_steadiness_rows(meta: RunMeta) -> list[tuple[str, str]]:
    """(rank, whether its probe found the machine steady or busy, and on what) for every rank
    whose probe recorded it; a run older than the verdict has none."""
    return [(f"probe steadiness, {f'node {node} ' if node else ''}rank {rank}", verdict.summary)
            for rank, node, verdict in rank_verdicts(meta.ranks)]


def topology_rows(meta: RunMeta) -> list[tuple[str, str, str]]:
    """(node, check, result) from meta.guests (the guests' NUMA facts and checks, as recorded)."""
    rows = []
    for node, facts in sorted((meta.guests or {}).items()):
        if not isinstance(facts, dict):
            rows.append((node, "facts", _compact(facts)))
            continue
        for key, value in flatten(facts):
            rows.append((node, key, value))
    return rows


def flatten(data: Any, prefix: str = "", depth: int = 3) -> list[tuple[str, str]]:
    """Nested dicts as (dotted key, short text) pairs; booleans read as pass/FAIL for checks."""
    if not isinstance(data, dict) or depth == 0:
        return [(prefix, _compact(data))] if prefix else []
    out = []
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.extend(flatten(value, name, depth - 1))
        else:
            out.append((name, _compact(value)))
    return out


def _compact(value: Any) -> str:
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True, default=str)
        return text if len(text) <= 300 else text[:297] + "..."
    return "–" if value is None else str(value)


# -------------------------------------------------------------- markdown


def split_figures(figures: Sequence) -> tuple[list, list]:
    """(key figures in KEY_FIGURES order, the rest in drawing order; serving's are the serving section's)."""
    by_name = {f.name: f for f in figures}
    key = [by_name[n] for n in KEY_FIGURES if n in by_name]
    return key, [f for f in figures if f.name not in KEY_FIGURES and f.name not in SERVE_FIGURES]


def serving_figures(figures: Sequence) -> list:
    return [f for f in figures if f.name in SERVE_FIGURES]


def slo_line(report: Report) -> str:
    """The SLOs and the rule each table was judged by, in one line."""
    line = f"SLOs: {'; '.join(s.describe() for s in report.slos)}. Judged by: "
    parts = []
    if has_static(report):
        parts.append(f"static batches at {report.rule.static_text()}")
    if report.serving is not None:
        parts.append(f"serving by attainment, {report.rule.serving_text()}")
    own = [s.title for s in report.slos if s.percentile]
    if own:
        parts.append(f"{', '.join(own)} at {'their' if len(own) > 1 else 'its'} own percentile "
                     "(that share of requests when serving)")
    line += "; ".join(parts) + f"; {report.rule.confidence:.0%} intervals by bootstrap."
    return " ".join([line] + [f"Note: {n}." for n in report.rule_notes])


def answer_tables(report: Report) -> list[Table]:
    """The answer: the static summary (unless the inputs are serving-only), then serving's."""
    out = [report.summary] if has_static(report) else []
    return out + ([report.serving_answer] if report.serving_answer is not None else [])


def render_text(report: Report) -> list[str]:
    """What `vcfslm report` prints first: the answer as plain lines (never wrapped or cut)."""
    return [line for table in answer_tables(report) for line in table.text()] + [slo_line(report)]


def serving_intro(rule: Rule) -> str:
    return ("Continuous batching: requests arrive on their own (open loop at a rate, or closed-loop "
            "users) and join a batch of a fixed number of slots between decode steps. A load meets an "
            f"SLO when {rule.serving_text()} at once: TTFT (queue included) and TPOT, counted over every "
            "request of every rank; a request unfinished by the window's cutoff met none. The threshold is "
            "the largest load tried before the first failing one, with its "
            f"{rule.confidence:.0%} interval from a bootstrap of windows within ranks and requests within "
            "windows; streams per VM are the time-averaged busy slots there times ranks per VM (Little's "
            "law, measured), the number the static crossover and the sizing law speak of. The "
            "serving / static ratio is given only where the static percentile and the attainment are the "
            f"same share ({rule.percentile} of streams beside {rule.serving_text()} would pair when they "
            "match).")


def server_text(facts) -> str:
    """How an HTTP server served a run (rank 0's server facts), in one sentence; "" for none."""
    if not isinstance(facts, dict) or not facts.get("name"):
        return ""
    peak = max((facts.get("peak_rss_bytes") or {}).values(), default=0)
    parts = [f"served by {facts['name']} {facts.get('version') or '(version unknown)'}, one server per vNUMA node",
             f"chunked prefill {'on' if facts.get('chunked_prefill') else 'off'}",
             f"prefix caching {'on' if facts.get('prefix_caching') else 'off'}",
             f"{facts.get('max_num_seqs')} sequences, {facts.get('kv_cache_gib')} GiB KV cache"]
    if facts.get("enforce_eager"):
        parts.append("eager (--enforce-eager: no torch.compile, slower steps than the compiled server)")
    if facts.get("startup_s") is not None:
        parts.append(f"{facts['startup_s']:.0f} s from launch to healthy")
    if peak:
        parts.append(f"peak RSS of its largest process {peak / 1e9:.2f} GB")
    return ", ".join(parts)


def serving_reasons(report: Report) -> list[str]:
    """One paragraph per answer threshold, then how its node counts follow."""
    if report.serving is None:
        return []
    out = []
    for t in report.serving.primaries:
        sizing = [s for s in report.serving.sizings if s.threshold is t and s.nodes_by_streams is not None]
        text = threshold_reason(t)
        if sizing:
            text += " Nodes: " + "; ".join(f"{s.peak_streams} streams → {s.law_text}"
                                           + (f" {s.interval_text()}" if s.interval_text() else "")
                                           for s in sizing) + "."
        if t.rate_per_vm and sizing and sizing[0].curve:
            text += " By rate: on the same curve (vcfslm size --threshold serving --peak-rps X)."
        elif t.rate_per_vm and sizing:
            text += (f" By rate: nodes = ceil(peak requests/s / {fmt_load(t.rate_per_vm * (1 - sizing[0].headroom))})"
                     " (vcfslm size --threshold serving --peak-rps X).")
        out.append(text)
    out += scale_out_reasons(report.serving)
    for meta in report.analysis.metas:
        out += endpoint_text(meta)
        served = server_text(((meta.ranks or {}).get("0") or {}).get("server"))
        if served:
            out.append(f"Run {meta.run_id}: {served}.")
        for stop in ((meta.ranks or {}).get("0") or {}).get("sweep") or ():
            out.append(f"Run {meta.run_id}: the sweep for {stop.get('slo')}, {stop.get('input_tokens')}-token "
                       f"inputs stopped: {stop.get('reason')}.")
    for c in report.serving.comparisons:
        head = f"{c.threshold.slo.title}, {c.threshold.key.input_tokens}-token inputs: "
        if c.ratio is not None:
            out.append(head + f"serving carries {c.threshold.streams_text} concurrent streams/VM at its "
                       f"threshold, static batches {c.static_text} at their crossover ({c.pairing}): "
                       f"ratio {c.ratio_text}.")
        elif c.static is not None and not c.comparable:
            out.append(head + f"no serving / static ratio: {c.pairing} judge different shares of users "
                       f"(pass --percentile p{c.threshold.share * 100:g} or --attainment "
                       f"{percentile_value(c.static.percentile) / 100:g} to pair them).")
    return out


def scale_out_reasons(serving: ServeAnalysis) -> list[str]:
    """One sentence per scale-out curve: the efficiency at each node count beyond one."""
    out = []
    for c in serving.scale_outs:
        parts = [f"{r.nodes} nodes {r.efficiency_text}" for r in c.rows if r.nodes > 1]
        inputs = c.key.context_phrase if c.key.workload else f"{c.key.input_tokens}-token inputs"
        head = f"{c.slo.title}, {inputs}, through one endpoint: "
        single = next((r for r in c.rows if r.nodes == 1), None)
        if single is None or single.measured is None:
            out.append(head + "no single-node threshold measured, so no scale-out efficiency "
                       "(measure --scale-out 1,... to have one).")
        else:
            out.append(head + f"one node holds {fmt_load(single.measured)} {c.key.unit}; scale-out efficiency "
                       "(threshold at N nodes over N × one node's) " + ", ".join(parts) + ".")
    return out


def endpoint_text(meta: RunMeta) -> list[str]:
    """How a run through one endpoint was loaded, one line per stage; [] for any other run."""
    stages = ((meta.guests or {}).get("endpoint") or {}).get("stages") or {}
    out = []
    for n, facts in sorted(stages.items(), key=lambda kv: int(kv[0])):
        if not isinstance(facts, dict):
            continue
        out.append(f"Run {meta.run_id}: one client on the operator's machine loaded {facts.get('url')} with "
                   f"{n} node(s) behind it ({len(facts.get('servers') or [])} server(s) whose counters split each "
                   f"window, model {facts.get('model')}, {facts.get('version') or 'version unknown'}, prompts as "
                   f"{facts.get('prompts')}).")
    return out


def render_markdown(report: Report, figures: Sequence, skipped: Sequence[str]) -> str:
    """Same order as the HTML; figures are the PNG files next to it."""
    key, more = split_figures(figures)
    static = has_static(report)
    out = [f"# vcfslm report — {report.title}", "", f"Inputs: {', '.join(report.sources)}. {slo_line(report)}",
           "", "## Answer", ""] + [t.markdown() for t in answer_tables(report)]
    out += ["## Validity warnings", ""]
    out += [f"- {w}" for w in report.warnings] or ["None."]
    if static:
        out += ["", "## Key figures", ""] + _md_figures(key)
        out += ["## Reasoning per SLO", "", report.reasons_intro, ""]
        for r in report.reasons:
            out += [f"- **{r.headline}.** {r.rule}"] + [f"  - {line}" for line in r.contexts]
    if report.serving is not None:
        out += ["", "## Serving", "", serving_intro(report.rule), ""] + _md_figures(serving_figures(figures))
        out += [f"- {line}" for line in serving_reasons(report)] + [""]
        out += [t.markdown() for t in report.serving_tables]
    if static:
        out += ["", "## Tables", ""] + [t.markdown() for t in report.tables]
        out += ["## Performance model", ""] + [f"- {line}" for line in _model_lines(report)] + [""]
        table = model_table(report.model) if report.model else None
        out += [table.markdown()] if table else []
    if static or more or skipped:
        out += ["## More figures", ""] + _md_figures(more)
        out += [f"- skipped {s}" for s in skipped]
    for meta in report.analysis.metas:
        out += ["", f"## Run {meta.run_id}", "", "| field | value |", "|---|---|"]
        out += [f"| {k} | {md_cell(v)} |" for k, v in meta_rows(meta)]
        topo = topology_rows(meta)
        out += ["", "Topology checks (guest facts):", ""]
        if topo:
            out += ["| node | check | result |", "|---|---|---|"]
            out += [f"| {n} | {k} | {md_cell(v)} |" for n, k, v in topo]
        else:
            out.append("No guest facts recorded.")
    return "\n".join(out) + "\n"


def _model_lines(report: Report) -> list[str]:
    return report.model.lines() if report.model else ["Not fitted."]


def _md_figures(figures: Sequence) -> list[str]:
    out = []
    for f in figures:
        out += [f"### {f.title}", "", f"![{f.title}]({f.path.name})", "", f.caption, ""]
    return out


# ------------------------------------------------------------------ HTML

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1150px;color:#222;line-height:1.4}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right;vertical-align:top}
th{background:#f0f3f7}td:first-child,th:first-child{text-align:left}
.warn{background:#fff4e0;border-left:4px solid #e0a030;padding:.5em 1em}
.ok{background:#eef8ee;border-left:4px solid #4a4;padding:.5em 1em}
figure{margin:1em 0}img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.9em;color:#555}
.fail{color:#b00;font-weight:bold}
table.kv td{text-align:left}
p.meta{color:#555;font-size:.9em}.scroll{overflow-x:auto}
table.summary{font-size:1em}
.warn h2{margin:.2em 0;font-size:1.1em}.warn ul{margin:.3em 0}
.figs{display:grid;grid-template-columns:repeat(auto-fit,minmax(540px,1fr));gap:0 1em}
details{margin:.4em 0;padding:.3em .6em;border:1px solid #ddd;border-radius:4px}
summary{cursor:pointer;font-weight:600}details ul{margin:.3em 0}
"""

# Once every image has decoded, sets <body data-images="N ok=N broken=0"> and
# data-layout="summary=Y warnings=Y first-figure=Y" (page offsets in CSS px): a cheap
# self-check that the inline figures render and the answer is laid out above them,
# which the browser tests read from the dumped DOM.
_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images', imgs.length + ' ok=' + ok + ' broken=' + (imgs.length - ok));
  function top(el) { return el ? Math.round(el.getBoundingClientRect().top + window.scrollY) : -1; }
  document.body.setAttribute('data-layout', 'summary=' + top(document.getElementById('summary'))
    + ' warnings=' + top(document.getElementById('validity')) + ' first-figure=' + top(imgs[0]));
});
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def table_html(table: Table, css_id: str | None = None) -> str:
    out = [f"<h3>{_e(table.title)}</h3>"]
    if table.rows:
        attr = f' id="{_e(css_id)}" class="{_e(css_id)}"' if css_id else ""
        # A wide table scrolls inside its box instead of widening the page.
        out.append(f'<div class="scroll"><table{attr}><thead><tr>'
                   + "".join(f"<th>{_e(c)}</th>" for c in table.columns) + "</tr></thead><tbody>")
        out += ["<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>" for row in table.rows]
        out.append("</tbody></table></div>")
    else:
        out.append("<p><em>(no rows)</em></p>")
    out += [f"<p><small>{_e(n)}</small></p>" for n in table.notes]
    return "\n".join(out)


def _kv_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    body = "".join("<tr>" + "".join(f'<td class="fail">{_e(v)}</td>' if v == "FAIL" else f"<td>{_e(v)}</td>"
                                    for v in row) + "</tr>" for row in rows)
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return f'<table class="kv"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _figure_html(f) -> str:
    data = base64.b64encode(Path(f.path).read_bytes()).decode("ascii")
    return (f'<figure id="{_e(f.name)}"><img alt="{_e(f.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(f.caption)}</figcaption></figure>")


def _warnings_html(warnings: Sequence[str]) -> str:
    if not warnings:
        return '<div class="ok" id="validity">No validity warnings.</div>'
    items = "".join(f"<li>{_e(w)}</li>" for w in warnings)
    return (f'<div class="warn" id="validity"><h2>Validity warnings ({len(warnings)})</h2>'
            f"<ul>{items}</ul></div>")


def _reasons_html(reasons: Sequence[SloReasons]) -> str:
    out = []
    for r in reasons:
        lines = "".join(f"<li>{_e(line)}</li>" for line in r.contexts)
        out.append(f"<details><summary>{_e(r.headline)}</summary><p>{_e(r.rule)}</p><ul>{lines}</ul></details>")
    return "\n".join(out)


def render_html(report: Report, figures: Sequence, skipped: Sequence[str]) -> str:
    """The answer first (summary table, warnings, key figures), then reasoning, tables, figures, metadata."""
    key, more = split_figures(figures)
    static = has_static(report)
    answers = answer_tables(report)
    parts = [f"<h1>vcfslm report — {_e(report.title)}</h1>",
             f'<p class="meta">Inputs: {_e(", ".join(report.sources))}. {_e(slo_line(report))}</p>',
             '<section id="answer"><h2>Answer</h2>' + table_html(answers[0], "summary")
             + "".join(table_html(t, "serving-answer") for t in answers[1:]) + "</section>",
             _warnings_html(report.warnings)]
    if key:
        parts.append('<h2>Key figures</h2><div class="figs">' + "".join(_figure_html(f) for f in key) + "</div>")
    if static:
        parts.append(f"<h2>Reasoning per SLO</h2><p>{_e(report.reasons_intro)}</p>" + _reasons_html(report.reasons))
    if report.serving is not None:
        parts.append(f'<h2 id="serving">Serving</h2><p>{_e(serving_intro(report.rule))}</p>')
        parts.append('<div class="figs">' + "".join(_figure_html(f) for f in serving_figures(figures)) + "</div>")
        parts.append("<ul>" + "".join(f"<li>{_e(line)}</li>" for line in serving_reasons(report)) + "</ul>")
        parts += [table_html(t) for t in report.serving_tables]
    if static:
        parts.append("<h2>Tables</h2>")
        parts += [table_html(t) for t in report.tables]
        parts.append('<h2 id="model">Performance model</h2><ul>'
                     + "".join(f"<li>{_e(line)}</li>" for line in _model_lines(report)) + "</ul>")
        table = model_table(report.model) if report.model else None
        parts += [table_html(table)] if table else []
    if static or more or skipped:
        parts.append("<h2>More figures</h2>")
        parts += [_figure_html(f) for f in more]
    if skipped:
        parts.append("<ul>" + "".join(f"<li>skipped {_e(s)}</li>" for s in skipped) + "</ul>")
    for meta in report.analysis.metas:
        parts.append(f"<h2>Run {_e(meta.run_id)}</h2>")
        parts.append(_kv_table(meta_rows(meta), ("field", "value")))
        parts.append("<h3>Topology checks (guest facts)</h3>")
        topo = topology_rows(meta)
        parts.append(_kv_table(topo, ("node", "check", "result")) if topo else "<p>No guest facts recorded.</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>vcfslm report — {_e(report.title)}</title><style>{_CSS}</style>"
            f"<script>{_SCRIPT}</script></head>\n<body>\n" + "\n".join(parts) + "\n</body></html>\n")
