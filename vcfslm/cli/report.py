"""`vcfslm report` (tables, figures, crossover, HTML) and `vcfslm size` (the sizing law)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import click

from ..analysis.cells import Analysis, model_text
from ..analysis.report import ReportOptions, judging_rule, known_slos, load_inputs, write_report
from ..analysis.report_render import render_text
from ..analysis.serve import analyse, compare, has_serving
from ..analysis.serve_points import UNITS, workload_title
from ..analysis.serve_tables import serve_sizing_table
from ..analysis.slo import crossovers
from ..analysis.slo import size as size_for
from ..analysis.slo_spec import Slo, resolve_slos
from ..analysis.summary import summary_table
from ..contract import presets_help
from ..errors import Problem, UsageError
from ..serving.judging import Rule
from .common import RichReporter, latest_run, output_option, print_json

PERCENTILE = click.Choice(["p50", "p90", "p99"])
PERCENTILE_HELP = ("Static cells: the percentile of streams that must meet each limit (p50 is the brief's). "
                   "Default: the one the runs recorded, else p90.")
ATTAINMENT_HELP = ("Serving: the share of requests that must meet every limit at once (0.9 = 90 %). "
                   "Default: the one the runs recorded, else 0.9.")
SLO_HELP = ("An SLO name (A, B, one from the inventory, or a preset) or a spec "
            "'name:tpot<=150ms,ttft<=2s[+1ms/tok][,p99]'. Repeatable. Default: every SLO of the run. Presets: "
            + presets_help() + ".")
ATTAINMENT = click.FloatRange(0, 1, min_open=True, max_open=True)


def _verbose() -> int:
    ctx = click.get_current_context()
    obj = ctx.find_root().obj
    return obj.get("verbose", 0) if isinstance(obj, dict) else 0


@click.command()
@click.argument("runs", nargs=-1, type=click.Path(file_okay=False, path_type=Path), metavar="[RUN]...")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the report (default: the first RUN, or <csv>-report/).")
@click.option("--slo", "slos", multiple=True, metavar="SLO", help=SLO_HELP)
@click.option("--percentile", type=PERCENTILE, default=None, help=PERCENTILE_HELP)
@click.option("--attainment", type=ATTAINMENT, default=None, metavar="SHARE", help=ATTAINMENT_HELP)
@click.option("--csv", "csv_files", multiple=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="A CSV of external measurements to analyse too. Columns: scope (single|cluster), vms, "
                   "ranks_per_vm, batch_per_rank, input_tokens, output_tokens, ttft_s, tpot_ms, rank_tps; "
                   "optional ttft_p90_s, ttft_p99_s, tpot_p90_ms, tpot_p99_ms, roofline_tpot_ms, roofline_ttft_s. "
                   "Repeatable.")
@click.option("--peak-streams", "peaks", multiple=True, type=click.IntRange(min=1), default=(256,),
              show_default=True, help="Peak concurrent streams for the sizing section. Repeatable.")
@click.option("--headroom", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Derate each VM's threshold by this fraction when sizing.")
@click.option("--no-predict", "no_predict", is_flag=True, default=False,
              help="Serving: leave out the simulator's prediction of each serving series (shown beside the "
                   "measured one wherever the runs also hold static cells of the same model and server).")
def report(runs, **options) -> None:
    """Tables, figures, SLO crossover and sizing of one or more runs, as report.html/.md and CSV.

    Runs of different models are never pooled: the answer has a row per model.

    \b
    Examples:
      vcfslm report runs/20250101-single runs/20250101-cluster
      vcfslm report runs/phi3 runs/llama3b runs/qwen7b      # one answer row per model
      vcfslm report runs/<id> --slo 'strict:tpot<=110ms,ttft<=1s' --percentile p99
      vcfslm report runs/<id> --slo B --slo mlperf-server --attainment 0.95
      vcfslm report --csv published.csv --percentile p50 --out /tmp/published
    """
    reporter = RichReporter(quiet=_verbose() == 0)
    slos = options["slos"]
    predicted, unpredicted = ([], [])
    if runs and not options["no_predict"]:
        from .report_predict import report_predictions

        predicted, unpredicted = report_predictions(list(runs), slos)
    asked = ReportOptions(slo_specs=slos, percentile=options["percentile"], peaks=options["peaks"],
                          headroom=options["headroom"], attainment=options["attainment"], predicted=tuple(predicted))
    result = write_report(list(runs), options["out_dir"], asked, list(options["csv_files"]), reporter)
    # The answer first, as pre-formatted lines: off a terminal nothing may wrap or be cut.
    for line in render_text(result.report):
        click.echo(line)
    click.echo(f"report written to {result.out_dir}")
    for path in result.files:
        click.echo(f"  {path}")
    for name in result.skipped_figures:
        click.echo(f"figure skipped: {name}")
    for line in unpredicted:
        click.echo(f"not predicted: {line}")
    if result.warnings:
        click.echo(f"{len(result.warnings)} validity warning(s), listed in the report:", err=True)
        for w in result.warnings[:10]:
            click.echo(f"  ! {w}", err=True)
        if len(result.warnings) > 10:
            click.echo(f"  ... and {len(result.warnings) - 10} more", err=True)


def workload_matches(label: str, asked: str) -> bool:
    """Does a series' workload (`name@digest`, "" for fixed lengths) answer `--workload`?"""
    if asked == "fixed" or asked.startswith("fixed:"):
        return label == ""
    return label.rpartition("@")[0] == asked or label == asked


