"""Load through one endpoint: the operator's one client against a deployment's front door
(`vcfslm bench --serve --endpoint URL` or `--deployment INVENTORY`).

A user of the running service sees one URL, a key, a router choosing a server. One process
on the operator's machine runs the rank bench's windows and sweep through the same loop
(bench/windows.py: `EndpointClient` the driver, `Alone` the coordinator) against that URL,
so `load` is the whole deployment's requests/s. Around each window it reads every server's
counter of finished requests (`vllm:request_success_total` on its /metrics, which needs no
key), so each record says how the router split the load. One stage per node count behind
the endpoint (`EndpointSpec.nodes`): the caller's `scale(n)` changes the deployment before
its first window; the records carry the count (`endpoint_nodes`), so one run holds a
scale-out curve. Faults and a front door that stops answering: endpoint/faults.py.

No torch, no SSH: the deployment is changed and the fault injected by callables the CLI
builds, so a test drives all of it against fake servers behind a real router.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import results
from ..bench.launch import report_event
from ..bench.tracker import BenchTracker
from ..bench.windows import Alone, ServeWindows, Window
from ..errors import BenchError, Problem, RunFolderError, UsageError
from ..matrix import serve_complete
from ..progress import NullReporter, Reporter
from ..results import ServeRecord
from ..run_meta import build_run_meta
from ..runspec import Fault, RunSpec
from ..serve.http_backend import (
    check_key,
    read_metrics,
    request_prompt_ids,
    sampled,
    server_version,
)
from ..serve.http_serve import http_record_fields, run_http_window
from ..serve.openai_client import Endpoint, Stream, stream_completion
from ..serve.scheduler import Request
from ..serving import servers
from .faults import FaultRun, endpoint_outage

log = logging.getLogger("vcfslm.endpoint")

NODE = "endpoint"                   # the records' node: the operator's client, not a guest
COMPLETIONS = "/v1/completions"
REQUESTS_FINISHED = "vllm:request_success_total"
# Words that are one token each in the common BPE vocabularies (with their leading space):
# the text prompts' words when no vocab is known.
TEXT_WORDS = ("the", "of", "and", "to", "in", "is", "on", "for", "with", "as", "at", "by")


@dataclass(frozen=True)
class Target:
    """One stage of the run: where the load goes and who stands behind it."""

    url: str
    nodes: int
    servers: tuple[str, ...] = ()                            # base URLs whose /metrics split the load
    programs: Mapping[str, str] = field(default_factory=dict)   # "node/program" -> its server's base URL


@dataclass(frozen=True)
class EndpointLaunch:
    """How an endpoint run is driven (what it measures is its RunSpec).

    key: the endpoint's API key (read by the caller from the key file; never written).
    scale(n): brings n nodes up behind the endpoint and says where the load goes (None:
    the spec's URL, servers and single node count). kill(fault): crashes the fault's server
    (its pid, or None when not known)."""

    key: str = field(repr=False)
    ca_file: str | None = None          # what the client trusts at an https endpoint (None: the system's store)
    runs_dir: str | Path = "runs"
    resume: bool = False
    scale: Callable[[int], Target] | None = None
    kill: Callable[[Fault], int | None] | None = None
    health_poll_s: float = 0.5
    restart_timeout_s: float = 900.0


@dataclass
class EndpointRun:
    run_dir: Path
    meta: results.RunMeta
    serve_records: list[ServeRecord] = field(default_factory=list)


# ------------------------------------------------------------------ pure parts


def endpoint_of(url: str, key: str, model: str = "", ca_file: str | None = None) -> Endpoint:
    """The client's Endpoint of a base URL (https://host:port, verified against `ca_file` or
    the system's store; http://host:port)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{url}: the client speaks https or http to an endpoint like https://10.0.0.11:8000")
    tls = parts.scheme == "https"
    return Endpoint(parts.hostname, parts.port or (443 if tls else 80), key, model, tls, ca_file)


def requests_split(series: Sequence[Mapping[str, float | None]]) -> tuple[dict[str, int | None], list[str]]:
    """Each server's finished requests over a window from its counter read before it, during it
    and after it (`series`, in time order; None: that read failed), and the servers whose
    counter went down between two reads: it restarted (a fault), and from there it counts what
    it finished since. A server whose first or last read failed is None: not known."""
    split: dict[str, int | None] = {}
    resets: list[str] = []
    for url in sorted({u for reads in series for u in reads}):
        values = [reads.get(url) for reads in series]
        if not values or values[0] is None or values[-1] is None:
            split[url] = None
            continue
        known = [v for v in values if v is not None]
        total = 0.0
        for earlier, later in zip(known[:-1], known[1:], strict=True):
            if later < earlier:
                total += later
                if url not in resets:
                    resets.append(url)
            else:
                total += later - earlier
        split[url] = int(round(total))
    return split, sorted(resets)


def text_prompt(seed: int, request: Request) -> str:
    """A request's prompt as words of one token each (when the served vocab is not known):
    the same words for the same seed, or for the same workload segments."""
    if request.segments:
        out = []
        for key, length in request.segments:
            rng = random.Random(key)
            out.extend(" " + rng.choice(TEXT_WORDS) for _ in range(length))
        return "".join(out)
    rng = random.Random(seed * 1_000_003 + request.index)
    return "".join(" " + rng.choice(TEXT_WORDS) for _ in range(request.input_tokens))


def served_model(url: str, key: str, ca_file: str | None = None) -> str:
    """The model the endpoint serves (its /v1/models), checked as a run checks it."""
    return EndpointClient.check(endpoint_of(url, key, ca_file=ca_file), url)


# ------------------------------------------------------------------ one stage's client


class EndpointClient:
    """The run's one client of one stage: the endpoint, its servers' counters, its faults; a
    driver of the window loop (bench/windows.WindowDriver). It compiles nothing."""

    compiles = 0

    def __init__(self, target: Target, spec: RunSpec, launch: EndpointLaunch):
        ep = spec.endpoint
        assert ep is not None
        self.target, self.spec, self.launch = target, spec, launch
        self.model = self.check(endpoint_of(target.url, launch.key, ca_file=launch.ca_file), target.url)
        self.endpoint = endpoint_of(target.url, launch.key, self.model, launch.ca_file)
        # The servers' proxies take /metrics with the key, over TLS from the deployment's CA.
        self.meters = {url: endpoint_of(url, launch.key, "", launch.ca_file) for url in target.servers}
        self.faults, self.limits = ep.fault_list, spec.serve_limits()
        self.server_name = spec.server.name if spec.server is not None else servers.VLLM.name
        missing = [f.target for f in self.faults if f.target not in target.programs]
        if self.faults and launch.kill is None:
            raise UsageError("--fault needs a way to kill a server: --deployment INVENTORY")
        if missing:
            known = ", ".join(sorted(target.programs)) or "none"
            raise BenchError(f"--fault {', '.join(missing)}: no such server behind the endpoint at "
                             f"{target.nodes} node(s) (servers: {known})")

    @staticmethod
    def check(endpoint: Endpoint, url: str) -> str:
        """The endpoint refuses a wrong key, takes the run's, and names the model it serves."""
        try:
            body = check_key(endpoint, f"the endpoint {url}")
        except OSError as exc:
            raise BenchError(f"the endpoint {url} does not answer: {exc}") from None
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise BenchError(f"the endpoint {url} lists no model: {body[:200]}") from None

    def counters(self) -> dict[str, dict[str, float] | None]:
        """Each server's /metrics, parsed (None: it did not answer)."""
        return {url: read_metrics(ep) for url, ep in self.meters.items()}

    def body(self, seed: int, r: Request) -> dict[str, Any]:
        ep = self.spec.endpoint
        body = servers.completion_body(self.model, [], r.output_tokens)
        body["prompt"] = (request_prompt_ids(seed, r, ep.vocab) if ep.prompts == "ids" and ep.vocab
                          else text_prompt(seed, r))
        return body

    def window(self, w: Window) -> tuple[dict[str, Any], list[str]]:
        """One window: (the record's measured fields, why it is invalid). BenchError when the
        endpoint stopped answering. Only a measured window takes the faults (a warm-up's is
        discarded)."""
        serve, limits, seed = self.spec.serve, self.limits, w.seed
        _, load, input_tokens, _ = w.scenario
        lock = threading.Lock()
        returned: dict[int, float] = {}         # when each stream came back (time.perf_counter)
        sent: dict[int, float] = {}

        def send(r: Request, deadline: float) -> Stream:
            stream = stream_completion(self.endpoint, COMPLETIONS, self.body(seed, r), deadline_s=deadline)
            with lock:
                returned[r.index] = time.perf_counter()
                if stream.sent_s is not None:
                    sent[r.index] = stream.sent_s
            return stream

        faults = [FaultRun(f, self._health(f), self.launch.kill, self.launch.health_poll_s,
                           self.launch.restart_timeout_s) for f in self.faults] if self.launch.kill and w.index >= 0 else []
        with sampled(self.counters) as reads:
            t0 = time.perf_counter()
            for f in faults:
                f.begin(t0)
            outcome = run_http_window(send, serve, load, input_tokens, random.Random(seed))
        for f in faults:
            f.finish()
        before, samples, after = reads[0], reads[1:], self.counters()
        # The window's clock starts where run_http_window took it, a moment after t0: any
        # request that went out says where (its send time less its time on that clock).
        start = next((sent[r.index] - r.started_s for r in outcome.requests
                      if r.started_s is not None and r.index in sent), t0)
        for f in faults:
            f.shift(t0 - start)
        failed_at = {i: at - start for i, at in returned.items()}
        spans = [(f.start_s, f.end_s) for f in faults if f.start_s is not None]
        outage = endpoint_outage(outcome.requests, spans)
        if outage is not None:
            raise BenchError(f"{self.target.url}: {outage}")
        fields = http_record_fields(outcome, serve, limits, self.server_name,
                                    self._server_metrics(before, after, samples))
        split, resets = requests_split([{u: None if m is None else m.get(REQUESTS_FINISHED) for u, m in reads.items()}
                                        for reads in (before, *samples, after)])
        reasons = []
        problem = servers.lag_problem(outcome.lags_s, self.spec.endpoint.max_lag_s)
        if problem:
            reasons.append(problem)
        fault: dict[str, Any] = {}
        for f in faults[:1]:                    # the spec holds one fault per window
            fault, why = f.account(outcome, failed_at, limits, serve.cutoff_s)
            reasons += why
        fields.update(endpoint=self.target.url, endpoint_nodes=self.target.nodes,
                      endpoint_servers=list(self.target.servers), server_requests=split, server_resets=resets,
                      window_finished=sum(1 for r in outcome.requests if r.done), fault=fault)
        return fields, reasons

    def rss(self) -> tuple[int, int]:
        """(peak, current) resident bytes: the client's peak (the servers' are theirs)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0

    def _health(self, fault: Fault) -> Endpoint | None:
        url = self.target.programs.get(fault.target)
        return endpoint_of(url, "", ca_file=self.launch.ca_file) if url else None

    def _server_metrics(self, before, after, samples) -> dict[str, float]:
        """The servers' own figures over the window, summed (counters) or their largest (gauges)."""
        out: dict[str, float] = {}
        for url in self.meters:
            b, a = before.get(url), after.get(url)
            if a is None:
                continue
            deltas = servers.metric_deltas(servers.VLLM, b or {}, a,
                                           [s[url] for s in samples if s.get(url)] + [a])
            for name, value in deltas.items():
                if name in servers.VLLM.gauges:
                    out[name] = max(out.get(name, 0.0), value)
                elif name != "queue_time_s_mean":
                    out[name] = out.get(name, 0.0) + value
        return out

    def facts(self) -> dict[str, Any]:
        version = server_version(self.endpoint)
        return {"url": self.target.url, "nodes": self.target.nodes, "servers": list(self.target.servers),
                "programs": dict(self.target.programs), "model": self.model, "version": version,
                "prompts": "token ids" if self.spec.endpoint.prompts == "ids" and self.spec.endpoint.vocab
                else "text"}


# ------------------------------------------------------------------ the run


def run_endpoint(spec: RunSpec, launch: EndpointLaunch, reporter: Reporter | None = None) -> EndpointRun:
    """Every stage of `spec` (one per node count behind the endpoint), each load and the
    sweep's; returns the run (records kept as each window ends). BenchError when the
    endpoint stops answering or a faulted server does not come back (meta.json says which)."""
    reporter = reporter or NullReporter()
    ep, serve = spec.endpoint, spec.serve
    if ep is None or serve is None:
        raise UsageError("an endpoint run needs the endpoint and the serving settings")
    if len(ep.nodes) > 1 and launch.scale is None:
        raise UsageError("several node counts (--scale-out) need a deployment to change: --deployment INVENTORY")
    run_dir = Path(launch.runs_dir) / spec.run_id
    if launch.resume and not (run_dir / "meta.json").exists():
        raise RunFolderError([Problem(str(run_dir / "meta.json"), None, None, "",
                                      f"cannot resume {spec.run_id}: no such file")])
    if not launch.resume and run_dir.exists():
        raise UsageError(f"run folder {run_dir} already exists (choose another --run-id or --resume)")
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = results.read_meta(run_dir) if launch.resume else None
    meta = build_run_meta(spec, previous=previous, guests=dict(previous.guests) if previous else {})
    meta.failure = None
    results.write_meta(run_dir, meta)
    tracker = BenchTracker(serve.warmup_windows + serve.repeats, started=time.monotonic())
    stages = [Stage(n, spec, launch, run_dir, meta, reporter, tracker) for n in ep.nodes]
    try:
        for stage in stages:
            stage.windows.run()
    except BenchError as exc:
        meta.failure = str(exc)[:4000]
        raise
    finally:
        meta.complete = meta.failure is None and all(serve_complete(s.windows.records, serve, 1) for s in stages)
        results.write_meta(run_dir, meta)
    return EndpointRun(run_dir, meta, [r for s in stages for r in s.windows.records])


class Stage:
    """One node count behind the endpoint, through the window loop: its driver (the stage's
    EndpointClient, made at its first window: a stage whose loads were all kept never changes
    the deployment) and its one process with no ranks (records and events of its own)."""

    compiles = 0

    def __init__(self, n: int, spec: RunSpec, launch: EndpointLaunch, run_dir: Path, meta: results.RunMeta,
                 reporter: Reporter, tracker: BenchTracker):
        self.n, self.spec, self.launch, self.run_dir, self.meta = n, spec, launch, run_dir, meta
        self.reporter, self.tracker, self.subject = reporter, tracker, f"{n} node(s)"
        self.client: EndpointClient | None = None
        identity = {"run_id": spec.run_id, "node": NODE, "node_rank": 0, "rank": 0, "local_rank": 0,
                    "world_size": 1, "ranks_per_node": 1, "nodes": n}
        # The file holds every stage's records, and a resumed run's: a new run's folder is new.
        self.windows = ServeWindows(self, Alone(identity, n, self.report), run_dir / results.SERVE_RESULTS,
                                    spec=spec.serve, limits=spec.serve_limits(), resume=True,
                                    placement={"client": {"pid": os.getpid(), "cpus": len(os.sched_getaffinity(0))}},
                                    ours=lambda r: r.endpoint_nodes == n)

    def window(self, w: Window) -> tuple[dict[str, Any], list[str]]:
        ep, n = self.spec.endpoint, self.n
        if self.client is None:
            target = self.launch.scale(n) if self.launch.scale else Target(ep.url or "", n, tuple(ep.servers))
            if target.nodes != n:
                raise BenchError(f"asked for {n} node(s) behind the endpoint, the deployment has {target.nodes}")
            self.client = EndpointClient(target, self.spec, self.launch)
            facts = self.client.facts()
            self.meta.guests.setdefault(NODE, {}).setdefault("stages", {})[str(n)] = facts
            results.write_meta(self.run_dir, self.meta)
            self.reporter.log(f"{n} node(s) behind {target.url}: {len(target.servers)} server(s), "
                              f"model {facts['model']}, prompts as {facts['prompts']}")
        return self.client.window(w)

    def rss(self) -> tuple[int, int]:
        assert self.client is not None                # a window made it
        return self.client.rss()

    def report(self, event: dict[str, Any], record: ServeRecord | None = None) -> None:
        """The window loop's events, as the rank workers' are shown; a fault's account; a server
        that did not come back stops the run (its window is kept)."""
        report_event(self.reporter, self.tracker, self.subject, {"rank": 0, **event})
        if event["phase"] == "swept":
            self.reporter.log(f"sweep {event['slo']}, input {event['input_tokens']}: stopped: {event['reason']}")
        f = record.fault if record is not None else None
        if f:
            self.reporter.log(f"{self.subject}, {record.load:g} {record.load_kind}: fault {f.get('kill')}: "
                              + (f"failed: {f['error']}" if "error" in f else
                                 f"down {f.get('start_s')}–{f.get('end_s')} s, {f.get('failed_all')} request(s) "
                                 f"failed, detected {f.get('detect_s')} s, restarted {f.get('restart_s')} s"))
        if record is not None and any("did not answer /health" in why for why in record.invalid_reasons):
            raise BenchError(f"{self.subject}: {'; '.join(record.invalid_reasons)} "
                             "(the window is kept; --resume continues once it is back)")
