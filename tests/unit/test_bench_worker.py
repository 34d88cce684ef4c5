"""The worker's pure parts (and bench/rank.py's and bench/windows.py's, which every kind of
rank shares): arguments, scenario selection, resume agreement, record files."""

from __future__ import annotations

import json

import pytest

from vcfslm import results
from vcfslm.bench import rank, windows, worker
from vcfslm.contract import parse_progress
from vcfslm.matrix import Matrix
from vcfslm.runspec import ProbeSpec, RunSpec, WorkerSpec


def record(rank=0, batch=1, inp=128, out=16, window=0, **kw):
    base = dict(run_id="r", node="n", node_rank=0, rank=rank, local_rank=rank, world_size=2,
                ranks_per_node=2, nodes=1, batch_per_rank=batch, input_tokens=inp, output_tokens=out,
                window=window, start_skew_s=0.0001, wall_s=2.0, generated_tokens=batch * out,
                rank_tps=batch * out / 2.0, ttft_s=[0.5] * batch, tpot_ms=[100.0] * batch,
                e2e_s=[2.0] * batch, peak_rss_bytes=10, roofline_tpot_ms=80.0,
                placement={"cpu_affinity": "0-23", "memory_numa_node": 0})
    base.update(kw)
    return results.WindowRecord(**base)


MATRIX = Matrix((1, 4), (128, 512), 16)


def spec_file(tmp_path, matrix: str | None = None, **run) -> str:
    """A worker spec file as the launcher writes it; `matrix` replaces its matrix's JSON."""
    spec = RunSpec(run_id="r", mode="cluster", model="synthetic:tiny", matrix=MATRIX, **run)
    data = json.loads(WorkerSpec(run=spec, out="/tmp/x", model="synthetic:tiny", nodes=2).to_json())
    if matrix is not None:
        data["run"]["matrix"] = json.loads(matrix)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    return str(path)


def matrix_json(**changes) -> str:
    return json.dumps({**MATRIX.to_dict(), **changes})


def test_parse_args_contract(tmp_path):
    path = spec_file(tmp_path, scenarios="1x*", threads=3, probe=ProbeSpec(enabled=False), seed=7)
    a = worker.parse_args(["--spec", path, "--node", "n0"])
    s = a.spec
    assert (s.matrix.batch_sizes, s.matrix.input_tokens, s.matrix.output_tokens) == ((1, 4), (128, 512), 16)
    assert (s.matrix.warmup, s.matrix.repeats, a.node, s.nodes, s.run.threads, s.seed) == (1, 3, "n0", 2, 3, 7)
    assert not s.resume and not s.run.probe.enabled and s.run.scenarios == "1x*" and s.run.compile_mode == "compile"


def test_parse_args_drops_torchruns_separator_and_accepts_node_name(tmp_path):
    a = worker.parse_args(["--", "--spec", spec_file(tmp_path), "--node-name", "n0"])
    assert a.node == "n0"


@pytest.mark.parametrize("bad", [matrix_json(output_tokens=1), matrix_json(batch_sizes=[1, "x"]),
                                 matrix_json(batch_sizes=[0]), matrix_json(repeats=0), '"1,4"',
                                 json.dumps({k: v for k, v in MATRIX.to_dict().items() if k != "warmup"})])
