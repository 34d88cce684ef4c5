"""The report's figures as PNG files: the only module that imports matplotlib.

1. rank throughput vs concurrent streams per VM, one line per input length;
2. per-rank TPOT, single VM vs cluster at matched per-rank load;
3. TPOT vs streams per VM with SLO threshold lines;
4. TTFT vs streams per VM with SLO threshold lines;
5. measured TPOT vs its bandwidth floor and TTFT vs its compute floor (one panel
   each, for whichever floor the probes measured);
6. the performance model's TPOT and TTFT against the measured ones (fitted on every
   cell, and fitted on the small batches only, predicting the rest);
7. serving: p90 TTFT (queue included) and p90 TPOT vs load per VM with SLO limits;
8. serving: goodput per SLO (and every finished request) vs load per VM;
9. serving: streams per VM at the serving threshold beside the static crossover;
10. with runs of several models: streams per VM at each SLO's crossover, one bar per model
    (drawn only then: with one model the answer table already says its one value).
A figure without the data it needs is skipped with a reason, never drawn empty.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede any pyplot-backed import

from matplotlib.figure import Figure as MplFigure  # noqa: E402
from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter  # noqa: E402

from vcfslm.analysis.cells import CLUSTER, SCOPE_TITLES, SINGLE, Cell, model_text, models_of  # noqa: E402
from vcfslm.analysis.serve_points import PCT, SERVE_FIGURES, series_of  # noqa: E402
from vcfslm.analysis.slo import Crossover  # noqa: E402
from vcfslm.analysis.slo_spec import Slo  # noqa: E402

# The per-model figure's file name (the report shows it among the key figures).
MODELS_FIGURE = "fig-10-models"

SLO_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


@dataclass(frozen=True)
class Figure:
    """A rendered figure: file, title and one-sentence caption."""

    name: str
    path: Path
    title: str
    caption: str


def render_all(cells: Sequence[Cell], slos: Sequence[Slo], out_dir: str | Path, run_title: str,
               percentile: str = "p50", model=None, crossovers: Sequence[Crossover] = ()
               ) -> tuple[list[Figure], list[str]]:
    """Draw every figure the data allow into `out_dir`; returns (figures, reasons for skipped ones).

    model: the report's predict.ModelSection, for figure 6; crossovers: the answer's, for figure 10.
    """
    cells = [c for c in cells if c.has_data]
    makers: list[tuple[str, Maker]] = [
        ("fig-1-throughput", lambda: throughput_figure(cells, run_title)),
        ("fig-2-matched-tpot", lambda: matched_tpot_figure(cells, run_title)),
        ("fig-3-tpot-slo", lambda: latency_figure(cells, slos, run_title, "tpot", percentile)),
        ("fig-4-ttft-slo", lambda: latency_figure(cells, slos, run_title, "ttft", percentile)),
        ("fig-5-roofline", lambda: roofline_figure(cells, run_title)),
        ("fig-6-model", lambda: model_figure(model, run_title)),
    ]
    if len(models_of(cells)) > 1:
        makers.append((MODELS_FIGURE, lambda: models_figure(crossovers, run_title)))
    return draw(makers, out_dir)


# A figure maker: (figure, title, caption), or the reason it cannot be drawn.
Maker = Callable[[], "tuple[MplFigure, str, str] | str"]


def draw(makers: Sequence[tuple[str, Maker]], out_dir: str | Path) -> tuple[list[Figure], list[str]]:
    """Each maker's figure saved as <name>.png in `out_dir`; (figures, reasons for skipped ones)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn, skipped = [], []
    for name, make in makers:
        result = make()
        if isinstance(result, str):
            skipped.append(f"{name}: {result}")
            continue
        fig, title, caption = result
        path = out_dir / f"{name}.png"
        fig.savefig(path, format="png", dpi=100)
        drawn.append(Figure(name, path, title, caption))
    return drawn, skipped


def _scope(cells: Sequence[Cell]) -> str:
    return SINGLE if any(c.scope == SINGLE for c in cells) else CLUSTER


