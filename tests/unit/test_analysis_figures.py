"""Figures: drawn, non-empty, labelled, log-2 axis; matplotlib stays in figures.py only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from test_analysis_support import BRIEF_SHAPED, brief_shaped_csv, make_run, make_serve_run

from vcfslm.analysis.csv_import import parse_csv
from vcfslm.analysis.slo_spec import DEFAULT_SLOS

ANALYSIS = Path(__file__).resolve().parents[2] / "vcfslm" / "analysis"


def both_scopes_with_roofline():
    header = "scope,vms,ranks_per_vm,batch_per_rank,input_tokens,output_tokens,ttft_s,tpot_ms,rank_tps,roofline_tpot_ms"
    rows = [header]
    for scope, vms in (("single", 1), ("cluster", 4)):
        for (inp, streams), (ttft, tpot, tps) in sorted(BRIEF_SHAPED.items()):
            rows.append(f"{scope},{vms},4,{streams // 4},{inp},256,{ttft},{tpot},{tps},110")
    return parse_csv("\n".join(rows) + "\n", "both.csv").cells


def model_section():
    from test_perfmodel import synthetic

    from vcfslm.analysis.perfmodel import fit_model, validate
    from vcfslm.analysis.predict import ModelSection

    obs = synthetic([1, 4, 8, 16], [128, 512], noise=0.03)
    small = [o for o in obs if o.scenario.batch <= 4]
    return ModelSection(fit_model(obs), validate(fit_model(obs), obs),
                        validate(fit_model(small), [o for o in obs if o.scenario.batch > 4]), (1, 4))


def test_all_six_figures_are_drawn_and_not_blank(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    from vcfslm.analysis.figures import render_all

    figures, skipped = render_all(both_scopes_with_roofline(), DEFAULT_SLOS, tmp_path, "run-42",
                                  model=model_section())
    assert skipped == []
    assert [f.name for f in figures] == ["fig-1-throughput", "fig-2-matched-tpot", "fig-3-tpot-slo",
                                         "fig-4-ttft-slo", "fig-5-roofline", "fig-6-model"]
    for f in figures:
        assert f.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = image.imread(f.path)
        assert pixels.shape[:2] == ((500, 1000) if f.name == "fig-6-model" else (500, 800))
        assert pixels.std() > 0.05, f"{f.name} looks blank"
        assert "run-42" in f.title


def test_missing_data_skips_figures_with_a_reason(tmp_path):
    from vcfslm.analysis.figures import render_all

    figures, skipped = render_all(parse_csv(brief_shaped_csv(), "b.csv").cells, DEFAULT_SLOS, tmp_path, "r")
    assert len(figures) == 3
    assert skipped == ["fig-2-matched-tpot: needs single-VM and cluster data at the same batch per rank",
                       "fig-5-roofline: no roofline data (no bandwidth or compute probe in this run)",
                       "fig-6-model: no performance model (not fitted)"]
    assert not (tmp_path / "fig-2-matched-tpot.png").exists()


def test_roofline_figure_has_a_panel_per_measured_floor():
    from vcfslm.analysis.figures import roofline_figure

    header = "scope,vms,ranks_per_vm,batch_per_rank,input_tokens,output_tokens,ttft_s,tpot_ms,rank_tps"
    rows = [f"single,1,4,{b},128,256,{0.2 * b},{110 + b},{8 * b},100,{0.1 * b}" for b in (1, 4, 16)]
    both = parse_csv("\n".join([header + ",roofline_tpot_ms,roofline_ttft_s", *rows]) + "\n", "x.csv").cells
    fig, title, caption = roofline_figure(both, "r")
    assert [ax.get_title() for ax in fig.axes] == ["TPOT: measured vs bandwidth floor",
                                                    "TTFT: measured vs compute floor"]
    assert fig.axes[1].get_ylabel() == "TTFT p50 (s)" and "TPOT and TTFT" in title
    assert "compute floor = prompt FLOPs / measured bf16 GEMM rate" in caption
    floor = [line for line in fig.axes[1].get_lines() if line.get_label().startswith("compute floor")][0]
    assert list(floor.get_ydata()) == pytest.approx([0.1, 0.4, 1.6])
    tpot_only = [c for c in both_scopes_with_roofline() if c.scope == "single"]
    fig, title, _ = roofline_figure(tpot_only, "r")
    assert len(fig.axes) == 1 and "TTFT" not in title


def test_axes_units_log2_legend_and_slo_lines():
    from vcfslm.analysis.figures import latency_figure, throughput_figure

    cells = parse_csv(brief_shaped_csv(), "b.csv").cells
    fig, title, _ = throughput_figure(cells, "my-run")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    assert list(ax.get_xticks()) == [4, 16, 32, 64]
    assert "streams per VM" in ax.get_xlabel() and "tokens/s" in ax.get_ylabel()
    assert "my-run" in ax.get_title() and ax.get_legend() is not None
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["128 input tokens", "512 input tokens",
                                                                   "1024 input tokens"]
    fig, _, _ = latency_figure(cells, DEFAULT_SLOS, "my-run", "tpot", "p50")
    ax = fig.axes[0]
    assert "(ms per output token)" in ax.get_ylabel()
    limits = sorted(line.get_ydata()[0] for line in ax.get_lines() if len(set(line.get_ydata())) == 1
                    and line.get_label().startswith("SLO"))
    assert limits == [130, 200]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_only_figures_imports_matplotlib():
    for path in sorted(ANALYSIS.glob("*.py")):
        mpl = {m for m in _imports(path) if m.split(".")[0] == "matplotlib"}
        assert bool(mpl) == (path.name == "figures.py"), path.name


def test_report_loads_figures_lazily():
    tree = ast.parse((ANALYSIS / "report.py").read_text())
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    top_level |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "vcfslm.analysis.figures" not in top_level
    code = ("import sys, vcfslm.analysis.report, vcfslm.cli.report; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


RAMP = {(1.0, 128): (0.5, 100.0, 2.0), (2.0, 128): (2.0, 150.0, 5.0), (4.0, 128): (6.0, 250.0, 12.0),
        (1.0, 1024): (1.5, 120.0, 3.0), (2.0, 1024): (4.0, 180.0, 7.0)}


def serving_analysis(tmp_path, with_static=True):
    from vcfslm.analysis.cells import aggregate, load_runs
    from vcfslm.analysis.serve import analyse

    def unfinished(r):
        if r.load == 2.0 and r.input_tokens == 1024:
            r.unfinished = 5
        return r

    dirs = [make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP, tweak=unfinished)]
    if with_static:
        short = {(streams // 4, inp): v for (inp, streams), v in BRIEF_SHAPED.items() if inp in (128, 1024)}
        dirs.append(make_run(tmp_path / "st", "st", ["vm1"], short))
    runs = load_runs(dirs)
    return analyse(runs, DEFAULT_SLOS, aggregate(runs).cells, (256,))


def test_serving_figures_are_drawn_from_the_run_and_not_blank(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    from vcfslm.analysis.figures import render_serving

    figures, skipped = render_serving(serving_analysis(tmp_path), DEFAULT_SLOS, tmp_path / "out", "run-7")
    assert skipped == []
    assert [f.name for f in figures] == ["fig-7-serve-latency", "fig-8-serve-goodput", "fig-9-serve-vs-static"]
    for f in figures:
        pixels = image.imread(f.path)
        assert pixels.shape[:2] == ((800, 800) if f.name == "fig-7-serve-latency" else (500, 800))
        assert pixels.std() > 0.05, f"{f.name} looks blank"
        assert "run-7" in f.title
    figures, skipped = render_serving(serving_analysis(tmp_path / "alone", False), DEFAULT_SLOS, tmp_path, "r")
    assert [f.name for f in figures] == ["fig-7-serve-latency", "fig-8-serve-goodput"]
    assert skipped == ["fig-9-serve-vs-static: no serving threshold with a static crossover of the same SLO and "
                       "context, judged at the same share, among the inputs"]


def test_serving_latency_figure_has_slo_lines_and_marks_unfinished_tails(tmp_path):
    from vcfslm.analysis.figures import serve_goodput_figure, serve_latency_figure

    fig, _, _ = serve_latency_figure(serving_analysis(tmp_path, False), DEFAULT_SLOS, "r")
    ttft, tpot = fig.axes
    assert ttft.get_ylabel() == "TTFT p90 (s), queue included" and tpot.get_ylabel() == "TPOT p90 (ms)"
    assert tpot.get_xlabel() == "offered load per VM (requests/s)"

    def limits(ax):
        return sorted(line.get_ydata()[0] for line in ax.get_lines() if line.get_label().startswith("SLO"))
    assert limits(ttft) == [3, 5] and limits(tpot) == [130, 200]
    labels = [line.get_label() for line in ttft.get_lines()]
    assert labels[:2] == ["128 input tokens", "1024 input tokens"]
    assert "tail reaches unfinished requests (∞)" in labels
    measured = ttft.get_lines()[0]
    assert list(measured.get_xdata()) == [4.0, 8.0, 16.0] and list(measured.get_ydata()) == [0.5, 2.0, 6.0]
    fig, _, _ = serve_goodput_figure(serving_analysis(tmp_path / "g", False), DEFAULT_SLOS, "r")
    (ax,) = fig.axes
    got = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert got["goodput SLO-A, 128 input tokens"] == [4.0, 0.0, 0.0]
    assert got["goodput SLO-B, 128 input tokens"] == [4.0, 4.0, 0.0]


def test_streams_per_model_are_drawn_only_when_the_cells_hold_several_models(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    from vcfslm.analysis.figures import models_figure, render_all
    from vcfslm.analysis.slo import crossovers

    header, *rows = brief_shaped_csv().splitlines()
    text = "\n".join([header + ",model"] + [r + ",synthetic:phi-3-mini" for r in rows]
                     + [r + ",synthetic:qwen2.5-7b" for r in rows]) + "\n"
    cells = parse_csv(text, "two.csv").cells
    xs = crossovers(cells, DEFAULT_SLOS, "p50")
    assert {x.model for x in xs} == {"synthetic:phi-3-mini", "synthetic:qwen2.5-7b"} and len(xs) == 12
    figures, _ = render_all(cells, DEFAULT_SLOS, tmp_path, "two", "p50", crossovers=xs)
    (fig,) = [f for f in figures if f.name == "fig-10-models"]
    assert fig.title == "Streams per VM at the SLO, per model (p50 of streams) — two"
    pixels = image.imread(fig.path)
    assert pixels.shape[:2] == (500, 800) and pixels.std() > 0.05
    one = parse_csv(brief_shaped_csv(), "b.csv").cells
    figures, skipped = render_all(one, DEFAULT_SLOS, tmp_path / "one", "r", crossovers=crossovers(one, DEFAULT_SLOS, "p50"))
    assert "fig-10-models" not in [f.name for f in figures] and not any("fig-10" in s for s in skipped)
    assert models_figure(crossovers(one, DEFAULT_SLOS, "p50"), "r") == "needs crossovers of at least two models"
