"""results/vllm_results.py: a serving series written in the layout of `vllm bench serve
--save-result --save-detailed`. The key set is read from the installed vLLM's own source
(vllm/benchmarks/serve.py, parsed, never imported), the values are checked on hand-made
records whose every request time is known, and the files on a synthetic run folder."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_analysis_support import make_serve_run, serve_record

from vcfslm.results import ServeRecord
from vcfslm.results.vllm_results import (
    UNFINISHED,
    VLLM_RESULTS,
    vllm_result,
    vllm_results,
    write_vllm_results,
)

REPO = Path(__file__).resolve().parents[2]
SERVE_SOURCE = ".venv-vllm/lib/python*/site-packages/vllm/benchmarks/serve.py"
# vllm's default percentile metrics and e2el, as `--percentile-metrics ttft,tpot,itl,e2el` writes them
METRICS = ("ttft", "tpot", "itl", "e2el")


# ------------------------------------------------------------------ hand-made records


def http_record(rank: int, arrivals: list[float], tokens: list[list[float]], *, unfinished: int = 0,
                failed: int = 0, errors: tuple[str, ...] = (), goodput: dict | None = None,
                window: int = 0, load: float = 2.0, kind: str = "rate", inp: int = 128,
                valid: bool = True) -> ServeRecord:
    """A vLLM server's window of rank `rank` (of 2): request i arrived at arrivals[i] and
    streamed its tokens at tokens[i]; each went out 10 ms after its arrival."""
    base = serve_record(local_rank=rank, ranks=2, kind=kind, load=load, inp=inp, out=3, window=window,
                        requests=len(arrivals), unfinished=unfinished, valid=valid)
    ttft = [t[0] - a for a, t in zip(arrivals, tokens, strict=True)]
    e2e = [t[-1] - a for a, t in zip(arrivals, tokens, strict=True)]
    outputs = [len(t) for t in tokens]
    tpot = [(e - f) / (n - 1) * 1000 if n > 1 else 0.0 for f, e, n in zip(ttft, e2e, outputs, strict=True)]
    return replace(base, server="vllm", arrival_s=arrivals, sent_s=[a + 0.01 for a in arrivals],
                   token_s=tokens, ttft_s=ttft, e2e_s=e2e, tpot_ms=tpot, request_output_tokens=outputs,
                   request_input_tokens=[inp] * len(arrivals), failed=failed, errors=list(errors),
                   goodput=goodput or {})


def two_ranks() -> list[ServeRecord]:
    """Window 0 of two ranks at 2 req/s each, 10 s spans.

    rank 0: three requests of 3 tokens, one more failed ("HTTP 503");
    rank 1: two of 2 tokens and one of 1 token, one more cut by the window's end.
    ttft (s): 0.2 0.4 0.1 | 0.3 0.2 0.4; e2e (s): 0.5 0.6 0.5 | 0.5 0.3 0.4;
    gaps (s): [0.1 0.2] [0.1 0.1] [0.3 0.1] | [0.2] [0.1] [].
    """
    rank0 = http_record(0, [5.0, 6.0, 7.0], [[5.2, 5.3, 5.5], [6.4, 6.5, 6.6], [7.1, 7.4, 7.5]],
                        unfinished=1, failed=1, errors=("HTTP 503",), goodput={"A": 0.2, "B": 0.3})
    rank1 = http_record(1, [5.0, 8.0, 9.0], [[5.3, 5.5], [8.2, 8.3], [9.4]],
                        unfinished=1, goodput={"A": 0.1, "B": 0.3})
    return [rank1, rank0]          # out of order on purpose: the result orders them


def series(records: list[ServeRecord], **kw) -> dict:
    return vllm_result(records, model="org/Tiny-Model", run_id="r1", date="20250101-000000", **kw)


# ------------------------------------------------------------------ the key set, from vLLM's source


def vllm_serve_source() -> Path:
    found = sorted(REPO.glob(SERVE_SOURCE))
    if not found:
        why = f"no vLLM at {REPO / SERVE_SOURCE} (make vllm): the key set is read from its source"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found[0]


def top_function(tree: ast.Module, name: str) -> ast.AST:
    return next(node for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name)


def in_source_order(root: ast.AST) -> list[ast.AST]:
    return sorted((n for n in ast.walk(root) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset))


def result_literal(benchmark: ast.AST) -> ast.Dict:
    """benchmark()'s first dict literal assigned to `result`: the generation branch."""
    return next(node.value for node in in_source_order(benchmark)
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "result" for t in node.targets))


