"""benchmarks/peers.py: argument parsing, and the GGUF writer on a 1-layer Phi-3-mini
when the peers' venv (benchmarks/peers-setup.sh) is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import peers  # noqa: E402


def test_engines_parse_in_order_and_unknown_ones_are_refused(capsys):
    args = peers.parse_args(["--engines", "llama.cpp, vcfslm,llama.cpp", "--layers", "1"])
    assert args.engines == ["llama.cpp", "vcfslm"] and args.layers == 1
    assert peers.parse_args([]).engines == list(peers.ENGINES)
    assert peers.batches(peers.parse_args(["--big-batch", "0"])) == [1]
    with pytest.raises(SystemExit):
        peers.parse_args(["--engines", "vllm,tgi"])
    assert "unknown engine(s) tgi" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peers.parse_args(["--break-rope", "vcfslm"])
    assert "--break-rope takes a peer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peers.parse_args(["--tokens", "1"])


def test_cpu_lists_are_written_as_taskset_reads_them():
    assert peers.cpu_list([0, 1, 2, 5]) == "0-2,5"
    assert peers.cpu_list([3]) == "3"
    assert peers.cpu_list([0, 2, 3, 4, 7, 8]) == "0,2-4,7-8"


def test_the_vcfslm_child_compiles_into_the_cache_bench_local_ranks_use(monkeypatch, tmp_path):
    args = peers.parse_args(["--cache", str(tmp_path / "formats")])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    assert peers.child_env(args, "vcfslm")["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert peers.child_env(args, "vcfslm")["TORCHINDUCTOR_CACHE_DIR"] == str(
        tmp_path / "home" / ".cache" / "vcfslm" / "inductor")
    assert "TORCHINDUCTOR_CACHE_DIR" not in peers.child_env(args, "vllm")


def test_a_broken_checkpoint_changes_rope_theta_alone(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    config = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "longrope"}, "hidden_size": 8}
    (good / "config.json").write_text(json.dumps(config))
    (good / "model.safetensors").write_bytes(b"weights")
    peers.broken_checkpoint(good, bad, 1e6)
    assert json.loads((bad / "config.json").read_text()) == {
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "longrope"}, "hidden_size": 8}
    assert (bad / "model.safetensors").is_symlink() and (bad / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((good / "config.json").read_text()) == config


def test_gguf_names_follow_llama_cpp_phi3():
    assert peers.gguf_name("model.layers.7.self_attn.qkv_proj.weight") == "blk.7.attn_qkv.weight"
    assert peers.gguf_name("model.layers.0.mlp.gate_up_proj.weight") == "blk.0.ffn_up.weight"
    assert peers.gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert peers.gguf_name("lm_head.weight") == "output.weight"


def _peers_python() -> Path:
    python = peers.DEFAULT_PEERS_PYTHON
    if not python.exists() or subprocess.run([str(python), "-c", "import gguf"], capture_output=True).returncode:
        pytest.skip("peers' venv with gguf absent (benchmarks/peers-setup.sh)")
    return python


READ_BACK = """
import json, sys
import gguf
r = gguf.GGUFReader(sys.argv[1])
out = {"tensors": {t.name: [t.tensor_type.name, [int(x) for x in t.shape]] for t in r.tensors},
       "arch": r.fields["general.architecture"].contents(),
       "layers": r.fields["phi3.block_count"].contents(),
       "vocab": len(r.fields["tokenizer.ggml.tokens"].contents())}
try:
    import llama_cpp, numpy as np
except ImportError:
    print(json.dumps(out)); sys.exit()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=16, n_threads=2, verbose=False)
llm.eval(json.loads(sys.argv[2]))
logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
out["logits"] = np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).astype(float).tolist()
print(json.dumps(out))
"""


def test_gguf_writer_on_a_one_layer_model(tmp_path):
    python = _peers_python()
    torch = pytest.importorskip("torch")
    hf, out = tmp_path / "hf", tmp_path / "model.gguf"
    facts = peers.write_checkpoint(hf, layers=1)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"hf": str(hf), "gguf": str(out)}))
    done = subprocess.run([str(python), str(BENCHMARKS / "peers.py"), "--child", "gguf", "--job", str(job)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    prompt = [101, 2002, 3003, 4004, 5005, 6006]
    read = subprocess.run([str(python), "-c", READ_BACK, str(out), json.dumps(prompt)], capture_output=True,
                          text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    got = json.loads(read.stdout)
    assert got["arch"] == "phi3" and got["layers"] == 1 and got["vocab"] == 32064
    t = got["tensors"]
    assert t["blk.0.attn_qkv.weight"] == ["BF16", [3072, 9216]]
    assert t["blk.0.ffn_up.weight"] == ["BF16", [3072, 16384]]
    assert t["output.weight"][0] == "BF16" and t["blk.0.attn_norm.weight"][0] == "F32"
    assert t["rope_factors_long.weight"] == ["F32", [48]] and len(t) == 2 + 1 + 6 + 2
    assert out.stat().st_size > facts["weight_bytes"]
    if "logits" in got:  # llama.cpp reads the file as the HF model computes it
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
        with torch.inference_mode():
            ref = model(torch.tensor([prompt])).logits[0, -1].float()
        ours = torch.tensor(got["logits"], dtype=torch.float32)
        assert torch.corrcoef(torch.stack([ref, ours]))[0, 1] > 0.99


def test_saved_samples_hold_every_window_of_every_round_and_recompute_the_cells(tmp_path):
    import argparse

    import numpy as np
    from peer_equivalence import compare
    from peer_stats import median_interval

    args = argparse.Namespace(cpus="0-1", threads=2, layers=1, prompt=32, tokens=4, save=tmp_path / "out" / "s.json")
    runs = {"vcfslm": [{"batches": {"1": {"tpot_ms": [10.0, 12.0], "ttft_s": [0.5, 0.6]}}},
                       {"batches": {"1": {"tpot_ms": [11.0, 13.0], "ttft_s": [0.4, 0.7]}}}]}
    tokens = np.zeros((1, 4), dtype=np.int64)
    verdicts = {"vcfslm": compare("vcfslm", tokens, np.zeros((1, 4, 8)), tokens)}
    gemm = argparse.Namespace(tflops=0.4)
    peers.save_samples(args, runs, {"vcfslm": None}, verdicts, [30.0, 31.0], gemm)
    saved = json.loads(args.save.read_text())
    assert [p.name for p in args.save.parent.iterdir()] == ["s.json"], "no temp file left behind"
    assert saved["rounds"] == runs and saved["read_gbs"] == [30.0, 31.0] and saved["gemm_tflops"] == 0.4
    assert saved["verdicts"]["vcfslm"]["equivalent"] is True
    rounds = [r["batches"]["1"]["tpot_ms"] for r in saved["rounds"]["vcfslm"]]
    assert median_interval(rounds).median == 11.5
