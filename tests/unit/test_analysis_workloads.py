"""Serving analysis of workloads: series of different workloads never pool, a workload series is
named by its workload, its loads are split by prompt length (analysis/lengths.py), the prefix
cache's share and the note for vcfslm's engine, and the report's table and CSV."""

from __future__ import annotations

import csv
import io
from types import SimpleNamespace

import pytest
from test_analysis_support import make_serve_run, serve_record

from vcfslm.analysis.cells import aggregate, load_runs
from vcfslm.analysis.endpoint import scale_outs
from vcfslm.analysis.lengths import (
    HISTORY_NOTE,
    cached_share,
    history_note,
    length_split,
    load_roles,
    split_loads,
)
from vcfslm.analysis.report import write_report
from vcfslm.analysis.serve import analyse
from vcfslm.analysis.serve_points import ServeKey, describe_key, workload_label, workload_title
from vcfslm.analysis.serve_tables import (
    length_table,
    serve_answer_table,
    serve_points_table,
    serve_sizing_table,
)
from vcfslm.analysis.slo_spec import DEFAULT_SLOS

SLO_A, SLO_B = DEFAULT_SLOS            # A: TPOT <= 130 ms, TTFT <= 3 s; B: TPOT <= 200 ms, TTFT <= 5 s
# (load per rank, input tokens) -> (TTFT s, TPOT ms, mean busy slots): SLO-A passes 1 and fails 2 per rank.
RAMP = {(1.0, 4096): (0.5, 100.0, 2.0), (2.0, 4096): (2.0, 150.0, 5.0), (4.0, 4096): (6.0, 250.0, 12.0)}
FAST = {(1.0, 4096): (0.2, 50.0, 1.0), (2.0, 4096): (0.3, 60.0, 2.0), (4.0, 4096): (0.5, 80.0, 4.0)}
PROMPTS = [100] * 5 + [2000] * 5       # ten requests per window: five short prompts, five long ones


def workload(name: str, digest: str, prompts=PROMPTS, *, server: str = "vcfslm", prefix=None, cached=None):
    """A tweak for make_serve_run: its records ran `name` (each window's ten requests `prompts`)."""
    def tweak(r):
        r.workload, r.workload_digest, r.server = name, digest, server
        r.request_input_tokens = list(prompts)
        r.request_prefix_tokens = list(prefix) if prefix is not None else [0] * len(prompts)
        r.request_cached_tokens = list(cached) if cached is not None else []
        return r
    return tweak


def analysed(*run_dirs, peaks=(256,)):
    runs = load_runs(run_dirs)
    return analyse(runs, DEFAULT_SLOS, aggregate(runs).cells, peaks)


def answer(result, slo):
    return [t for t in result.primaries if t.slo == slo]


# ------------------------------------------------------------------ never pooled


def test_two_workloads_at_one_context_stay_two_series_and_two_answers(tmp_path):
    chat = make_serve_run(tmp_path / "c", "c", ["vm1"], RAMP, tweak=workload("chat", "aaaa1111"))
    trace = make_serve_run(tmp_path / "t", "t", ["vm1"], FAST, tweak=workload("file:trace.jsonl", "bbbb2222cccc"))
    got = analysed(chat, trace)
    assert sorted({p.key.workload for p in got.points}) == ["chat@aaaa1111", "file:trace.jsonl@bbbb2222cccc"]
    assert all(p.requests == 40 for p in got.points), "one run's windows per load, never the other's"
    by_workload = {t.key.workload: t for t in answer(got, SLO_A)}
    assert (by_workload["chat@aaaa1111"].status, by_workload["chat@aaaa1111"].passing) == ("threshold", 1.0)
    assert by_workload["file:trace.jsonl@bbbb2222cccc"].status == "above"
    # Each workload has its own sizing, and no static context to compare with.
    assert len(got.sizings) == 2 * len(DEFAULT_SLOS)
    assert {c.note for c in got.comparisons} == {"a workload's lengths vary: no static crossover"}