def _new(title: str) -> tuple[MplFigure, object]:
    fig = MplFigure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    # Run ids are long: wrap rather than let the title run off the canvas.
    ax.set_title(textwrap.fill(title, width=90), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    return fig, ax


def _log2_axis(ax, values: Sequence[int], label: str) -> None:
    """A log-2 x axis ticked at the tested loads."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    ax.set_xlabel(label)


def _by_input(cells: Sequence[Cell]) -> dict[tuple[int, int, str], list[Cell]]:
    """One line per (input, output, model): two models' cells never join into one line."""
    groups: dict[tuple[int, int, str], list[Cell]] = {}
    for c in sorted(cells, key=lambda c: c.streams_per_vm):
        groups.setdefault((c.input_tokens, c.output_tokens, c.model), []).append(c)
    return groups


def _ctx_label(key: tuple[int, int, str], groups) -> str:
    outputs = {o for _, o, _ in groups}
    models = {m for _, _, m in groups}
    return ((f"{model_text(key[2])}, " if len(models) > 1 else "") + f"{key[0]} input tokens"
            + (f" / {key[1]} output" if len(outputs) > 1 else ""))


def throughput_figure(cells: Sequence[Cell], run_title: str):
    scope = _scope(cells)
    cells = [c for c in cells if c.scope == scope and math.isfinite(c.rank_tps)]
    if not cells:
        return "no rank throughput measured"
    title = f"Rank throughput vs concurrency ({SCOPE_TITLES[scope]}) — {run_title}"
    fig, ax = _new(title)
    groups = _by_input(cells)
    for key, group in groups.items():
        ax.plot([c.streams_per_vm for c in group], [c.rank_tps for c in group], marker="o",
                label=_ctx_label(key, groups))
    _log2_axis(ax, [c.streams_per_vm for c in cells], "concurrent streams per VM (log 2)")
    ax.set_ylabel("rank throughput p50 (generated tokens/s per rank)")
    ax.set_ylim(bottom=0)
    ax.legend(title="context")
    return fig, title, "Generated tokens per second of one rank; input tokens never count."


def matched_tpot_figure(cells: Sequence[Cell], run_title: str):
    single = [c for c in cells if c.scope == SINGLE and math.isfinite(c.tpot_ms.p50)]
    cluster = [c for c in cells if c.scope == CLUSTER and math.isfinite(c.tpot_ms.p50)]
    matched = {(c.input_tokens, c.output_tokens, c.batch_per_rank) for c in single} & \
              {(c.input_tokens, c.output_tokens, c.batch_per_rank) for c in cluster}
    if not matched:
        return "needs single-VM and cluster data at the same batch per rank"
    title = f"Per-rank TPOT at matched per-rank load, single VM vs cluster — {run_title}"
    fig, ax = _new(title)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    ctxs = sorted({(i, o) for i, o, _ in matched})
    for n, ctx in enumerate(ctxs):
        color = colors[n % len(colors)]
        for group, style, marker, name in ((single, "-", "o", SCOPE_TITLES[SINGLE]),
                                           (cluster, "--", "s", SCOPE_TITLES[CLUSTER])):
            pts = sorted((c.batch_per_rank, c.tpot_ms.p50) for c in group
                         if (c.input_tokens, c.output_tokens, c.batch_per_rank) in matched
                         and (c.input_tokens, c.output_tokens) == ctx)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style, marker=marker, color=color,
                    label=f"{name}, {ctx[0]} input tokens")
    _log2_axis(ax, [b for _, _, b in matched], "concurrent streams per rank (batch per rank, log 2)")
    ax.set_ylabel("TPOT p50 (ms per output token)")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig, title, "Same batch per rank on one VM and across the cluster: equal lines mean no per-rank cost."


