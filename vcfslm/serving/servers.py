"""Serving backends, pure: which servers vcfslm can drive, how each is launched and probed,
and the few decisions around them (CPU split, KV-cache size, lag, metrics deltas).

`vcfslm` is the rank engine itself, driven in-process (serve/scheduler.py). Every other entry
is an OpenAI-compatible HTTP server, one per vNUMA node, that the guest stage installs
(its playbook) and renders a launch script for (its template), and that each bench rank
starts, waits for, drives over the streaming completions API with prompts as token ids,
and stops (serve/server_process.py, serve/http_serve.py). Adding llama.cpp's
`llama-server` or OpenVINO Model Server is one more `HttpBackend` here: the load, the
records, the sweep and the sizing do not change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

IN_PROCESS = "vcfslm"
GIB = 1024**3
# Headroom over the exact KV bytes of slots x context: the server's block rounding and
# its own per-block bookkeeping (vLLM CPU held 7,281 tokens in 3 GiB of 384 KiB tokens,
# 89 % of the raw division).
KV_HEADROOM = 1.5


@dataclass(frozen=True)
class HttpBackend:
    """One OpenAI-compatible server: how it is installed, launched and probed."""

    name: str
    playbook: str                     # playbooks/<name>.yaml installs it on a guest
    template: str                     # templates/<template>: the per-vNUMA-node launch script
    entry: str | None                 # a file copied beside the scripts (None: none)
    health_path: str = "/health"
    version_path: str = "/version"
    metrics_path: str = "/metrics"
    completions_path: str = "/v1/completions"
    # Log lines worth keeping as the server's facts (its kernel/ISA line, its scheduler).
    fact_patterns: tuple[str, ...] = ()
    # Prometheus counters whose per-window increase is recorded, and gauges sampled
    # during a window (their maximum is recorded): record name -> metric name.
    counters: Mapping[str, str] = field(default_factory=dict)
    gauges: Mapping[str, str] = field(default_factory=dict)

    def script_name(self, numa_node: int) -> str:
        return f"{self.name}-node{numa_node}.sh"


VLLM = HttpBackend(
    name="vllm", playbook="vllm.yaml", template="vllm.sh.j2", entry="vllm-entry.py",
    fact_patterns=(r"[Cc]hunked prefill", r"[Pp]refix caching",
                   r"ISA|AMX|avx512|AVX512|[Aa]ttention backend|OMP_THREADS_BIND|core ids",
                   r"KV cache|kv cache|GPU KV cache size|# CPU blocks", r"Maximum concurrency"),
    counters={"queue_time_s_sum": "vllm:request_queue_time_seconds_sum",
              "queue_time_count": "vllm:request_queue_time_seconds_count",
              "preemptions": "vllm:num_preemptions_total",
              "prompt_tokens": "vllm:prompt_tokens_total",
              "generation_tokens": "vllm:generation_tokens_total",
              "prefix_cache_hits": "vllm:prefix_cache_hits_total",
              "requests_finished": "vllm:request_success_total"},
    gauges={"kv_cache_usage_max": "vllm:kv_cache_usage_perc",
            "waiting_max": "vllm:num_requests_waiting",
            "running_max": "vllm:num_requests_running"},
)

HTTP_BACKENDS: dict[str, HttpBackend] = {VLLM.name: VLLM}
SERVERS = (IN_PROCESS, *HTTP_BACKENDS)


@dataclass(frozen=True)
class ServerSpec:
    """Which server a serving run drives and how it is started (meta.json: matrix.server)."""

    name: str = IN_PROCESS
    reserved_cores: int = 0            # per vNUMA node: left to the client and the server's own threads
    kv_cache_gib: int | None = None    # None: sized from the model, slots and context (kv_cache_gib())
    chunked_prefill: bool = True
    prefix_caching: bool = True
    enforce_eager: bool = False        # vLLM's --enforce-eager: no torch.compile (quicker start, slower steps)
    listen: str = "loopback"           # "loopback" | "bench": the VM's loopback, or its bench address
    host: str = "127.0.0.1"            # where this node's servers listen (the bench address when "bench")
    port: int = 8100                   # the first vNUMA node's; node n listens on port + n
    health_timeout_s: float = 900.0    # launch to /health (vLLM took 149 s for the full shape on 2 cores)
    max_lag_s: float = 0.5             # a request sent later than planned by more: the window is invalid
    launch_dir: str | None = None      # where the per-node scripts are (None: the rank's launch folder)

    def __post_init__(self):
        problems = server_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def in_process(self) -> bool:
        return self.name == IN_PROCESS

    @property
    def backend(self) -> HttpBackend | None:
        return HTTP_BACKENDS.get(self.name)

    def port_for(self, numa_node: int) -> int:
        return self.port + numa_node

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def of_record(cls, data: Mapping[str, Any] | None) -> ServerSpec:
        known = {k: v for k, v in (data or {}).items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def with_launch_dir(self, path: str) -> ServerSpec:
        return replace(self, launch_dir=path)

    def on_node(self, launch_dir: str, bench_ip: str) -> ServerSpec:
        """This spec as one VM's ranks take it: its scripts' folder and its listening address."""
        return replace(self, launch_dir=launch_dir, host=bench_ip if self.listen == "bench" else "127.0.0.1")


def server_problems(spec: ServerSpec) -> list[str]:
    out = []
    if spec.name not in SERVERS:
        out.append(f"server must be one of {', '.join(SERVERS)}, got {spec.name!r}")
    if spec.listen not in ("loopback", "bench"):
        out.append(f"listen must be loopback or bench, got {spec.listen!r}")
    if spec.reserved_cores < 0:
        out.append(f"reserved cores must not be negative, got {spec.reserved_cores}")
    if spec.kv_cache_gib is not None and spec.kv_cache_gib < 1:
        out.append(f"the KV cache must be at least 1 GiB, got {spec.kv_cache_gib}")
    if not 0 < spec.port < 65536 - 64:
        out.append(f"port must leave room for one server per vNUMA node, got {spec.port}")
    if not spec.health_timeout_s > 0 or not spec.max_lag_s > 0:
        out.append("the health timeout and the allowed lag must be positive")
    return out


# ------------------------------------------------------------------ decisions


def split_cpus(node_cpus: Sequence[int], reserved: int) -> tuple[list[int], list[int]]:
    """(server CPUs, client CPUs) of one vNUMA node: the last `reserved` CPUs go to the
    client and the server's own threads (vLLM's CPU guide leaves one free); with 0 the two
    share every CPU. Raises ValueError when nothing would be left to the server."""
    cpus = sorted(node_cpus)
    if reserved <= 0:
        return cpus, cpus
    if reserved >= len(cpus):
        raise ValueError(f"{reserved} reserved core(s) leave none of the node's {len(cpus)} CPUs to the server")
    return cpus[:-reserved], cpus[-reserved:]


def kv_cache_gib(kv_bytes_per_token: int, slots: int, context_tokens: int, headroom: float = KV_HEADROOM) -> int:
    """Whole GiB of KV cache for `slots` sequences of `context_tokens` (at least 1)."""
    return max(1, math.ceil(kv_bytes_per_token * slots * context_tokens * headroom / GIB))


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """K and V bytes per token of a HF config.json (GQA and head_dim overrides counted)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def server_argv(spec: ServerSpec, *, model_dir: str, served_name: str, slots: int, max_model_len: int,
                numa_node: int, uds: str | None = None) -> list[str]:
    """The arguments the bench appends to a node's launch script (vLLM's `serve`); `uds`: on
    that Unix socket instead of the spec's address and port (serve up's servers)."""
    listen = ["--uds", uds] if uds else ["--host", spec.host, "--port", str(spec.port_for(numa_node))]
    argv = ["serve", model_dir, "--served-model-name", served_name, *listen, "--dtype", "bfloat16",
            "--max-num-seqs", str(slots), "--max-model-len", str(max_model_len),
            "--enable-chunked-prefill" if spec.chunked_prefill else "--no-enable-chunked-prefill",
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
            # Each reply's usage then says how much of its prompt the prefix cache held.
            "--enable-prompt-tokens-details"]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def completion_body(served_name: str, prompt_ids: Sequence[int], output_tokens: int) -> dict[str, Any]:
    """A streaming completion that produces exactly `output_tokens` from token-id input."""
    return {"model": served_name, "prompt": list(prompt_ids), "max_tokens": output_tokens,
            "min_tokens": output_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}