def test_the_answer_and_sizing_name_each_workload_on_its_own_row(tmp_path):
    chat = make_serve_run(tmp_path / "c", "c", ["vm1"], RAMP, tweak=workload("chat", "aaaa1111"))
    trace = make_serve_run(tmp_path / "t", "t", ["vm1"], FAST, tweak=workload("file:trace.jsonl", "bbbb2222cccc"))
    got = analysed(chat, trace)
    table = serve_answer_table(got.comparisons, got.sizings)
    assert table.columns[:2] == ["SLO", "input tokens or workload"]
    assert [row[:3] for row in table.rows] == [
        ["SLO-A", "chat (mix)", "req/s"], ["SLO-A", "trace.jsonl (requests file, bbbb2222)", "req/s"],
        ["SLO-B", "chat (mix)", "req/s"], ["SLO-B", "trace.jsonl (requests file, bbbb2222)", "req/s"]]
    sizing = serve_sizing_table([s for s in got.sizings if s.threshold.slo == SLO_A])
    # chat: 4 req/s/VM with 2 busy slots x 4 ranks, 256 / 8 = 32 nodes; the trace passes every load tried.
    assert [(row[1], row[5], row[6], row[8]) for row in sizing.rows] == [
        ("chat (mix)", "8.0", "4 [4–<8]", "32 [13–32]"),
        ("trace.jsonl (requests file, bbbb2222)", "≥ 16.0", "≥ 16", "≤ 16")]


def test_a_fixed_workload_is_the_specs_fixed_lengths_and_names_follow_the_kind():
    r = serve_record()
    assert workload_label(r) == ""
    r.workload = "fixed:128/64"
    assert workload_label(r) == "", "fixed:IN/OUT is the classic context: it pools with it"
    r.workload, r.workload_digest = "rag", "0123456789ab"
    assert workload_label(r) == "rag@0123456789ab"
    assert workload_title("rag@0123456789ab") == "rag (mix)"
    assert workload_title("mooncake:conv.jsonl@feedfacecafe") == "conv.jsonl (Mooncake trace, feedface)"
    key = ServeKey("single", 1, 4, "rate", "poisson", 16, 4096, 1024, workload="chat@aaaa")
    assert describe_key(key) == "single VM (1 VM x 4 ranks, 16 slots, poisson) workload chat (mix)"
    assert (key.context_text, key.output_text) == ("chat (mix)", "–")


def test_scale_out_curves_keep_workloads_apart():
    def threshold(workload, nodes):
        key = ServeKey("single", nodes, 1, "rate", "poisson", 16, 4096, 1024, "vllm", "m", nodes, False, workload)
        return SimpleNamespace(key=key, slo=SLO_A, status="threshold", passing=float(nodes))

    curves = scale_outs([threshold(w, n) for w in ("chat@a", "rag@b") for n in (1, 2)])
    assert sorted(c.key.workload for c in curves) == ["chat@a", "rag@b"]
    assert all(c.nodes == [1, 2] for c in curves)


# ------------------------------------------------------------------ by prompt length