def test_parse_args_rejects(bad, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        worker.parse_args(["--spec", spec_file(tmp_path, matrix=bad), "--node", "n0"])
    assert exc.value.code == 2


def test_parse_args_rejects_a_missing_spec_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        worker.parse_args(["--spec", str(tmp_path / "none.json"), "--node", "n0"])
    assert exc.value.code == 2 and "cannot read --spec" in capsys.readouterr().err


def test_torchrun_env():
    env = rank.TorchrunEnv.from_environ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                                         "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                                         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.group_rank) == (5, 1, 8, 4, 1)
    assert rank.TorchrunEnv.from_environ({}).world_size == 1


def test_only_scenarios_every_rank_finished_are_skipped():
    a, b, c = (1, 128, 16), (1, 512, 16), (4, 128, 16)
    assert rank.agreed_skips([{a, b}, {a}, {a, c}]) == {a}
    assert rank.agreed_skips([{a, b}, set()]) == set()
    assert rank.agreed_skips([]) == set()


def test_record_schema_round_trip(tmp_path):
    path = tmp_path / "ranks" / "rank-0.jsonl"
    recs = [record(window=w) for w in range(3)] + [record(batch=4, window=0, valid=False,
                                                          invalid_reasons=["1 compilation(s)"])]
    for r in recs:
        results.append_record(path, r)
    back = results.read_records(path)
    assert back == recs
    line = json.loads(path.read_text().splitlines()[0])
    assert line["schema"] == results.SCHEMA_VERSION and line["placement"]["cpu_affinity"] == "0-23"
    assert results.finished_scenarios(back, repeats=3) == {(1, 128, 16)}


def test_drop_scenarios_keeps_the_others(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    results.write_records(path, [record(window=0), record(window=1), record(batch=4, window=0)])
    assert windows.drop_scenarios(path, {(4, 128, 16)}) == 1
    assert [r.scenario for r in results.read_records(path)] == [(1, 128, 16)] * 2
    assert windows.drop_scenarios(path, {(8, 128, 16)}) == 0
    assert windows.drop_scenarios(tmp_path / "missing.jsonl", {(1, 128, 16)}) == 0


def test_each_rank_writes_its_own_files(tmp_path):
    assert rank.rank_file(tmp_path, 3) == tmp_path / "ranks" / "rank-3.jsonl"
    assert rank.serve_file(tmp_path, 3) == tmp_path / "ranks" / "serve-3.jsonl"
    assert rank.facts_file(tmp_path, 3) == tmp_path / "ranks" / "rank-3.json"


def test_no_rank_module_imports_the_static_worker():
    """The serving loops share bench/rank.py with the static worker, which starts them: an
    import back (even inside a function) would make a cycle."""
    import ast
    from pathlib import Path

    def imported(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            return [module] + [f"{module}.{a.name}".lstrip(".") for a in node.names]
        return []

    bench = Path(worker.__file__).parent
    wrong = [f"{name}:{node.lineno}" for name in ("rank.py", "serve_worker.py", "http_worker.py", "windows.py")
             for node in ast.walk(ast.parse((bench / name).read_text()))
             if any(m.split(".")[-1] == "worker" for m in imported(node))]
    assert not wrong, wrong


def test_records_sort_by_node_rank_then_scenario():
    recs = [record(rank=1, window=0), record(rank=0, batch=4), record(rank=0, window=1), record(rank=0)]
    ordered = results.merge_records([recs])
    assert [(r.rank, r.batch_per_rank, r.window) for r in ordered] == [(0, 1, 0), (0, 1, 1), (0, 4, 0), (1, 1, 0)]


def test_progress_line_is_one_json_object(capsys):
    rank.progress({"rank": 0, "phase": "measure", "scenario": 1, "scenarios": 2, "window": 0})
    line = capsys.readouterr().out
    assert line.endswith("\n") and line.count("\n") == 1
    assert parse_progress(line)["phase"] == "measure"


def test_worker_module_keeps_heavy_imports_lazy():
    import subprocess
    import sys

    code = ("import sys, vcfslm.bench.worker, vcfslm.bench.local, vcfslm.bench.placement; "
            "print(sorted(m for m in ('torch', 'transformers', 'paramiko', 'pyVmomi', 'click') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_window_driver_takes_the_one_loops_protocol():
    """The static engine, the slot engine, a rank's HTTP server and an endpoint drive one loop."""
    import inspect

    from vcfslm.bench.serve_worker import SlotDriver
    from vcfslm.endpoint.client import EndpointClient
    from vcfslm.serve.http_backend import HttpDriver

    for driver in (worker.StaticDriver, SlotDriver, HttpDriver, EndpointClient):
        for name in ("window", "rss"):
            got = inspect.signature(getattr(driver, name)).parameters
            assert list(got) == list(inspect.signature(getattr(windows.WindowDriver, name)).parameters), (driver, name)
        assert "compiles" in inspect.getsource(driver), driver
