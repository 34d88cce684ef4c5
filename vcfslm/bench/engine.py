"""The decode engine: one packed copy of the weights, eager prefill, a torch.compile'd
one-token decode step, static KV cache, greedy sampling, exactly `output_tokens` tokens
per stream.

Why it is built this way (gpt-fast's recipe, on CPU):
- Every linear holds one copy of its weight, in the layout of the CPU's fastest bf16
  kernel (vcfslm.bench.linear), and prefill and decode both call that kernel. Inductor
  freezing would instead fold a second, packed copy into each compiled graph and keep the
  originals for eager prefill (2-3x the weights per replica); here the graph holds no
  constants, so a replica stays near 1x and Inductor's FX graph cache can be on (the
  brief's "warm compilation cache").
- Decode is memory-bound: every step reads every weight once. torch.compile fuses what
  lies between the linears (norms, rotary, activations, the cache update) into a few
  C++ kernels, so a step is the weight reads plus little else.
- The KV cache is a `StaticCache` sized to input + output tokens, so the decode step
  has one static shape per (batch, context) and compiles to one graph; `cache.reset()`
  keeps its addresses, so windows after the first reuse that graph.
- Prefill runs eagerly (one big matrix product per linear, compute-bound) with
  `logits_to_keep=1`, so the prompt's logits are never materialised, and the lm_head
  reads one contiguous row per stream.
- On CPU every op is synchronous: the time after a call returns is when its tokens
  exist; the loop needs no `.item()`.

Compiles are counted by the backend itself, so a window can tell whether a compile
happened inside it (and is then flagged invalid by the worker). A new (batch, context)
shape resets Dynamo first, so a matrix of many shapes never reaches Dynamo's recompile
limit (past it a step would silently run eagerly): one engine per process.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from ..contract import MEASUREMENT_MODES, normalize_compile_mode
from .linear import KernelPlan, PackReport, choose_plan, onednn_bf16, pack_linears

log = logging.getLogger(__name__)


class CompileCounter:
    """A torch.compile backend (Inductor) that counts the graphs it compiles."""

    def __init__(self):
        self.graphs = 0
        self.seconds = 0.0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        started = time.perf_counter()
        shapes = [tuple(x.shape) for x in example_inputs if hasattr(x, "shape")][:3]
        log.debug("compile: graph %d, first input shapes %s", self.graphs, shapes)
        try:
            return compile_fx(gm, example_inputs)
        finally:
            took = time.perf_counter() - started
            self.seconds += took
            log.debug("compile: graph %d done in %.1f s (%.1f s in all)", self.graphs, took, self.seconds)


class _DecodeStep(torch.nn.Module):
    """One greedy decode step as a module (what torch.compile traces)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, token, position_ids, cache):
        logits = self.model(input_ids=token, position_ids=position_ids, cache=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1, :]
        return logits.argmax(dim=-1, keepdim=True), logits


@dataclass
class Generation:
    """One batched generation: tokens and the times (time.perf_counter) that define metrics."""

    tokens: torch.Tensor          # [batch, output_tokens]
    request_start: float
    first_token: float            # prefill done, first token of every stream available
    last_token: float             # last decode step done
    step_s: list[float] = field(default_factory=list)  # each decode step's duration
    compiles: int = 0             # graphs compiled during this generation

    @property
    def decode_s(self) -> float:
        return self.last_token - self.first_token


