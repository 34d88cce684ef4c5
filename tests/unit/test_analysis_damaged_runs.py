"""A corpus of damaged run folders through `vcfslm report`: exit 2 and file:line field: message, no traceback.

Every case starts from the same good synthetic run (8 records, one per rank x scenario)
and breaks one thing, the way a hand edit, a foreign tool or a killed writer would.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_analysis_support import make_run

from vcfslm.cli import main

TABLE = {(1, 128): (0.1, 100.0, 10.0), (4, 128): (0.4, 120.0, 33.0)}
TORN = "torn last line skipped (no newline at the end and not valid JSON: its writer was stopped mid-line)"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("corpus") / "good", "good", ["vm1"], TABLE)


@pytest.fixture
def good(pristine, tmp_path) -> Path:
    """A private copy of the good run, to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


def rewrite(run: Path, edit: Callable[[list[dict]], None]) -> None:
    recs = records(run)
    edit(recs)
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def report(*args) -> tuple[int, list[str], str]:
    r = CliRunner().invoke(main, ["report", *map(str, args)])
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    return r.exit_code, r.stderr.splitlines(), r.output


def refused(*args) -> list[str]:
    """The error lines of a report that must fail as bad input."""
    code, err, output = report(*args)
    assert code == 2, output
    assert err[0].startswith("error: ")
    return [err[0][len("error: "):], *err[1:]]


def test_the_good_run_reports(good):
    code, err, output = report(good)
    assert code == 0 and not err, output


def test_string_tpot(good):
    rewrite(good, lambda rs: rs[6].update(tpot_ms="100"))
    assert refused(good) == [f"{good}/results.jsonl:7: tpot_ms: expected a list of numbers, got str"]


def test_bool_as_int_nan_ttft_negative_tokens_and_a_missing_field_all_at_once(good):
    def edit(rs):
        rs[0]["batch_per_rank"] = True
        rs[2]["ttft_s"] = [float("nan")]            # json.dumps writes NaN
        rs[3]["generated_tokens"] = -64
        del rs[5]["wall_s"]
        rs[5]["ttft_s"] = ["0.1"]
    rewrite(good, edit)
    assert refused(good) == [
        f"{good}/results.jsonl:1: batch_per_rank: expected an integer, got bool",
        f"{good}/results.jsonl:3: ttft_s[0]: expected a finite number, got nan",
        f"{good}/results.jsonl:4: generated_tokens: must not be negative, got -64",
        f"{good}/results.jsonl:6: wall_s: required field missing",
        f"{good}/results.jsonl:6: ttft_s[0]: expected a number, got str",
    ]


def test_a_zero_batch_and_a_newer_schema(good):
    def edit(rs):
        rs[1]["batch_per_rank"] = 0
        rs[4]["schema"] = 2
    rewrite(good, edit)
    assert refused(good) == [
        f"{good}/results.jsonl:2: batch_per_rank: must be at least 1, got 0",
        f"{good}/results.jsonl:5: schema: version 2 is newer than this vcfslm reads (up to 1): upgrade vcfslm",
    ]


def test_unknown_fields_are_tolerated(good):
    rewrite(good, lambda rs: [r.update(written_by_a_newer_vcfslm={"x": 1}) for r in rs])
    code, err, output = report(good)
    assert code == 0, output


def test_many_bad_records_are_capped_with_a_count(good):
    def edit(rs):
        rs[:] = [{**rs[i % len(rs)], "window": i, "wall_s": "10"} for i in range(25)]
    rewrite(good, edit)
    lines = refused(good)
    assert lines[:2] == [f"{good}/results.jsonl:1: wall_s: expected a number, got str",
                         f"{good}/results.jsonl:2: wall_s: expected a number, got str"]
    assert len(lines) == 21 and lines[-1] == f"... and 5 more problem(s) in {good}/results.jsonl"


