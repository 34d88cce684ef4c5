"""analysis/below.py through the serving answer: when even the smallest load measured fails,
the answer says whether a single request misses the SLO (no load meets it) or the sweep did
not reach a lower load (its budget, its windows), in the reasoning, the sizing, the answer
table's note, the JSON and `vcfslm size`."""

from __future__ import annotations

import json

from click.testing import CliRunner
from test_analysis_support import make_serve_run

from vcfslm.analysis.cells import aggregate, load_runs
from vcfslm.analysis.serve import analyse
from vcfslm.analysis.serve_sizing import size
from vcfslm.analysis.serve_tables import serve_answer_table
from vcfslm.analysis.slo_spec import DEFAULT_SLOS
from vcfslm.cli import main
from vcfslm.results.records import REQUEST_LISTS

SLO_A = DEFAULT_SLOS[0]                # TPOT <= 130 ms, TTFT <= 3 s
HEAD = ("SLO-A (TPOT ≤ 130 ms, TTFT ≤ 3 s), serving requests/s (poisson, 16 slots per rank), 128-token inputs / "
        "{out} output, 90 % attainment: ")
# (load per rank, input) -> (TTFT s, TPOT ms, busy slots): 4 ranks x 10 requests per window, 1 s apart.
# Two output tokens: each request lasts 0.5 + 0.3 = 0.8 s, so none overlaps another (they ran alone).
ALONE = {(1.0, 128): (0.5, 300.0, 0.8)}
# 64 output tokens: each lasts 9 + 400 x 63 ms = 34 s, so every one overlaps the others.
SLOW = {(1.0, 128): (9.0, 400.0, 15.0), (2.0, 128): (12.0, 500.0, 16.0)}


def answer_of(run_dir):
    runs = load_runs([run_dir])
    got = analyse(runs, DEFAULT_SLOS, aggregate(runs).cells, (256,), 0.0)
    (t,) = [t for t in got.primaries if t.slo == SLO_A]
    (row,) = [r for c, r in zip(got.comparisons, serve_answer_table(got.comparisons, got.sizings).rows,
                                strict=True) if c.threshold is t]
    return t, row


def test_a_single_request_that_misses_says_no_load_meets_it(tmp_path):
    t, row = answer_of(make_serve_run(tmp_path / "a", "a", ["vm1"], ALONE, out=2))
    assert (t.status, t.threshold_text, t.binding) == ("below", "< 4", "TPOT")
    assert t.summary().startswith(
        HEAD.format(out=2) + "a single request misses TPOT, so no load meets SLO-A. Even 4 req/s/VM has attainment "
        "0 % < 90 % (40 requests; p90 TPOT 300.0 ms, p90 TTFT 0.50 s); TPOT binds. Of the 40 requests that ran "
        "alone (none other in flight), 40 missed it, and fewer requests in flight cannot do better. ")
    s = size(t, 256)
    assert s.answer_text() == "< 4 req/s/VM → not achievable: a single request misses TPOT, so no load meets SLO-A"
    assert (s.nodes, s.nodes_text()) == (None, "not achievable")
    assert s.reasoning.endswith("no node count can be read: a single request misses TPOT, so no load meets SLO-A.")
    assert t.to_dict()["below"] == {
        "kind": "alone", "note": "a single request misses TPOT, so no load meets SLO-A", "next_load_per_vm": None,
        "alone_requests": 40, "alone_met": 0, "alone_binding": "TPOT", "expected_requests_per_window": None}
    assert row[3:] == ["< 4", "4", "TPOT", "–", "–", "–", "not achievable",
                       "a single request misses TPOT, so no load meets SLO-A; few samples: 90 % attainment judged "
                       "on fewer than 50 requests at 4 (40) req/s/VM; no static-batch data among the inputs"]


def test_a_budget_that_ran_out_keeps_the_threshold_below_the_loads_measured(tmp_path):
    t, row = answer_of(make_serve_run(tmp_path / "w", "w", ["vm1"], SLOW))
    assert (t.status, t.threshold_text) == ("below", "< 4")
    assert t.summary().startswith(
        HEAD.format(out=64) + "below the smallest load tried. Even 4 req/s/VM has attainment 0 % < 90 % (40 "
        "requests; p90 TPOT 400.0 ms, p90 TTFT 9.00 s); TPOT and TTFT binds. The threshold, if any, lies below the "
        "loads measured. No request ran alone (its whole time with none other in flight). Lower loads were not "
        "measured (the sweep's steps or budget ran out, or the run did not sweep). Measure lower loads to find the "
        "threshold (2 req/s/VM next). ")
    s = size(t, 256)
    assert (s.answer_text(), s.nodes_text()) == ("< 4 req/s/VM → below range nodes", "below range")
    assert s.reasoning.endswith("no node count can be read: even the smallest load tried fails; measure lower loads "
                                "(the sweep's budget ran out before 2 req/s/VM, or it did not sweep).")
    below = t.to_dict()["below"]
    assert (below["kind"], below["next_load_per_vm"], below["alone_requests"]) == ("lower", 2.0, 0)
    assert row[-1].startswith("below the loads measured: the sweep's budget ran out before 2 req/s/VM, or it did "
                              "not sweep; few samples: ")


def test_windows_too_short_for_a_lower_load_say_so(tmp_path):
    # Two overlapping requests in ranks 0 and 1's windows, none in ranks 2 and 3's: one per window
    # at 4 req/s/VM, so 2 would leave half a request per window.
    def thin(r):
        if r.local_rank >= 2:
            for name in REQUEST_LISTS:
                setattr(r, name, [])
            r.offered = r.completed = 0
        return r

    t, row = answer_of(make_serve_run(tmp_path / "f", "f", ["vm1"], {(1.0, 128): SLOW[(1.0, 128)]}, requests=2,
                                      tweak=thin))
    assert "The threshold, if any, lies below the loads measured. No request ran alone (its whole time with none " \
           "other in flight). Lower loads were not judged: 2 req/s/VM would leave about 0.5 requests per window, " \
           "under one. Measure with longer windows to find it." in t.summary()
    below = t.to_dict()["below"]
    assert (below["kind"], below["expected_requests_per_window"]) == ("few", 0.5)
    assert row[-2:] == ["below range", "below the loads measured: windows too short to judge 2 req/s/VM: about 0.5 "
                                       "requests per window; few samples: 90 % attainment judged on fewer than 50 "
                                       "requests at 4 (4) req/s/VM; no static-batch data among the inputs"]


def test_size_prints_the_lone_request_answer_as_a_statement(tmp_path):
    run_dir = make_serve_run(tmp_path / "a", "a", ["vm1"], ALONE, out=2)
    r = CliRunner().invoke(main, ["size", "--peak-streams", "256", "--threshold", "serving", "--slo", "A",
                                  "--results", str(run_dir)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert ("answer: SLO-A, 128-token inputs, 90 % attainment: < 4 req/s/VM → not achievable: a single request "
            "misses TPOT, so no load meets SLO-A, binding TPOT") in lines
    assert "nodes: not achievable" in lines
    r = CliRunner().invoke(main, ["size", "--peak-streams", "256", "--threshold", "serving", "--slo", "A",
                                  "--results", str(run_dir), "-o", "json"])
    (answer,) = json.loads(r.output)["sizings"]
    assert (answer["status"], answer["nodes"]) == ("below", None)
    assert answer["answer"] == "< 4 req/s/VM → not achievable: a single request misses TPOT, so no load meets SLO-A"
