"""A tiny Phi-3 checkpoint vLLM's CPU attention accepts (head_dim 64), with a word-level
tokenizer of its vocabulary: for the tests that start a real vLLM server."""

from __future__ import annotations

from pathlib import Path


def write_tiny_vllm_model(out: Path) -> Path:
    from vcfslm.engine.checkpoint import write_checkpoint

    write_checkpoint("synthetic:tiny-64", out)
    return out