@click.command()
@click.option("--peak-streams", type=click.IntRange(min=1), default=None,
              help="Peak concurrent user streams the service must carry (required unless --peak-rps).")
@click.option("--peak-rps", type=click.FloatRange(min=0, min_open=True), default=None, metavar="X",
              help="Peak requests per second: sizes from the serving threshold of a rate load "
                   "(nodes = ceil(peak req/s / threshold req/s per VM)). Needs --threshold serving.")
@click.option("--threshold", "threshold_kind", type=click.Choice(["static", "serving"]), default=None,
              help="Which threshold to size from: the static-batch crossover, or the serving threshold "
                   "(continuous batching, judged by attainment; its concurrent streams per VM). Default: "
                   "static when the inputs have static-batch measurements, else serving.")
@click.option("--slo", "slos", multiple=True, metavar="SLO", help=SLO_HELP + " Omitted: every SLO x context.")
@click.option("--input-tokens", type=click.IntRange(min=1), default=None,
              help="Context length to size for (default: every tested one).")
@click.option("--output-tokens", type=click.IntRange(min=1), default=None,
              help="Output length, when the results hold several.")
@click.option("--workload", default=None, metavar="NAME",
              help="Serving: size for this workload only (its name as bench --workload took it: chat, rag, "
                   "file:NAME.jsonl, mooncake:NAME.jsonl; fixed: the fixed-length contexts).")
@click.option("--results", "results", multiple=True, type=click.Path(exists=True, path_type=Path),
              metavar="RUN|CSV", help="Run dir(s) or CSV file(s) (default: the latest run under --runs-dir).")
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"),
              show_default=True, help="Where to look for the latest run.")
