"""The checkpoint loader: save_pretrained folders of each family load (safe_open into a
meta-device skeleton) a linear or a tensor at a time, pack as they arrive, and compute what
transformers' own from_pretrained model computes; a bad checkpoint is a clear error; a
1-layer Phi-3-mini-width load stays near one copy of its weights at its peak."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vcfslm.engine import numerics  # noqa: E402
from vcfslm.engine.linear import (  # noqa: E402
    DENSE_BF16,
    PACK_CHECK_RTOL,
    KernelPlan,
    PackedLinear,
    choose_plan,
    onednn_bf16,
)
from vcfslm.engine.model import ModelSourceError, load_model, load_tokenizer, tiny_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPT, STEPS = 6, 5


def _small(cls, **extra):
    values = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    values.update(extra)
    return cls(**values)


def family_config(family: str):
    """Tiny configs with each family's structure: GQA (4 heads on 2 KV heads), Qwen2's q/k/v
    biases, Qwen3's q/k norms and head_dim override, Phi-3's fused projections and LongRoPE,
    Gemma's scaled embedding; Llama and Gemma tie their embeddings."""
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": lambda: _small(LlamaConfig, tie_word_embeddings=True),
        "qwen2": lambda: _small(Qwen2Config, tie_word_embeddings=False),
        "qwen3": lambda: _small(Qwen3Config, head_dim=32, tie_word_embeddings=False),
        "mistral": lambda: _small(MistralConfig, sliding_window=None),
        "phi3": lambda: tiny_config(num_key_value_heads=2, initializer_range=0.1),
        "gemma": lambda: _small(GemmaConfig, head_dim=16),
    }[family]()