def latency_figure(cells: Sequence[Cell], slos: Sequence[Slo], run_title: str, indicator: str,
                   percentile: str):
    scope = _scope(cells)
    attr, unit, limit_attr = {"tpot": ("tpot_ms", "ms per output token", "tpot_ms"),
                              "ttft": ("ttft_s", "s", "ttft_s")}[indicator]
    pts = [(c, getattr(c, attr).get(percentile)) for c in cells if c.scope == scope]
    pts = [(c, v) for c, v in pts if v is not None]
    if not pts:
        return f"no {indicator.upper()} {percentile} values"
    name = indicator.upper()
    title = f"{name} {percentile} vs concurrency with SLO limits ({SCOPE_TITLES[scope]}) — {run_title}"
    fig, ax = _new(title)
    groups = _by_input([c for c, _ in pts])
    values = {id(c): v for c, v in pts}
    for key, group in groups.items():
        ax.plot([c.streams_per_vm for c in group], [values[id(c)] for c in group], marker="o",
                label=_ctx_label(key, groups))
    for n, slo in enumerate(slos):
        limit = getattr(slo, limit_attr)
        if limit is not None:
            ax.axhline(limit, color="0.3", linestyle=SLO_STYLES[n % len(SLO_STYLES)], linewidth=1.2,
                       label=f"{slo.title}: {name} ≤ {limit:g} {unit.split()[0]}")
    _log2_axis(ax, [c.streams_per_vm for c, _ in pts], "concurrent streams per VM (log 2)")
    ax.set_ylabel(f"{name} {percentile} ({unit})")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig, title, f"Points at or below an SLO line meet that SLO's {name} limit."


# (panel, Cell attribute of the floor, how the measured p50 is read, y label, what the floor is)
ROOFLINE_PANELS = (
    ("TPOT", "roofline_tpot_ms", lambda c: c.tpot_ms.p50, "TPOT p50 (ms per output token)",
     "bandwidth floor"),
    ("TTFT", "roofline_ttft_s", lambda c: c.ttft_s.p50, "TTFT p50 (s)", "compute floor"),
)


