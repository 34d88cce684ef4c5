"""Window records of run dirs -> per-scope cells: pooling, spread, validity flags."""

from __future__ import annotations

import math

import pytest
from test_analysis_support import make_run, record

from vcfslm.analysis.cells import CLUSTER, SINGLE, CellKey, aggregate, cell_from_records, load_runs
from vcfslm.errors import RunFolderError
from vcfslm.results import load_run

TABLE = {(1, 128): (0.1, 100.0, 10.0), (4, 128): (0.4, 120.0, 33.0)}


def analyse(*dirs):
    return aggregate(load_runs(dirs))


def test_scope_from_node_count_and_streams(tmp_path):
    a = analyse(make_run(tmp_path / "s", "s", ["vm1"], TABLE),
                make_run(tmp_path / "c", "c", ["vm1", "vm2", "vm3", "vm4"], TABLE))
    assert a.scopes() == [SINGLE, CLUSTER]
    single = {c.batch_per_rank: c for c in a.scope_cells(SINGLE)}
    cluster = {c.batch_per_rank: c for c in a.scope_cells(CLUSTER)}
    assert (single[4].streams_per_vm, single[4].streams_cluster, single[4].vms) == (16, 16, 1)
    assert (cluster[4].streams_per_vm, cluster[4].streams_cluster, cluster[4].vms) == (16, 64, 4)
    assert cluster[1].ranks_measured == 16 and cluster[1].windows == 16
    assert not a.warnings


def test_percentiles_pool_streams_of_every_rank_and_window():
    # 4 ranks x 2 windows, one stream each: TPOT 100..107 ms; rank t/s 10..17.
    recs = [record(local_rank=r, window=w, tpot=100.0 + 4 * w + r, ttft=0.1 * (1 + r), tps=10.0 + 4 * w + r)
            for w in range(2) for r in range(4)]
    c = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), recs)
    assert c.tpot_ms.p50 == pytest.approx(103.5)
    assert c.tpot_ms.p90 == pytest.approx(106.3)
    assert c.ttft_s.p50 == pytest.approx(0.25)
    assert c.rank_tps == pytest.approx(13.5)
    # per repeat: mean rank t/s across ranks (11.5, 15.5), p50 TPOT (101.5, 105.5)
    assert c.rank_tps_repeats == pytest.approx((11.5, 15.5))
    assert c.tpot_repeats == pytest.approx((101.5, 105.5))
    assert c.rank_tps_spread == pytest.approx((11.5, 15.5)) and c.repeats == 2
    assert c.per_user_tps() == pytest.approx(1000 / 103.5)
    assert not c.flags


def test_roofline_efficiency():
    c = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), [record(tpot=125.0, roofline=100.0)])
    assert c.roofline_efficiency == pytest.approx(0.8)
    assert cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), [record()]).roofline_efficiency is None


def test_ttft_efficiency_is_the_p50_prefill_floor_of_valid_windows_over_measured_ttft():
    key = CellKey(SINGLE, 1, 4, 1, 128, 64)
    recs = [record(window=0, ttft=0.5, roofline_ttft=0.30), record(window=1, ttft=0.5, roofline_ttft=0.40),
            record(window=2, ttft=0.5, roofline_ttft=0.35),
            record(window=3, ttft=9.0, roofline_ttft=9.0, valid=False, reasons=("recompiled",))]
    c = cell_from_records(key, recs)
    assert c.roofline_ttft_s == pytest.approx(0.35) and c.ttft_efficiency == pytest.approx(0.7)
    old = cell_from_records(key, [record(ttft=0.5, roofline=100.0)])     # a run from before the compute probe
    assert old.roofline_ttft_s is None and old.ttft_efficiency is None and old.roofline_efficiency is not None


def test_a_failed_numerics_gate_names_the_node_and_rank_once(tmp_path):
    def gate(r):
        if r.node == "vm2" and r.local_rank == 1:
            r.valid, r.invalid_reasons = False, ["numerics gate: top-1 agreement 0.62 < 0.99"]
        return r
    a = analyse(make_run(tmp_path / "c", "c", ["vm1", "vm2"], TABLE, tweak=gate))
    assert a.warnings[0] == ("run c: numerics gate failed on node vm2, rank 5 (local rank 1): top-1 agreement "
                             "0.62 < 0.99; its 2 window(s) are left out of every number")
    assert sum("top-1 agreement" in w for w in a.warnings) == 1
    cell = a.scope_cells(CLUSTER)[0]
    assert "1 invalid window(s) left out (numerics gate failed on vm2 rank 5)" in cell.flags
    # Said once, per rank: the cells it voids do not each repeat it among the warnings.
    assert len(a.warnings) == 1


