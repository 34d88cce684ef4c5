"""analysis/endpoint.py and its place in the report: the scale-out curve through one endpoint
(threshold at N nodes, N × one node's, the efficiency and its interval), sizing on that
curve, and the faults table, on synthetic endpoint runs with known latencies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_analysis_support import make_serve_run

from vcfslm.analysis.cells import aggregate, load_runs
from vcfslm.analysis.endpoint import (
    ScaleRow,
    curve_interval,
    curve_nodes,
    server_shares,
    shares_text,
)
from vcfslm.analysis.report import ReportOptions, write_report
from vcfslm.analysis.serve import analyse
from vcfslm.analysis.serve_tables import fault_table, scale_out_table
from vcfslm.analysis.slo_spec import DEFAULT_SLOS
from vcfslm.serving.judging import Interval

SLO_A, SLO_B = DEFAULT_SLOS            # A: TPOT <= 130 ms, TTFT <= 3 s; B: TPOT <= 200 ms, TTFT <= 5 s
MET, MISSED = (0.5, 100.0), (6.0, 400.0)
SERVERS = ["http://10.0.0.1:8200", "http://10.0.0.1:8201", "http://10.0.0.2:8200", "http://10.0.0.2:8201"]


def endpoint_run(tmp_path, run_id, nodes, passing, failing, busy=3.0, fault=None, model="models/phi",
                 fault_every=False):
    """A run through one endpoint with `nodes` behind it: every request meets both SLOs at the
    loads up to `passing` (the deployment's req/s) and misses both from `failing`; `fault` in
    the window at `passing` (in every window with `fault_every`)."""
    table = {(float(load), 128): (*(MET if load <= passing else MISSED), busy * load / passing)
             for load in sorted({passing / 2, passing, failing})}
    servers = SERVERS[:2 * nodes]

    def as_endpoint(r):
        r.node, r.nodes, r.endpoint, r.endpoint_nodes = "endpoint", nodes, "http://10.0.0.1:8000", nodes
        r.server, r.endpoint_servers = "vllm", list(servers)
        r.server_requests = {u: r.completed // len(servers) + (i < r.completed % len(servers))
                             for i, u in enumerate(servers)}
        r.window_finished = r.completed
        if fault is not None and (fault_every or r.load == passing):
            r.fault = fault
        return r

    return make_serve_run(tmp_path / run_id, run_id, ["endpoint"], table, ranks=1, requests=40,
                          tweak=as_endpoint, model=model)


@pytest.fixture
def curve_runs(tmp_path):
    return [endpoint_run(tmp_path, "one", 1, 4.0, 8.0), endpoint_run(tmp_path, "two", 2, 7.0, 14.0)]


def analysed(runs, peaks=(256,), headroom=0.0):
    loaded = load_runs(runs)
    return analyse(loaded, DEFAULT_SLOS, aggregate(loaded).cells, peaks, headroom)


def test_endpoint_series_are_per_deployment_and_split_per_node(curve_runs):
    got = analysed(curve_runs)
    two = [p for p in got.points if p.key.endpoint_nodes == 2]
    assert {p.key.scope for p in two} == {"cluster"} and two[0].key.ranks_per_vm == 2
    p = next(p for p in two if p.load == 7.0)
    assert p.load_per_vm == 3.5 and p.streams_per_vm == pytest.approx(1.5)     # a share of 2 nodes


def test_the_curve_reads_each_node_count_beside_n_times_one(curve_runs):
    got = analysed(curve_runs)
    (curve,) = [c for c in got.scale_outs if c.slo == SLO_B]
    one, two = curve.rows
    assert (one.nodes, one.measured, one.ideal, one.efficiency) == (1, 4.0, 4.0, 1.0)
    assert (two.nodes, two.measured, two.ideal) == (2, 7.0, 8.0)
    assert two.efficiency == pytest.approx(0.875)
    # Every request alike: each threshold's interval is [passing–<failing]; the efficiency's pairs them.
    iv = two.efficiency_interval
    assert (iv.low, iv.high) == (pytest.approx(7.0 / (2 * 8.0)), pytest.approx(14.0 / (2 * 4.0)))
    assert two.efficiency_text == "0.88 [0.44–1.75]"
    assert two.split() == {u: 0.25 for u in SERVERS}
    table = scale_out_table(got.scale_outs)
    assert table.title.startswith("Scale-out under serving")
    row = next(r for r in table.rows if r[0] == "SLO-B" and r[2] == "2")
    assert row[3].startswith("7 ") and row[4] == "8" and row[5] == "0.88 [0.44–1.75]"
    assert row[-1] == "4 servers, 25–25 %"


def test_sizing_reads_the_curve_and_says_so(curve_runs):
    got = analysed(curve_runs, peaks=(12,))
    t = next(t for t in got.primaries if t.slo == SLO_B)
    assert t.key.endpoint_nodes == 1                           # the single-node series answers
    s = next(s for s in got.sizings if s.threshold is t)
    # Streams at the threshold: 3 busy at 1 node, 2 x 1.5 at 2; 12 streams go past both, at 1.5 per node.
    assert s.curve and s.nodes_by_streams == 8
    assert "sized on the cluster curve measured through one endpoint" in s.reasoning
    assert "the efficiency measured at 2 nodes kept" in s.reasoning
    by_rate = got.size_for(t, peak_rps=6.0)
    assert by_rate.nodes_by_rate == 2 and "2 nodes carry 7" in by_rate.reasoning
    assert got.size_for(t, peak_rps=3.0).nodes_by_rate == 1


def test_without_a_curve_sizing_stays_per_vm(tmp_path):
    got = analysed([endpoint_run(tmp_path, "one", 1, 4.0, 8.0)])
    assert got.scale_outs == [] and all(not s.curve for s in got.sizings)


def test_a_curve_without_one_node_has_no_efficiency(tmp_path):
    got = analysed([endpoint_run(tmp_path, "two", 2, 7.0, 14.0)])
    (row,) = next(c for c in got.scale_outs if c.slo == SLO_B).rows
    assert row.ideal is None and row.efficiency_text == "–"


def test_curve_nodes_takes_the_fewest_measured_then_extrapolates():
    caps = [(1, 4.0), (2, 7.0)]
    assert curve_nodes(caps, 3.0) == (1, False)
    assert curve_nodes(caps, 6.5) == (2, False)
    assert curve_nodes(caps, 6.5, headroom=0.1) == (3, True)       # 7 x 0.9 = 6.3 falls short: past 2 nodes
    assert curve_nodes(caps, 10.0) == (3, True)                    # 3.5 per node
    assert curve_nodes([], 1.0) is None
    iv = curve_interval([(1, 4.0, 3.0, 5.0), (2, 7.0, 6.0, 8.0)], 10.0)
    assert (iv.low, iv.high) == (3, 4)                             # high ends 4/node: 3; low ends 3/node: 4


def test_the_efficiency_interval_follows_the_cautious_formula():
    def t(passing, low, high, status="threshold", high_bound=False):
        return SimpleNamespace(status=status, passing=passing, interval=Interval(low, high, False, high_bound, 500))

    row = ScaleRow(3, t(9.0, 8.0, 12.0), t(4.0, 3.0, 5.0))
    assert row.efficiency == 0.75
    iv = row.efficiency_interval
    assert iv.low == pytest.approx(8.0 / 15.0) and iv.high == pytest.approx(12.0 / 9.0)
    # Every load passed at one node: the single threshold is a floor, so the efficiency a ceiling.
    bound = ScaleRow(2, t(8.0, 7.0, 9.0), t(4.0, 4.0, 4.0, "above", True))
    assert bound.efficiency_text.startswith("≤ 1.00") and bound.efficiency_interval.low is None


def test_shares_of_the_servers_counters():
    records = [SimpleNamespace(server_requests={"a": 6, "b": 4}), SimpleNamespace(server_requests={"a": 4, "b": None})]
    assert server_shares(records) == {"a": 10 / 14, "b": 4 / 14}
    assert shares_text(server_shares(records)) == "2 servers, 29–71 %"
    assert shares_text({}) == "–"


FAULT = {"kill": "kill:slm-01/vllm-node0@8", "target": "slm-01/vllm-node0", "at_s": 8.0, "pid": 4242,
         "start_s": 8.1, "end_s": 11.6, "restart_s": 3.5, "detect_s": 0.4, "failed": 3, "failed_all": 4,
         "requests_during": 12, "requests_after": 20, "attainment_during": {"A": 0.5, "B": 0.75},
         "attainment_after": {"A": 1.0, "B": 1.0}, "errors": ["HTTP 502: Bad Gateway"]}


def test_faults_are_listed_with_their_account(tmp_path):
    got = analysed([endpoint_run(tmp_path, "f", 2, 7.0, 14.0, fault=FAULT)])
    (f,) = got.faults
    assert (f.run_id, f.nodes, f.load) == ("f", 2, 7.0)
    table = fault_table(got.faults, DEFAULT_SLOS)
    (row,) = table.rows
    assert row[4:11] == ["slm-01/vllm-node0", "8.0", "8.1", "11.6", "3.5", "0.4", "3 / 4"]
    assert row[11:] == ["50 % / 100 %", "75 % / 100 %"]
    missed = fault_table([f.__class__(**{**f.__dict__, "fault": {**FAULT, "end_s": None}})], DEFAULT_SLOS)
    assert missed.rows[0][7] == "not back"


def test_the_report_has_the_scale_out_table_and_says_where_the_nodes_come_from(curve_runs, tmp_path):
    out = write_report(curve_runs, tmp_path / "report", ReportOptions(peaks=(12,)))
    md = (out.out_dir / "report.md").read_text()
    assert "Scale-out under serving (through one endpoint)" in md
    assert "nodes on the measured cluster curve" in md
    assert "scale-out efficiency (threshold at N nodes over N × one node's) 2 nodes 0.88" in md
    assert "with 2 node(s) behind it" not in md          # no stages recorded: synthetic runs
    assert "scale_out" in (out.out_dir / "serving.json").read_text()


def test_windows_with_a_fault_are_their_own_series_and_never_the_capacity(curve_runs, tmp_path):
    faulted = endpoint_run(tmp_path, "f1", 1, 2.0, 4.0, fault=FAULT, fault_every=True)
    got = analysed([*curve_runs, faulted])
    keys = {p.key for p in got.points if p.key.endpoint_nodes == 1}
    assert {k.faulted for k in keys} == {False, True}
    assert all(not t.key.faulted for t in got.primaries)
    assert all(not r.threshold.key.faulted for c in got.scale_outs for r in c.rows)
    assert "a server killed in each window" in " ".join(t.title for t in serving_tables_of(got))
    alone = analysed([faulted])
    assert all(t.key.faulted and "threshold under faults" in t.summary() for t in alone.primaries)


def serving_tables_of(got):
    from vcfslm.analysis.report import serving_tables

    return serving_tables(got, DEFAULT_SLOS)