def header_keys(main_async: ast.AST) -> set[str]:
    """The constant result_json["..."] keys main_async always sets (its own statements, so
    not the ramp-up keys an `if` adds)."""
    keys = set()
    for stmt in main_async.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "result_json" and isinstance(target.slice, ast.Constant)):
                    keys.add(target.slice.value)
    return keys


def processed_metrics(benchmark: ast.AST) -> set[str]:
    """The metric names benchmark() passes to process_one_metric."""
    return {call.args[0].value for call in ast.walk(benchmark)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "process_one_metric" and isinstance(call.args[0], ast.Constant)}


def metric_key_templates(benchmark: ast.AST) -> list[ast.JoinedStr]:
    """The f-strings process_one_metric keys `result` with (mean_{m}_ms, p{p}_{m}_ms, ...)."""
    helper = next(n for n in ast.walk(benchmark) if isinstance(n, ast.FunctionDef) and n.name == "process_one_metric")
    return [target.slice for node in ast.walk(helper) if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
            and target.value.id == "result" and isinstance(target.slice, ast.JoinedStr)]


def default_percentiles(tree: ast.Module) -> list[str]:
    """--metric-percentiles' default, as p_word spells each."""
    call = next(c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.args
                and isinstance(c.args[0], ast.Constant) and c.args[0].value == "--metric-percentiles")
    default = next(k.value.value for k in call.keywords if k.arg == "default")
    return [str(int(float(p))) if float(p) == int(float(p)) else p for p in default.split(",")]


def rendered(template: ast.JoinedStr, metric: str, p_word: str) -> str:
    names = {"metric_attribute_name": metric, "p_word": p_word}
    parts = []
    for value in template.values:
        if isinstance(value, ast.Constant):
            parts.append(value.value)
        else:
            assert isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name), ast.dump(value)
            parts.append(names[value.value.id])
    return "".join(parts)


@pytest.fixture(scope="module")
def vllm_layout():
    tree = ast.parse(vllm_serve_source().read_text(encoding="utf-8"))
    benchmark, main_async = top_function(tree, "benchmark"), top_function(tree, "main_async")
    literal = result_literal(benchmark)
    keys = [k.value for k in literal.keys]
    # One entry per request: the list comprehensions over `outputs`, and the output lengths.
    per_request = [k.value for k, v in zip(literal.keys, literal.values, strict=True) if isinstance(v, ast.ListComp)]
    metric_keys = {rendered(t, m, p) for t in metric_key_templates(benchmark)
                   for m in METRICS for p in default_percentiles(tree)}
    return {"header": header_keys(main_async), "result": keys, "per_request": [*per_request, "output_lens"],
            "metrics": processed_metrics(benchmark), "metric_keys": metric_keys}


def test_vllm_source_parses_into_a_layout(vllm_layout):
    # Guards the parsing itself: a vLLM that moved these would make the next test vacuous.
    assert {"date", "backend", "model_id", "request_rate", "max_concurrency"} <= vllm_layout["header"]
    assert vllm_layout["result"][0] == "duration" and "itls" in vllm_layout["per_request"]
    assert "output_lens" in vllm_layout["result"]
    assert {"mean_ttft_ms", "median_itl_ms", "std_e2el_ms", "p99_tpot_ms"} <= vllm_layout["metric_keys"]


def test_every_key_vllm_writes_is_there(vllm_layout):
    result = series(two_ranks())
    assert vllm_layout["header"] <= result.keys(), vllm_layout["header"] - result.keys()
    assert set(vllm_layout["result"]) <= result.keys(), set(vllm_layout["result"]) - result.keys()
    assert set(METRICS) <= vllm_layout["metrics"], "vllm no longer processes one of " + ", ".join(METRICS)
    assert vllm_layout["metric_keys"] <= result.keys(), vllm_layout["metric_keys"] - result.keys()
    lengths = {key: len(result[key]) for key in vllm_layout["per_request"]}
    assert set(lengths.values()) == {result["num_prompts"]} == {8}, lengths


def test_a_closed_loop_has_vllm_s_concurrency_keys_too(vllm_layout):
    users = [replace(r, load_kind="users", arrival="closed") for r in two_ranks()]
    result = series(users)
    assert vllm_layout["metric_keys"] <= result.keys()
    assert "mean_client_queue_time_ms" in result and "client_queue_time" in vllm_layout["metrics"]


# ------------------------------------------------------------------ values


