"""vcfslm's engine beside OpenVINO GenAI, llama.cpp and vLLM: one model, one machine, one run.

    make peers                                             # once: .venv-peers (OpenVINO, llama.cpp) and .venv-vllm
    .venv/bin/python benchmarks/peers.py --layers 4        # quick: 4 of Phi-3-mini's 32 layers
    .venv/bin/python benchmarks/peers.py --layers 32       # the full shape (~7.6 GB bf16 per engine)
    .venv/bin/python benchmarks/peers.py --engines vcfslm,llama.cpp --rounds 3
    .venv/bin/python benchmarks/peers.py --equivalence-only --break-rope llama.cpp   # the check, caught

Model: the synthetic Phi-3-mini-128k shape with random bf16 weights from one seed
(vcfslm.engine.model), saved once as a Hugging Face checkpoint under `--cache`; that
checkpoint is the only source of the other formats: an OpenVINO IR exported by
optimum-intel with bf16 constants (not the int8 weight compression optimum applies by
itself above 1B parameters) and a bf16 GGUF written here with the `gguf` package. vcfslm
and vLLM load the checkpoint itself. The peers run in their own venvs (transformers < 5.6
for optimum-intel; vLLM's pins); a peer that is not installed is reported as missing.

Equivalence first (peer_equivalence): on a `--equivalence-layers` checkpoint from the same
seed, every engine's greedy continuation of the same prompt ids is compared with HF
eager's (float32): top-1 agreement, and logit correlation where the engine exposes logits.
A peer that is not equivalent is reported so, and neither timed nor ranked.

Alternation: at most one engine is resident at a time. Each round starts one child
process per engine, in order (A B C, A B C, ...), every child pinned to the same CPUs
(`taskset -c --cpus`; vLLM's OMP threads bound to them too); a child loads its model from
disk, runs a discarded warm-up window and `--windows` measured windows at batch 1, then
the same at batch `--big-batch`, reports, and exits. The read probe runs in this process
before every round; the fastest read gives the floors. OpenVINO's ranked row keeps a bf16
KV cache like the others; its default u8 KV cache is an extra row, never ranked. llama.cpp
decodes all sequences of a batch in one `llama_decode` (its multi-sequence batch API).

TPOT = (last token - first token) / (tokens - 1) per step of the batch; TTFT = request
start -> first token; decode tok/s = batch / TPOT. Greedy, EOS ignored, the same prompt
token ids for every engine. Cells are medians with 95 % intervals and ratios (vcfslm /
peer) carry theirs, by bootstrap over rounds (peer_stats); a ratio whose interval spans 1
is printed "even". Nothing here asserts.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("vcfslm", "openvino", "openvino-u8kv", "llama.cpp", "vllm")
# An extra row, timed and checked but never ranked: OpenVINO with its default u8 KV cache
# (the ranked OpenVINO row keeps bf16 KV, as the others do).
UNRANKED = {"openvino-u8kv"}
PEER_MODULES = {"openvino": "openvino_genai", "openvino-u8kv": "openvino_genai", "llama.cpp": "llama_cpp",
                "vllm": "vllm"}
OPENVINO_KV = {"openvino": "bf16", "openvino-u8kv": None}
DEFAULT_CACHE = ROOT / ".vcfslm" / "peers"
DEFAULT_PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SEED = 0
EQUIVALENCE_PROMPTS = 4


def engine_list(text: str) -> list[str]:
    """`vcfslm,openvino` -> ["vcfslm", "openvino"] (argparse type); order kept, duplicates dropped."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {', '.join(unknown) or '(none)'}; "
                                         f"known: {', '.join(ENGINES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="Phi-3-mini layers to keep (32 = full model)")
    ap.add_argument("--engines", type=engine_list, default=list(ENGINES), help=f"subset of {','.join(ENGINES)}")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per window")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of one child per engine")
    ap.add_argument("--windows", type=int, default=2, help="measured windows per batch per round")
    ap.add_argument("--big-batch", type=int, default=16, help="the second batch size (0: batch 1 only)")
    ap.add_argument("--probe-mib", type=int, default=1024)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the three model formats are kept")
    ap.add_argument("--peers-python", type=Path, default=DEFAULT_PEERS_PYTHON,
                    help="the interpreter of the peers' venv (benchmarks/peers-setup.sh)")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                    help="the interpreter of vLLM's venv (make vllm)")
    ap.add_argument("--cpus", default=cpu_list(sorted(os.sched_getaffinity(0))),
                    help="the CPUs every child is pinned to (taskset -c; vLLM's OMP threads too)")
    ap.add_argument("--equivalence-layers", type=int, default=2,
                    help="layers of the checkpoint the equivalence check runs on (0: skip the check)")
    ap.add_argument("--equivalence-only", action="store_true", help="run the equivalence check, then stop")
    ap.add_argument("--break-rope", type=str, default="", metavar="ENGINE",
                    help="give ENGINE a model whose rope theta is changed (the check must call it not equivalent)")
    ap.add_argument("--build-only", action="store_true", help="build the model formats the engines need, then stop")
    ap.add_argument("--save", type=Path, metavar="JSON",
                    help="also write every window of every round, the probes and the verdicts to JSON")
    ap.add_argument("--child", choices=("checkpoint", "openvino-ir", "gguf", "reference", *ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.layers < 1 or args.tokens < 2 or args.rounds < 1 or args.windows < 1 or args.equivalence_layers < 0:
        ap.error("--layers >= 1, --tokens >= 2, --rounds >= 1, --windows >= 1 and --equivalence-layers >= 0")
    if args.break_rope and args.break_rope not in ENGINES[1:]:
        ap.error(f"--break-rope takes a peer: {', '.join(ENGINES[1:])}")
    return args


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (taskset's and VLLM_CPU_OMP_THREADS_BIND's form)."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}" if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def model_dir(args, layers: int | None = None) -> Path:
    return args.cache / f"phi-3-mini-L{layers or args.layers}-seed{SEED}"


def batches(args) -> list[int]:
    return [1] + ([args.big_batch] if args.big_batch > 1 else [])


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------ model formats


def write_checkpoint(out: Path, layers: int) -> dict:
    """The synthetic Phi-3-mini (one seed) as a HF checkpoint + a minimal tokenizer (runs in .venv)."""
    sys.path.insert(0, str(ROOT))
    from decode_efficiency import spec_for
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vcfslm.engine.model import load_model

    loaded = load_model(spec_for(layers), seed=SEED)
    config = loaded.config
    loaded.model.save_pretrained(out)
    # optimum's export wants a tokenizer; ids are all this benchmark feeds, so a word-level
    # vocabulary of the model's size is enough.
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2, "<|endoftext|>": config.eos_token_id})
    vocab = {token: i for i, token in sorted((i, t) for t, i in vocab.items())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>",
                            unk_token="<unk>", pad_token="<|endoftext|>").save_pretrained(out)
    facts = {"params": loaded.facts["params"], "weight_bytes": loaded.weight_bytes,
             "step_weight_bytes": loaded.step_weight_bytes, "kv_bytes_per_token": loaded.kv_bytes_per_token}
    (out / "facts.json").write_text(json.dumps(facts))
    return facts


