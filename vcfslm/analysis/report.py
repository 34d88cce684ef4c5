"""Write the answer of one or more runs (and/or CSV tables) as report.html, report.md, CSVs and PNGs.

Every rendering (HTML, markdown, the CLI's text) opens with the answer: the summary
table (SLO x input length -> threshold, first failing load, binding indicator,
nodes per peak), then the validity warnings, then the key figures (TPOT and TTFT
against the SLO lines, single VM vs cluster), then the reasoning said once per SLO,
then the detail tables, the remaining figures and the runs' metadata.

With serving records (bench --serve) a Serving section follows the reasoning: the serving
threshold per SLO and context beside the static crossover (opening the answer too),
latency and goodput against load, every series' loads; serving.json holds its numbers.
Runs through one endpoint add the scale-out table (their thresholds at 1, 2, … nodes behind
it, and the efficiency) and the faults they took. A series that ran a workload (or whose
prompts varied in length) is split by prompt length beside its loads (TTFT and TPOT per
bucket, serve-length-buckets.csv), and each workload is a row of the answer of its own.
A serving-only report leaves out the static sections that would be empty.

The renderings are analysis/report_render.py's; this module loads the inputs, builds the
`Report` and writes its files. matplotlib is loaded only when figures are drawn
(vcfslm.analysis.figures)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from vcfslm.analysis.cells import Analysis, CellKey, aggregate, load_runs
from vcfslm.analysis.csv_import import import_csv
from vcfslm.analysis.predict import model_section
from vcfslm.analysis.report_render import Report, has_static, render_html, render_markdown
from vcfslm.analysis.serve import ServeAnalysis, has_serving
from vcfslm.analysis.serve import analyse as analyse_serving
from vcfslm.analysis.serve_points import series_of
from vcfslm.analysis.serve_predicted import PredictedSeries, predicted_table
from vcfslm.analysis.serve_tables import (
    fault_table,
    length_buckets_csv,
    length_table,
    scale_out_table,
    serve_answer_table,
    serve_points_table,
    serve_thresholds_table,
)
from vcfslm.analysis.slo import crossovers, size
from vcfslm.analysis.slo_spec import resolve_slos, slos_from_meta
from vcfslm.analysis.summary import reasoning_intro, slo_reasons, summary_table
from vcfslm.analysis.tables import (
    Table,
    cells_csv,
    compare,
    comparison_table,
    crossover_table,
    results_table,
)
from vcfslm.errors import CsvError, Problem, UsageError
from vcfslm.progress import NullReporter, Reporter
from vcfslm.results import RunMeta, atomic_write_text
from vcfslm.serving.judging import LEGACY_SERVING_RULE, Rule

DEFAULT_PEAKS = (256,)


@dataclass(frozen=True)
class ReportOptions:
    """What the answer is asked for: the SLOs (names or specs; empty: every SLO of the runs),
    the judging rule (percentile of streams, serving attainment; None: the runs' own rule),
    and the peaks and headroom sizing plans for."""

    slo_specs: Sequence[str] = ()
    percentile: str | None = None
    peaks: Sequence[int] = DEFAULT_PEAKS
    headroom: float = 0.0
    attainment: float | None = None
    # Serving series as the simulator predicts them (the CLI's, from the runs' static cells):
    # each shown beside the measured one (analysis/serve_predicted.py).
    predicted: Sequence[PredictedSeries] = ()


@dataclass
class ReportFiles:
    out_dir: Path
    files: list[Path]
    warnings: list[str]
    skipped_figures: list[str]
    report: Report


def load_inputs(run_dirs: Sequence[str | os.PathLike[str]], csv_files: Sequence[str | os.PathLike[str]] = ()
                ) -> tuple[Analysis, list[str]]:
    """Cells of every run dir and CSV; the same cell from two inputs is refused (a CSV that names
    no model clashes with a cell of any model at the same point)."""
    if not run_dirs and not csv_files:
        raise UsageError("nothing to analyse: give a run dir or --csv FILE")
    analysis = aggregate(load_runs(run_dirs)) if run_dirs else Analysis(cells=[])
    sources = [str(p) for p in run_dirs]
    origin: dict[CellKey, dict[str, str]] = {}      # the point, model aside -> model -> source
    for c in analysis.cells:
        origin.setdefault(replace(c.key, model=""), {})[c.model] = c.source or "run"
    problems = []
    for path in csv_files:
        imported = import_csv(path)
        for cell in imported.cells:
            here = origin.setdefault(replace(cell.key, model=""), {})
            clash = [src for model, src in here.items() if model == cell.model or "" in (model, cell.model)]
            if clash:
                problems.append(Problem(cell.source, None, None, "", f"same cell as in {clash[0]}; "
                                        "analyse these inputs separately"))
            here[cell.model] = cell.source
        analysis.cells.extend(imported.cells)
        sources.append(str(path))
    if problems:
        raise CsvError(problems)
    return analysis, sources


def known_slos(metas: Sequence[RunMeta]) -> tuple[list, list[str]]:
    """SLOs from the first run whose inventory defined some (defaults otherwise), plus warnings."""
    defined = [m for m in metas if m.slos]
    warnings = []
    if len({json.dumps(m.slos, sort_keys=True) for m in defined}) > 1:
        warnings.append(f"runs define different SLOs; using those of {defined[0].run_id}")
    return slos_from_meta(defined[0].slos if defined else None), warnings


def judging_rule(metas: Sequence[RunMeta], percentile: str | None = None, attainment: float | None = None
                 ) -> tuple[Rule, list[str]]:
    """The rule the inputs are judged by: the flags, else what the first run recorded, else
    the defaults; plus a line for each run that recorded another rule, or none."""
    recorded_pct = [((m.matrix or {}).get("judging") or {}).get("percentile") for m in metas]
    serves = [(m, (m.matrix or {}).get("serve")) for m in metas if isinstance((m.matrix or {}).get("serve"), dict)]
    recorded_share = [s.get("attainment") for _, s in serves]
    pct = percentile or next((p for p in recorded_pct if p), None) or Rule().percentile
    share = attainment if attainment is not None else next((a for a in recorded_share if a), None)
    rule = Rule(percentile=pct, attainment=share if share is not None else Rule().attainment)
    notes = []
    for m, p in zip(metas, recorded_pct, strict=True):
        if isinstance((m.matrix or {}).get("serve"), dict):
            continue                      # a serving run's rule is its attainment (below)
        if p is None:
            notes.append(f"run {m.run_id} records no static rule (written before runs did): its cells are "
                         f"judged at {rule.percentile} of streams")
        elif p != rule.percentile:
            notes.append(f"run {m.run_id} asked for {p}; judged here at {rule.percentile} of streams")
    for m, spec in serves:
        if "attainment" not in spec:
            notes.append(f"run {m.run_id} was swept by {LEGACY_SERVING_RULE}, before attainment; its loads "
                         f"are judged here by {rule.serving_text()}")
        elif spec["attainment"] != rule.attainment:
            notes.append(f"run {m.run_id} was swept at {spec['attainment']:g} attainment; judged here by "
                         f"{rule.serving_text()}")
    return rule, notes


def build(analysis: Analysis, sources: Sequence[str], options: ReportOptions | None = None) -> Report:
    """The report's content (pure: no files); options: SLOs, rule, peaks, headroom (None: the
    runs' own SLOs and rule, DEFAULT_PEAKS, no headroom)."""
    options = options or ReportOptions()
    peaks, headroom = options.peaks, options.headroom
    known, warnings = known_slos(analysis.metas)
    slos = resolve_slos(options.slo_specs, known)
    rule, rule_notes = judging_rule(analysis.metas, options.percentile, options.attainment)
    percentile = rule.percentile
    cells = analysis.cells
    from_csv = any(c.origin == "csv" and c.tpot_ms.p90 is not None for c in cells)
    tails = percentile != "p50" or any(c.repeats >= 2 for c in cells) or from_csv
    tables = [results_table(cells, scope, tails) for scope in analysis.scopes()]
    comparisons = compare(cells)
    if comparisons:
        tables.append(comparison_table(comparisons))
    xs = crossovers(cells, slos, percentile, rule)
    sizings = [size(c, peak, headroom) for c in xs for peak in peaks]
    serving = (analyse_serving(analysis.runs, slos, cells, peaks, headroom, rule)
               if has_serving(analysis.runs) else None)
    static = any(c.has_data for c in cells) or serving is None
    # Crossover and sizing are both in the summary table; no second copy among the tables.
    report = Report(title=run_title(analysis, sources), analysis=analysis, sources=list(sources),
                    percentile=percentile, slos=slos, rule=rule, rule_notes=rule_notes,
                    crossovers=xs, sizings=sizings, tables=tables,
                    summary=summary_table(xs, sizings, percentile, headroom),
                    reasons=slo_reasons(xs, sizings, headroom), reasons_intro=reasoning_intro(headroom),
                    warnings=warnings + analysis.warnings + (serving.warnings if serving else []),
                    model=model_section(analysis.runs) if static else None, serving=serving)
    if serving is not None:
        report.serving_answer = serve_answer_table(serving.comparisons, serving.sizings, headroom)
        report.serving_tables = serving_tables(serving, slos, options.predicted)
        report.serving_predicted = [p for p in options.predicted if any(q.key == p.key for q in serving.points)]
    return report


def serving_tables(serving: ServeAnalysis, slos: Sequence, predicted: Sequence[PredictedSeries] = ()
                   ) -> list[Table]:
    """The serving section's detail: every series' loads (each followed by its split by prompt
    length, where it has one, and by the simulator's prediction of it, where there is one),
    then (when the answer does not show them all) every series' thresholds. The nodes are in
    the answer table and the reasoning."""
    several_models = len({p.key.model for p in serving.points}) > 1
    split = {s.key: s for s in serving.lengths}
    simulated = {p.key: p for p in predicted}
    out = [scale_out_table(serving.scale_outs)] if serving.scale_outs else []
    out += [fault_table(serving.faults, slos)] if serving.faults else []
    for key, points in series_of(serving.points).items():
        out.append(serve_points_table(points, slos, several_models))
        out += [length_table(split[key], slos, several_models)] if key in split else []
        if key in simulated:
            out.append(predicted_table(simulated[key], points, slos, serving.thresholds))
    if len(serving.thresholds) > len(serving.primaries):
        out.append(serve_thresholds_table(serving.thresholds))
    return out


def run_title(analysis: Analysis, sources: Sequence[str]) -> str:
    names = [m.label or m.run_id for m in analysis.metas]
    names += [Path(s).name for s in sources[len(analysis.metas):]]
    return ", ".join(names) or "no runs"


def write_report(run_dirs: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str] | None = None,
                 options: ReportOptions | None = None, csv_files: Sequence[str | os.PathLike[str]] = (),
                 reporter: Reporter | None = None) -> ReportFiles:
    """Load, analyse, draw and write; `out_dir` defaults to the first run dir (or `<csv>-report/`);
    options: what the answer is asked for (see build)."""
    reporter = reporter or NullReporter()
    reporter.update("report", "loading")
    analysis, sources = load_inputs(run_dirs, csv_files)
    report = build(analysis, sources, options)
    out = Path(out_dir) if out_dir else (Path(run_dirs[0]) if run_dirs else
                                         Path(csv_files[0]).with_name(Path(csv_files[0]).stem + "-report"))
    out.mkdir(parents=True, exist_ok=True)
    reporter.update("report", "drawing figures")
    from vcfslm.analysis import figures as fig_module  # matplotlib only when drawing

    figures, skipped = ([], [])
    if has_static(report):
        figures, skipped = fig_module.render_all(analysis.cells, report.slos, out, report.title, report.percentile,
                                                 report.model, report.crossovers)
    if report.serving is not None:
        more, more_skipped = fig_module.render_serving(report.serving, report.slos, out, report.title)
        figures, skipped = figures + more, skipped + more_skipped
    reporter.update("report", "writing")
    files = [f.path for f in figures]
    outputs = {
        "report.md": render_markdown(report, figures, skipped),
        "report.html": render_html(report, figures, skipped),
        "tables.csv": cells_csv(analysis.cells),
        "crossover.csv": crossover_table(report.crossovers).csv(),
    }
    if report.serving is not None:
        # Serving points, thresholds, comparison and sizing as data (the figures redraw from the run).
        outputs["serving.json"] = json.dumps({"title": report.title, "sources": report.sources,
                                              "slos": [s.to_dict() for s in report.slos],
                                              **report.serving.to_dict(),
                                              "predicted": [p.to_dict() for p in report.serving_predicted]},
                                             indent=2, sort_keys=True) + "\n"
        if report.serving.lengths:
            outputs["serve-length-buckets.csv"] = length_buckets_csv(report.serving.lengths, report.slos)
    for name, text in outputs.items():
        atomic_write_text(out / name, text)
        _readable(out / name)
        files.append(out / name)
    for name in skipped:
        reporter.log(f"figure skipped: {name}")
    reporter.update("report", f"written to {out}")
    return ReportFiles(out, files, report.warnings, skipped, report)


def _readable(path: Path) -> None:
    """Temp-file writes are private (0600); a report is meant to be shared like the PNGs."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
