"""vcfslm's engine beside OpenVINO GenAI and llama.cpp: one model shape, one machine, one run.

    make peers                                             # once: the peers' venv, .venv-peers
    .venv/bin/python benchmarks/peers.py --layers 4        # quick: 4 of Phi-3-mini's 32 layers
    .venv/bin/python benchmarks/peers.py --layers 32       # the full shape (~7.6 GB bf16 per engine)
    .venv/bin/python benchmarks/peers.py --engines vcfslm,llama.cpp

Model: the synthetic Phi-3-mini-128k shape with random bf16 weights from one seed
(vcfslm.bench.model), saved once as a Hugging Face checkpoint under `--cache`; that
checkpoint is the only source of the other two formats: an OpenVINO IR exported by
optimum-intel with bf16 constants (not the int8 weight compression optimum applies by
itself above 1B parameters) and a bf16 GGUF written here with the `gguf` package.
vcfslm loads the same checkpoint. The peers run in their own venv (transformers < 5.6
for optimum-intel); a peer that is not installed there is reported as missing.

Alternation: at most one engine is resident at a time. Each round starts one child
process per engine, in order (A B C, A B C, ...); a child loads its model from disk,
runs a discarded warm-up window and `--windows` measured windows at batch 1, then the
same at batch `--big-batch` where the engine supports it, reports, and exits. The read
probe runs in this process before every round; the fastest read gives the floors.

TPOT = (last token - first token) / (tokens - 1) per step of the batch; TTFT = request
start -> first token; decode tok/s = batch / TPOT. Greedy, EOS ignored, the same prompt
token ids for every engine. Ratios are vcfslm / peer; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("vcfslm", "openvino", "llama.cpp")
PEER_MODULES = {"openvino": "openvino_genai", "llama.cpp": "llama_cpp"}
NO_BATCH = {"llama.cpp": "not supported (llama-cpp-python's high-level API decodes one sequence)"}
DEFAULT_CACHE = ROOT / ".vcfslm" / "peers"
DEFAULT_PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
SEED = 0


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
    ap.add_argument("--rounds", type=int, default=2, help="rounds of one child per engine")
    ap.add_argument("--windows", type=int, default=2, help="measured windows per batch per round")
    ap.add_argument("--big-batch", type=int, default=16, help="the second batch size (0: batch 1 only)")
    ap.add_argument("--probe-mib", type=int, default=1024)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the three model formats are kept")
    ap.add_argument("--peers-python", type=Path, default=DEFAULT_PEERS_PYTHON,
                    help="the interpreter of the peers' venv (benchmarks/peers-setup.sh)")
    ap.add_argument("--build-only", action="store_true", help="build the model formats the engines need, then stop")
    ap.add_argument("--child", choices=("checkpoint", "openvino-ir", "gguf", *ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.layers < 1 or args.tokens < 2 or args.rounds < 1 or args.windows < 1:
        ap.error("--layers >= 1, --tokens >= 2, --rounds >= 1 and --windows >= 1")
    return args


def model_dir(args) -> Path:
    return args.cache / f"phi-3-mini-L{args.layers}-seed{SEED}"


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

    from vcfslm.bench.model import load_model

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

    from vcfslm.bench.engine import DecodeEngine
    from vcfslm.bench.linear import choose_plan, onednn_bf16
    from vcfslm.bench.model import load_model

    torch.set_num_threads(job["threads"])
    started = time.perf_counter()
    # The checkpoint loader packs each linear as it arrives (vcfslm.bench.loader): the load's
    # peak is read before anything else runs.
    loaded = load_model(job["hf"], seed=SEED, max_context=job["prompt"] + job["tokens"],
                        plan=choose_plan(onednn_bf16()))
    load_peak = peak_rss_bytes()
    engine = DecodeEngine(loaded.model, "compile")
    out = {"load_s": time.perf_counter() - started, "load_peak_rss": load_peak, "weight_bytes": loaded.weight_bytes,
           "kernel": f"KernelPlan {engine.plan.label}; engine {engine.label}; "
                     f"pack check max relative error {engine.pack.max_rel_error:.2g}; "
                     f"loaded by vcfslm.bench.loader (packed as it loads)"}

    def window(batch, i):
        w = engine_window(engine, torch.tensor(job["prompts"][str(batch)][i]), job["tokens"])
        return w["tpot_ms"], w["ttft_s"]

    out["batches"] = {str(b): run_windows(window, b, job["windows"]) for b in job["batches"]}
    return out


def child_openvino(job: dict) -> dict:
    """OpenVINO GenAI's LLMPipeline on the IR, bf16 inference hint (runs in the peers' venv)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    config = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": job["threads"]}
    started = time.perf_counter()
    pipe = og.LLMPipeline(job["ov"], "CPU", **config)
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
    for key in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES", "KV_CACHE_PRECISION"):
        try:
            facts.append(f"{key} {core.get_property('CPU', key)}")
        except Exception:  # a property this version does not report
            pass
    facts.append(f"INFERENCE_PRECISION_HINT {config['INFERENCE_PRECISION_HINT']}, "
                 f"INFERENCE_NUM_THREADS {job['threads']} (given to LLMPipeline)")
    batches_out = {}
    for b in job["batches"]:
        try:
            batches_out[str(b)] = run_windows(window, b, job["windows"])
        except RuntimeError as exc:  # a batch the pipeline refuses is reported, not faked
            batches_out[str(b)] = {"unsupported": f"not supported: {str(exc).splitlines()[0][:120]}"}
    return {"load_s": load_s, "kernel": "; ".join(facts), "batches": batches_out}