def export_openvino(hf: Path, out: Path) -> dict:
    """The checkpoint as a stateful OpenVINO IR with bf16 constants (runs in the peers' venv)."""
    import openvino as ov
    import torch
    from optimum.exporters.openvino import main_export
    from optimum.intel import OVConfig

    # An ov_config switches optimum's int8 weight compression (models > 1B) off; its dtype
    # "fp32" alone would load the model in fp32, so the bf16 load is asked for as well, and
    # the constants stay bf16.
    main_export(str(hf), output=str(out), task="text-generation-with-past", stateful=True,
                ov_config=OVConfig(dtype="fp32"), model_loading_kwargs={"torch_dtype": torch.bfloat16},
                convert_tokenizer=True)
    counts: dict[str, int] = {}
    for op in ov.Core().read_model(out / "openvino_model.xml").get_ops():
        if op.get_type_name() == "Constant" and len(op.shape) == 2:
            kind = op.get_element_type().get_type_name()
            counts[kind] = counts.get(kind, 0) + math.prod(op.shape)
    return {"matrix_constants": counts}


def _safetensors(hf: Path):
    """(name, dtype, shape, memmap of the bytes) of every tensor of a checkpoint, no copy."""
    import numpy as np

    for path in sorted(hf.glob("*.safetensors")):
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                yield name, meta["dtype"], meta["shape"], data[start:end]


GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """HF Phi-3 tensor name -> llama.cpp's phi3 name (Phi-3's qkv and gate_up are fused in both)."""
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, index, part = stem.split(".", 3)
        return f"blk.{index}.{GGUF_NAMES[part]}.{kind}"
    return f"{GGUF_NAMES[stem]}.{kind}"