def roofline_figure(cells: Sequence[Cell], run_title: str):
    """Measured TPOT and TTFT against their floors: one panel per indicator with a floor."""
    cells = [c for c in cells if c.has_data]
    panels = [p for p in ROOFLINE_PANELS if any(getattr(c, p[1]) is not None for c in cells)]
    if not panels:
        return "no roofline data (no bandwidth or compute probe in this run)"
    cells = [c for c in cells if any(getattr(c, p[1]) is not None for p in panels)]
    scope = _scope(cells)
    cells = [c for c in cells if c.scope == scope]
    names = " and ".join(p[0] for p in panels)
    title = f"Measured {names} vs roofline floor ({SCOPE_TITLES[scope]}) — {run_title}"
    # Two panels stack (shared x axis) so each keeps the width of the other figures.
    fig = MplFigure(figsize=(8, 5 if len(panels) == 1 else 8), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(textwrap.fill(title, width=90), fontsize=10)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, floor_attr, measured, ylabel, floor_name) in zip(axes, panels, strict=True):
        ax.grid(True, which="major", alpha=0.3)
        groups = _by_input([c for c in cells if getattr(c, floor_attr) is not None])
        for n, (key, group) in enumerate(groups.items()):
            color = colors[n % len(colors)]
            xs = [c.streams_per_vm for c in group]
            ax.plot(xs, [measured(c) for c in group], marker="o", color=color,
                    label=f"measured, {_ctx_label(key, groups)}")
            ax.plot(xs, [getattr(c, floor_attr) for c in group], linestyle="--", color=color,
                    label=f"{floor_name}, {_ctx_label(key, groups)}")
        ax.set_title(f"{name}: measured vs {floor_name}", fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    _log2_axis(axes[-1], [c.streams_per_vm for c in cells], "concurrent streams per VM (log 2)")
    for ax in axes[:-1]:
        ax.set_xlabel("")
    caption = {"TPOT": "bandwidth floor = bytes read per decode step / measured memory bandwidth",
               "TTFT": "compute floor = prompt FLOPs / measured bf16 GEMM rate"}
    return fig, title, "Dashed: the floor each indicator cannot beat; " + \
        "; ".join(caption[p[0]] for p in panels) + "."


MODEL_PANELS = (("TPOT", "measured_tpot_ms", "predicted_tpot_ms", "ms"), ("TTFT", "measured_ttft_s", "predicted_ttft_s", "s"))


def model_figure(section, run_title: str):
    """The model against the measurements, per indicator: on the diagonal is exact."""
    if section is None or section.in_sample is None:
        return "no performance model (" + (section.reason if section is not None else "not fitted") + ")"
    title = f"Performance model vs measured — {run_title}"
    fig = MplFigure(figsize=(10, 5), layout="constrained")
    axes = fig.subplots(1, 2, squeeze=False)[0]
    fig.suptitle(textwrap.fill(title, width=110), fontsize=10)
    series = [("fitted on every cell", section.in_sample, "o", "full")]
    if section.held_out is not None and section.held_out.cells:
        batches = ", ".join(map(str, section.fit_batches))
        series.append((f"predicted from batches {batches}", section.held_out, "s", "none"))
    for ax, (name, measured, predicted, unit) in zip(axes, MODEL_PANELS, strict=True):
        values = []
        for label, check, marker, fill in series:
            xs = [getattr(c, measured) for c in check.cells]
            ys = [getattr(c, predicted) for c in check.cells]
            values += xs + ys
            ax.plot(xs, ys, linestyle="none", marker=marker, fillstyle=fill, label=label)
        lo, hi = min(values) / 1.3, max(values) * 1.3
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="model = measured")
        band = 0.15 if name == "TPOT" else 0.25
        ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)],
                        color="grey", alpha=0.15, label=f"±{band:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured p50 {name} ({unit})")
        ax.set_ylabel(f"model {name} ({unit})")
        ax.set_title(name, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    return fig, title, ("Each point is one cell (batch x input length). The shaded band is the accuracy the "
                        "model is held to (15 % for TPOT, 25 % for TTFT); hollow squares were predicted by a "
                        "fit that never saw them.")


# ------------------------------------------------------------------ serving

def render_serving(serving, slos: Sequence[Slo], out_dir: str | Path, run_title: str
                   ) -> tuple[list[Figure], list[str]]:
    """Serving mode's figures (serving: an analysis.serve.ServeAnalysis): latency vs load,
    goodput vs load, the serving threshold beside the static crossover."""
    # The names are serve.SERVE_FIGURES, in its order: the report places the serving section by them.
    latency, goodput, vs_static = SERVE_FIGURES
    makers = [
        (latency, lambda: serve_latency_figure(serving, slos, run_title)),
        (goodput, lambda: serve_goodput_figure(serving, slos, run_title)),
        (vs_static, lambda: serve_vs_static_figure(serving, run_title)),
    ]
    return draw(makers, out_dir)


def _answer_series(serving) -> list[tuple[object, list]]:
    """(key, points with data) of every series the answer reads, in order."""
    keys = list(dict.fromkeys(t.key for t in serving.primaries))
    by_key = series_of(serving.points)
    out = [(k, [p for p in by_key.get(k, []) if p.has_data]) for k in keys]
    return [(k, pts) for k, pts in out if pts]


def _series_label(key, keys) -> str:
    # A workload series is named by its workload: its input tokens are only its longest prompt.
    label = key.context_text if key.workload else f"{key.input_tokens} input tokens"
    if len({k.output_tokens for k in keys if not k.workload}) > 1 and not key.workload:
        label += f" / {key.output_tokens} output"
    if len({(k.context, k.workload) for k in keys}) < len(keys):
        label += f" ({key.load_kind}, {key.slots} slots)"
    if len({k.server for k in keys}) > 1:
        label = f"{key.server}: {label}"
    return label


def _load_label(keys) -> str:
    kinds = {k.load_kind for k in keys}
    if kinds == {"rate"}:
        return "offered load per VM (requests/s)"
    if kinds == {"users"}:
        return "closed-loop users per VM"
    return "load per VM (requests/s or users)"


SERVE_PANELS = (("TTFT", "ttft_p90_s", "ttft_s", "s"), ("TPOT", "tpot_p90_ms", "tpot_ms", "ms"))


def serve_latency_figure(serving, slos: Sequence[Slo], run_title: str):
    """p90 TTFT (queue included) and p90 TPOT against load per VM, SLO limits as lines."""
    series = _answer_series(serving)
    if not series:
        return "no serving load with valid data"
    keys = [k for k, _ in series]
    title = f"Serving: {PCT} TTFT and TPOT vs load per VM with SLO limits — {run_title}"
    fig = MplFigure(figsize=(8, 8), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(textwrap.fill(title, width=90), fontsize=10)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, attr, limit_attr, unit) in zip(axes, SERVE_PANELS, strict=True):
        ax.grid(True, which="major", alpha=0.3)
        limits = [getattr(s, limit_attr) for s in slos if getattr(s, limit_attr) is not None]
        finite = [getattr(p, attr) for _, pts in series for p in pts if math.isfinite(getattr(p, attr))]
        top = max(finite + limits + [0.0]) * 1.15 or 1.0
        unfinished_drawn = False
        for n, (key, pts) in enumerate(series):
            color = colors[n % len(colors)]
            xs = [p.load_per_vm for p in pts]
            ys = [getattr(p, attr) for p in pts]
            ax.plot(xs, [y if math.isfinite(y) else float("nan") for y in ys], marker="o", color=color,
                    label=_series_label(key, keys))
            inf = [x for x, y in zip(xs, ys, strict=True) if not math.isfinite(y)]
            if inf:
                ax.plot(inf, [top] * len(inf), linestyle="none", marker="^", color=color, markersize=9,
                        label=None if unfinished_drawn else "tail reaches unfinished requests (∞)")
                unfinished_drawn = True
        for n, slo in enumerate(slos):
            limit = getattr(slo, limit_attr)
            if limit is not None:
                ax.axhline(limit, color="0.3", linestyle=SLO_STYLES[n % len(SLO_STYLES)], linewidth=1.2,
                           label=f"{slo.title}: {name} ≤ {limit:g} {unit}")
        ax.set_ylim(0, top * 1.05)
        ax.set_ylabel(f"{name} {PCT} ({unit})" + (", queue included" if name == "TTFT" else ""))
        ax.set_title(f"{name} {PCT} vs load", fontsize=9)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel(_load_label(keys))
    return fig, title, (f"Each point pools every counted request of one load ({PCT}); points at or below an SLO "
                        "line meet that SLO's limit. A triangle at the top: the tail reaches requests unfinished "
                        "by the window's cutoff.")


def serve_goodput_figure(serving, slos: Sequence[Slo], run_title: str):
    """Goodput per SLO (and every finished request) per VM against load per VM."""
    series = _answer_series(serving)
    if not series or not slos:
        return "no serving load with valid data"
    keys = [k for k, _ in series]
    title = f"Serving: goodput per SLO vs load per VM — {run_title}"
    fig, ax = _new(title)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-",) + SLO_STYLES
    for n, (key, pts) in enumerate(series):
        color = colors[n % len(colors)]
        xs = [p.load_per_vm for p in pts]
        label = _series_label(key, keys)
        ax.plot(xs, [p.completed_per_vm for p in pts], color=color, linewidth=3, alpha=0.3,
                label=f"completed, {label}")
        for m, slo in enumerate(slos):
            ax.plot(xs, [p.goodput_per_vm.get(slo.name, 0.0) for p in pts], color=color, marker="o",
                    linestyle=styles[m % len(styles)], label=f"goodput {slo.title}, {label}")
    if {k.load_kind for k in keys} == {"rate"}:
        hi = max(p.load_per_vm for _, pts in series for p in pts)
        ax.plot([0, hi], [0, hi], color="0.6", linewidth=1, linestyle=":", label="offered (every request served)")
    ax.set_xlabel(_load_label(keys))
    ax.set_ylabel("requests/s per VM")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return fig, title, ("Goodput: requests per second per VM that met the SLO (both limits, each request). "
                        "The wide pale line counts every finished request; where goodput leaves it, requests "
                        "start missing the SLO.")


def serve_vs_static_figure(serving, run_title: str):
    """Concurrent streams per VM at the serving threshold beside the static crossover, each
    with its 95 % interval; only pairs judged at the same share of users."""
    pairs = [c for c in serving.comparisons if c.static_streams is not None and c.comparable
             and c.threshold.streams_per_vm is not None and c.threshold.status in ("threshold", "above")]
    if not pairs:
        return ("no serving threshold with a static crossover of the same SLO and context, judged at the same "
                "share, among the inputs")
    title = f"Serving threshold vs static-batch crossover ({pairs[0].pairing}, streams per VM) — {run_title}"
    fig, ax = _new(title)
    width = 0.38
    xs = list(range(len(pairs)))
    static = [c.static_streams for c in pairs]
    served = [c.threshold.streams_per_vm for c in pairs]
    ax.bar([x - width / 2 for x in xs], static, width, label="static batches (crossover)", color="0.6",
           yerr=_bars(static, [c.static.interval for c in pairs]), capsize=3)
    ax.bar([x + width / 2 for x in xs], served, width, label="continuous batching (serving threshold)",
           yerr=_bars(served, [c.threshold.streams_interval for c in pairs]), capsize=3)
    for x, c in zip(xs, pairs, strict=True):
        ax.annotate(f"× {c.ratio_text}", (x + width / 2, c.threshold.streams_per_vm), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"{c.threshold.slo.title}\n{c.threshold.key.input_tokens} in" for c in pairs])
    ax.set_ylabel("concurrent streams per VM at the threshold")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return fig, title, ("Static: the largest batch-per-rank × ranks per VM meeting the SLO. Serving: the "
                        "time-averaged busy slots per VM at the largest passing load. The label is their ratio; "
                        "“≥”/“≤” where a side is a bound. Whiskers: 95 % bootstrap intervals, up to the first "
                        "failing load.")


