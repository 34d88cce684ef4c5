"""The decode engine: static KV cache, eager prefill, a torch.compile'd one-token decode
step (Inductor, freezing), greedy sampling, exactly `output_tokens` tokens per stream.

Why it is built this way (gpt-fast's recipe on CPU):
- Decode is memory-bound: every step reads every weight once. Freezing lets Inductor
  treat weights as constants (constant folding, pre-packed GEMM weights, fused
  pointwise ops), so a step gets closer to the bandwidth floor than eager PyTorch.
- The KV cache is a `StaticCache` sized to input + output tokens, so the decode step
  has one static shape per (batch, context) and compiles to one graph; `cache.reset()`
  keeps its addresses, so windows after the first reuse that graph.
- Prefill runs eagerly (a big matrix product per layer, compute-bound, one call) with
  `logits_to_keep=1` so the prompt's logits are never materialised.
- On CPU every op is synchronous: the time after a call returns is when its tokens
  exist; the loop needs no `.item()`.

Compiles are counted by the backend itself, so a window can tell whether a compile
happened inside it (and is then flagged invalid by the worker).

Memory: freezing folds the weights into the graph as constants; with pre-packing
(oneDNN on AVX512-BF16/AMX CPUs, or the autotuned C++ GEMM template elsewhere) those
constants are a second, packed copy. The original weights cannot be dropped
(`freezing_discard_parameters`): eager prefill uses them, and every new (batch, context)
shape recompiles from them. So a replica holds about 2x its weights while a graph is
live, never more: a new shape first releases the previous graph and its constants
(`release()`, which resets Dynamo for the whole process: one engine per process).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class CompileOptions:
    """How the decode step is compiled. enabled=False runs it eagerly (the baseline).

    max_autotune: let Inductor pick its C++ GEMM template (weights pre-packed at freeze
    time) over ATen per matrix shape; slower to compile, faster decode on CPUs where
    oneDNN has no bf16 packing path.
    """

    enabled: bool = True
    freezing: bool = True
    max_autotune: bool = True
    fullgraph: bool = True

    def inductor_patches(self) -> dict[str, Any]:
        patches: dict[str, Any] = {"freezing": self.freezing}
        if self.freezing:
            # The FX graph cache stores a frozen graph's folded constants (the packed
            # weights) inside its entry: a full copy of the model on disk per (batch,
            # context) graph, and the pickled copy stays in memory. Compiled C++ kernels
            # and autotuning results are still cached (their own caches).
            patches["fx_graph_cache"] = False
        if self.max_autotune:
            patches.update({"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                            "autotune_num_choices_displayed": 0,
                            "max_autotune_report_choices_stats": False})
        return patches

    @property
    def label(self) -> str:
        if not self.enabled:
            return "eager"
        return "compile" + ("+freezing" if self.freezing else "") + ("+autotune" if self.max_autotune else "")


class CompileCounter:
    """A torch.compile backend (Inductor) that counts the graphs it compiles."""

    def __init__(self, patches: dict[str, Any]):
        self.patches = dict(patches)
        self.graphs = 0
        self.seconds = 0.0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        started = time.perf_counter()
        try:
            return compile_fx(gm, example_inputs)
        finally:
            self.seconds += time.perf_counter() - started


class _DecodeStep(torch.nn.Module):
    """One greedy decode step as a module, so Inductor freezing sees the weights as parameters."""

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
    """Greedy batched generation with a static cache and a compiled decode step.

    One engine holds one model; scenarios of a new (batch, context) shape get a new
    cache and a new graph (the previous scenario's graph and cache are dropped first, so
    a replica never holds two sets of frozen weights).
    """

    def __init__(self, model, options: CompileOptions | None = None, *,
                 prefill_upcast: bool | None = None):
        self.model = model
        self.options = options or CompileOptions()
        # Prefill is compute-bound; without a native bf16 GEMM (oneDNN bf16: AVX512-BF16
        # or AMX) PyTorch's bf16 matmul is several times slower than fp32 SGEMM.
        self.prefill_upcast = (not native_bf16_gemm()) if prefill_upcast is None else prefill_upcast
        self._prefill_mode = _Float32WideLinear() if self.prefill_upcast else None
        self.counter = CompileCounter(self.options.inductor_patches())
        self._step_module = _DecodeStep(model).eval()
        self._step = self._make_step()
        self._cache = None
        self._cache_shape: tuple[int, int] | None = None

    def _make_step(self):
        if not self.options.enabled:
            return self._step_module
        compiled = torch.compile(self._step_module, backend=self.counter,
                                 fullgraph=self.options.fullgraph, dynamic=False)
        patches = self.counter.patches

        def step(*args):
            # Dynamo reads `freezing` while tracing (parameters become constants only
            # then), so the options must be live around the call, not only in compile_fx.
            with torch._inductor.config.patch(patches):
                return compiled(*args)

        return step

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
        """Drop the cache and every compiled graph (and the frozen weights they hold)."""
        self._cache = None
        self._cache_shape = None
        if self.options.enabled:
            torch._dynamo.reset()
            _drop_generated_constants()
            self._step = self._make_step()
        gc.collect()

    # ------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, output_tokens: int, *, record_steps: bool = False
                 ) -> Generation:
        """Generate exactly `output_tokens` greedy tokens per stream (EOS ignored).

        prompt: int64 [batch, input_tokens]. The request starts when this is called.
        """
        if output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        batch, prompt_len = prompt.shape
        compiles_before = self.counter.graphs
        request_start = time.perf_counter()
        cache = self.cache_for(batch, prompt_len + output_tokens)
        token = self._prefill(prompt, cache).argmax(dim=-1, keepdim=True)
        first_token = time.perf_counter()
        out = [token]
        position = torch.full((batch, 1), prompt_len, dtype=torch.long)
        steps: list[float] = []
        last = first_token
        for _ in range(output_tokens - 1):
            token, _ = self._step(token, position, cache)
            out.append(token)
            position = position + 1
            if record_steps:
                now = time.perf_counter()
                steps.append(now - last)
                last = now
        last_token = time.perf_counter()
        return Generation(torch.cat(out, dim=1), request_start, first_token, last_token, steps,
                          self.counter.graphs - compiles_before)

    def _prefill(self, prompt: torch.Tensor, cache) -> torch.Tensor:
        """Run the prompt through the model (eager), filling `cache`; last position's logits."""
        batch, prompt_len = prompt.shape
        positions = torch.arange(prompt_len, dtype=torch.long).unsqueeze(0).expand(batch, -1)
        if self._prefill_mode is None:
            out = self.model(input_ids=prompt, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=1)
        else:
            with self._prefill_mode:
                out = self.model(input_ids=prompt, position_ids=positions, cache=cache,
                                 use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def step_logits(self, prompt: torch.Tensor, forced: torch.Tensor, *, compiled: bool = True
                    ) -> torch.Tensor:
        """Logits of each decode step when the tokens fed are `forced` [batch, steps].

        Teacher forcing makes the compiled and the eager step see identical inputs, so
        their logits compare position by position (free-running greedy tokens diverge
        on near-ties). Returns float32 [batch, steps, vocab].
        """
        batch, prompt_len = prompt.shape
        steps = forced.shape[1]
        cache = self.cache_for(batch, prompt_len + steps)
        self._prefill(prompt, cache)
        step = self._step if compiled else self._step_module
        out = []
        for i in range(steps):
            position = torch.full((batch, 1), prompt_len + i, dtype=torch.long)
            _, logits = step(forced[:, i:i + 1].contiguous(), position, cache)
            out.append(logits.float().clone())
        return torch.stack(out, dim=1)


def native_bf16_gemm() -> bool:
    """Whether oneDNN has a native bf16 GEMM on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


class _Float32WideLinear(torch.overrides.TorchFunctionMode):
    """Inside this mode, bf16 linears with many rows run as fp32 SGEMM.

    The weights stay bf16 in memory; each wide call converts one weight into a reused
    fp32 scratch buffer (a bf16 GEMM accumulates in fp32 anyway). Narrow calls (the
    lm_head on one row per stream) keep the bf16 path.
    """

    MIN_ROWS = 64

    def __init__(self):
        super().__init__()
        self._scratch = torch.empty(0, dtype=torch.float32)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
                    and x.numel() // max(x.shape[-1], 1) >= self.MIN_ROWS):
                if self._scratch.numel() < weight.numel():
                    self._scratch = torch.empty(weight.numel(), dtype=torch.float32)
                w32 = self._scratch[:weight.numel()].view(weight.shape)
                w32.copy_(weight)
                b32 = None if bias is None else bias.float()
                return torch.nn.functional.linear(x.float(), w32, b32).to(x.dtype)
        return func(*args, **kwargs)


def _drop_generated_constants() -> None:
    """Free the constants (frozen, pre-packed weights) of Inductor's generated modules.

    torch._dynamo.reset() forgets the graphs, but Inductor keeps every generated
    module alive (PyCodeCache and sys.modules) with its constants as attributes; without
    this a new scenario would add one more packed copy of the weights.
    """
    import sys

    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:  # pragma: no cover - other torch layouts
        return
    for module in list(PyCodeCache.modules):
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                delattr(module, name)
        sys.modules.pop(module.__name__, None)
    PyCodeCache.cache_clear()


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
