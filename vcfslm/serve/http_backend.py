"""The rank's side of an HTTP serving backend: it starts its vNUMA node's server, makes
sure it answers with this run's key, drives each window over the streaming API, reads
the server's /metrics around it, and stops the server.

The rank is the server's only client (one rank per vNUMA node), so a torchrun rank
stays what it is in the static bench: the unit that the rendezvous, the barriers and
the gathers align. The key is made here, per run and per server, and handed to the
server through its environment only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import BenchError
from ..serving import servers
from ..serving.decisions import ServeSpec
from ..serving.servers import HttpBackend, ServerSpec
from ..serving.workloads import segment_ids
from ..topology import format_cpu_list
from . import server_process
from .http_serve import http_record_fields, invalid_reasons, run_http_window
from .openai_client import Endpoint, get, stream_completion
from .scheduler import Request

log = logging.getLogger("vcfslm.bench.worker")
SERVED_NAME = "vcfslm-model"
METRICS_EVERY_S = 2.0


def prompt_ids(seed: int, index: int, length: int, vocab: int) -> list[int]:
    """A request's prompt as token ids: the same ids for the same seed whatever the server."""
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(3, vocab) for _ in range(length)]


def request_prompt_ids(seed: int, request: Request, vocab: int) -> list[int]:
    """A request's prompt: its workload segments' ids (a conversation's history, a trace's
    shared blocks: equal segments, equal ids), else drawn from the window's seed."""
    if request.segments:
        return segment_ids(request.segments, vocab)
    return prompt_ids(seed, request.index, request.input_tokens, vocab)


def model_facts(model_dir: str) -> dict[str, Any]:
    """The few config.json numbers the client and the KV-cache size need."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: an HTTP server needs a model folder with a config.json ({exc})") from None
    return {"vocab_size": int(config["vocab_size"]), "kv_bytes_per_token": servers.kv_bytes_per_token(config),
            "max_position_embeddings": config.get("max_position_embeddings")}


def check_key(endpoint: Endpoint, label: str) -> str:
    """The server (`label`) refuses a wrong API key and takes `endpoint`'s: its /v1/models."""
    status, _ = get(Endpoint(endpoint.host, endpoint.port, "not-" + endpoint.key, endpoint.model, endpoint.tls,
                             endpoint.ca_file), "/v1/models")
    if status != 401:
        raise BenchError(f"{label} answered a wrong API key with HTTP {status}: it does not check the key, "
                         "so anyone on that address could use it")
    status, body = get(endpoint, "/v1/models")
    if status != 200:
        raise BenchError(f"{label} refused the run's API key: HTTP {status} {body[:200]}")
    return body


def healthy(endpoint: Endpoint, path: str = "/health") -> bool:
    try:
        return get(endpoint, path, timeout_s=2.0)[0] == 200
    except OSError:
        return False


@contextmanager
def sampled(read: Callable[[], Any], every_s: float = METRICS_EVERY_S) -> Iterator[list]:
    """read() now and every `every_s` until the block ends: the reads, in order (a server's
    counters before and during a window)."""
    reads, stop = [read()], threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            reads.append(read())

    sampler = threading.Thread(target=sample, daemon=True, name="metrics")
    sampler.start()
    try:
        yield reads
    finally:
        stop.set()
        sampler.join(10)


def read_metrics(endpoint: Endpoint, path: str = "/metrics") -> dict[str, float] | None:
    """A server's /metrics, parsed (None: it did not answer)."""
    try:
        status, body = get(endpoint, path, timeout_s=5.0)
    except OSError:
        return None
    return servers.parse_metrics(body) if status == 200 else None


def server_version(endpoint: Endpoint, path: str = "/version") -> str | None:
    """The version a server says it runs (None: it does not say)."""
    try:
        status, body = get(endpoint, path)
        return json.loads(body).get("version") if status == 200 else None
    except (OSError, ValueError, AttributeError):
        return None