def test_pooled_counts_throughput_and_arrays():
    result = series(two_ranks())
    # duration: 2 ranks x one 10 s window, over the 2 ranks; 6 of 8 counted requests finished
    assert result["duration"] == pytest.approx(10.0)
    assert (result["completed"], result["failed"]) == (6, 2)
    assert result["request_throughput"] == pytest.approx(0.6)
    assert result["total_output_tokens"] == 3 * 3 + 2 + 2 + 1
    assert result["total_input_tokens"] == 6 * 128
    assert result["output_throughput"] == pytest.approx(14 / 10)
    assert result["total_token_throughput"] == pytest.approx((14 + 6 * 128) / 10)
    # rank 0's window first, each window's finished requests then its unfinished ones
    assert result["errors"] == ["", "", "", "HTTP 503", "", "", "", UNFINISHED]
    assert result["output_lens"] == [3, 3, 3, 0, 2, 2, 1, 0]
    assert result["ttfts"] == pytest.approx([0.2, 0.4, 0.1, 0.0, 0.3, 0.2, 0.4, 0.0])
    assert result["latencies"] == pytest.approx([0.5, 0.6, 0.5, 0.0, 0.5, 0.3, 0.4, 0.0])
    assert result["start_times"] == [5.0, 6.0, 7.0, 0.0, 5.0, 8.0, 9.0, 0.0]
    assert result["queue_times"] == pytest.approx([0.01] * 3 + [0.0] + [0.01] * 3 + [0.0])
    expected_itls = [[0.1, 0.2], [0.1, 0.1], [0.3, 0.1], [], [0.2], [0.1], [], []]
    assert [len(i) for i in result["itls"]] == [len(i) for i in expected_itls]
    for got, want in zip(result["itls"], expected_itls, strict=True):
        assert got == pytest.approx(want)
    assert result["generated_texts"] == [""] * 8 and result["rtfx"] == 0.0


def test_header_of_a_rate_series():
    result = series(two_ranks())
    assert result["request_rate"] == 4.0           # 2 req/s per rank x 2 ranks
    assert result["max_concurrency"] is None and "mean_client_queue_time_ms" not in result
    assert (result["backend"], result["endpoint_type"], result["label"]) == ("vllm", "vllm", "vllm")
    assert result["model_id"] == result["tokenizer_id"] == "org/Tiny-Model"
    assert result["num_prompts"] == 8 and result["date"] == "20250101-000000"
    assert result["burstiness"] == 1.0
    extras = result["vcfslm"]
    assert (extras["run_id"], extras["ranks"], extras["load"], extras["scope"]) == ("r1", 2, 2.0, "ranks")


def test_statistics_match_vllm_s_numpy_definitions():
    result = series(two_ranks())
    ttfts = [0.2, 0.4, 0.1, 0.3, 0.2, 0.4]
    tpots = [0.15, 0.1, 0.2, 0.2, 0.1]               # the one-token request has no TPOT
    itls = [0.1, 0.2, 0.1, 0.1, 0.3, 0.1, 0.2, 0.1]
    e2els = [0.5, 0.6, 0.5, 0.5, 0.3, 0.4]
    # by hand, for TTFT: sorted 0.1 0.2 0.2 0.3 0.4 0.4; p99 at position 4.95
    assert result["mean_ttft_ms"] == pytest.approx(1600 / 6)
    assert result["median_ttft_ms"] == pytest.approx(250.0)
    assert result["p99_ttft_ms"] == pytest.approx(400.0)
    assert result["mean_itl_ms"] == pytest.approx(150.0)
    assert result["p99_e2el_ms"] == pytest.approx(595.0)   # 0.5 + 0.95 x 0.1 s
    for name, values in {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}.items():
        assert result[f"mean_{name}_ms"] == pytest.approx(np.mean(values) * 1000)
        assert result[f"median_{name}_ms"] == pytest.approx(np.median(values) * 1000)
        assert result[f"std_{name}_ms"] == pytest.approx(np.std(values) * 1000)
        assert result[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99) * 1000)


def test_goodput_is_the_first_slo_s_unless_one_is_named():
    records = two_ranks()
    # A: 0.2 and 0.1 req/s over each 10 s span: 3 good requests over the 10 s duration
    assert series(records)["request_goodput"] == pytest.approx(0.3)
    assert series(records, slo="B")["request_goodput"] == pytest.approx(0.6)
    assert series(records, slo="nothing-judged")["request_goodput"] is None
    assert series([replace(r, goodput={}) for r in records])["request_goodput"] is None
    assert series(records)["vcfslm"]["goodput"] == pytest.approx({"A": 0.3, "B": 0.6})


