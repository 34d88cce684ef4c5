"""`bench --serve`: flags resolve into one ServeSpec (flags > resumed run > inventory >
defaults), bad combinations exit 2 naming the flag, the workers get it as JSON."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.bench.launch import worker_args
from vcfslm.cli import main
from vcfslm.cli.bench_spec import Resumed, parse_slos, resolve
from vcfslm.contract import Matrix, serve_complete, serve_limits, serve_matrix
from vcfslm.errors import UsageError
from vcfslm.inventory import load_inventory
from vcfslm.runspec import RunSpec, WorkerSpec
from vcfslm.serving import ServeSpec

LAB = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"


def _run(*args):
    return CliRunner().invoke(main, ["bench", *args])


@pytest.mark.parametrize(("args", "message"), [
    (["--local", "--rates", "1"], "error: --rates only apply to --serve runs"),
    (["--local", "--serve", "--batch-sizes", "1"], "error: --batch-sizes do not apply to --serve"),
    (["--local", "--serve", "--rates", "1", "--users", "2"], "error: give --rates or --users, not both"),
    (["--local", "--serve"], "error: --rates/--users: serving needs a load"),
    (["--local", "--serve", "--rates", "1", "--duration", "8"], "leave nothing of the 8 s window"),
    (["--local", "--resume", "x", "--sweep"], "error: --resume continues a run with its own settings; drop --sweep"),
    (["--local", "--attainment", "0.9"], "error: --attainment only applies to --serve runs"),
    (["--local", "--sweep-precision", "0.1"], "error: --sweep-precision only apply to --serve runs"),
    (["--local", "--serve", "--rates", "1", "--attainment", "1.5"], "Invalid value for '--attainment'"),
    (["--local", "--resume", "x", "--percentile", "p50"], "error: --resume continues a run with its own SLOs and rule"),
])
def test_bad_serve_flags_exit_2_naming_the_flag(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert any(line.startswith(message) or message in line for line in result.output.splitlines()), result.output


def _inventory(tmp_path, serve=None, slo=None, **bench):
    """inventories/lab.yaml with these bench settings, bench.serve (whole) and slo."""
    doc = yaml.safe_load(LAB.read_text())
    doc["bench"].update(bench, serve=serve or {})
    doc["slo"] = {**doc.get("slo", {}), **(slo or {})}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_inventory(path)


def _serve(flags, inventory=None, resumed=None) -> ServeSpec:
    return resolve({"serve": True, **flags}, inventory, resumed, "local").serve


def test_flags_win_over_the_inventory_and_defaults_fill_the_rest(tmp_path):
    inventory = _inventory(tmp_path, {"rates": [0.5, 1.0], "slots": 8, "duration_s": 30.0, "arrival": "gamma",
                                      "burstiness": 0.5, "sweep": False},
                           input_tokens=[128, 512], output_tokens=64, repeats=2)
    spec = _serve({"rates": [2.0, 4.0], "sweep": True}, inventory)
    assert spec.loads == (2.0, 4.0) and spec.load_kind == "rate"
    assert (spec.slots, spec.duration_s, spec.arrival, spec.burstiness, spec.sweep) == (8, 30.0, "gamma", 0.5, True)
    assert (spec.input_tokens, spec.output_tokens, spec.repeats) == ((128, 512), 64, 2)


def test_the_attainment_and_the_sweep_precision_reach_the_spec(tmp_path):
    inventory = _inventory(tmp_path, slo={"attainment": 0.95})
    spec = _serve({"rates": [1.0], "sweep_precision": 0.1, "sweep_budget": 30.0}, inventory)
    assert (spec.attainment, spec.sweep_precision, spec.sweep_budget_s) == (0.95, 0.1, 30.0)
    flag = _serve({"rates": [1.0], "attainment": 0.8}, inventory)
    assert flag.attainment == 0.8                          # the flag wins over the inventory's slo.attainment
    assert ServeSpec.of_record({"loads": [1.0]}).attainment == 0.9      # a run recorded before attainment


def test_users_from_the_inventory_mean_a_closed_loop(tmp_path):
    spec = _serve({}, _inventory(tmp_path, {"users": [4, 8]}, input_tokens=[256], output_tokens=32))
    assert spec.load_kind == "users" and spec.loads == (4.0, 8.0) and spec.arrival_kind == "closed"


def test_a_resumed_run_keeps_its_spec(tmp_path):
    previous = ServeSpec(loads=(3.0,), input_tokens=(64,), sweep=True)
    run = RunSpec(run_id="r", mode="local", model="synthetic:tiny", serve=previous, matrix=serve_matrix(previous))
    resumed = Resumed(tmp_path / "r", SimpleNamespace(spec=run.record(), mode="local"))
    assert _serve({}, None, resumed) == previous


def test_a_bad_value_is_a_usage_error():
    with pytest.raises(UsageError, match="--serve: .*think time"):
        _serve({"users": [2], "think_s": -1.0})


def test_workers_get_the_spec_and_limits_as_json():
    spec = ServeSpec(loads=(1.0, 2.0), input_tokens=(128,), output_tokens=16, slots=4)
    matrix = serve_matrix(spec)
    assert (matrix.batch_sizes, matrix.input_tokens, matrix.output_tokens) == ((4,), (128,), 16)
    run = RunSpec(run_id="r", mode="local", model="synthetic:tiny", threads=1, serve=spec,
                  matrix=Matrix(matrix.batch_sizes, matrix.input_tokens, 16, 0, 1))
    assert worker_args("/tmp/r/spec-n.json", "n") == ["--spec", "/tmp/r/spec-n.json", "--node", "n"]
    got = WorkerSpec.from_json(WorkerSpec(run=run, out="/tmp/r", model="synthetic:tiny").to_json())
    assert got.run.serve == spec
    assert set(got.run.serve_limits()) == {"A", "B"} and got.run.serve_limits() == serve_limits(None)


class _R:
    def __init__(self, rank, load, window=0, input_tokens=128):
        self.rank, self.load, self.window, self.input_tokens = rank, load, window, input_tokens


def test_serve_complete_needs_every_rank_at_every_load():
    spec = ServeSpec(loads=(1.0, 2.0), input_tokens=(128,), repeats=1)
    full = [_R(rank, load) for rank in (0, 1) for load in (1.0, 2.0)]
    assert serve_complete(full, spec, 2)
    assert not serve_complete(full[:-1], spec, 2)
    sweep = ServeSpec(loads=(1.0, 2.0), input_tokens=(128,), sweep=True)
    # a sweep may stop its grid after the first load, but a load it measured needs all ranks
    assert serve_complete([_R(0, 1.0), _R(1, 1.0), _R(0, 1.5), _R(1, 1.5)], sweep, 2)
    assert not serve_complete([_R(0, 1.0), _R(1, 1.0), _R(0, 1.5)], sweep, 2)
    # a load the refinement proposed inside a gap is measured in an extra window (numbered
    # from repeats): complete when every rank has that window, not its grid windows
    grid = [_R(0, 1.0), _R(1, 1.0), _R(0, 4.0), _R(1, 4.0)]
    assert serve_complete([*grid, _R(0, 2.5, window=1), _R(1, 2.5, window=1)], sweep, 2)
    assert not serve_complete([*grid, _R(0, 2.5, window=1)], sweep, 2)
    # a bisection load (grid windows) still needs all of them
    assert not serve_complete([*grid, _R(0, 2.5), _R(1, 2.5), _R(0, 2.5, window=1)], sweep, 2)


def test_slo_flags_become_the_runs_slos():
    assert parse_slos(("B-scaled:tpot<=800ms,ttft<=20s",)) == {"B-scaled": {"tpot_ms": 800.0, "ttft_s": 20.0}}
    assert parse_slos(()) is None
    # A preset by name, with the percentile its source judges at.
    assert parse_slos(("mlperf-server",)) == {"mlperf-server": {"tpot_ms": 100.0, "ttft_s": 2.0,
                                                                 "percentile": "p99"}}
    result = _run("--local", "--slo", "B:tpot<=x")
    assert result.exit_code == 2 and "error: --slo: slo 'B': cannot read condition 'tpot<=x'" in result.output
    result = _run("--local", "--resume", "r1", "--slo", "B:tpot<=1s")
    assert result.exit_code == 2 and "--resume continues a run with its own SLOs" in result.output