class DecodeEngine:
    """Greedy batched generation with packed weights, a static cache and a compiled step.

    model: a bf16 causal LM; its nn.Linear layers are replaced in place by packed ones
    (the originals are dropped). mode: "compile" or "eager". plan: the linear kernel
    (default: the best this CPU offers).
    """

    def __init__(self, model, mode: str = "compile", *, plan: KernelPlan | None = None,
                 check_packing: bool = True):
        self.model = model
        self.mode = normalize_compile_mode(mode)
        self.plan = plan or choose_plan(onednn_bf16())
        self.pack: PackReport = pack_linears(model, self.plan, check=check_packing)
        self.counter = CompileCounter()
        self._step_module = _DecodeStep(model).eval()
        self._step = self._make_step()
        self._cache = None
        self._cache_shape: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        return f"{self.mode}, linears {self.plan.label}"

    @property
    def is_measurement_mode(self) -> bool:
        return self.mode in MEASUREMENT_MODES

    def _make_step(self):
        if self.mode == "eager":
            return self._step_module
        return torch.compile(self._step_module, backend=self.counter, fullgraph=True, dynamic=False)

    @property
    def compiles(self) -> int:
        return self.counter.graphs

    # ------------------------------------------------------------------ cache

    def cache_for(self, batch: int, max_len: int):
        """The static cache for (batch, max_len), reset; a new shape drops the old graph."""
        from transformers import StaticCache

        if self._cache_shape != (batch, max_len):
            if self._cache is not None:
                self.release()
            self._cache = StaticCache(config=self.model.config, max_cache_len=max_len)
            self._cache_shape = (batch, max_len)
        else:
            self._cache.reset()
        return self._cache

    def release(self) -> None:
        """Drop the cache and every compiled graph."""
        self._cache = None
        self._cache_shape = None
        if self.mode != "eager":
            log.debug("compile: new shape, compiled graphs dropped (dynamo reset)")
            torch._dynamo.reset()
            self._step = self._make_step()
        gc.collect()

    # ------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, output_tokens: int, *, record_steps: bool = False,
                 eager: bool = False) -> Generation:
        """Generate exactly `output_tokens` greedy tokens per stream (EOS ignored).

        prompt: int64 [batch, input_tokens]. The request starts when this is called.
        eager: run the decode step without compile (a check, never a measurement).
        """
        if output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        batch, prompt_len = prompt.shape
        compiles_before = self.counter.graphs
        request_start = time.perf_counter()
        cache = self.cache_for(batch, prompt_len + output_tokens)
        token = self.prefill(prompt, cache).argmax(dim=-1, keepdim=True)
        first_token = time.perf_counter()
        out = [token]
        position = torch.full((batch, 1), prompt_len, dtype=torch.long)
        steps: list[float] = []
        last = first_token
        step = self._step_module if eager else self._step
        for _ in range(output_tokens - 1):
            token, _ = step(token, position, cache)
            out.append(token)
            position = position + 1
            if record_steps:
                now = time.perf_counter()
                steps.append(now - last)
                last = now
        last_token = time.perf_counter()
        return Generation(torch.cat(out, dim=1), request_start, first_token, last_token, steps,
                          self.counter.graphs - compiles_before)

    def decode_step(self, token: torch.Tensor, position: torch.Tensor, cache):
        """One decode step as generate runs it (compiled unless the mode is eager):
        (next greedy tokens [batch, 1], logits [batch, vocab]). For benchmarks timing a step."""
        return self._step(token, position, cache)

    def prefill(self, prompt: torch.Tensor, cache) -> torch.Tensor:
        """Run the prompt through the model (eager), filling `cache`; last position's logits."""
        batch, prompt_len = prompt.shape
        positions = torch.arange(prompt_len, dtype=torch.long).unsqueeze(0).expand(batch, -1)
        out = self.model(input_ids=prompt, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def step_logits(self, prompt: torch.Tensor, forced: torch.Tensor, *, compiled: bool = True,
                    max_len: int | None = None) -> torch.Tensor:
        """Logits of each decode step when the tokens fed are `forced` [batch, steps].

        Teacher forcing makes the compiled and the eager step see identical inputs, so
        their logits compare position by position (free-running greedy tokens diverge
        on near-ties). max_len: the cache length (default prompt + steps; pass a
        scenario's context to reuse its compiled graph). Returns float32 [batch, steps, vocab].
        """
        batch, prompt_len = prompt.shape
        steps = forced.shape[1]
        cache = self.cache_for(batch, max(max_len or 0, prompt_len + steps))
        self.prefill(prompt, cache)
        step = self._step if compiled else self._step_module
        out = []
        for i in range(steps):
            position = torch.full((batch, 1), prompt_len + i, dtype=torch.long)
            # clone: a fresh (inference) tensor of plain strides, so Dynamo guards match the
            # generation loop's and the gate reuses its graph instead of compiling another
            _, logits = step(forced[:, i:i + 1].clone(memory_format=torch.contiguous_format), position, cache)
            out.append(logits.float().clone())
        return torch.stack(out, dim=1)


def synthetic_prompt(batch: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A deterministic random prompt (the same on every rank for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    # Skip the first 100 ids: special tokens live there in real vocabularies.
    low = min(100, vocab_size - 1)
    return torch.randint(low, vocab_size, (batch, length), generator=gen, dtype=torch.long)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size now (from /proc/self/statm), 0 when unknown."""
    import os

    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