def write_gguf(hf: Path, out: Path) -> None:
    """The checkpoint as a bf16 GGUF of llama.cpp's phi3 architecture (runs in the peers' venv)."""
    import gguf
    import numpy as np

    c = json.loads((hf / "config.json").read_text())
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    original = c.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    scale = c["max_position_embeddings"] / original
    w = gguf.GGUFWriter(str(out), "phi3")
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    # LongRoPE's attention factor, as llama.cpp's own converter computes it.
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # A dummy sentencepiece-style vocabulary of the model's size: <unk> <s> </s>, the 256
    # byte tokens, then plain pieces; the benchmark feeds token ids.
    n, eos = c["vocab_size"], c["eos_token_id"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(len(tokens), n)]
    types += [gguf.TokenType.NORMAL] * (n - len(types))
    tokens[eos], types[eos] = "<|endoftext|>", gguf.TokenType.CONTROL
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(eos)
    w.add_unk_token_id(0)
    w.add_pad_token_id(c.get("pad_token_id") or eos)
    for name, dtype, shape, raw in _safetensors(hf):
        if dtype != "BF16":
            raise ValueError(f"{name}: {dtype}, expected BF16")
        bits = raw.view(np.uint16).reshape(shape)
        if len(shape) == 1:  # norms in f32, as llama.cpp's converter keeps them
            w.add_tensor(gguf_name(name), (bits.astype(np.uint32) << 16).view(np.float32))
        else:
            w.add_tensor(gguf_name(name), bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    for which in ("long", "short"):
        w.add_tensor(f"rope_factors_{which}.weight", np.asarray(rope[f"{which}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------------ children: one engine each


def child_vcfslm(job: dict) -> dict:
    """Load the checkpoint into vcfslm's engine and run the job's windows (runs in .venv)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from decode_efficiency import engine_window

    from vcfslm.engine.decode import DecodeEngine
    from vcfslm.engine.linear import default_plan
    from vcfslm.engine.model import load_model

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    # The checkpoint loader packs each linear as it arrives (vcfslm.engine.loader): the load's
    # peak is read before anything else runs.
    loaded = load_model(job["hf"], seed=SEED, max_context=job["prompt"] + job["tokens"],
                        plan=default_plan())
    load_peak = peak_rss_bytes()
    engine = DecodeEngine(loaded.model, "compile")
    out = {"load_s": time.perf_counter() - started, "load_peak_rss": load_peak, "weight_bytes": loaded.weight_bytes,
           "kernel": f"KernelPlan {engine.plan.label}; engine {engine.label}; "
                     f"pack check max relative error {engine.pack.max_rel_error:.2g}; "
                     f"loaded by vcfslm.engine.loader (packed as it loads)"}

    def window(batch, i):
        w = engine_window(engine, torch.tensor(job["prompts"][str(batch)][i]), job["tokens"])
        return w["tpot_ms"], w["ttft_s"]

    out["batches"] = {str(b): run_windows(window, b, job["windows"]) for b in job["batches"]}
    return out


def openvino_pipeline(job: dict):
    """LLMPipeline with the bf16 hint; KV cache bf16 unless the job keeps OpenVINO's default
    (u8 on CPU: the extra, unranked row)."""
    import openvino_genai as og

    config = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("kv") == "bf16":
        config["KV_CACHE_PRECISION"] = "bf16"
    return config, og.LLMPipeline(job["ov"], "CPU", **config)


def child_openvino(job: dict) -> dict:
    """OpenVINO GenAI's LLMPipeline on the IR, bf16 inference hint (runs in the peers' venv)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    started = time.perf_counter()
    config, pipe = openvino_pipeline(job)
    load_s = time.perf_counter() - started
    gen = og.GenerationConfig()
    gen.max_new_tokens = gen.min_new_tokens = job["tokens"]
    gen.ignore_eos = True
    gen.do_sample = False

    def window(batch, i):
        ids = np.asarray(job["prompts"][str(batch)][i], dtype=np.int64)
        inputs = og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        result = pipe.generate(inputs, gen)
        wall = time.perf_counter() - t0
        if len(result.tokens) != batch or any(len(t) != job["tokens"] for t in result.tokens):
            raise RuntimeError(f"expected {batch} x {job['tokens']} tokens")
        # The pipeline's own TTFT; its TPOT is per token of the batch, so a step is timed
        # here as the rest of the call over the remaining steps.
        ttft = result.perf_metrics.get_ttft().mean / 1000
        return (wall - ttft) / (job["tokens"] - 1) * 1000, ttft

    core = ov.Core()
    facts = [f"OpenVINO {ov.get_version()}", "device CPU"]
    for key in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES"):
        try:
            facts.append(f"{key} {core.get_property('CPU', key)}")
        except Exception:  # a property this version does not report
            pass
    facts.append(", ".join(f"{k} {v}" for k, v in config.items()) + " (given to LLMPipeline)"
                 + ("" if "KV_CACHE_PRECISION" in config else "; KV cache at OpenVINO's default"))
    batches_out = {}
    for b in job["batches"]:
        try:
            batches_out[str(b)] = run_windows(window, b, job["windows"])
        except RuntimeError as exc:  # a batch the pipeline refuses is reported, not faked
            batches_out[str(b)] = {"unsupported": f"not supported: {str(exc).splitlines()[0][:120]}"}
    return {"load_s": load_s, "kernel": "; ".join(facts), "batches": batches_out}


# ggml's type numbers for a KV cache (llama-cpp-python names no BF16 constant).
GGML_KV_TYPES = {0: "f32", 1: "f16", 30: "bf16"}


class LlamaBatched:
    """llama.cpp decoding many sequences in one `llama_decode`, as its batched-bench does:
    a context of its own with one KV sequence per row (llama-cpp-python's high-level
    `Llama` holds one sequence; it is used here only to load the GGUF)."""

    def __init__(self, path: str, rows: int, prompt: int, tokens: int, threads: int):
        import llama_cpp
        from llama_cpp import _internals

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=prompt + tokens + 8, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = rows
        params.n_ctx = rows * (prompt + tokens + 8)   # split evenly: each sequence holds its own
        params.n_batch = params.n_ubatch = max(rows * prompt, 32)  # the whole prefill in one decode
        params.n_threads = params.n_threads_batch = threads
        self.ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        self.kv_types = (params.type_k, params.type_v)
        self.batch = _internals.LlamaBatch(n_tokens=params.n_batch, embd=0, n_seq_max=1, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _logits(self, index: int):
        import numpy as np

        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx.ctx, index), shape=(self.vocab,))

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch.batch
        for n, (token, pos, seq, logits) in enumerate(entries):
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
            b.seq_id[n][0] = seq
        b.n_tokens = len(entries)
        self.ctx.decode(self.batch)

    def generate(self, rows: list[list[int]], tokens: int, keep_first_logits: bool = False):
        """Greedy `tokens` per row; (tokens [rows][tokens], first logits or None, TTFT s, TPOT ms)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx.ctx), True)
        t0 = time.perf_counter()
        entries, last = [], []
        for seq, ids in enumerate(rows):
            entries += [(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)]
            last.append(len(entries) - 1)
        self._decode(entries)
        first = [self._logits(i).copy() for i in last] if keep_first_logits else None
        token = [int(self._logits(i).argmax()) for i in last]
        out = [[t] for t in token]
        t1 = time.perf_counter()
        for step in range(tokens - 1):
            self._decode([(t, len(rows[s]) + step, s, True) for s, t in enumerate(token)])
            token = [int(self._logits(s).argmax()) for s in range(len(rows))]
            for s, t in enumerate(token):
                out[s].append(t)
        tpot = (time.perf_counter() - t1) / max(tokens - 1, 1) * 1000
        return out, first, t1 - t0, tpot

    def kernel(self) -> str:
        info = self.lib.llama_print_system_info().decode().strip()
        # llama.cpp's default KV type is f16: two bytes a value, as the others' bf16.
        kv = "/".join(GGML_KV_TYPES.get(t, f"ggml type {t}") for t in self.kv_types)
        return (f"llama-cpp-python {self.lib.__version__}, bf16 GGUF, KV cache {kv} (K/V), one llama_decode per step "
                f"for all sequences (n_seq_max {self.lib.llama_n_seq_max(self.ctx.ctx)}); {info}")


def child_llama(job: dict) -> dict:
    """llama.cpp on the bf16 GGUF, greedy over its logits (runs in the peers' venv)."""
    started = time.perf_counter()
    engine = LlamaBatched(job["gguf"], max(job["batches"]), job["prompt"], job["tokens"], job["threads"])
    load_s = time.perf_counter() - started

    def window(batch, i):
        _, _, ttft, tpot = engine.generate(job["prompts"][str(batch)][i], job["tokens"])
        return tpot, ttft

    out = {str(b): run_windows(window, b, job["windows"]) for b in job["batches"]}
    return {"load_s": load_s, "kernel": engine.kernel(), "batches": out}


# ------------------------------------------------------------------ equivalence children
# Each writes the greedy continuation of job["prompts"] (and its logits where the engine
# exposes them) to job["out"] (.npz); peer_equivalence.compare judges it.


def equivalence_reference(job: dict) -> dict:
    """HF eager in float32 on the bf16 checkpoint: tokens and logits at every position (.venv)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["hf"], dtype=torch.float32, attn_implementation="eager").eval()
    prompt = torch.tensor(job["prompts"])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=job["tokens"], min_new_tokens=job["tokens"], output_logits=True,
                             return_dict_in_generate=True, pad_token_id=model.config.eos_token_id)
    np.savez(job["out"], tokens=out.sequences[:, prompt.shape[1]:].numpy(),
             logits=torch.stack(out.logits, dim=1).float().numpy())
    return {"kernel": f"transformers eager, float32, torch {torch.__version__}"}


def equivalence_vcfslm(job: dict) -> dict:
    """vcfslm's packed, compiled engine, the way it is timed (.venv)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from vcfslm.engine.decode import DecodeEngine
    from vcfslm.engine.linear import default_plan
    from vcfslm.engine.model import load_model

    torch.set_num_threads(job["threads"])
    prompt = torch.tensor(job["prompts"])
    loaded = load_model(job["hf"], seed=SEED, max_context=prompt.shape[1] + job["tokens"],
                        plan=default_plan())
    engine = DecodeEngine(loaded.model, "compile")
    with torch.inference_mode():
        first = engine.prefill(prompt, engine.store_for(*prompt.shape)).float().numpy()
    tokens = engine.generate(prompt, job["tokens"]).tokens.numpy()
    np.savez(job["out"], tokens=tokens, first_logits=first)
    return {"kernel": f"vcfslm {engine.label}, linears {engine.plan.label}"}


def equivalence_openvino(job: dict) -> dict:
    """OpenVINO GenAI's greedy tokens (its pipeline exposes no logits) (peers' venv)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    _, pipe = openvino_pipeline(job)
    gen = og.GenerationConfig()
    gen.max_new_tokens = gen.min_new_tokens = job["tokens"]
    gen.ignore_eos, gen.do_sample = True, False
    ids = np.asarray(job["prompts"], dtype=np.int64)
    result = pipe.generate(og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), gen)
    np.savez(job["out"], tokens=np.asarray(result.tokens, dtype=np.int64))
    return {"kernel": f"OpenVINO GenAI {ov.get_version()}, KV {job.get('kv') or 'default'}"}


def equivalence_llama(job: dict) -> dict:
    """llama.cpp's greedy tokens and its full logits at the first position (peers' venv)."""
    import numpy as np

    rows = job["prompts"]
    engine = LlamaBatched(job["gguf"], len(rows), len(rows[0]), job["tokens"], job["threads"])
    tokens, first, _, _ = engine.generate(rows, job["tokens"], keep_first_logits=True)
    np.savez(job["out"], tokens=np.asarray(tokens, dtype=np.int64), first_logits=np.stack(first))
    return {"kernel": engine.kernel()}


def child_vllm(job: dict) -> dict:
    import peer_vllm

    return peer_vllm.child_timing(job, run_windows)


def equivalence_vllm(job: dict) -> dict:
    import peer_vllm

    return peer_vllm.child_equivalence(job)


def run_windows(window, batch: int, count: int) -> dict:
    """One discarded warm-up window, then `count` measured ones: TPOT ms, TTFT s each. Window i
    gets prompt set i: no prompt repeats within a process, so an engine's prefix cache
    (OpenVINO GenAI reuses the KV of a prompt it has seen) never skips a measured prefill."""
    window(batch, 0)
    tpot, ttft = zip(*(window(batch, i) for i in range(1, count + 1)), strict=True)
    return {"tpot_ms": list(tpot), "ttft_s": list(ttft), "peak_rss": peak_rss_bytes()}


CHILDREN = {"vcfslm": child_vcfslm, "openvino": child_openvino, "openvino-u8kv": child_openvino,
            "llama.cpp": child_llama, "vllm": child_vllm}
EQUIVALENCE = {"reference": equivalence_reference, "vcfslm": equivalence_vcfslm,
               "openvino": equivalence_openvino, "openvino-u8kv": equivalence_openvino,
               "llama.cpp": equivalence_llama, "vllm": equivalence_vllm}


def child_main(args) -> int:
    job = json.loads(args.job.read_text()) if args.job else {}
    if args.child == "checkpoint":
        result = write_checkpoint(Path(job["hf"]), job["layers"])
    elif args.child == "openvino-ir":
        result = export_openvino(Path(job["hf"]), Path(job["ov"]))
    elif args.child == "gguf":
        write_gguf(Path(job["hf"]), Path(job["gguf"]))
        result = {}
    elif job.get("equivalence"):
        result = EQUIVALENCE[args.child](job)
    else:
        result = CHILDREN[args.child](job)
    result["peak_rss"] = peak_rss_bytes()
    print("CHILD " + json.dumps(result))
    return 0


# ------------------------------------------------------------------ the run


def engine_python(args, name: str) -> Path | str:
    return {"vcfslm": sys.executable, "vllm": args.vllm_python}.get(name, args.peers_python)


def child_env(args, name: str, kv_gib: int = 2) -> dict:
    """What every child of `name` runs under, beside taskset: the compile cache for vcfslm,
    the CPU binding and the in-process engine core for vLLM."""
    if name == "vcfslm":
        from vcfslm.bench.pages import HUGE_PAGES_ENV
        from vcfslm.guest_layout import host_inductor_cache

        # The rank's environment: its weights on 2 MiB pages, as rank.sh sets, and the compile
        # cache `bench --local` ranks use, so a graph either compiled is warm for the other.
        return {"TORCHINDUCTOR_CACHE_DIR": str(host_inductor_cache(None, os.environ)), **HUGE_PAGES_ENV}
    if name == "vllm":
        return {"VLLM_CPU_OMP_THREADS_BIND": args.cpus, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {}


def run_child(python: Path | str, kind: str, job: dict, env: dict | None = None, cpus: str | None = None) -> dict:
    """Run this file as a `kind` child under `python`, pinned to `cpus`; its CHILD line, parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
    pin = ["taskset", "-c", cpus] if cpus else []
    try:
        done = subprocess.run([*pin, str(python), __file__, "--child", kind, "--job", fh.name], capture_output=True,
                              text=True, env={**os.environ, **(env or {})}, check=False)
    finally:
        os.unlink(fh.name)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CHILD ")), None)
    if done.returncode != 0 or line is None:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{kind} child failed ({done.returncode})")
    return json.loads(line[len("CHILD "):])


def peer_status(args) -> dict[str, str | None]:
    """None for an engine that can run; otherwise why it cannot."""
    status: dict[str, str | None] = {}
    for name in args.engines:
        module = PEER_MODULES.get(name)
        python = Path(engine_python(args, name))
        setup = "make vllm" if name == "vllm" else "make peers"
        if module is None:
            status[name] = None
        elif not python.exists():
            status[name] = f"missing: no {python} ({setup})"
        else:
            probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, check=False)
            status[name] = None if probe.returncode == 0 else f"missing: `import {module}` fails in {python} ({setup})"
    return status


def ensure_formats(args, ready: list[str], layers: int | None = None, rope_theta: float | None = None,
                   root: Path | None = None) -> dict:
    """Build whatever model format a ready engine needs and the cache lacks; paths + facts.
    rope_theta: a deliberately broken copy (under `root`) whose rope theta is changed in
    every format, its weights linked to the good checkpoint's."""
    layers = layers or args.layers
    good = model_dir(args, layers)
    root = root or good
    paths = {"hf": str(root / "hf"), "ov": str(root / "openvino"), "gguf": str(root / "model-bf16.gguf")}
    if rope_theta is not None:
        ensure_formats(args, [], layers)
        broken_checkpoint(good / "hf", root / "hf", rope_theta)
    steps = [("checkpoint", sys.executable, root / "hf" / "facts.json", rope_theta is None),
             ("openvino-ir", args.peers_python, root / "openvino" / "openvino_model.xml",
              bool({"openvino", "openvino-u8kv"} & set(ready))),
             ("gguf", args.peers_python, root / "model-bf16.gguf", "llama.cpp" in ready)]
    for kind, python, marker, wanted in steps:
        if not wanted or marker.exists():
            continue
        started = time.perf_counter()
        # The IR folder and the GGUF file are written under a name of their own, then renamed
        # into place: a build cut short never leaves a marker over half a model in the cache.
        partial = {"gguf": marker.with_name(f"{marker.name}.partial-{os.getpid()}"),
                   "openvino-ir": marker.parent.with_name(f"{marker.parent.name}.partial-{os.getpid()}")}.get(kind)
        if kind == "openvino-ir":
            shutil.rmtree(partial, ignore_errors=True)
        job = {**paths, "layers": layers, **({{"gguf": "gguf", "openvino-ir": "ov"}[kind]: str(partial)}
                                             if partial else {})}
        result = run_child(python, kind, job)
        if kind == "openvino-ir":
            shutil.rmtree(marker.parent, ignore_errors=True)
            partial.rename(marker.parent)
        elif partial:
            partial.rename(marker)
        extra = "".join(f"; {k} {v}" for k, v in result.items() if k != "peak_rss")
        print(f"built {kind} {marker.parent if kind != 'gguf' else marker} in {time.perf_counter() - started:.0f} s "
              f"(peak RSS {result['peak_rss'] / 1e9:.1f} GB{extra})", flush=True)
    return {**paths, "facts": json.loads((good / "hf" / "facts.json").read_text())}


def broken_checkpoint(good: Path, out: Path, rope_theta: float) -> None:
    """`good` with config.json's rope theta changed; every other file a link to good's."""
    out.mkdir(parents=True, exist_ok=True)
    for src in good.iterdir():
        dst = out / src.name
        if src.name != "config.json" and not dst.exists():
            dst.symlink_to(src)
    config = json.loads((good / "config.json").read_text())
    for holder in (config, config.get("rope_parameters") or {}, config.get("rope_scaling") or {}):
        if "rope_theta" in holder:
            holder["rope_theta"] = rope_theta
    (out / "config.json").write_text(json.dumps(config, indent=2))


def reference_outputs(args, layers: int, prompts: list[list[int]], run) -> tuple[dict, str]:
    """HF eager's tokens and logits for `prompts`, computed once per checkpoint, prompts, length
    and transformers/torch versions and kept beside the checkpoint: every check of the same
    cache compares against the same reference without loading the model in float32 again."""
    import hashlib

    import numpy as np

    versions = "/".join(md.version(name) for name in ("transformers", "torch"))
    key = hashlib.sha256(json.dumps([prompts, args.tokens, versions]).encode()).hexdigest()[:16]
    saved, about = model_dir(args, layers) / f"reference-{key}.npz", model_dir(args, layers) / f"reference-{key}.txt"
    if saved.exists() and about.exists():
        return dict(np.load(saved)), about.read_text().strip() + " (kept from an earlier check of this cache)"
    partial = saved.with_name(saved.stem + ".partial.npz")
    outputs, kernel = run("reference", partial)
    about.write_text(kernel + "\n")
    partial.rename(saved)
    return outputs, kernel


def check_equivalence(args, ready: list[str]) -> dict:
    """Every ready engine's greedy continuation on the small checkpoint, against HF eager's;
    engine -> peer_equivalence.Verdict. --break-rope gives one engine a broken conversion."""
    import numpy as np
    import peer_equivalence

    layers = args.equivalence_layers
    paths = ensure_formats(args, ready, layers)
    broken = {}
    if args.break_rope in ready:
        theta = json.loads(Path(paths["hf"], "config.json").read_text())
        theta = (theta.get("rope_parameters") or theta.get("rope_scaling") or theta).get("rope_theta", 10000.0)
        broken = ensure_formats(args, [args.break_rope], layers, rope_theta=theta * 100,
                                root=model_dir(args, layers) / "broken-rope")
        print(f"equivalence: {args.break_rope} is given a broken conversion: rope theta {theta:g} -> {theta * 100:g}")
    vocab = json.loads(Path(paths["hf"], "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(7)
    prompts = rng.integers(3, vocab - 1, size=(EQUIVALENCE_PROMPTS, args.prompt)).tolist()
    verdicts = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(name, out=None):
            out = out or Path(tmp, f"{name}.npz")
            job = {**(broken if name == args.break_rope else paths), "prompts": prompts, "tokens": args.tokens,
                   "threads": args.threads, "equivalence": True, "out": str(out), "kv": OPENVINO_KV.get(name)}
            python = sys.executable if name == "reference" else engine_python(args, name)
            result = run_child(python, name, job, child_env(args, name), args.cpus)
            return dict(np.load(out)), result["kernel"]

        ref, kernel = reference_outputs(args, layers, prompts, run)
        print(f"equivalence reference: {kernel}; {EQUIVALENCE_PROMPTS} prompts x {args.prompt} tokens, "
              f"{args.tokens} generated, {layers}-layer checkpoint {model_dir(args, layers)}")
        for name in ready:
            got, kernel = run(name)
            verdicts[name] = peer_equivalence.compare(
                name, ref["tokens"], ref["logits"], got["tokens"], got.get("first_logits"),
                got.get("topk_ids"), got.get("topk_logprobs"))
            print(f"EQUIVALENCE {verdicts[name].line()}", flush=True)
    return verdicts


def cell_rounds(runs: list[dict], batch: int, key: str) -> list[list[float]] | str | None:
    """One list of window samples per round (rounds are the bootstrap's unit), or why there are none."""
    cells = [r["batches"].get(str(batch)) for r in runs]
    bad = next((c["unsupported"] for c in cells if c and "unsupported" in c), None)
    if bad or not cells or any(c is None for c in cells):
        return bad
    return [c[key] for c in cells]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    sys.path.insert(0, str(ROOT))
    import torch
    from decode_efficiency import cpu_line, spec_for
    from transformers import AutoConfig

    from vcfslm.bench import probe
    from vcfslm.engine.decode import synthetic_prompt

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load0 = os.getloadavg()[0]
    print(cpu_line())
    # With --equivalence-only no timed model is built: its layers would only mislead.
    timed = "equivalence only" if args.equivalence_only else f"model {spec_for(args.layers)}"
    print(f"threads {args.threads}; every child pinned with taskset -c {args.cpus}; prompt {args.prompt} tokens; "
          f"{args.tokens} generated; {timed}, seed {SEED}; engines {', '.join(args.engines)}",
          flush=True)
    status = peer_status(args)
    ready = [e for e in args.engines if status[e] is None]
    for name in args.engines:
        if status[name]:
            print(f"{name}: {status[name]}")
    verdicts = check_equivalence(args, ready) if args.equivalence_layers and not args.build_only else {}
    for name, verdict in verdicts.items():
        if not verdict.equivalent:
            status[name] = "not equivalent (not timed, not ranked): " + "; ".join(verdict.reasons)
    if args.equivalence_only:
        return 0 if all(v.equivalent for n, v in verdicts.items() if n != args.break_rope) else 1
    ready = [e for e in ready if status[e] is None]
    paths = ensure_formats(args, ready)
    facts = paths["facts"]
    config = AutoConfig.from_pretrained(paths["hf"])
    print(f"model: {facts['params'] / 1e9:.3f}B params, {facts['weight_bytes'] / 1e9:.3f} GB bf16, in {model_dir(args)}")
    if args.build_only:
        return 0
    # One prompt set per window (warm-up first), the same sets for every engine.
    prompts = {str(b): [synthetic_prompt(b, args.prompt, config.vocab_size, seed=1000 * b + i).tolist()
                        for i in range(args.windows + 1)] for b in batches(args)}
    job = {**paths, "threads": args.threads, "prompt": args.prompt, "tokens": args.tokens, "windows": args.windows,
           "batches": batches(args), "prompts": prompts}
    kv_gib = max(1, math.ceil(max(batches(args)) * (args.prompt + args.tokens + 8) * facts["kv_bytes_per_token"]
                              * 2 / 2**30))

    gemm = probe.measure_gemm(args.threads)
    reads: list[float] = []
    runs: dict[str, list[dict]] = {e: [] for e in ready}
    for r in range(args.rounds):
        reads.append(probe.measure_bandwidth(args.threads, args.probe_mib, repeats=2).read_gbs)
        for name in ready:
            result = run_child(engine_python(args, name), name, {**job, "kv": OPENVINO_KV.get(name)},
                               child_env(args, name, kv_gib), args.cpus)
            runs[name].append(result)
            b1 = result["batches"]["1"]
            load_peak = (f" (peak RSS {result['load_peak_rss'] / 1e9:.2f} GB = "
                         f"{result['load_peak_rss'] / result['weight_bytes']:.2f} x weights)"
                         if "load_peak_rss" in result else "")
            print(f"round {r + 1}/{args.rounds} {name}: load {result['load_s']:.1f} s{load_peak}, batch 1 TPOT "
                  + ", ".join(f"{t:.1f}" for t in b1["tpot_ms"]) + " ms", flush=True)
    reads.append(probe.measure_bandwidth(args.threads, args.probe_mib, repeats=2).read_gbs)
    read_gbs = max(reads)
    if args.save:
        save_samples(args, runs, status, verdicts, reads, gemm)
    print_report(args, config, facts, runs, status, verdicts, read_gbs, reads, gemm, started, load0)
    return 0


def save_samples(args, runs, status, verdicts, reads, gemm) -> None:
    """The raw material of the report: every window of every round per engine, so that a
    cell or a ratio can be recomputed (peer_stats) without running the engines again."""
    from dataclasses import asdict

    from vcfslm.results import atomic_write_json

    payload = {"argv": sys.argv[1:], "cpus": args.cpus, "threads": args.threads, "layers": args.layers,
               "prompt": args.prompt, "tokens": args.tokens, "read_gbs": reads,
               "gemm_tflops": gemm.tflops, "status": status,
               "verdicts": {name: asdict(v) for name, v in verdicts.items()}, "rounds": runs}
    atomic_write_json(args.save, payload)
    print(f"samples saved to {args.save}", flush=True)


def print_report(args, config, facts, runs, status, verdicts, read_gbs, reads, gemm, started, load0) -> None:
    from peer_stats import median_interval, ratio_interval, ratio_text

    from vcfslm import roofline

    context = roofline.mean_decode_context(args.prompt, args.tokens)
    floors = {}
    print()
    print(f"alternation: {args.rounds} rounds of {' '.join(runs) or '(none)'}, one child process per engine per "
          f"round (one engine resident at a time), each: load from disk, 1 discarded + {args.windows} measured "
          f"windows per batch; read probe before each round; every child on CPUs {args.cpus}")
    for b in batches(args):
        step_bytes = roofline.decode_step_bytes(facts["step_weight_bytes"], facts["kv_bytes_per_token"], b, context)
        flops = roofline.decode_step_flops(config, b, context)
        memory = roofline.roofline_tpot_ms(step_bytes, read_gbs)
        compute = flops / (gemm.tflops * 1e12) * 1000
        ttft = roofline.roofline_ttft_s(roofline.prefill_flops(config, b, args.prompt), gemm.tflops,
                                     facts["step_weight_bytes"], read_gbs)
        floors[b] = max(memory, compute)
        print(f"roofline batch {b}: {step_bytes / 1e9:.3f} GB per step / {read_gbs:.1f} GB/s read = {memory:.1f} ms; "
              f"compute {flops / 1e9:.1f} GFLOP / {gemm.tflops:.3f} TFLOP/s = {compute:.1f} ms; "
              f"TTFT floor {ttft:.3f} s")
    print(f"probe: read {min(reads):.1f}-{read_gbs:.1f} GB/s over {len(reads)} probes; bf16 GEMM {gemm.tflops:.3f} "
          f"TFLOP/s ({gemm.kernel}, M={gemm.rows})")
    print("cells: median over every window of every round, (95 % interval: bootstrap over rounds)")
    print()
    print(f"{'engine':<13} {'batch':>5}  {'TPOT ms (95 % interval)':>26}  {'TTFT s (95 % interval)':>24}  "
          f"{'decode tok/s':>12}  {'peak RSS GB':>11}  {'roofline/TPOT':>13}")
    samples = {}
    for b in batches(args):
        for name in args.engines:
            if status[name]:
                print(f"{name:<13} {b:>5}  {status[name]}")
                continue
            tpot, ttft = cell_rounds(runs[name], b, "tpot_ms"), cell_rounds(runs[name], b, "ttft_s")
            if not isinstance(tpot, list):
                print(f"{name:<13} {b:>5}  {tpot or 'no windows'}")
                continue
            samples[name, b] = tpot, ttft
            tp, tt = median_interval(tpot), median_interval(ttft)
            rss = max(r["peak_rss"] for r in runs[name])
            tag = "  (extra row, not ranked)" if name in UNRANKED else ""
            print(f"{name:<13} {b:>5}  {tp.median:9.1f} ({tp.low:7.1f}-{tp.high:7.1f})  "
                  f"{tt.median:8.3f} ({tt.low:6.3f}-{tt.high:6.3f})  {b * 1000 / tp.median:12.2f}  {rss / 1e9:11.2f}  "
                  f"{floors[b] / tp.median:13.2f}{tag}")
    print()
    print("ratios vcfslm/peer, median (95 % interval, bootstrap over rounds); 'even' when the interval spans 1:")
    for b in batches(args):
        if ("vcfslm", b) not in samples:
            continue
        mine = samples["vcfslm", b]
        for peer in (n for n in args.engines if n != "vcfslm" and n not in UNRANKED and (n, b) in samples):
            theirs = samples[peer, b]
            print(f"RATIO vcfslm/{peer} batch {b}: TPOT {ratio_text(ratio_interval(mine[0], theirs[0]))}; "
                  f"TTFT {ratio_text(ratio_interval(mine[1], theirs[1]))}")
    loads = [r for r in runs.get("vcfslm", []) if "load_peak_rss" in r]
    if loads:
        worst = max(r["load_peak_rss"] for r in loads)
        print(f"vcfslm checkpoint load: peak RSS {worst / 1e9:.2f} GB for {loads[0]['weight_bytes'] / 1e9:.2f} GB "
              f"of weights = {worst / loads[0]['weight_bytes']:.2f} x (target <= 1.3 x; the whole child's peak is "
              f"in the table)")
    print()
    if verdicts:
        print("equivalence (checked before timing; a peer not equivalent is neither timed nor ranked):")
        for verdict in verdicts.values():
            print(f"  {verdict.line()}")
    print("kernel path of each engine:")
    for name, results in runs.items():
        print(f"  {name}: {results[0]['kernel']}")
    print(f"noise: load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs); "
          f"wall {time.perf_counter() - started:.0f} s")

if __name__ == "__main__":
    sys.exit(main())