def random_model(config, seed: int = 0):
    """A bf16 model of `config` with random weights everywhere, biases and norms included (a
    loader that dropped one of them would change the logits)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name and "gemma" not in type(model).__name__.lower() else 0.0)
                        + 0.2 * torch.randn_like(p))
    return model


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def hf_model(folder: Path, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation=attn).eval()


def ids(vocab: int, batch: int = 2, length: int = PROMPT + STEPS) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(7))


def plan() -> KernelPlan:
    return choose_plan(onednn_bf16())


FAMILIES = [("llama", True), ("qwen2", False), ("qwen3", True), ("mistral", False), ("phi3", False),
            ("gemma", True)]


@pytest.mark.parametrize("family,tokenizer", FAMILIES, ids=[f"{f}-{'tok' if t else 'notok'}" for f, t in FAMILIES])
def test_family_checkpoint_loads_as_from_pretrained_does(tmp_path, family, tokenizer):
    from vcfslm.engine.decode import DecodeEngine

    folder = tmp_path / family
    config = family_config(family)
    random_model(config).save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder, config.vocab_size)
    assert (load_tokenizer(str(folder)) is not None) is tokenizer
    tokens = ids(config.vocab_size)
    with torch.inference_mode():
        want_sdpa = hf_model(folder, "sdpa")(tokens).logits
        want_eager = hf_model(folder, "eager")(tokens).logits[:, PROMPT:].float()

    # Unpacked, the loaded model is the from_pretrained model to the bit.
    plain = load_model(str(folder), max_context=64)
    assert {type(m) for m in plain.model.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    with torch.inference_mode():
        got = plain.model(tokens).logits
    torch.testing.assert_close(got, want_sdpa, rtol=0, atol=0)

    # Packed as it loads, the engine's teacher-forced decode steps pass the gate's tolerance
    # against HF eager.
    packed = load_model(str(folder), max_context=64, plan=plan())
    linears = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert linears and not [m for m in packed.model.modules() if type(m) is torch.nn.Linear]
    engine = DecodeEngine(packed.model, "eager")
    assert engine.pack.linears == len(linears) == plain.facts["layers"] * (
        4 if family == "phi3" else 7) + 1
    got = engine.step_logits(tokens[:, :PROMPT], tokens[:, PROMPT:], compiled=False)
    gate = numerics.compare_logits(got, want_eager, rtol=numerics.DEFAULT_RTOL, min_top1=numerics.DEFAULT_MIN_TOP1)
    assert gate.passed, gate.reason
    assert packed.facts["params"] == plain.facts["params"]


def test_tied_embeddings_load_once_and_stay_tied(tmp_path):
    from vcfslm.engine.checkpoint_files import checkpoint_entries

    folder = tmp_path / "llama"
    config = family_config("llama")
    random_model(config).save_pretrained(folder)
    names = {e.name for e in checkpoint_entries(folder)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    plain = load_model(str(folder)).model
    assert plain.lm_head.weight is plain.get_input_embeddings().weight
    dense = load_model(str(folder), plan=KernelPlan(DENSE_BF16)).model
    assert isinstance(dense.lm_head, PackedLinear)
    # dense-bf16 keeps a weight as it is: the packed lm_head reads the embedding's memory
    assert dense.lm_head.packed_weight.data_ptr() == dense.get_input_embeddings().weight.data_ptr()


def test_sharded_fp32_checkpoint_converts_and_matches(tmp_path):
    from vcfslm.engine.checkpoint_files import INDEX_NAME

    folder = tmp_path / "qwen2"
    config = family_config("qwen2")
    random_model(config).float().save_pretrained(folder, max_shard_size="200KB")
    assert (folder / INDEX_NAME).is_file() and len(list(folder.glob("*.safetensors"))) > 2
    tokens = ids(config.vocab_size)
    with torch.inference_mode():
        want = hf_model(folder, "sdpa")(tokens).logits
        loaded = load_model(str(folder))
        assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
        torch.testing.assert_close(loaded.model(tokens).logits, want, rtol=0, atol=0)


def _mapped_ranges(suffix: str) -> list[tuple[int, int]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(suffix):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def test_before_pack_sees_the_mapped_model_and_the_engine_keeps_the_loaders_pack(tmp_path, monkeypatch):
    from vcfslm.engine import decode as engine_mod

    folder = tmp_path / "mistral"
    config = family_config("mistral")
    random_model(config).save_pretrained(folder)
    tokens = ids(config.vocab_size)
    with torch.inference_mode():
        want = hf_model(folder, "sdpa")(tokens).logits
    seen = []

    def before_pack(model):
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and not [m for m in linears if isinstance(m, PackedLinear)]
        ranges = _mapped_ranges(".safetensors")
        # zero copy: every weight the hook sees is a view of the mapped checkpoint
        assert all(any(lo <= m.weight.data_ptr() < hi for lo, hi in ranges) for m in linears)
        with torch.inference_mode():
            seen.append(model(tokens).logits)

    loaded = load_model(str(folder), plan=plan(), before_pack=before_pack)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], want, rtol=0, atol=0)
    ranges = _mapped_ranges(".safetensors")
    assert not any(lo <= t.data_ptr() < hi for t in loaded.model.state_dict().values() for lo, hi in ranges
                   if not t.is_mkldnn)
    # every handle is dropped: no file of the checkpoint stays mapped (its pages in RSS)
    gc.collect()
    assert not [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]

    def no_second_pack(*args, **kwargs):
        raise AssertionError("the engine packed a packed model again")

    monkeypatch.setattr(engine_mod, "pack_linears", no_second_pack)
    engine = engine_mod.DecodeEngine(loaded.model, "eager")
    from vcfslm.engine.loader import packed_report

    assert engine.pack is packed_report(loaded.model) and engine.plan == plan()
    assert engine.pack.linears == config.num_hidden_layers * 7 + 1
    assert 0 <= engine.pack.max_rel_error <= PACK_CHECK_RTOL  # the loader checked every linear
    other = KernelPlan(DENSE_BF16, 2) if plan() == KernelPlan(DENSE_BF16) else KernelPlan(DENSE_BF16)
    with pytest.raises(ValueError, match="cannot be repacked"):
        engine_mod.DecodeEngine(loaded.model, "eager", plan=other)


def _rewrite(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
     "tensor model.layers.1.mlp.down_proj.weight of Qwen2ForCausalLM is missing from the checkpoint"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32, dtype=torch.bfloat16)}),
     r"tensor model.layers.0.self_attn.q_proj.bias has shape \[32\]; Qwen2ForCausalLM expects \[64\]"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(4, dtype=torch.bfloat16)}),
     r"tensor model.layers.0.extra.weight \(model.safetensors\) is not a weight of Qwen2ForCausalLM"),
], ids=["missing", "shape", "unexpected"])
def test_a_bad_checkpoint_names_the_folder_and_the_tensor(tmp_path, edit, message):
    folder = tmp_path / "bad"
    random_model(family_config("qwen2")).save_pretrained(folder)
    _rewrite(folder, edit)
    with pytest.raises(ModelSourceError, match=f"^{folder}: {message}"):
        load_model(str(folder), plan=plan())


def test_a_folder_without_safetensors_is_refused(tmp_path):
    folder = tmp_path / "bin"
    family_config("llama").save_pretrained(folder)
    with pytest.raises(ModelSourceError, match=rf"^{folder}: no \*.safetensors file"):
        load_model(str(folder))


# ---------------------------------------------------------------- peak RSS of one load

# The child measures its own RSS before it loads (interpreter, torch, transformers, the Phi-3
# modeling code and a first packed linear: what any rank holds before a weight arrives) and
# its high-water mark after; the load may add at most 1.3x the weights it loaded to that
# baseline (issue 30's target for a replica loaded from a checkpoint).
RSS_CHILD = r"""
import json, sys
import torch
from transformers.models.phi3 import modeling_phi3  # noqa: F401  (the code the load runs)
from vcfslm.engine.linear import choose_plan, onednn_bf16, pack_linears
from vcfslm.engine.model import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