def child_llama(job: dict) -> dict:
    """llama-cpp-python on the bf16 GGUF, greedy over its logits (runs in the peers' venv)."""
    import llama_cpp
    import numpy as np

    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["prompt"] + job["tokens"] + 8,
                          n_batch=max(job["prompt"], 32), n_threads=job["threads"],
                          n_threads_batch=job["threads"], logits_all=False, verbose=False)
    load_s = time.perf_counter() - started

    vocab = llm.n_vocab()

    def next_token() -> int:
        # Without logits_all, Llama.eval keeps no scores: read the last output's logits.
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    def window(batch, i):
        (ids,) = job["prompts"][str(batch)][i]
        llm.reset()  # the next eval drops the cache past position 0
        t0 = time.perf_counter()
        llm.eval(ids)
        token = next_token()
        t1 = time.perf_counter()
        for _ in range(job["tokens"] - 1):
            llm.eval([token])
            token = next_token()
        return (time.perf_counter() - t1) / (job["tokens"] - 1) * 1000, t1 - t0

    info = llama_cpp.llama_print_system_info().decode().strip()
    out = {str(b): run_windows(window, b, job["windows"]) if b == 1 else {"unsupported": NO_BATCH["llama.cpp"]}
           for b in job["batches"]}
    return {"load_s": load_s, "kernel": f"llama-cpp-python {llama_cpp.__version__}, bf16 GGUF; {info}",
            "batches": out}


def run_windows(window, batch: int, count: int) -> dict:
    """One discarded warm-up window, then `count` measured ones: TPOT ms, TTFT s each. Window i
    gets prompt set i: no prompt repeats within a process, so an engine's prefix cache
    (OpenVINO GenAI reuses the KV of a prompt it has seen) never skips a measured prefill."""
    window(batch, 0)
    tpot, ttft = zip(*(window(batch, i) for i in range(1, count + 1)), strict=True)
    return {"tpot_ms": list(tpot), "ttft_s": list(ttft), "peak_rss": peak_rss_bytes()}


CHILDREN = {"vcfslm": child_vcfslm, "openvino": child_openvino, "llama.cpp": child_llama}


def child_main(args) -> int:
    job = json.loads(args.job.read_text()) if args.job else {}
    if args.child == "checkpoint":
        result = write_checkpoint(Path(job["hf"]), job["layers"])
    elif args.child == "openvino-ir":
        result = export_openvino(Path(job["hf"]), Path(job["ov"]))
    elif args.child == "gguf":
        write_gguf(Path(job["hf"]), Path(job["gguf"]))
        result = {}
    else:
        result = CHILDREN[args.child](job)
    result["peak_rss"] = peak_rss_bytes()
    print("CHILD " + json.dumps(result))
    return 0


