"""report.html renders in headless Chromium: the answer table above the first figure, a
visible validity warning naming a rank that failed the numerics gate, no broken image,
and a non-blank page; a serving run beside a static one adds the serving section's
three figures, every one decoded; runs of two models answer with a row per model and
draw streams per VM per model first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from vcfslm.analysis.report import write_report
from vcfslm.results import (
    SERVE_RESULTS,
    RunMeta,
    ServeRecord,
    WindowRecord,
    write_meta,
    write_records,
)
from vcfslm.roofline import ModelDims
from vcfslm.serving.decisions import ServeSpec

pytestmark = pytest.mark.integration

PHI3_2L = ModelDims(num_hidden_layers=2, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
                    head_dim=96, intermediate_size=8192, vocab_size=32064, step_weight_bytes=650_016_768,
                    kv_bytes_per_token=24_576)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (make setup installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def synthetic_run(run_dir, run_id, nodes, gate_failed=None, model="synthetic:tiny", slower=1.0):
    """Two contexts x four loads, two repeats, every rank of every node, with roofline data.

    `gate_failed` = (node, local rank) whose windows all failed the numerics gate; `slower`
    scales every TPOT (another model's cost per token).
    """
    meta = RunMeta(run_id=run_id, created="2025-01-01T00:00:00", command=["vcfslm", "bench"],
                   mode="cluster" if len(nodes) > 1 else "local", nodes=nodes, ranks_per_node=4,
                   threads_per_rank=24, model=model,
                   matrix={"batch_sizes": [1, 4, 8, 16], "input_tokens": [128, 1024], "output_tokens": 64,
                           "warmup": 1, "repeats": 2},
                   complete=True, guests={n: {"vnuma_nodes": 4, "numa_ok": True} for n in nodes},
                   # each rank's probes and model shape: the report fits its performance model on them
                   ranks={str(r): {"node": nodes[r // 4], "local_rank": r % 4, "probe": {"read_gbs": 60.0},
                                   "gemm": {"tflops": 2.0, "threads": 24}, "model": PHI3_2L.to_facts()}
                          for r in range(4 * len(nodes))})
    records = []
    for batch in (1, 4, 8, 16):
        for inp in (128, 1024):
            tpot, ttft = (110.0 + 5 * batch + inp / 50) * slower, 0.1 * batch * inp / 128
            for window in range(2):
                for node_rank, node in enumerate(nodes):
                    for local in range(4):
                        wall = ttft + tpot * 63 / 1000
                        records.append(WindowRecord(
                            run_id=run_id, node=node, node_rank=node_rank, rank=node_rank * 4 + local,
                            local_rank=local, world_size=4 * len(nodes), ranks_per_node=4, nodes=len(nodes),
                            batch_per_rank=batch, input_tokens=inp, output_tokens=64, window=window,
                            start_skew_s=0.001, wall_s=wall, generated_tokens=batch * 64,
                            rank_tps=batch * 64 / wall, ttft_s=[ttft] * batch,
                            tpot_ms=[tpot + window + local * 0.1] * batch, e2e_s=[wall] * batch,
                            roofline_tpot_ms=100.0, roofline_ttft_s=0.7 * ttft))
                        if (node, local) == gate_failed:
                            records[-1].valid = False
                            records[-1].invalid_reasons = ["numerics gate: top-1 agreement 0.81 < 0.99"]
    write_meta(run_dir, meta)
    write_records(run_dir / "results.jsonl", records)
    return run_dir


@pytest.fixture(scope="module")
def report_html(tmp_path_factory):
    base = tmp_path_factory.mktemp("render")
    single = synthetic_run(base / "single", "single", ["vm1"])
    cluster = synthetic_run(base / "cluster", "cluster", ["vm1", "vm2", "vm3", "vm4"], gate_failed=("vm3", 1))
    result = write_report([single, cluster], base / "out")
    assert result.skipped_figures == []
    return base / "out" / "report.html"


def chromium(args, tmp_path, timeout=120):
    profile = tmp_path / "profile"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dom(report_html, tmp_path_factory):
    """The page after load, as Chromium laid it out (its own script records image and layout checks)."""
    r = chromium(["--virtual-time-budget=10000", "--window-size=1200,3000", "--dump-dom", report_html.as_uri()],
                 tmp_path_factory.mktemp("chromium"))
    assert "<body" in r.stdout, f"no DOM dumped; stderr tail:\n{r.stderr[-2000:]}"
    return r.stdout


@needs_chromium
def test_every_image_loads(dom):
    m = re.search(r'data-images="(\d+) ok=(\d+) broken=(\d+)"', dom)
    assert m, "the page's image check did not run"
    total, ok, broken = map(int, m.groups())
    assert (total, ok, broken) == (6, 6, 0)   # fig-6-model among them


@needs_chromium
def test_the_answer_table_is_laid_out_above_the_first_figure(dom):
    m = re.search(r'data-layout="summary=(-?\d+) warnings=(-?\d+) first-figure=(-?\d+)"', dom)
    assert m, "the page's layout check did not run"
    summary, warnings, figure = map(int, m.groups())
    assert 0 < summary < warnings < figure, (summary, warnings, figure)
    assert summary < 400, "the answer should be on the first screen"
    # And in the document: the answer table, then the warnings, then the first image.
    assert dom.index('<table id="summary"') < dom.index('id="validity"') < dom.index("<img")
    assert dom.count("<details>") == 2        # one collapsible reasoning per SLO, not one per context


@needs_chromium
def test_a_rank_that_failed_the_numerics_gate_is_named_in_the_visible_warnings(dom):
    box = dom.split('id="validity"')[1].split("</div>")[0]
    assert "run cluster: numerics gate failed on node vm3, rank 9 (local rank 1): top-1 agreement 0.81 &lt; " \
        "0.99; its 16 window(s) are left out of every number" in box


@needs_chromium
def test_screenshot_is_not_blank(report_html, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    shot = tmp_path / "shot.png"
    r = chromium([f"--screenshot={shot}", "--window-size=1200,3000", report_html.as_uri()], tmp_path)
    assert shot.exists(), f"no screenshot; stderr tail:\n{r.stderr[-2000:]}"
    pixels = image.imread(shot)
    assert pixels.shape[:2] == (3000, 1200)
    rgb = pixels[..., :3]
    dark = (rgb.mean(axis=2) < 0.5).mean()
    assert rgb.std() > 0.05 and 0.005 < dark < 0.5, "the page looks blank or all dark"
    keep = os.environ.get("VCFSLM_KEEP_SCREENSHOT")
    if keep:                       # to look at the page by eye: VCFSLM_KEEP_SCREENSHOT=/tmp/report.png
        shutil.copy(shot, keep)


def serving_run(run_dir, run_id):
    """One VM, four ranks, three rates at 128 and 1024 input tokens: latency and busy slots
    grow with the rate, so each SLO has a threshold inside the range tried."""
    spec = ServeSpec(load_kind="rate", loads=(0.5, 1.0, 2.0), input_tokens=(128, 1024), output_tokens=64,
                     duration_s=30.0)
    meta = RunMeta(run_id=run_id, created="2025-01-01T00:00:00", command=["vcfslm", "bench", "--serve"],
                   mode="local", nodes=["vm1"], ranks_per_node=4, threads_per_rank=24, model="synthetic:tiny",
                   matrix={"serve": spec.to_dict()}, complete=True,
                   guests={"vm1": {"vnuma_nodes": 4, "numa_ok": True}})
    records = []
    for load in spec.loads:
        for inp in spec.input_tokens:
            n = int(load * 20)
            ttft = [0.2 * load * inp / 128 + 0.01 * i for i in range(n)]
            tpot = [110.0 + 40 * load + inp / 50 + i for i in range(n)]
            for local in range(4):
                records.append(ServeRecord(
                    run_id=run_id, node="vm1", node_rank=0, rank=local, local_rank=local, world_size=4,
                    ranks_per_node=4, nodes=1, load_kind="rate", load=load, arrival="poisson", slots=16,
                    input_tokens=inp, output_tokens=64, window=0, seed=local, duration_s=30.0, warmup_s=5.0,
                    cooldown_s=5.0, span_s=20.0, wall_s=32.0, offered=n, completed=n, unfinished=0,
                    arrival_s=[5.0 + i for i in range(n)], queue_s=[0.0] * n, ttft_s=ttft, tpot_ms=tpot,
                    e2e_s=[f + p * 63 / 1000 for f, p in zip(ttft, tpot, strict=True)],
                    request_input_tokens=[inp] * n, request_output_tokens=[64] * n, generated_tokens=n * 64,
                    rank_tps=n * 64 / 20.0, mean_active=2.0 * load * (1 + inp / 1024), max_queue=1))
    write_meta(run_dir, meta)
    write_records(run_dir / SERVE_RESULTS, records)
    return run_dir


@pytest.fixture(scope="module")
def serving_dom(tmp_path_factory):
    base = tmp_path_factory.mktemp("render-serving")
    result = write_report([synthetic_run(base / "single", "single", ["vm1"]), serving_run(base / "serve", "serve")],
                          base / "out")
    assert [s for s in result.skipped_figures if "serve" in s] == []
    r = chromium(["--virtual-time-budget=10000", "--window-size=1200,3000", "--dump-dom",
                  (base / "out" / "report.html").as_uri()], tmp_path_factory.mktemp("chromium-serving"))
    assert "<body" in r.stdout, f"no DOM dumped; stderr tail:\n{r.stderr[-2000:]}"
    return r.stdout, len([f for f in result.files if f.suffix == ".png"])


@needs_chromium
def test_the_serving_section_renders_every_figure(serving_dom):
    serving_dom, drawn = serving_dom
    m = re.search(r'data-images="(\d+) ok=(\d+) broken=(\d+)"', serving_dom)
    assert m, "the page's image check did not run"
    total, ok, broken = map(int, m.groups())
    assert (total, ok, broken) == (drawn, drawn, 0) and drawn >= 6   # the static ones and three serving
    section = serving_dom.split('<h2 id="serving">')[1]
    for name in ("fig-7-serve-latency", "fig-8-serve-goodput", "fig-9-serve-vs-static"):
        assert f'id="{name}"' in section
    assert serving_dom.index('<table id="summary"') < serving_dom.index('<table id="serving-answer"') \
        < serving_dom.index('id="validity"')


@pytest.fixture(scope="module")
def models_dom(tmp_path_factory):
    base = tmp_path_factory.mktemp("render-models")
    phi = synthetic_run(base / "phi3", "phi3", ["vm1"], model="synthetic:phi-3-mini")
    qwen = synthetic_run(base / "qwen7b", "qwen7b", ["vm1"], model="synthetic:qwen2.5-7b", slower=1.2)
    result = write_report([phi, qwen], base / "out")
    assert "fig-10-models" in [f.stem for f in result.files if f.suffix == ".png"]
    r = chromium(["--virtual-time-budget=10000", "--window-size=1200,3000", "--dump-dom",
                  (base / "out" / "report.html").as_uri()], tmp_path_factory.mktemp("chromium-models"))
    assert "<body" in r.stdout, f"no DOM dumped; stderr tail:\n{r.stderr[-2000:]}"
    return r.stdout, result.report


@needs_chromium
def test_two_models_answer_side_by_side_and_draw_streams_per_model_first(models_dom):
    dom, report = models_dom
    m = re.search(r'data-images="(\d+) ok=(\d+) broken=(\d+)"', dom)
    assert m, "the page's image check did not run"
    total, ok, broken = map(int, m.groups())
    assert broken == 0 and total == ok
    table = dom.split('<table id="summary"')[1].split("</table>")[0]
    assert table.index("<th>model</th>") < table.index("<th>SLO</th>")
    # SLO x context x model: every row names its model, and each model has a row per SLO x context.
    rows = re.findall(r"<tr><td>([^<]*)</td><td>(SLO-[^<]*)</td><td>(\d+)</td>", table)
    assert sorted(rows) == sorted((m, s, i) for m in ("synthetic:phi-3-mini", "synthetic:qwen2.5-7b")
                                  for s in ("SLO-A", "SLO-B") for i in ("128", "1024"))
    assert len(report.summary.rows) == 8
    assert dom.index('id="fig-10-models"') < dom.index('id="fig-3-tpot-slo"')