def test_buckets_by_hand():
    # Rank 0: five requests of 100, 200, 300, 2000 and 5000 prompt tokens, two more unfinished.
    one = serve_record(ttft=[0.1, 0.2, 0.3, 2.0, 6.0], tpot=[50.0, 60.0, 70.0, 150.0, 300.0], unfinished=2)
    one.request_input_tokens = [100, 200, 300, 2000, 5000]
    # Rank 1: two more short prompts, one of them too slow for SLO-A's TPOT.
    two = serve_record(local_rank=1, ttft=[0.3, 0.4], tpot=[80.0, 200.0])
    two.request_input_tokens = [150, 250]
    # An invalid window counts nowhere.
    bad = serve_record(local_rank=2, ttft=[9.0], tpot=[900.0], valid=False, reasons=("recompiled",))
    bad.request_input_tokens = [100]
    split = length_split([one, two, bad], DEFAULT_SLOS, 1.0, ("SLO-A threshold",))
    assert [b.label for b in split.buckets] == ["<256", "256–1023", "1024–4095", "≥4096"]
    short, mid, long, longest = split.buckets
    # <256: TTFT 0.1 0.2 0.3 0.4, TPOT 50 60 80 200 (linear between ranks: p50 at 1.5, p90 at 2.7)
    assert short.requests == 4 and short.prompt_tokens == 700
    assert (short.ttft_p50_s, short.ttft_p90_s) == pytest.approx((0.25, 0.37))
    assert (short.tpot_p50_ms, short.tpot_p90_ms) == pytest.approx((70.0, 164.0))
    assert short.meets == {"A": 0.75, "B": 1.0}
    assert (mid.requests, mid.ttft_p90_s, mid.tpot_p50_ms, mid.meets) == (1, 0.3, 70.0, {"A": 1.0, "B": 1.0})
    assert (long.ttft_p50_s, long.tpot_p90_ms, long.meets) == (2.0, 150.0, {"A": 0.0, "B": 1.0})
    assert longest.meets == {"A": 0.0, "B": 0.0}
    assert (split.unfinished, split.roles, split.cached_share) == (2, ("SLO-A threshold",), None)


def test_the_loads_split_are_all_when_few_else_those_the_thresholds_read():
    thresholds = [SimpleNamespace(slo=SLO_A, passing=2.0, failing=4.0),
                  SimpleNamespace(slo=SLO_B, passing=4.0, failing=8.0)]
    roles = load_roles(thresholds)
    assert roles == {2.0: ["SLO-A threshold"], 4.0: ["SLO-A first failing", "SLO-B threshold"],
                     8.0: ["SLO-B first failing"]}
    assert split_loads([1.0, 2.0, 4.0], roles) == [1.0, 2.0, 4.0]
    assert split_loads([0.5, 1.0, 2.0, 4.0, 8.0, 16.0], roles) == [2.0, 4.0, 8.0]
    assert split_loads([0.5, 1.0, 2.0, 4.0, 8.0], {}) == [0.5, 1.0, 2.0, 4.0, 8.0]


def test_a_fixed_series_is_not_split_unless_its_prompts_varied(tmp_path):
    fixed = analysed(make_serve_run(tmp_path / "f", "f", ["vm1"], RAMP))
    assert fixed.lengths == []

    def drawn(r):                       # the spec's lengths drawn per request (`uniform`)
        r.request_input_tokens = [200 + 300 * i for i in range(10)]
        return r

    varied = analysed(make_serve_run(tmp_path / "v", "v", ["vm1"], RAMP, tweak=drawn))
    (series,) = varied.lengths
    assert series.key.workload == "" and series.every_load
    assert [b.label for b in series.splits[0].buckets] == ["<256", "256–1023", "1024–4095"]


# ------------------------------------------------------------------ the prefix cache


def test_cached_share_of_prompt_tokens(tmp_path):
    cached = [0] * 5 + [1500] * 5       # the long prompts half held by the cache: 7500 / (500 + 10000)
    run = make_serve_run(tmp_path / "v", "v", ["vm1"], RAMP,
                         tweak=workload("chat", "aaaa1111", server="vllm", cached=cached))
    got = analysed(run)
    assert all(p.cached_share == pytest.approx(7500 / 10500) for p in got.points)
    table = serve_points_table(got.points, DEFAULT_SLOS)
    column = table.columns.index("prefix cache (prompt tokens)")
    assert {row[column] for row in table.rows} == {"71.4 %"}
    (series,) = got.lengths
    short, long = series.splits[0].buckets
    assert (short.cached_share, long.cached_share) == (0.0, 0.75)
    assert "| 4 | SLO-A threshold | 1024–4095 | 20 | 0.50 | 0.50 | 100.0 | 100.0 | 100.0 % | 100.0 % | 75.0 % |" \
        in length_table(series, DEFAULT_SLOS).markdown().splitlines()
    # A server that did not say: no share, no column.
    assert cached_share([serve_record()]) is None
    assert "prefix cache (prompt tokens)" not in serve_points_table(
        analysed(make_serve_run(tmp_path / "n", "n", ["vm1"], RAMP)).points, DEFAULT_SLOS).columns


