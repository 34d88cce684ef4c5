"""`vcfslm report` puts the serving simulator's answer beside a measured serving series
wherever the runs also hold static cells of the same model and server to fit on; the
prediction is the simulator's own (the same as `predict --serve` on the static run), its
error against the measured p50s and each SLO's threshold both ways are in the table, and
`serving.json` carries it."""

from __future__ import annotations

import json

from test_analysis_support import make_serve_run
from test_predict_cli import model_run, run

SLO = "B:tpot<=400ms,ttft<=5s"


def serve_run(path, model="synthetic:tiny"):
    # Measured: 0.5 s TTFT and 100 ms TPOT at every load, one rank, 16 slots, 128/16.
    return make_serve_run(path, "serve", ["local"], {(0.5, 128): (0.5, 100.0, 1.0), (1.0, 128): (0.5, 100.0, 2.0)},
                          ranks=1, out=16, requests=20, model=model)


def markdown_table(text: str, title: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("### " + title))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_a_serving_series_is_shown_beside_the_simulators_prediction_of_it(tmp_path):
    static = model_run(tmp_path / "static", "static")
    serve = serve_run(tmp_path / "serve")
    out = run("report", static, serve, "--slo", SLO, "--out", tmp_path / "report")
    assert out.exit_code == 0, out.output
    text = (tmp_path / "report" / "report.md").read_text()
    header, _, *rows = markdown_table(text, "Serving predicted beside measured")
    assert header[:7] == ["load/rank (req/s)", "TTFT p50 (s) measured", "predicted", "error",
                          "TPOT p50 (ms) measured", "predicted", "error"]
    assert [r[0] for r in rows] == ["0.5", "1"] and all(r[1] == "0.50" and r[4] == "100.0" for r in rows)
    # The same prediction predict --serve gives for the run's spec from the static run alone.
    alone = run("predict", "--serve", "--results", static, "--rates", "0.5,1", "--slots", "16", "--input-tokens",
                "128", "--output-tokens", "16", "--duration", "20", "--warmup-s", "0", "--cooldown-s", "0",
                "--slo", SLO, "-o", "json")
    assert alone.exit_code == 0, alone.output
    doc = json.loads((tmp_path / "report" / "serving.json").read_text())
    (series,) = doc["predicted"]
    want = {row["load"]: row for row in json.loads(alone.stdout)["loads"]}
    for p in series["loads"]:
        assert p["tpot_p50_ms"] == want[p["load"]]["tpot_ms"]["p50"]
        assert p["ttft_p50_s"] == want[p["load"]]["ttft_s"]["p50"]
    for r in rows:
        tpot = float(r[5])
        assert r[6] == f"{tpot / 100.0 - 1:+.0%}"
    assert "not calibrated on this run's own steps" in series["basis"]
    assert any(line.startswith("- SLO-B threshold per VM: measured ") for line in text.splitlines())


def test_no_prediction_without_static_cells_of_the_same_model_or_when_asked_not_to(tmp_path):
    static = model_run(tmp_path / "static", "static")
    other = serve_run(tmp_path / "other", model="synthetic:tiny-64")
    out = run("report", static, other, "--slo", SLO, "--out", tmp_path / "r1")
    assert out.exit_code == 0, out.output
    assert "not predicted: serve: no static cells of synthetic:tiny-64 on vcfslm among the runs: nothing to " \
           "predict its serving from" in out.stdout.splitlines()
    assert "Serving predicted beside measured" not in (tmp_path / "r1" / "report.md").read_text()
    same = serve_run(tmp_path / "same")
    out = run("report", static, same, "--slo", SLO, "--no-predict", "--out", tmp_path / "r2")
    assert out.exit_code == 0, out.output
    assert "Serving predicted beside measured" not in (tmp_path / "r2" / "report.md").read_text()
    assert json.loads((tmp_path / "r2" / "serving.json").read_text())["predicted"] == []