@click.option("--headroom", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Fraction of each VM's threshold kept free (0.1 = plan at 90%).")
@click.option("--percentile", type=PERCENTILE, default=None, help=PERCENTILE_HELP)
@click.option("--attainment", type=ATTAINMENT, default=None, metavar="SHARE", help=ATTAINMENT_HELP)
@output_option
def size(**options) -> None:
    """Nodes needed: ceil(peak streams / single-VM threshold), with the reasoning and 95 % intervals.

    \b
    Examples:
      vcfslm size --peak-streams 256 --slo B --input-tokens 128
      vcfslm size --peak-streams 256 --results runs/<id> --headroom 0.1
      vcfslm size --peak-streams 1000 --results published.csv --output json
      vcfslm size --peak-streams 256 --threshold serving --results runs/<serving-id>
      vcfslm size --peak-rps 40 --threshold serving --slo B --results runs/<serving-id>
    """
    opts = SizeOptions.from_cli(options)
    peak_streams, peak_rps = opts.peak_streams, opts.peak_rps
    if peak_rps is not None and opts.threshold_kind == "static":
        raise click.UsageError("--peak-rps sizes from the serving threshold of a rate load, not the static "
                               "crossover: use --threshold serving, or --peak-streams")
    if peak_streams is None and peak_rps is None:
        raise click.UsageError("Missing option '--peak-streams' (or '--peak-rps' with --threshold serving)")
    sources = list(opts.results) or [latest_run(opts.runs_dir)]
    run_dirs = [p for p in sources if p.is_dir()]
    csv_files = [p for p in sources if not p.is_dir()]
    analysis, names = load_inputs(run_dirs, csv_files)
    known, _ = known_slos(analysis.metas)
    chosen = resolve_slos(opts.slos, known)
    rule, rule_notes = judging_rule(analysis.metas, opts.percentile, opts.attainment)
    serves = has_serving(analysis.runs)
    kind = opts.threshold_kind or ("static" if any(c.has_data for c in analysis.cells) or not serves
                                   else "serving")
    if peak_rps is not None and kind != "serving":
        raise click.UsageError("--peak-rps sizes from the serving threshold of a rate load; these inputs have "
                               "static-batch measurements, so add --threshold serving")
    inputs = SizingInputs(analysis, names, sources, chosen, rule, rule_notes)
    if kind == "serving":
        _size_serving(inputs, opts)
        return
    if peak_streams is None:
        raise click.UsageError("Missing option '--peak-streams' (the static crossover sizes by streams)")
    _size_static(inputs, opts, serves)


@dataclass(frozen=True)
class SizeOptions:
    """The `size` command's options: the peak to carry, the threshold and context to size
    from, where the measurements are, and the judging rule."""

    peak_streams: int | None = None
    peak_rps: float | None = None
    threshold_kind: str | None = None
    slos: tuple[str, ...] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None
    workload: str | None = None
    results: tuple[Path, ...] = ()
    runs_dir: Path = Path("runs")
    headroom: float = 0.0
    percentile: str | None = None
    attainment: float | None = None
    output: str = "text"

    @classmethod
    def from_cli(cls, options: dict) -> SizeOptions:
        """From click's parsed options (every field is an option of `size`, named alike)."""
        return cls(**{f.name: options[f.name] for f in fields(cls)})

    @property
    def context(self) -> tuple[int | None, int | None]:
        """(input tokens, output tokens) to size for; None: every tested one."""
        return (self.input_tokens, self.output_tokens)


@dataclass(frozen=True)
class SizingInputs:
    """What sizing reads: the analysed inputs and their names, the sources as given, the SLOs
    chosen, and the judging rule with its notes."""

    analysis: Analysis
    names: list[str]
    sources: list[Path]
    chosen: list[Slo]
    rule: Rule
    rule_notes: list[str]


def _size_static(inputs: SizingInputs, opts: SizeOptions, serves: bool) -> None:
    analysis, names, sources, chosen = inputs.analysis, inputs.names, inputs.sources, inputs.chosen
    rule, rule_notes = inputs.rule, inputs.rule_notes
    peak_streams, headroom, output = opts.peak_streams, opts.headroom, opts.output
    input_tokens, output_tokens = opts.context
    cells = [c for c in analysis.cells
             if (input_tokens is None or c.input_tokens == input_tokens)
             and (output_tokens is None or c.output_tokens == output_tokens)]
    if not any(c.has_data for c in cells):
        tested = sorted({(c.input_tokens, c.output_tokens) for c in analysis.cells if c.has_data})
        listing = ", ".join(f"{i} in / {o} out" for i, o in tested) or "none"
        hint = " (the inputs hold serving measurements: --threshold serving)" if serves else ""
        raise UsageError([Problem(", ".join(map(str, sources)), None, None, "",
                                  f"no measurements for the asked context; tested contexts: {listing}{hint}")])
    answers = [size_for(c, peak_streams, headroom) for c in crossovers(cells, chosen, rule.percentile, rule)]
    if output == "json":
        print_json({"results": [str(s) for s in names], "threshold": "static", "peak_streams": peak_streams,
                    "headroom": headroom, "percentile": rule.percentile, "rule": rule.static_text(),
                    "rule_notes": rule_notes, "sizings": [a.to_dict() for a in answers]})
        return
    click.echo(f"sizing from {', '.join(map(str, names))} (static crossover, {rule.static_text()})")
    click.echo("SLOs: " + "; ".join(s.describe() for s in chosen))
    for note in rule_notes:
        click.echo(f"note: {note}")
    if len(answers) > 1:
        # Plain aligned lines, not a rich table: piped output must keep every value whole.
        xs = list(dict.fromkeys(a.crossover for a in answers))
        for line in summary_table(xs, answers, rule.percentile, headroom).text():
            click.echo(line)
    for a in answers:
        click.echo(f"- {a.reasoning}")
    for a in answers:
        c = a.crossover
        click.echo(f"answer: {c.model_label}{c.slo.title}, {c.input_tokens}-token inputs, {c.rule}: {a.answer_text()}"
                   + (f", binding {c.binding}" if c.binding else ""))
    if len(answers) == 1:
        a = answers[0]
        click.echo(f"nodes: {a.nodes if a.nodes is not None else 'not achievable in this configuration'}")


def _size_serving(inputs: SizingInputs, opts: SizeOptions) -> None:
    """Sizing from the serving threshold (its concurrent streams per VM; by rate with --peak-rps)."""
    analysis, names, sources, chosen = inputs.analysis, inputs.names, inputs.sources, inputs.chosen
    rule, rule_notes = inputs.rule, inputs.rule_notes
    peak_streams, peak_rps, headroom, output = opts.peak_streams, opts.peak_rps, opts.headroom, opts.output
    where = ", ".join(map(str, sources))
    serving = analyse(analysis.runs, chosen, analysis.cells, rule=rule)
    if not serving.points:
        raise UsageError([Problem(where, None, None, "", "no serving measurements among the inputs (a run of "
                                  "`vcfslm bench --serve`); size from the static crossover: --threshold static")])
    input_tokens, output_tokens = opts.context
    picked = [t for t in serving.primaries
              if (input_tokens is None or t.key.input_tokens == input_tokens)
              and (output_tokens is None or t.key.output_tokens == output_tokens)
              and (opts.workload is None or workload_matches(t.key.workload, opts.workload))]
    if not picked:
        tested = sorted({(p.key.workload, p.key.context) for p in serving.points})
        listing = ", ".join(workload_title(w) if w else f"{i} in / {o} out" for w, (i, o) in tested)
        raise UsageError([Problem(where, None, None, "", "no serving measurements for the asked context or "
                                  f"workload; tested serving contexts: {listing}")])
    if peak_rps is not None:
        rates = [t for t in picked if t.key.load_kind == "rate"]
        if not rates:
            kinds = ", ".join(sorted({UNITS[t.key.load_kind] for t in picked}))
            raise UsageError([Problem("--peak-rps", None, None, "", "needs the serving threshold of a rate load "
                                      f"(requests/s); these inputs' serving loads are {kinds}: use --peak-streams")])
        picked = rates if peak_streams is None else picked
    # On a cluster curve measured through one endpoint where the inputs hold one, else per VM.
    answers = [serving.size_for(t, peak_streams, peak_rps if t.key.load_kind == "rate" else None, headroom)
               for t in picked]
    beside = {id(c.threshold): c for c in compare(picked, analysis.cells, rule)}
    if output == "json":
        print_json({"results": [str(s) for s in names], "threshold": "serving", "attainment": rule.attainment,
                    "rule": rule.serving_text(), "rule_notes": rule_notes,
                    "peak_streams": peak_streams, "peak_rps": peak_rps, "headroom": headroom,
                    "sizings": [{**a.to_dict(), "static": beside[id(a.threshold)].to_dict()} for a in answers],
                    "warnings": serving.warnings})
        return
    click.echo(f"sizing from {', '.join(map(str, names))} (serving threshold, {rule.serving_text()})")
    click.echo("SLOs: " + "; ".join(s.describe() for s in chosen))
    for note in rule_notes:
        click.echo(f"note: {note}")
    if len(answers) > 1:
        for line in serve_sizing_table(answers).text():
            click.echo(line)
    for a in answers:
        click.echo(f"- {a.reasoning}")
        c = beside[id(a.threshold)]
        if c.ratio is not None:
            click.echo(f"  static crossover ({c.pairing}): {c.static_text} streams/VM; serving / static = "
                       f"{c.ratio_text}")
    which = "rate" if peak_rps is not None else "streams"
    several_models = len({a.threshold.key.model for a in answers}) > 1
    for a in answers:
        t = a.threshold
        model = f"{model_text(t.key.model)}, " if several_models else ""
        context = workload_title(t.key.workload) if t.key.workload else f"{t.key.input_tokens}-token inputs"
        click.echo(f"answer: {model}{t.slo.title}, {context}, {t.rule}: {a.answer_text(which)}"
                   + (f", binding {t.binding}" if t.binding else ""))
    if len(answers) == 1:
        a = answers[0]
        text = a.nodes_text("rate" if peak_rps is not None else "streams")
        click.echo(f"nodes: {text if text not in ('–', 'below range') else 'not readable (see above)'}")


COMMANDS = [report, size]