class HttpDriver:
    """One rank's server and client: a driver of the window loop (bench/windows.WindowDriver),
    its windows judged by `limits`; the server writes its log to `log_path`."""

    def __init__(self, spec: ServerSpec, serve: ServeSpec, *, model_dir: str, numa_node: int,
                 node_cpus: list[int], log_path: Path, limits: dict[str, Any] | None = None):
        backend = spec.backend
        if backend is None:
            raise BenchError(f"{spec.name} is not an HTTP server")
        self.backend: HttpBackend = backend
        self.spec, self.serve, self.limits = spec, serve, limits or {}
        self.model_dir, self.numa_node = model_dir, numa_node
        self.node_cpus = list(node_cpus)
        self.server_cpus, self.client_cpus = servers.split_cpus(node_cpus, spec.reserved_cores)
        self.facts_model = model_facts(model_dir)
        self.kv_gib = spec.kv_cache_gib or servers.kv_cache_gib(
            self.facts_model["kv_bytes_per_token"], serve.slots, serve.max_context)
        self.log_path = log_path
        self.endpoint = Endpoint(spec.host, spec.port_for(numa_node), secrets.token_urlsafe(24), SERVED_NAME)
        self.process: server_process.ServerProcess | None = None
        self.startup_s: float | None = None
        self.compiles = 0                  # the in-process engine's counter; a server compiles before /health

    @property
    def vocab(self) -> int:
        return self.facts_model["vocab_size"]

    def script(self) -> str:
        folder = self.spec.launch_dir
        if not folder:
            raise BenchError("no folder of launch scripts for the server (server.launch_dir)")
        path = Path(folder) / self.backend.script_name(self.numa_node)
        if not path.exists():
            raise BenchError(f"{path} does not exist: the guest stage renders one launch script per vNUMA "
                             f"node (vcfslm provision; --local renders them into the run folder)")
        return str(path)

    def start(self) -> None:
        """Launch the server, wait for /health, check that it takes this run's key and only it."""
        argv = servers.server_argv(self.spec, model_dir=self.model_dir, served_name=SERVED_NAME,
                                   slots=self.serve.slots, max_model_len=self.serve.max_context,
                                   numa_node=self.numa_node)
        env = {"VLLM_API_KEY": self.endpoint.key, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib)}
        label = f"{self.backend.name} on vNUMA node {self.numa_node} ({self.spec.host}:{self.endpoint.port})"
        self.process = server_process.start(self.script(), argv, env=env, log_path=self.log_path, label=label,
                                             cpus=self.node_cpus)
        log.info("started %s, pid %d, log %s", label, self.process.pid, self.log_path)
        self.startup_s = self.process.wait_healthy(lambda: healthy(self.endpoint, self.backend.health_path),
                                                    self.spec.health_timeout_s)
        log.info("%s healthy after %.1f s", label, self.startup_s)
        check_key(self.endpoint, self.process.label)
        # The client's threads (made by this one) run on the reserved CPUs, or on all of the
        # node's when none are: never on the single core OpenMP bound this thread to, where
        # a server thread spins.
        os.sched_setaffinity(0, self.client_cpus)

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.endpoint, self.backend.metrics_path) or {}

    def window(self, w) -> tuple[dict[str, Any], list[str]]:
        """One window `w` (the loop's Window: its scenario, index and seed): (the record's measured
        fields, why it is invalid)."""
        assert self.process is not None
        self.process.check_alive()
        path, seed = self.backend.completions_path, w.seed
        _, load, input_tokens, _ = w.scenario

        def send(r, deadline: float):
            body = servers.completion_body(SERVED_NAME, request_prompt_ids(seed, r, self.vocab), r.output_tokens)
            return stream_completion(self.endpoint, path, body, deadline_s=deadline)

        with sampled(self.metrics) as reads:
            outcome = run_http_window(send, self.serve, load, input_tokens, random.Random(seed))
        # A server that died under the window stops the run, as a dead rank does.
        self.process.check_alive()
        after = self.metrics()
        deltas = servers.metric_deltas(self.backend, reads[0], after, [*reads[1:], after])
        fields = http_record_fields(outcome, self.serve, self.limits, self.backend.name, deltas)
        return fields, invalid_reasons(outcome, self.spec.max_lag_s) + self.thread_problems()

    def facts(self) -> dict[str, Any]:
        """What the run records of the server: version, how it runs, where it ran, its memory."""
        version = server_version(self.endpoint, self.backend.version_path)
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return {"name": self.backend.name, "version": version, "pid": self.process and self.process.pid,
                "log": str(self.log_path), "startup_s": self.startup_s, "host": self.spec.host,
                "port": self.endpoint.port, "numa_node": self.numa_node,
                "server_cpus": self.server_cpus, "client_cpus": self.client_cpus,
                "kv_cache_gib": self.kv_gib, "chunked_prefill": self.spec.chunked_prefill,
                "prefix_caching": self.spec.prefix_caching, "enforce_eager": self.spec.enforce_eager,
                "max_num_seqs": self.serve.slots,
                "max_model_len": self.serve.max_context,
                "log_facts": servers.fact_lines(self.backend, text),
                "peak_rss_bytes": self.process.peak_rss_bytes() if self.process else {}}

    def thread_problems(self) -> list[str]:
        """Server threads running outside the server's CPUs (a binding that did not hold)."""
        if self.process is None:
            return []
        allowed = set(self.server_cpus)
        out = []
        for pid in [self.process.pid, *server_process.descendants(self.process.pid)]:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    cpu = int((task / "stat").read_text().rsplit(")", 1)[1].split()[36])
                except (OSError, ValueError, IndexError):
                    continue
                if cpu not in allowed:
                    out.append(f"server thread {task.name} (pid {pid}) ran on CPU {cpu}, outside "
                               f"{format_cpu_list(self.server_cpus)}")
                    break
        return out[:3]

    def rss(self) -> tuple[int, int]:
        """(peak, current) resident bytes of the replica: the server's largest process (the one
        holding the weights), not the client's."""
        if self.process is None:
            return 0, 0
        pids = [self.process.pid, *server_process.descendants(self.process.pid)]
        peaks = [v for pid in pids if (v := server_process.vm_field(pid, "VmHWM")) is not None]
        now = [v for pid in pids if (v := server_process.vm_field(pid, "VmRSS")) is not None]
        return max(peaks, default=0), max(now, default=0)

    def stop(self) -> None:
        if self.process is not None:
            code = self.process.stop()
            log.info("stopped %s (exit %s)", self.process.label, code)

