"""`bench --local`'s pure parts, the rank wrapper it renders, and the command's option checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from vcfslm.bench import launch, local
from vcfslm.errors import UsageError
from vcfslm.guest.templates import render_template
from vcfslm.matrix import Matrix
from vcfslm.results import WindowRecord
from vcfslm.runspec import ProbeSpec, RunSpec


def test_plan_ranks_maps_topology_slots_onto_real_cpu_ids():
    # two nodes whose CPUs interleave (0,2,4,.. on node 0): rank CPU sets follow the real ids
    nodes = {0: tuple(range(0, 8, 2)), 1: tuple(range(1, 8, 2))}
    assert local.plan_ranks(nodes, ranks=2, threads=4) == [
        {"local_rank": 0, "numa_node": 0, "cpus": "0,2,4,6", "bind": "node"},
        {"local_rank": 1, "numa_node": 1, "cpus": "1,3,5,7", "bind": "node"}]
    assert local.plan_ranks(nodes, ranks=4, threads=2) == [
        {"local_rank": 0, "numa_node": 0, "cpus": "0,2", "bind": "cpus"},
        {"local_rank": 1, "numa_node": 0, "cpus": "4,6", "bind": "cpus"},
        {"local_rank": 2, "numa_node": 1, "cpus": "1,3", "bind": "cpus"},
        {"local_rank": 3, "numa_node": 1, "cpus": "5,7", "bind": "cpus"}]


def test_plan_ranks_on_one_small_node():
    assert local.plan_ranks({0: (0, 1)}, ranks=2, threads=1) == [
        {"local_rank": 0, "numa_node": 0, "cpus": "0", "bind": "cpus"},
        {"local_rank": 1, "numa_node": 0, "cpus": "1", "bind": "cpus"}]
    assert local.default_threads({0: (0, 1)}, 2) == 1
    assert local.default_threads({0: (0, 1)}, 1) == 2
    assert local.default_threads({0: tuple(range(24)), 1: tuple(range(24, 48))}, 2) == 24


def test_plan_ranks_refuses_oversubscription():
    with pytest.raises(UsageError, match="exceeds"):
        local.plan_ranks({0: (0, 1)}, ranks=3, threads=1)
    with pytest.raises(UsageError, match="span"):
        local.plan_ranks({0: (0, 1), 1: (2, 3)}, ranks=1, threads=3)


def test_torchrun_command_separates_worker_arguments(tmp_path):
    matrix = Matrix((1, 4), (128,), 16, warmup=0, repeats=2)
    spec = RunSpec(run_id="x", mode="local", model="synthetic:tiny", matrix=matrix, threads=2, scenarios="1x*",
                   probe=ProbeSpec(enabled=False), nodes=("local",))
    job = local.worker_spec(spec, Path("/r/x"), resume=True)
    spec_file = tmp_path / "spec-local.json"
    spec_file.write_text(job.to_json())
    cmd = local.torchrun_command("/py", 2, Path("/r/x/launch/rank.sh"), launch.worker_args(str(spec_file), "local"))
    assert cmd[:8] == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "--no-python", "/r/x/launch/rank.sh"]
    assert cmd[8] == "--"  # torchrun would reject the worker's --node as an abbreviation
    tail = cmd[9:]
    assert tail == ["--spec", str(spec_file), "--node", "local"]
    from vcfslm.bench.worker import parse_args

    parsed = parse_args(cmd[8:])
    assert parsed.spec.matrix == matrix and parsed.spec.matrix.warmup == 0
    assert parsed.spec.resume and not parsed.spec.run.probe.enabled and parsed.spec.run.scenarios == "1x*"
    assert parsed.node == "local" and parsed.spec.out == "/r/x" and parsed.spec.run.threads == 2


def test_progress_status_line():
    status = launch.progress_status({"phase": "measure", "scenario": 2, "scenarios": 4, "batch": 4,
                                     "input_tokens": 128, "window": 1, "tpot_ms_p50": 80.1,
                                     "ttft_s_p50": 0.5, "rank_tps": 40.0, "valid": False})
    assert "2/4" in status and "80.1" in status and "invalid" in status


def test_progress_status_of_a_probe_says_a_busy_machine():
    probed = {"phase": "probed", "read_gbs": 20.1, "triad_gbs": 18.0, "gemm_tflops": 0.2}
    assert launch.progress_status({**probed, "steadiness": "steady"}) == "bandwidth read 20.1 GB/s, triad 18.0 GB/s"
    assert launch.progress_status(probed) == "bandwidth read 20.1 GB/s, triad 18.0 GB/s"   # an older worker
    assert launch.progress_status({**probed, "steadiness": "busy"}) == (
        "bandwidth read 20.1 GB/s, triad 18.0 GB/s  (probed on a busy machine: see the report's validity warnings)")


def _rec(rank, batch, window):
    return WindowRecord(run_id="r", node="local", node_rank=0, rank=rank, local_rank=rank, world_size=2,
                        ranks_per_node=2, nodes=1, batch_per_rank=batch, input_tokens=8, output_tokens=4,
                        window=window, start_skew_s=0, wall_s=1, generated_tokens=4, rank_tps=4,
                        ttft_s=[0.1], tpot_ms=[1.0], e2e_s=[1.0])


def test_run_complete_needs_every_rank_and_window():
    matrix = Matrix((1, 2), (8,), 4, repeats=2)
    recs = [_rec(r, b, w) for r in (0, 1) for b in (1, 2) for w in (0, 1)]
    assert local.run_complete(recs, matrix, world_size=2)
    assert not local.run_complete(recs[:-1], matrix, world_size=2)
    assert local.run_complete(recs[:4], matrix, world_size=1)
    assert local.run_complete([r for r in recs if r.batch_per_rank == 1], matrix, 2, "1x*")


# ------------------------------------------------------------------ rank.sh


CONTEXT = {"python": "PYTHON", "threads_per_rank": 1, "inductor_cache_dir": "/tmp/vcfslm-inductor",
           "use_numactl": True, "env_file": "",
           "ranks": [{"local_rank": 0, "numa_node": 0, "cpus": "0", "bind": "cpus"},
                     {"local_rank": 1, "numa_node": 0, "cpus": "1", "bind": "cpus"}]}


def render(tmp_path: Path, **overrides) -> Path:
    fake = tmp_path / "fake-python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "echo \"ARGS $*\"\necho \"OMP=$OMP_NUM_THREADS BIND=${OMP_PROC_BIND:-} "
                    "CACHE=$TORCHINDUCTOR_CACHE_DIR NODE=$VCFSLM_NUMA_NODE CPUS=$VCFSLM_CPUS\"\n"
                    "echo \"AFFINITY $(cut -d' ' -f1 <<< \"$(taskset -pc $$ | sed 's/.*: //')\")\"\n")
    fake.chmod(0o755)
    context = {**CONTEXT, "python": str(fake), **overrides}
    script = tmp_path / "rank.sh"
    script.write_text(render_template("rank.sh.j2", context))
    script.chmod(0o755)
    return script


def test_rank_sh_renders_and_passes_bash_n(tmp_path):
    script = render(tmp_path)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "OMP_NUM_THREADS=1" in text and "vcfslm.bench.worker" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
                    reason="needs 2 CPUs and taskset")
@pytest.mark.parametrize("use_numactl", [True, False])
def test_rank_sh_pins_each_local_rank(tmp_path, use_numactl):
    script = render(tmp_path, use_numactl=use_numactl)
    env = {**os.environ, "LOCAL_RANK": "1"}
    env.pop("OMP_PROC_BIND", None)
    out = subprocess.run([str(script), "--", "--node", "x"], capture_output=True, text=True, env=env, check=True).stdout
    assert "ARGS -m vcfslm.bench.worker -- --node x" in out
    assert "OMP=1" in out and "CACHE=/tmp/vcfslm-inductor" in out and "NODE=0 CPUS=1" in out
    if use_numactl:
        assert "AFFINITY 1" in out and "BIND=close" in out
    else:
        assert "BIND=" in out and "BIND=close" not in out


def test_rank_sh_refuses_an_unplanned_local_rank(tmp_path):
    script = render(tmp_path)
    done = subprocess.run([str(script)], capture_output=True, text=True, env={**os.environ, "LOCAL_RANK": "7"})
    assert done.returncode == 64 and "no placement for LOCAL_RANK=7" in done.stderr


def test_rank_sh_accepts_topology_rank_slots(tmp_path):
    from vcfslm.topology import rank_slots

    context = {k: v for k, v in CONTEXT.items() if k != "ranks"}
    text = render_template("rank.sh.j2", {**context, "rank_slots": rank_slots(96, 4, 4, 24)})
    assert "3) NUMA_NODE=3; CPUS='72-95'; BIND='node' ;;" in text


# ------------------------------------------------------------------ the command's checks


def invoke(*args):
    from vcfslm.cli import main

    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("args,message", [
    (["bench", "--local", "--nodes", "2"], "cannot be combined with --nodes"),
    (["bench", "--ranks", "2", "--nodes", "1"], "--ranks only apply to --local"),
    (["bench"], "choose a mode"),
    (["bench", "--local", "--model", "synthetic:gpt5"], "unknown synthetic model"),
    (["bench", "--local", "--batch-sizes", "1,x"], "comma-separated integers"),
    (["bench", "--local", "--resume", "no-such-run"], "no run at"),
])
def test_bench_option_errors_exit_2(args, message, tmp_path):
    result = invoke(*args, "--runs-dir", str(tmp_path)) if "--resume" in args else invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_bench_and_probe_are_registered():
    result = invoke("--help")
    assert "bench" in result.output and "probe" in result.output


@pytest.mark.parametrize("flags, expected", [(["--probe-mib", "64"], {"enabled": True, "mib": 64}),
                                             (["--no-probe"], {"enabled": False, "mib": None})])
def test_probe_settings_reach_the_cluster_workers(flags, expected):
    inventory = str(Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml")
    result = invoke("bench", "--nodes", "1", "--dry-run", "-i", inventory, "-o", "json", *flags)
    assert result.exit_code == 0, result.output
    [launch] = json.loads(result.stdout)
    assert launch["spec"]["run"]["probe"] == expected
    assert "spec-" in launch["torchrun"][launch["torchrun"].index("--spec") + 1]


def _config_file(tmp_path, **changes) -> str:
    from vcfslm import presets

    values = {**presets.tiny_values("gemma-3-1b"), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return f"synthetic:config={path}"


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "gemma2", "attn_logit_softcapping": 50.0}, "uses attn_logit_softcapping=50.0, which the engine"),
    ({"model_type": "no-such-family"}, "cannot build model_type 'no-such-family'"),
])
def test_a_config_the_engine_cannot_run_exits_2(tmp_path, changes, message):
    result = invoke("bench", "--local", "--model", _config_file(tmp_path, **changes), "--runs-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not list(tmp_path.glob("*/meta.json"))   # nothing was started


def test_a_model_too_big_for_this_machine_is_refused_before_a_rank_starts(tmp_path, monkeypatch):
    from vcfslm.lab import generate

    monkeypatch.setattr(generate, "machine_shape", lambda: generate.MachineShape(cpus=2, numa_nodes=2, memory_gib=24))
    result = invoke("bench", "--local", "--model", "synthetic:qwen2.5-7b", "--ranks", "2", "--batch-sizes", "1,16",
                    "--input-tokens", "128", "--output-tokens", "16", "--runs-dir", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert ("synthetic:qwen2.5-7b does not fit this machine: 1 replica(s) per NUMA node x (14.2 GiB weights + "
            "0.1 GiB KV cache at batch 16 x 144 tokens + 1.0 GiB runtime) = 15.3 GiB, and a NUMA node has 12.0 GiB"
            ) in " ".join(result.output.split())
    assert not list(tmp_path.iterdir())


def test_model_presets_lists_every_preset_as_json():
    from vcfslm import presets

    result = invoke("model", "presets", "-o", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list(presets.PRESET_NAMES)
    qwen = next(r for r in rows if r["name"] == "qwen2.5-7b")
    assert (qwen["kv_heads"], qwen["head_dim"], qwen["tied"], qwen["params_b"]) == (4, 128, False, 7.62)


def test_a_resume_keeps_the_spec_it_recorded_when_the_inventory_changed(tmp_path, monkeypatch):
    """`--resume` runs what meta.json recorded, not what the inventory says since."""
    import yaml

    given = []

    def fake_torchrun(cmd, log_path, reporter, timeout, tracker=None):
        given.append(json.loads(Path(cmd[cmd.index("--spec") + 1]).read_text()))
        return 0, [], []

    monkeypatch.setattr(local, "_run_streaming", fake_torchrun)
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml").read_text())
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump(doc))
    runs = str(tmp_path / "runs")
    first = invoke("bench", "--local", "-i", str(inventory), "--model", "synthetic:tiny", "--ranks", "1",
                   "--threads", "1", "--no-numactl", "--runs-dir", runs, "--run-id", "r1")
    assert first.exit_code == 0, first.output
    recorded = json.loads((tmp_path / "runs" / "r1" / "meta.json").read_text())["spec"]
    assert recorded["matrix"]["batch_sizes"] == [1, 2] and recorded["compile_mode"] == "compile"

    doc["bench"].update(batch_sizes=[8], input_tokens=[64], output_tokens=16, repeats=5, compile="eager")
    doc["slos"] = {"gold": {"tpot_ms": 50, "ttft_s": 1}}
    doc["slo"] = {**doc.get("slo", {}), "percentile": "p99"}
    inventory.write_text(yaml.safe_dump(doc))
    again = invoke("bench", "--local", "-i", str(inventory), "--resume", "r1", "--runs-dir", runs)
    assert again.exit_code == 0, again.output

    first_run, resumed_run = (dict(g["run"], command=None) for g in given)
    assert resumed_run == first_run
    assert resumed_run["matrix"] == {"batch_sizes": [1, 2], "input_tokens": [16, 32], "output_tokens": 8,
                                     "warmup": 1, "repeats": 2}
    assert resumed_run["slos"] == {"A": {"tpot_ms": 130, "ttft_s": 3}, "B": {"tpot_ms": 200, "ttft_s": 5}}
    assert given[1]["resume"] and not given[0]["resume"]
    meta = json.loads((tmp_path / "runs" / "r1" / "meta.json").read_text())
    assert dict(meta["spec"], command=None) == dict(recorded, command=None)
    assert meta["matrix"]["batch_sizes"] == [1, 2] and meta["matrix"]["compile"] == "compile"