def models_figure(crossovers: Sequence[Crossover], run_title: str):
    """Streams per VM at the crossover of each SLO and context, one bar per model side by side,
    with the threshold's 95 % interval; a bound (≥) or no threshold (none) is said on its bar."""
    models = list(dict.fromkeys(c.model for c in crossovers))
    if len(models) < 2:
        return "needs crossovers of at least two models"
    groups = list(dict.fromkeys((c.slo, c.input_tokens, c.output_tokens) for c in crossovers))
    several_outputs = len({g[2] for g in groups}) > 1
    title = f"Streams per VM at the SLO, per model ({crossovers[0].rule}) — {run_title}"
    fig, ax = _new(title)
    width = 0.8 / len(models)
    by_key = {(c.slo, c.input_tokens, c.output_tokens, c.model): c for c in crossovers}
    for n, model in enumerate(models):
        xs, values, intervals, marks = [], [], [], []
        for g, key in enumerate(groups):
            c = by_key.get((*key, model))
            if c is None:
                continue
            value = float(c.max_tested if c.status == "all" else (c.threshold or 0))
            xs.append(g - 0.4 + width * (n + 0.5))
            values.append(value)
            intervals.append(c.interval if c.status == "crossover" else None)
            marks.append(c.threshold_text)          # "16", "≥ 64" or "none", as the answer table says it
        ax.bar(xs, values, width, label=model_text(model), yerr=_bars(values, intervals), capsize=3)
        for x, v, mark in zip(xs, values, marks, strict=True):
            ax.annotate(mark, (x, v), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{slo.title}\n{inp} in" + (f" / {out} out" if several_outputs else "")
                                       for slo, inp, out in groups])
    ax.set_ylabel("concurrent streams per VM at the threshold")
    ax.set_ylim(bottom=0)
    ax.legend(title="model", fontsize=8)
    return fig, title, ("Each bar: the largest tested streams per VM that meets the SLO before the first failing "
                        "load, for one model, labelled as the answer table says it; “≥”: every tested load met "
                        "it (the bar is the largest tested), “none”: even the lowest failed. Whiskers: 95 % "
                        "bootstrap intervals, up to the first failing load. Nodes for a peak follow by the sizing "
                        "law from each bar.")


def _bars(values, intervals):
    """matplotlib yerr (below, above) from each value's interval; 0 where none is known."""
    below, above = [], []
    for v, iv in zip(values, intervals, strict=True):
        lo = v if iv is None or iv.low is None else iv.low
        hi = v if iv is None or iv.high is None else iv.high
        below.append(max(0.0, v - lo))
        above.append(max(0.0, hi - v))
    return [below, above]
