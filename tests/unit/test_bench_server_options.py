"""`bench --serve --server vllm`: how the option resolves, what it refuses, what the workers get,
and the launch scripts `--local` renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.bench import local
from vcfslm.errors import UsageError
from vcfslm.guest.templates import render_template
from vcfslm.serving.decisions import ServeSpec
from vcfslm.serving.servers import ServerSpec

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "inventories" / "lab.yaml"


def invoke(*args):
    from vcfslm.cli import main

    return CliRunner().invoke(main, list(args))


def lab_inventory(tmp_path: Path, **serve) -> str:
    doc = yaml.safe_load(LAB.read_text())
    doc["guest"]["model"] = "/models/tiny-64"
    doc["bench"]["ranks_per_node"] = 1
    doc["bench"].setdefault("serve", {}).update(serve)
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64, "num_attention_heads": 2,
                                                    "hidden_size": 128, "num_hidden_layers": 2}))
    return folder


def test_cluster_workers_get_the_server_with_their_own_address_and_scripts(tmp_path):
    inv = lab_inventory(tmp_path, vllm={"listen": "bench", "reserved_cores": 0})
    result = invoke("bench", "--nodes", "2", "--dry-run", "-i", inv, "-o", "json", "--serve", "--rates", "1",
                    "--server", "vllm")
    assert result.exit_code == 0, result.output
    launches = json.loads(result.stdout)
    specs = [la["spec"]["server"] for la in launches]
    doc = yaml.safe_load(Path(inv).read_text())
    assert [s["host"] for s in specs] == [str(n["bench_ip"]) for n in doc["nodes"][:2]]
    assert {s["launch_dir"] for s in specs} == {doc["guest"]["workdir"] + "/launch"}
    assert {s["name"] for s in specs} == {"vllm"}


def test_cluster_servers_listen_on_loopback_by_default(tmp_path):
    inv = lab_inventory(tmp_path, server="vllm", vllm={"listen": "loopback", "reserved_cores": 0})
    result = invoke("bench", "--nodes", "1", "--dry-run", "-i", inv, "-o", "json", "--serve", "--rates", "1")
    assert result.exit_code == 0, result.output
    [launch] = json.loads(result.stdout)
    spec = launch["spec"]["server"]
    assert spec["host"] == "127.0.0.1" and spec["listen"] == "loopback"


def test_the_rank_engine_passes_no_server():
    result = invoke("bench", "--nodes", "1", "--dry-run", "-i", str(LAB), "-o", "json", "--serve", "--rates", "1")
    assert result.exit_code == 0, result.output
    [launch] = json.loads(result.stdout)
    assert "--server" not in launch["torchrun"] and launch["spec"]["server"] is None
    assert launch["spec"]["run"]["serve"]["loads"] == [1.0]


def test_a_synthetic_guest_model_is_refused_for_a_server():
    result = invoke("bench", "--nodes", "1", "--dry-run", "-i", str(LAB), "--serve", "--rates", "1",
                    "--server", "vllm")
    assert result.exit_code == 2
    assert "guest.model" in result.output and "vcfslm model write" in result.output


def test_server_flags_need_serve():
    result = invoke("bench", "--local", "--server", "vllm")
    assert result.exit_code == 2 and "--server only apply to --serve" in result.output


def test_local_server_without_its_interpreter_exits_2_after_writing_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("VCFSLM_MODEL_CACHE", str(tmp_path / "cache"))
    result = invoke("bench", "--local", "--serve", "--server", "vllm", "--model", "synthetic:tiny-64",
                    "--rates", "1", "--input-tokens", "8", "--output-tokens", "4", "--runs-dir", str(tmp_path / "runs"),
                    "--server-python", str(tmp_path / "no-python"))
    assert result.exit_code == 2, result.output
    assert "--server-python" in result.output and "make vllm" in result.output
    [written] = list((tmp_path / "cache").iterdir())
    assert written.name == "synthetic-tiny-64-seed0" and (written / "tokenizer.json").exists()


def test_local_renders_one_script_per_numa_node(tmp_path):
    slots = [{"local_rank": 0, "numa_node": 0, "cpus": "0-23", "bind": "node"},
             {"local_rank": 1, "numa_node": 1, "cpus": "24-47", "bind": "node"}]
    python = tmp_path / "python"
    python.write_text("")
    spec = ServeSpec(loads=(1.0,), input_tokens=(128,), output_tokens=16, slots=16)
    server = local.render_server_scripts(tmp_path / "launch", ServerSpec(name="vllm", reserved_cores=1), slots,
                                         spec, str(model_folder(tmp_path)), True, str(python), render_template)
    assert server.launch_dir == str((tmp_path / "launch").resolve())
    one = (tmp_path / "launch" / "vllm-node1.sh").read_text()
    assert "VLLM_CPU_OMP_THREADS_BIND='24-46'" in one and "--membind=1" in one
    assert "VLLM_API_KEY:?" in one and "VLLM_API_KEY=" not in one
    assert (tmp_path / "launch" / "vllm-entry.py").exists()


def test_local_refuses_two_ranks_on_one_node_and_a_model_without_config(tmp_path):
    spec = ServeSpec(loads=(1.0,), input_tokens=(8,), output_tokens=4)
    shared = [{"local_rank": i, "numa_node": 0, "cpus": str(i), "bind": "cpus"} for i in range(2)]
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(UsageError, match="one server per NUMA node"):
        local.render_server_scripts(tmp_path / "l", ServerSpec(name="vllm"), shared, spec,
                                    str(model_folder(tmp_path)), True, str(python), render_template)
    with pytest.raises(UsageError, match="serves a model folder"):
        local.render_server_scripts(tmp_path / "l", ServerSpec(name="vllm"), shared[:1], spec,
                                    "synthetic:tiny", True, str(python), render_template)