def test_a_cell_with_other_invalid_windows_still_warns_beside_the_gate(tmp_path):
    def gate(r):
        if r.local_rank == 1:
            r.valid, r.invalid_reasons = False, ["numerics gate: logits differ"]
        elif r.local_rank == 2 and r.batch_per_rank == 4:
            r.valid, r.invalid_reasons = False, ["recompiled"]
        return r
    a = analyse(make_run(tmp_path / "s", "s", ["vm1"], TABLE, tweak=gate))
    assert a.warnings == [
        "run s: numerics gate failed on node vm1, rank 1 (local rank 1): logits differ; its 2 window(s) are left "
        "out of every number",
        "single VM (1 VM x 4 ranks) input 128 / output 64, batch 4/rank: 2 invalid window(s) left out "
        "(recompiled; numerics gate failed on vm1 rank 1)"]


def test_invalid_windows_are_left_out_and_flagged():
    recs = [record(window=0, tpot=100.0), record(window=1, tpot=900.0, valid=False, reasons=("recompiled",),
                                                 recompiles=2)]
    c = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), recs)
    assert c.tpot_ms.p50 == 100.0 and c.invalid_windows == 1 and c.recompiles == 2
    assert any("1 invalid window(s) left out (recompiled)" in f for f in c.flags)
    # The invalid-window flag already says why; the recompiles are not flagged a second time.
    assert not any("recompiles inside" in f for f in c.flags)


def test_a_window_counted_valid_that_recompiled_is_flagged_once():
    recs = [record(window=0, tpot=100.0, recompiles=3), record(window=1, tpot=100.0)]
    c = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), recs)
    assert c.invalid_windows == 0 and c.recompiles == 3
    assert list(c.flags) == ["recompiles inside 1 window(s) counted as valid"]


def test_a_cell_without_valid_windows_has_no_numbers():
    c = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), [record(valid=False)])
    assert not c.has_data and math.isnan(c.tpot_ms.p50)
    assert "no valid window: no numbers" in c.flags


def test_start_skew_is_flagged_relative_to_the_window():
    small = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), [record(skew=0.04, wall=10.0)])
    assert not small.flags
    late = cell_from_records(CellKey(SINGLE, 1, 4, 1, 128, 64), [record(skew=0.8, wall=10.0)])
    assert any("start skew up to 0.800 s" in f for f in late.flags)


def test_incomplete_and_missing_scenarios(tmp_path):
    # repeats=2 asked; the batch-4 scenario has only window 0, the batch-1 scenario is missing entirely.
    def drop(r):
        if r.batch_per_rank == 1 or r.window == 1:
            return None
        return r
    run = make_run(tmp_path / "r", "r", ["vm1"], TABLE, repeats=2, complete=False, tweak=drop)
    a = analyse(run)
    cells = {c.batch_per_rank: c for c in a.cells}
    assert not cells[1].has_data and "no windows recorded (scenario missing)" in cells[1].flags
    assert "incomplete: 4 of 8 windows recorded" in cells[4].flags
    text = "\n".join(a.warnings)
    assert "run r is not complete" in text and "batch 4/rank: incomplete" in text


def test_runs_of_the_same_scope_pool_as_repeats(tmp_path):
    a = analyse(make_run(tmp_path / "a", "a", ["vm1"], {(1, 128): (0.1, 100.0, 10.0)}),
                make_run(tmp_path / "b", "b", ["vm1"], {(1, 128): (0.1, 110.0, 9.0)}))
    (cell,) = a.cells
    assert cell.repeats == 2 and cell.rank_tps_spread == (9.0, 10.0) and cell.source == "a, b"
    assert cell.expected_windows == 8 and not cell.flags


def test_load_runs_reports_every_bad_dir(tmp_path):
    good = make_run(tmp_path / "good", "good", ["vm1"], TABLE)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text("{not json")
    with pytest.raises(RunFolderError) as err:
        load_runs([good, tmp_path / "missing", broken])
    assert str(err.value).splitlines() == [
        f"{tmp_path / 'missing'}: does not exist: not a run folder",
        f"{broken / 'meta.json'}:1:2: not valid JSON: Expecting property name enclosed in double quotes"]
    assert load_run(good)[0].run_id == "good"


def test_an_eager_run_is_labelled_a_baseline_and_a_compiled_one_is_not(tmp_path):
    def eager(r):
        r.placement = {**r.placement, "compile_mode": "eager"}
        return r
    a = analyse(make_run(tmp_path / "e", "e", ["vm1"], TABLE, tweak=eager))
    assert a.warnings == ["run e ran the decode step in eager mode: a baseline, not a measurement mode (ops "
                          "between the linears run unfused, so TPOT carries per-op overhead); measure with "
                          "bench.compile: compile"]

    def compiled(r):
        r.placement = {**r.placement, "compile_mode": "compile"}
        return r
    assert analyse(make_run(tmp_path / "c", "c", ["vm1"], TABLE, tweak=compiled)).warnings == []