def test_the_engine_without_a_prefix_cache_is_noted_for_a_multi_turn_workload(tmp_path):
    prefix = [0] * 5 + [1500] * 5       # the long prompts are second turns carrying the first's history
    run = make_serve_run(tmp_path / "e", "e", ["vm1"], RAMP, tweak=workload("chat", "aaaa1111", prefix=prefix))
    got = analysed(run)
    note = HISTORY_NOTE + "."
    assert note in serve_points_table(got.points, DEFAULT_SLOS).notes
    assert note in length_table(got.lengths[0], DEFAULT_SLOS).notes
    assert all(row[-1].endswith("; vcfslm's engine has no prefix cache: each turn's history prefilled again")
               for row in serve_answer_table(got.comparisons, got.sizings).rows)
    # vLLM reuses the history; a single-turn workload carries none: no note either way.
    records = [r for p in got.points for r in p.result.windows]
    assert history_note("vllm", records) == ""
    single_turn = analysed(make_serve_run(tmp_path / "s", "s", ["vm1"], RAMP, tweak=workload("rag", "cccc3333")))
    assert single_turn.lengths[0].notes == ()


# ------------------------------------------------------------------ the report


def test_the_report_has_the_length_table_its_csv_and_a_row_per_workload(tmp_path):
    chat = make_serve_run(tmp_path / "c", "c", ["vm1"], RAMP, tweak=workload("chat", "aaaa1111"))
    trace = make_serve_run(tmp_path / "t", "t", ["vm1"], FAST, tweak=workload("file:trace.jsonl", "bbbb2222cccc"))
    result = write_report([chat, trace], tmp_path / "out")
    lines = (tmp_path / "out" / "report.md").read_text().splitlines()
    assert ("### TTFT and TPOT by prompt length, single VM (1 VM x 4 ranks, 16 slots, poisson) workload chat (mix)"
            in lines)
    assert ("| load/VM (req/s) | read at | prompt tokens | requests | TTFT p50 (s) | TTFT p90 (s) | TPOT p50 (ms) "
            "| TPOT p90 (ms) | meets SLO-A | meets SLO-B |") in lines
    assert "| 4 | SLO-A threshold | <256 | 20 | 0.50 | 0.50 | 100.0 | 100.0 | 100.0 % | 100.0 % |" in lines
    assert ("| 8 | SLO-A first failing; SLO-B threshold | 1024–4095 | 20 | 2.00 | 2.00 | 150.0 | 150.0 | 0.0 % "
            "| 100.0 % |") in lines
    assert any(line.startswith("- Unfinished requests have no length on record") for line in lines)
    assert "### Serving threshold per SLO and context or workload (continuous batching, 90 % attainment)" in lines
    answer_rows = [line for line in lines if line.startswith("| SLO-A | ")]
    assert [row.split(" | ")[1] for row in answer_rows] == ["chat (mix)", "trace.jsonl (requests file, bbbb2222)"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "serve-length-buckets.csv").read_text())))
    assert tmp_path / "out" / "serve-length-buckets.csv" in result.files
    assert {r["workload"] for r in rows} == {"chat@aaaa1111", "file:trace.jsonl@bbbb2222cccc"}
    chat_short = [r for r in rows if r["workload"] == "chat@aaaa1111" and r["bucket"] == "<256"]
    assert [(r["load_per_vm"], r["requests"], r["meets_A"]) for r in chat_short] == [
        ("4", "20", "1"), ("8", "20", "0"), ("16", "20", "0")]


def test_a_report_without_workloads_writes_no_length_csv(tmp_path):
    write_report([make_serve_run(tmp_path / "f", "f", ["vm1"], RAMP)], tmp_path / "out")
    assert not (tmp_path / "out" / "serve-length-buckets.csv").exists()
    assert "by prompt length" not in (tmp_path / "out" / "report.md").read_text()