def test_a_torn_last_line_is_a_warning_and_the_other_records_load(good):
    path = good / "results.jsonl"
    text = path.read_text()
    last = text.splitlines()[-1]
    path.write_text(text + last[:len(last) // 2])          # a writer killed mid-line: no newline
    code, err, output = report(good)
    assert code == 0, output
    warning = f"{good}/results.jsonl:9: {TORN}"
    assert err == ["1 validity warning(s), listed in the report:", f"  ! {warning}"]
    assert warning in (good / "report.md").read_text()
    assert "incomplete" not in output                       # all 8 good records counted


def test_a_torn_middle_line_is_an_error(good):
    path = good / "results.jsonl"
    lines = path.read_text().splitlines()
    cut = lines[1][:lines[1].index('"e2e_s"')]              # '{"batch_per_rank": 1, '
    path.write_text("\n".join([lines[0], cut, *lines[2:]]) + "\n")
    assert refused(good) == [f"{good}/results.jsonl:2:{len(cut) + 1}: not valid JSON: "
                             "Expecting property name enclosed in double quotes"]


def test_a_line_that_is_not_an_object(good):
    path = good / "results.jsonl"
    path.write_text(path.read_text() + "[1, 2]\n")
    assert refused(good) == [f"{good}/results.jsonl:9: expected a JSON object, got list"]


def test_an_empty_results_file(good):
    (good / "results.jsonl").write_text("")
    assert refused(good) == [f"no records: {good}/results.jsonl is empty"]


def test_a_results_file_with_only_a_torn_line(good):
    (good / "results.jsonl").write_text('{"batch_per_rank": 1, "e2e')
    assert refused(good) == [f"no records: {good}/results.jsonl holds only a torn last line"]


def test_rank_files_are_checked_when_results_jsonl_is_absent(good):
    recs = records(good)
    (good / "results.jsonl").unlink()
    (good / "ranks").mkdir()
    (good / "ranks" / "rank-0.jsonl").write_text(json.dumps(recs[0]) + "\n")
    (good / "ranks" / "rank-1.jsonl").write_text(json.dumps({**recs[1], "rank": "1"}) + "\n")
    assert refused(good) == [f"{good}/ranks/rank-1.jsonl:1: rank: expected an integer, got str"]


def test_no_results_and_no_rank_files(good):
    (good / "results.jsonl").unlink()
    assert refused(good) == [f"no records: {good}/results.jsonl does not exist and {good}/ranks/ "
                             "holds no rank-*.jsonl"]


def test_a_missing_meta_json(good):
    (good / "meta.json").unlink()
    assert refused(good) == [f"{good}/meta.json: does not exist: not a run folder"]


def test_a_meta_json_that_is_not_json(good):
    (good / "meta.json").write_text('{"run_id": "good",\n  oops\n}\n')
    assert refused(good) == [f"{good}/meta.json:2:3: not valid JSON: Expecting property name enclosed in "
                             "double quotes"]


def test_a_meta_json_with_wrong_types(good):
    path = good / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(ranks_per_node="four", complete="yes")
    meta["matrix"]["batch_sizes"] = [1, "4"]
    del meta["model"]
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    def line(key):
        return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith(f'  "{key}"'))
    assert refused(good) == [
        f"{good}/meta.json:{line('ranks_per_node')}: ranks_per_node: expected an integer, got str",
        f"{good}/meta.json: model: required field missing",
        f"{good}/meta.json:{line('complete')}: complete: expected true or false, got str",
        f"{good}/meta.json:{line('matrix')}: matrix.batch_sizes[1]: expected an integer, got str",
    ]


def test_a_run_dir_that_does_not_exist(tmp_path):
    assert refused(tmp_path / "nope") == [f"{tmp_path / 'nope'}: does not exist: not a run folder"]


def test_every_bad_run_is_named_at_once(good, tmp_path):
    (good / "results.jsonl").write_text("")
    assert refused(good, tmp_path / "nope") == [f"no records: {good}/results.jsonl is empty",
                                                f"{tmp_path / 'nope'}: does not exist: not a run folder"]


def test_size_refuses_a_damaged_run_too(good):
    rewrite(good, lambda rs: rs[0].update(e2e_s=[1, None]))
    r = CliRunner().invoke(main, ["size", "--peak-streams", "64", "--results", str(good)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.splitlines() == [f"error: {good}/results.jsonl:1: e2e_s[1]: expected a number, got null"]


def test_a_bad_meta_json_and_bad_records_are_named_together(good):
    (good / "meta.json").write_text("[]")
    rewrite(good, lambda rs: rs[7].update(rank_tps=-1.0))
    assert refused(good) == [f"{good}/meta.json: expected a JSON object, got list",
                             f"{good}/results.jsonl:8: rank_tps: must not be negative, got -1.0"]


def test_slos_in_meta_json_that_are_not_numbers(good):
    path = good / "meta.json"
    meta = json.loads(path.read_text())
    meta["slos"] = {"gold": {"tpot_ms": "fast"}}
    path.write_text(json.dumps(meta))
    assert refused(good) == ["meta.json slos: slos.gold: limits must be numbers: {'tpot_ms': 'fast'}"]


def test_size_picks_the_latest_readable_run(good, tmp_path):
    broken = tmp_path / "zzz-broken"
    broken.mkdir()
    (broken / "meta.json").write_text('{"created": "2099"')
    r = CliRunner().invoke(main, ["size", "--peak-streams", "64", "--runs-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert f"sizing from {good} (static crossover, p90 of streams)" in r.output.splitlines()


def test_a_recorded_rule_that_no_rule_can_be(good):
    path = good / "meta.json"
    meta = json.loads(path.read_text())
    meta["matrix"]["judging"] = {"percentile": "p95"}
    meta["matrix"]["serve"] = {"loads": [1.0], "attainment": 1.5}
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.startswith('  "matrix"'))
    assert refused(good) == [
        f"{good}/meta.json:{line}: matrix.judging.percentile: expected one of p50, p90, p99, got 'p95'",
        f"{good}/meta.json:{line}: matrix.serve.attainment: expected a share between 0 and 1, got 1.5"]


def test_a_run_written_before_runs_recorded_their_rule_reads_and_is_labelled(good):
    meta = json.loads((good / "meta.json").read_text())
    assert "judging" not in meta["matrix"]
    code, _, output = report(good, "--percentile", "p50")
    assert code == 0, output
    assert ("Note: run good records no static rule (written before runs did): its cells are judged at p50 of "
            "streams.") in output
    # A run that recorded its rule is judged by it, and says nothing more.
    meta["matrix"]["judging"] = {"percentile": "p50"}
    (good / "meta.json").write_text(json.dumps(meta))
    code, _, output = report(good)
    assert code == 0 and "Judged by: static batches at p50 of streams" in output and "Note:" not in output