plan = choose_plan(onednn_bf16())
pack_linears(torch.nn.Sequential(torch.nn.Linear(256, 256, dtype=torch.bfloat16)), plan)
baseline, hwm_before = status("VmRSS:"), status("VmHWM:")
loaded = load_model(sys.argv[1], plan=plan)
print(json.dumps({"baseline": baseline, "hwm_before": hwm_before, "hwm": status("VmHWM:"),
                  "rss": status("VmRSS:"), "weight_bytes": loaded.weight_bytes,
                  "held_weight_bytes": loaded.held_weight_bytes}))
"""
PEAK_RATIO = 1.3


@pytest.fixture(scope="module")
def phi3_mini_one_layer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3-mini-L1") / "hf"
    write = ("import sys; from pathlib import Path; from vcfslm.engine.checkpoint import write_checkpoint; "
             "write_checkpoint('synthetic:phi-3-mini,layers=1', Path(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", write, str(folder)], capture_output=True, text=True,
                          env=_child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


def _child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_peak_rss_of_a_checkpoint_load_stays_within_its_bound(phi3_mini_one_layer):
    done = subprocess.run([sys.executable, "-c", RSS_CHILD, str(phi3_mini_one_layer)], capture_output=True,
                          text=True, env=_child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert 600e6 < got["weight_bytes"] < 650e6  # 1 layer of hidden 3072, vocabulary 32064 in and out
    # What the plan holds: the model's bytes, or its linears twice over where it holds fp32.
    weights = got["held_weight_bytes"]
    bound = got["baseline"] + PEAK_RATIO * weights
    assert got["hwm"] <= bound, (f"peak RSS {got['hwm'] / 1e6:.0f} MB > baseline {got['baseline'] / 1e6:.0f} MB "
                                 f"+ {PEAK_RATIO} x {weights / 1e6:.0f} MB of weights")
    assert got["rss"] >= got["baseline"] + 0.9 * weights  # the weights are really in memory


def test_checkpoint_files_refuse_a_broken_index_or_header(tmp_path):
    from vcfslm.engine.checkpoint_files import INDEX_NAME, CheckpointError, checkpoint_entries

    folder = tmp_path / "sharded"
    random_model(family_config("llama")).save_pretrained(folder, max_shard_size="100KB")
    index = json.loads((folder / INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    assert len(checkpoint_entries(folder)) == len(index["weight_map"])
    (folder / shard).rename(folder / "elsewhere.bin")
    with pytest.raises(CheckpointError, match=f"^{folder}: {INDEX_NAME} names shard {shard}, which is not in"):
        checkpoint_entries(folder)
    (folder / "elsewhere.bin").write_bytes(b"\x10\x00")
    (folder / "elsewhere.bin").rename(folder / shard)
    with pytest.raises(CheckpointError, match=f"^{folder / shard}: too short for a safetensors file"):
        checkpoint_entries(folder)
    (folder / shard).write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(CheckpointError, match=rf"^{folder / shard}: not a readable safetensors file \(.*JSON"):
        checkpoint_entries(folder)


def test_a_synthetic_model_is_packed_by_load_model_when_given_a_plan():
    from vcfslm.engine.loader import packed_report

    seen = []
    loaded = load_model("synthetic:tiny", plan=plan(), before_pack=lambda m: seen.append(
        sum(type(x) is torch.nn.Linear for x in m.modules())))
    assert seen == [2 * 4 + 1]  # called once, before any linear was packed
    report = packed_report(loaded.model)
    assert report is not None and report.linears == 2 * 4 + 1 and report.plan == plan()
    assert loaded.facts["params"] == load_model("synthetic:tiny").facts["params"]