# ------------------------------------------------------------------ the run


def run_child(python: Path | str, kind: str, job: dict, env: dict | None = None) -> dict:
    """Run this file as a `kind` child under `python`; its CHILD line, parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
    try:
        done = subprocess.run([str(python), __file__, "--child", kind, "--job", fh.name], capture_output=True,
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
        if module is None:
            status[name] = None
        elif not args.peers_python.exists():
            status[name] = f"missing: no {args.peers_python} (run benchmarks/peers-setup.sh)"
        else:
            probe = subprocess.run([str(args.peers_python), "-c", f"import {module}"], capture_output=True,
                                   text=True, check=False)
            status[name] = None if probe.returncode == 0 else f"missing: `import {module}` fails in {args.peers_python}"
    return status


def ensure_formats(args, ready: list[str]) -> dict:
    """Build whatever model format a ready engine needs and the cache lacks; paths + facts."""
    root = model_dir(args)
    paths = {"hf": str(root / "hf"), "ov": str(root / "openvino"), "gguf": str(root / "model-bf16.gguf")}
    steps = [("checkpoint", sys.executable, root / "hf" / "facts.json", True),
             ("openvino-ir", args.peers_python, root / "openvino" / "openvino_model.xml", "openvino" in ready),
             ("gguf", args.peers_python, root / "model-bf16.gguf", "llama.cpp" in ready)]
    for kind, python, marker, wanted in steps:
        if not wanted or marker.exists():
            continue
        started = time.perf_counter()
        partial = marker.with_name(marker.name + ".partial") if kind == "gguf" else None
        job = {**paths, "layers": args.layers, **({"gguf": str(partial)} if partial else {})}
        result = run_child(python, kind, job)
        if partial:
            partial.rename(marker)
        extra = "".join(f"; {k} {v}" for k, v in result.items() if k != "peak_rss")
        print(f"built {kind} {marker.parent if kind != 'gguf' else marker} in {time.perf_counter() - started:.0f} s "
              f"(peak RSS {result['peak_rss'] / 1e9:.1f} GB{extra})", flush=True)
    return {**paths, "facts": json.loads((root / "hf" / "facts.json").read_text())}


def summarize(runs: list[dict], batch: int) -> dict | None:
    """Every window of every round of one engine at one batch, pooled."""
    cells = [r["batches"].get(str(batch)) for r in runs]
    if any(c is None or "unsupported" in c for c in cells):
        return next((c for c in cells if c and "unsupported" in c), None)
    tpot = [x for c in cells for x in c["tpot_ms"]]
    ttft = [x for c in cells for x in c["ttft_s"]]
    return {"tpot": tpot, "ttft": statistics.median(ttft), "tok_s": batch * 1000 / statistics.median(tpot),
            "peak_rss": max(r["peak_rss"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    sys.path.insert(0, str(ROOT))
    import torch
    from decode_efficiency import cpu_line, spec_for
    from transformers import AutoConfig

    from vcfslm.bench import probe
    from vcfslm.bench.engine import synthetic_prompt

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load0 = os.getloadavg()[0]
    print(cpu_line())
    print(f"threads {args.threads}; prompt {args.prompt} tokens; {args.tokens} generated; model {spec_for(args.layers)}, "
          f"seed {SEED}; engines {', '.join(args.engines)}", flush=True)
    status = peer_status(args)
    ready = [e for e in args.engines if status[e] is None]
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
    # Later rounds of vcfslm find its compiled step in Inductor's FX graph cache.
    inductor = {"TORCHINDUCTOR_CACHE_DIR": str(args.cache / "inductor")}

    gemm = probe.measure_gemm(args.threads)
    reads: list[float] = []
    runs: dict[str, list[dict]] = {e: [] for e in ready}
    for r in range(args.rounds):
        reads.append(probe.measure_bandwidth(args.threads, args.probe_mib, repeats=2).read_gbs)
        for name in ready:
            python = sys.executable if name == "vcfslm" else args.peers_python
            result = run_child(python, name, job, inductor if name == "vcfslm" else None)
            runs[name].append(result)
            b1 = result["batches"]["1"]
            load_peak = (f" (peak RSS {result['load_peak_rss'] / 1e9:.2f} GB = "
                         f"{result['load_peak_rss'] / result['weight_bytes']:.2f} x weights)"
                         if "load_peak_rss" in result else "")
            print(f"round {r + 1}/{args.rounds} {name}: load {result['load_s']:.1f} s{load_peak}, batch 1 TPOT "
                  + ", ".join(f"{t:.1f}" for t in b1["tpot_ms"]) + " ms", flush=True)
    reads.append(probe.measure_bandwidth(args.threads, args.probe_mib, repeats=2).read_gbs)
    read_gbs = max(reads)
    print_report(args, config, facts, runs, status, read_gbs, reads, gemm, started, load0)
    return 0


def print_report(args, config, facts, runs, status, read_gbs, reads, gemm, started, load0) -> None:
    from vcfslm import roofline

    context = roofline.mean_decode_context(args.prompt, args.tokens)
    floors = {}
    print()
    print(f"alternation: {args.rounds} rounds of {' '.join(runs) or '(none)'}, one child process per engine per "
          f"round (one engine resident at a time), each: load from disk, 1 discarded + {args.windows} measured "
          f"windows per batch; read probe before each round")
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
    print()
    print(f"{'engine':<10} {'batch':>5}  {'TPOT ms median':>14} {'min':>7} {'max':>7}  {'TTFT s':>7}  "
          f"{'decode tok/s':>12}  {'peak RSS GB':>11}  {'roofline/TPOT':>13}")
    table = {}
    for b in batches(args):
        for name in args.engines:
            if status[name]:
                print(f"{name:<10} {b:>5}  {status[name]}")
                continue
            cell = table[name, b] = summarize(runs[name], b)
            if cell is None or "unsupported" in cell:
                print(f"{name:<10} {b:>5}  {(cell or {}).get('unsupported', 'no windows')}")
                continue
            tp = cell["tpot"]
            print(f"{name:<10} {b:>5}  {statistics.median(tp):14.1f} {min(tp):7.1f} {max(tp):7.1f}  {cell['ttft']:7.3f}  "
                  f"{cell['tok_s']:12.2f}  {cell['peak_rss'] / 1e9:11.2f}  {floors[b] / statistics.median(tp):13.2f}")
    print()
    for b in batches(args):
        mine = table.get(("vcfslm", b))
        for peer in (n for n in args.engines if n != "vcfslm"):
            theirs = table.get((peer, b))
            if not mine or "tpot" not in mine or not theirs or "tpot" not in theirs:
                continue
            print(f"RATIO vcfslm/{peer} batch {b}: TPOT {statistics.median(mine['tpot']) / statistics.median(theirs['tpot']):.2f}"
                  f"  TTFT {mine['ttft'] / theirs['ttft']:.2f}  decode tok/s {mine['tok_s'] / theirs['tok_s']:.2f}"
                  f"  peak RSS {mine['peak_rss'] / theirs['peak_rss']:.2f}  (below 1 for TPOT and TTFT, above 1 for tok/s: vcfslm faster)")
    loads = [r for r in runs.get("vcfslm", []) if "load_peak_rss" in r]
    if loads:
        worst = max(r["load_peak_rss"] for r in loads)
        print(f"vcfslm checkpoint load: peak RSS {worst / 1e9:.2f} GB for {loads[0]['weight_bytes'] / 1e9:.2f} GB "
              f"of weights = {worst / loads[0]['weight_bytes']:.2f} x (target <= 1.3 x; the whole child's peak is "
              f"in the table)")
    print()
    print("kernel path of each engine:")
    for name, results in runs.items():
        print(f"  {name}: {results[0]['kernel']}")
    print(f"noise: load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs); "
          f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