def test_peak_rates_overlay_the_ranks_windows():
    result = series(two_ranks())
    # second 0 after the first arrival (5.0): 3 tokens of rank 0 and 2 of rank 1; two requests
    assert result["max_output_tokens_per_s"] == 5.0
    assert result["max_concurrent_requests"] == 2


def test_windows_pool_into_one_duration():
    later = [replace(r, window=1) for r in two_ranks()]
    result = series(two_ranks() + later)
    assert result["duration"] == pytest.approx(20.0)          # 2 windows x 10 s, one rank's
    assert result["request_throughput"] == pytest.approx(12 / 20)
    assert result["num_prompts"] == 16


def test_a_closed_loop_is_an_unlimited_rate_under_a_concurrency_cap():
    users = [replace(r, load_kind="users", arrival="closed") for r in two_ranks()]
    result = series(users)
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 4     # 2 users x 2 ranks
    assert result["mean_client_queue_time_ms"] == pytest.approx(10.0)


def test_the_in_process_engine_has_no_inter_token_latencies():
    record = serve_record(requests=2, ttft=0.5, tpot=100.0, out=11, unfinished=1)
    result = series([record])
    assert result["itls"] == [[], [], []]
    assert result["mean_itl_ms"] == 0.0 and result["p99_itl_ms"] == 0.0       # vllm's `or 0`
    assert result["mean_tpot_ms"] == pytest.approx(100.0)
    assert result["queue_times"] == [0.0, 0.0, 0.0]
    assert (result["backend"], result["label"]) == ("openai", "vcfslm")
    assert result["errors"] == ["", "", UNFINISHED]
    # 11 tokens spread over 1 s from the first at 5.5 s: 5 in second 0, 6 in second 1
    assert result["max_output_tokens_per_s"] == 6.0


def test_only_valid_windows_count_and_each_series_is_its_own():
    bad = replace(two_ranks()[0], valid=False, window=1)
    other_load = [replace(r, load=4.0) for r in two_ranks()]
    results = vllm_results([*two_ranks(), bad, *other_load], model="org/Tiny-Model")
    assert sorted(results) == ["vllm-4.0qps-Tiny-Model.json", "vllm-8.0qps-Tiny-Model.json"]
    assert results["vllm-4.0qps-Tiny-Model.json"]["num_prompts"] == 8         # not the invalid window's
    assert results["vllm-8.0qps-Tiny-Model.json"]["vcfslm"]["load"] == 4.0


def test_series_at_one_load_get_distinct_safe_names():
    longer = [replace(r, input_tokens=512) for r in two_ranks()]
    names = sorted(vllm_results([*two_ranks(), *longer], model="synthetic:tiny/"))
    assert names == ["vllm-4.0qps-synthetic_tiny-in128-out3.json", "vllm-4.0qps-synthetic_tiny-in512-out3.json"]
    twin = [replace(r, endpoint="http://a:1") for r in two_ranks()]
    twins = sorted(vllm_results([*two_ranks(), *[replace(r, endpoint="http://b:1") for r in twin]],
                                model="m"))
    assert len(twins) == 2 and len(set(twins)) == 2


# ------------------------------------------------------------------ files


def test_write_vllm_results_writes_json_that_reads_back_and_rewrites_in_place(tmp_path):
    def judged(record):
        return replace(record, goodput={"A": 0.5, "B": 0.7})

    run = make_serve_run(tmp_path / "run", "run-1", ["vm1"], {(1.0, 128): (0.5, 100.0, 2.0),
                                                              (2.0, 128): (0.6, 110.0, 3.0)},
                         ranks=2, slos={"B": {"tpot_ms": 200.0, "ttft_s": 5.0}}, tweak=judged)
    paths = write_vllm_results(run)
    assert [p.name for p in paths] == ["vcfslm-2.0qps-synthetic_tiny.json", "vcfslm-4.0qps-synthetic_tiny.json"]
    assert all(p.parent == run / VLLM_RESULTS for p in paths)
    loaded = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    assert [d["completed"] for d in loaded] == [20, 20]
    assert loaded[0]["date"] == "20250101-000000" and loaded[0]["vcfslm"]["run_id"] == "run-1"
    assert loaded[0]["request_goodput"] == pytest.approx(0.7 * 2)      # the run's first SLO, B, both ranks'
    assert loaded[0]["duration"] == pytest.approx(10.0)
    first = paths[0].read_text(encoding="utf-8")
    again = write_vllm_results(run)
    assert again == paths and sorted((run / VLLM_RESULTS).iterdir()) == sorted(paths)
    assert paths[0].read_text(encoding="utf-8") == first
    assert not list((run / VLLM_RESULTS).glob(".*"))                   # no temporary file left