def lag_problem(lags_s: Sequence[float], max_lag_s: float) -> str | None:
    """Why a window is invalid because its client fell behind its plan (None: it kept up)."""
    worst = max(lags_s, default=0.0)
    if worst > max_lag_s:
        late = sum(1 for v in lags_s if v > max_lag_s)
        return (f"the client sent {late} request(s) late, by up to {worst:.3f} s (allowed {max_lag_s:g} s): "
                f"the offered load was lower than planned")
    return None


# ------------------------------------------------------------------ /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}.
    Histogram buckets are dropped (their _sum and _count are kept)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1).endswith("_bucket"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def metric_deltas(backend: HttpBackend, before: Mapping[str, float], after: Mapping[str, float],
                  samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One window's server-side figures: counter increases, gauge maxima, mean queue time."""
    out: dict[str, float] = {}
    for name, metric in backend.counters.items():
        if metric in after:
            out[name] = after[metric] - before.get(metric, 0.0)
    for name, metric in backend.gauges.items():
        values = [s[metric] for s in samples if metric in s]
        if values:
            out[name] = max(values)
    count = out.pop("queue_time_count", None)
    total = out.pop("queue_time_s_sum", None)
    if count and total is not None:
        out["queue_time_s_mean"] = total / count
    return out


def fact_lines(backend: HttpBackend, log_text: str, limit: int = 12) -> list[str]:
    """The server log's lines that say how it runs (its kernels, chunked prefill, KV cache)."""
    patterns = [re.compile(p) for p in backend.fact_patterns]
    out: list[str] = []
    for line in log_text.splitlines():
        if any(p.search(line) for p in patterns) and line.strip() not in out:
            out.append(line.strip()[:300])
            if len(out) >= limit:
                break
    return out
