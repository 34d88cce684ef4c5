"""The run-file schema on read: each field's check, from the dataclass annotations, and the readers."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
from test_analysis_support import make_run, record

from vcfslm.errors import RunFolderError
from vcfslm.results import (
    MAX_PROBLEMS,
    RunFile,
    RunMeta,
    SchemaError,
    WindowRecord,
    load_run,
    meta_findings,
    read_records,
    read_run,
    record_findings,
    write_records,
)


def good() -> dict:
    return json.loads(record().to_json())


def findings(**changes) -> list[tuple[str, str]]:
    return record_findings({**good(), **changes})


def test_a_written_record_is_good_and_reads_back_equal():
    r = record(roofline=1.5)
    assert record_findings(json.loads(r.to_json())) == []
    assert WindowRecord.from_dict(json.loads(r.to_json())) == r


@pytest.mark.parametrize(("changes", "expected"), [
    ({"rank": True}, [("rank", "expected an integer, got bool")]),
    ({"rank": 1.0}, [("rank", "expected an integer, got float")]),
    ({"rank": -1}, [("rank", "must not be negative, got -1")]),
    ({"input_tokens": 0}, [("input_tokens", "must be at least 1, got 0")]),
    ({"wall_s": "10"}, [("wall_s", "expected a number, got str")]),
    ({"wall_s": False}, [("wall_s", "expected a number, got bool")]),
    ({"wall_s": math.inf}, [("wall_s", "expected a finite number, got inf")]),
    ({"start_skew_s": -0.5}, [("start_skew_s", "must not be negative, got -0.5")]),
    ({"tpot_ms": 100.0}, [("tpot_ms", "expected a list of numbers, got float")]),
    ({"tpot_ms": [1, None, math.nan]}, [("tpot_ms[1]", "expected a number, got null"),
                                        ("tpot_ms[2]", "expected a finite number, got nan")]),
    ({"invalid_reasons": ["ok", 3]}, [("invalid_reasons[1]", "expected a string, got int")]),
    ({"valid": 1}, [("valid", "expected true or false, got int")]),
    ({"node": None}, [("node", "expected a string, got null")]),
    ({"placement": []}, [("placement", "expected an object, got list")]),
    ({"roofline_tpot_ms": "fast"}, [("roofline_tpot_ms", "expected a number, got str")]),
    ({"schema": 0}, [("schema", "must be at least 1, got 0")]),
    ({"schema": 9}, [("schema", "version 9 is newer than this vcfslm reads (up to 1): upgrade vcfslm")]),
])
def test_each_field_is_checked_by_its_annotation(changes, expected):
    assert findings(**changes) == expected


def test_what_the_schema_allows():
    assert findings(wall_s=10, ttft_s=[0, 1], rank_tps=0) == []         # an int is a number
    assert findings(roofline_tpot_ms=None, roofline_ttft_s=None) == []   # optional
    assert findings(something_new={"a": 1}) == []                        # newer writers add keys
    data = good()
    del data["schema"], data["valid"], data["placement"]                 # defaults
    assert record_findings(data) == []


def test_tpot_may_be_nan_only_for_a_single_output_token():
    assert findings(output_tokens=1, tpot_ms=[math.nan]) == []
    assert findings(output_tokens=2, tpot_ms=[math.nan]) == [("tpot_ms[0]", "expected a finite number, got nan")]


def test_missing_fields_and_non_objects():
    data = good()
    del data["run_id"], data["ttft_s"]
    assert record_findings(data) == [("run_id", "required field missing"), ("ttft_s", "required field missing")]
    assert record_findings([1]) == [("", "expected a JSON object, got list")]


def test_from_dict_raises_a_value_error_listing_every_finding():
    with pytest.raises(SchemaError) as err:
        WindowRecord.from_dict({**good(), "rank": "0", "tpot_ms": "1"})
    assert isinstance(err.value, ValueError)
    assert err.value.findings == [("rank", "expected an integer, got str"),
                                  ("tpot_ms", "expected a list of numbers, got str")]
    assert str(err.value) == "rank: expected an integer, got str; tpot_ms: expected a list of numbers, got str"


def meta_dict(**changes) -> dict:
    meta = RunMeta(run_id="r", created="2025", command=["vcfslm"], mode="local", nodes=["vm1"], ranks_per_node=4,
                   threads_per_rank=24, model="m", matrix={"batch_sizes": [1, 4], "input_tokens": 128,
                                                           "output_tokens": 64, "repeats": 3, "scenarios": None})
    return {**asdict(meta), **changes}


def test_meta_fields_and_the_matrix_the_analysis_reads():
    assert meta_findings(meta_dict()) == []
    assert RunMeta.from_dict(meta_dict(unknown=1)).run_id == "r"
    assert meta_findings(meta_dict(nodes="vm1", threads_per_rank=0, label=3)) == [
        ("nodes", "expected a list of strings, got str"), ("threads_per_rank", "must be at least 1, got 0"),
        ("label", "expected a string, got int")]
    matrix = {"batch_sizes": "1,4", "input_tokens": [128, -1], "output_tokens": 2.5, "warmup": -1,
              "repeats": 0, "scenarios": 7}
    assert meta_findings(meta_dict(matrix=matrix)) == [
        ("matrix.batch_sizes", "expected an integer or a list of integers, got str"),
        ("matrix.input_tokens[1]", "must be at least 1, got -1"),
        ("matrix.output_tokens", "expected an integer or a list of integers, got float"),
        ("matrix.warmup", "must not be negative, got -1"),
        ("matrix.repeats", "must be at least 1, got 0"),
        ("matrix.scenarios", "expected a string, got int")]
    with pytest.raises(SchemaError, match="ranks_per_node: expected an integer, got str"):
        RunMeta.from_dict(meta_dict(ranks_per_node="four"))


def test_read_records_reports_problems_per_line_and_caps_them(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps({**good(), "rank": str(i)}) for i in range(MAX_PROBLEMS + 3)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RunFolderError) as err:
        read_records(path)
    shown = [str(p) for p in err.value.problems]
    assert shown[0] == f"{path}:1: rank: expected an integer, got str"
    assert len(shown) == MAX_PROBLEMS + 1 and shown[-1] == f"... and 3 more problem(s) in {path}"
    assert err.value.exit_code == 2


def test_read_records_skips_a_torn_last_line_and_says_so(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, [record(window=0), record(window=1)])
    path.write_text(path.read_text() + "\n\n" + record(window=2).to_json()[:30])
    warnings: list[str] = []
    assert [r.window for r in read_records(path, warnings)] == [0, 1]
    assert warnings == [f"{path}:5: torn last line skipped (no newline at the end and not valid JSON: its "
                        "writer was stopped mid-line)"]
    assert len(read_records(path)) == 2                  # without a list to tell, it is skipped quietly
    path.write_text(path.read_text() + "\n")             # with its newline it is a broken line
    with pytest.raises(RunFolderError, match=r"r.jsonl:5:\d+: not valid JSON"):
        read_records(path)


def test_a_last_line_without_newline_that_is_json_still_counts(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(record(window=0).to_json() + "\r\n" + record(window=1).to_json())
    assert [r.window for r in read_records(path)] == [0, 1]


def test_read_records_on_unreadable_files(tmp_path):
    with pytest.raises(RunFolderError, match="nope.jsonl: does not exist"):
        read_records(tmp_path / "nope.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(RunFolderError, match=r"bin.jsonl: not UTF-8 text \(byte 0\)"):
        read_records(tmp_path / "bin.jsonl")


def test_load_run_allows_a_run_without_records_read_run_does_not(tmp_path):
    run = make_run(tmp_path / "r", "r", ["vm1"], {(1, 128): (0.1, 100.0, 10.0)})
    (run / "results.jsonl").write_text("")
    meta, recs = load_run(run)                            # a crashed run that --resume picks up
    assert meta.run_id == "r" and recs == []
    with pytest.raises(RunFolderError, match="no records: .*results.jsonl is empty"):
        read_run(run)


def test_a_run_file_unpacks_as_meta_and_records_and_carries_warnings(tmp_path):
    run = make_run(tmp_path / "r", "r", ["vm1"], {(1, 128): (0.1, 100.0, 10.0)})
    path = run / "results.jsonl"
    path.write_text(path.read_text() + "{")
    loaded = read_run(run)
    assert isinstance(loaded, RunFile) and loaded.sources == [path] and len(loaded.warnings) == 1
    meta, recs = loaded
    assert meta is loaded.meta and len(recs) == 4
    warnings: list[str] = []
    load_run(run, warnings)
    assert warnings == loaded.warnings


def test_meta_problems_name_the_line_of_their_key(tmp_path):
    run = make_run(tmp_path / "r", "r", ["vm1", "vm2"], {(1, 128): (0.1, 100.0, 10.0)})
    path = run / "meta.json"
    meta = json.loads(path.read_text())
    meta["nodes"] = ["vm1", 2]
    meta["guests"]["vm1"]["nodes"] = "a nested key of the same name, earlier in the file"
    path.write_text(json.dumps(meta, indent=2, sort_keys=True))
    top = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith('  "nodes"'))
    with pytest.raises(RunFolderError) as err:
        read_run(run)
    assert [str(p) for p in err.value.problems] == [f"{path}:{top}: nodes[1]: expected a string, got int"]


def test_rank_numerics_load_rank_wide_from_old_runs_and_per_graph_from_new_ones():
    from vcfslm.results.runs import rank_summaries

    old = {"passed": True, "steps": 8, "batch": 1, "max_abs_diff": 0.1, "max_rel_diff": 0.01,
           "top1_agreement": 1.0, "rtol": 0.15, "min_top1": 0.75, "reason": "", "greedy": None}
    new = {"passed": False, "failed": ["static 4x128"], "greedy": None, "graphs": [
        {"graph": "static 1x128", "passed": True, "reason": "", "compiled": old, "reference": old},
        {"graph": "static 4x128", "passed": False, "reason": "against eager: top-1 agreement 0.50 < 0.75",
         "compiled": {**old, "passed": False}, "reference": None}]}
    ranks = rank_summaries([{"rank": 0, "numerics": old}, {"rank": 1, "numerics": new}])
    assert meta_findings(meta_dict(ranks=ranks)) == []
    meta = RunMeta.from_dict(meta_dict(ranks=ranks))
    assert meta.ranks["0"]["numerics"]["passed"] and meta.ranks["1"]["numerics"]["failed"] == ["static 4x128"]
