"""Load through one endpoint: the operator's one client against a deployment's front door
(`vcfslm bench --serve --endpoint URL` or `--deployment INVENTORY`).

The rank bench drives each vNUMA node's server from its own rank; a user of the running
service sees something else: one URL, a key, a router choosing a server. Here one process
on the operator's machine runs the same open-loop (or closed-loop) windows against that
URL (serve/http_serve.py, the same arrivals, the same ServeRecord), so `load` is the whole
deployment's requests/s, not a rank's. Around each window it reads every server's own
counter of finished requests (`vllm:request_success_total` on its /metrics, which needs no
key), so each record says how the router split the load.

Stages: one per node count behind the endpoint (`EndpointSpec.nodes`). Between stages the
caller's `scale(n)` changes the deployment (the CLI's `serve up --nodes n`) and says where
the load goes now; the records carry the count (`endpoint_nodes`), so one run holds a
scale-out curve.

Faults (`--fault kill:NODE/PROGRAM@SECONDS`): in every measured window the caller's `kill`
crashes that server SECONDS after the window starts, and the client polls the server's
/health every half second until it answers again: the fault's end. The window keeps the
fault's start and end, the requests that failed after the kill (each one a miss: a 5xx, a
dropped or a stalled stream, none lost), the time to detect (the kill to the last failed
request: when the router stopped sending to the dead server) and to restart (the kill to
healthy), and the attainment of the requests that arrived during [start, end] and after it.

A front door or router that stops answering (requests refused or answered 502/503/504 one
after another, outside an injected fault) stops the run with BenchError naming it; that
window is not kept, every earlier one is, and `--resume` measures it again.

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

from .. import judging, results, servers, serving
from ..contract import build_run_meta, serve_complete
from ..errors import BenchError, Problem, RunFolderError, UsageError
from ..progress import NullReporter, Reporter
from ..results import ServeRecord
from ..runspec import Fault, RunSpec
from ..serve.http_backend import request_prompt_ids
from ..serve.http_serve import HttpOutcome, http_record_fields, run_http_window
from ..serve.openai_client import Endpoint, Stream, get, stream_completion
from ..serve.scheduler import Request
from .launch import report_event
from .serve_worker import sweep_input
from .tracker import BenchTracker

log = logging.getLogger("vcfslm.bench.endpoint")

NODE = "endpoint"                   # the records' node: the operator's client, not a guest
COMPLETIONS = "/v1/completions"
REQUESTS_FINISHED = "vllm:request_success_total"
METRICS_EVERY_S = 2.0
# Failed requests in a row, outside a fault, that say the front door stopped answering.
OUTAGE_RUN = 5
# What a front door or router that stopped answering leaves: a refused connection, or the
# gateway errors nginx gives when the router behind it does not answer. Not 503: that is the
# router answering that it has no healthy server (a fault's aftermath, until it takes the
# restarted one back), a failed request like any other.
UNREACHABLE = ("ConnectionRefusedError", "HTTP 502", "HTTP 504")
# After the kill, how long the server may keep answering /health before the fault is said
# not to have taken it down (a kill is immediate; its socket closes within this).
DOWN_GRACE_S = 5.0
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


def unreachable(error: str | None) -> bool:
    """Did this failure come from nothing answering at the door (not from a server's stream)?"""
    return error is not None and any(mark in error for mark in UNREACHABLE)


def endpoint_outage(requests: Sequence[Request], spans: Sequence[tuple[float, float | None]] = (),
                    run: int = OUTAGE_RUN) -> str | None:
    """Why the window says the endpoint stopped answering (None: it did not): `run` requests
    in a row, in the order they went out, refused or answered 502/504, none of them sent
    inside a fault's [start, end] (`spans`; an open end: to the window's end)."""

    def in_fault(at: float) -> bool:
        return any(start <= at and (end is None or at <= end) for start, end in spans)

    sent = sorted((r for r in requests if r.started_s is not None),
                  key=lambda r: (r.started_s, r.index))
    streak: list[Request] = []
    for r in sent:
        if unreachable(r.error) and not in_fault(r.started_s):
            streak.append(r)
            if len(streak) >= run:
                break
        else:
            streak = []
    if len(streak) < run:
        return None
    return (f"the endpoint stopped answering: {len(streak)} requests in a row from {streak[0].started_s:.1f} s "
            f"into the window failed at the door ({streak[0].error})")


def fault_accounting(requests: Sequence[Request], failed_at: Mapping[int, float], start_s: float,
                     end_s: float | None, limits: Mapping[str, Mapping[str, Any]], cutoff_s: float
                     ) -> dict[str, Any]:
    """One fault's account from its window's requests (times on the window's clock).

    failed_at: when each request's stream came back to the client (its failure time for a
    failed one; a request still out at the cutoff failed then). Failed requests: every one
    sent that failed from the kill on, also after the server is back (the router may still
    have it out of rotation: a 503 from it is the fault's too); counted ones are judged as
    misses, none dropped. A request the window never sent (due in the cool-down after every
    counted one was done) is no failure. Detection: the kill to the last failed request sent
    after it (the router's last pick of a server that could not serve; 0 when every failure
    was already in flight at the kill). Attainment per SLO: the share of the counted requests
    arriving in [start, end] (during) or after end (after) that met every limit at once."""
    until = cutoff_s if end_s is None else end_s
    failures = [(failed_at.get(r.index, cutoff_s), r) for r in requests
                if not r.done and (r.started_s is not None or r.error is not None)]
    hit = [(at, r) for at, r in failures if at >= start_s]
    sent_after = [r.started_s for _, r in hit if r.started_s is not None and r.started_s >= start_s]
    counted = [r for r in requests if r.counted]
    during = [r for r in counted if start_s <= r.arrival_s <= until]
    after = [] if end_s is None else [r for r in counted if r.arrival_s > end_s]
    errors: list[str] = []
    for _, r in hit:
        if r.error and r.error not in errors and len(errors) < 3:
            errors.append(r.error)
    return {"start_s": round(start_s, 3), "end_s": None if end_s is None else round(end_s, 3),
            "restart_s": None if end_s is None else round(end_s - start_s, 3),
            "detect_s": (round(max(sent_after) - start_s, 3) if sent_after else 0.0) if hit else None,
            "failed": sum(1 for _, r in hit if r.counted), "failed_all": len(hit),
            "requests_during": len(during), "requests_after": len(after),
            "attainment_during": _attainment(during, limits), "attainment_after": _attainment(after, limits),
            "errors": errors}


def _attainment(requests: Sequence[Request], limits: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Per SLO: the share of these requests that met every limit at once (None: no request)."""
    done = [r for r in requests if r.done]
    ttft = [r.first_s - r.arrival_s for r in done]
    tpot = [(r.last_s - r.first_s) / (r.produced - 1) * 1000.0 if r.produced > 1 else 0.0 for r in done]
    unfinished = len(requests) - len(done)
    out: dict[str, float | None] = {}
    inputs = [r.input_tokens for r in done]
    for name, lim in limits.items():
        a = judging.attainment(ttft, tpot, unfinished, lim.get("tpot_ms"), lim.get("ttft_s"), input_tokens=inputs,
                               ttft_per_token_ms=lim.get("ttft_per_token_ms"))
        out[name] = round(a.share, 4) if requests else None
    return out


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
    return EndpointClient.check(endpoint_of(url, key, ca_file=ca_file), url, key)


# ------------------------------------------------------------------ the fault


class FaultRun:
    """One fault in one window: the kill at its time, then /health polled until it answers."""

    def __init__(self, fault: Fault, health: Endpoint | None, kill: Callable[[Fault], int | None],
                 poll_s: float, timeout_s: float):
        self.fault, self.health, self.kill = fault, health, kill
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.start_s: float | None = None
        self.end_s: float | None = None
        self.pid: int | None = None
        self.error: str | None = None
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, t0: float) -> None:
        """Arm the kill at t0 + at_s (t0: the window's start on time.perf_counter)."""
        self._thread = threading.Thread(target=self._run, args=(t0,), daemon=True, name="fault")
        self._thread.start()

    def _healthy(self) -> bool:
        if self.health is None:
            return False
        try:
            return get(self.health, "/health", timeout_s=2.0)[0] == 200
        except OSError:
            return False

    def _run(self, t0: float) -> None:
        wait = t0 + self.fault.at_s - time.perf_counter()
        if wait > 0 and self._stop.wait(wait):
            return
        # The fault starts when the kill is sent, not when it returns: over SSH the server dies
        # somewhere in between, and a stream it cut then is the fault's failure too.
        issued_s = time.perf_counter() - t0
        try:
            self.pid = self.kill(self.fault)
        except Exception as exc:  # any failure of the caller's kill is the fault's, said in its record
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.start_s, returned_s = issued_s, time.perf_counter() - t0
        if self.health is None:
            self.note = "no /health to poll: its server's URL is not known"
            return
        seen_down = False
        while not self._stop.is_set():
            now = time.perf_counter() - t0
            if now - self.start_s > self.timeout_s:
                return
            if self._healthy():
                if seen_down:
                    self.end_s = time.perf_counter() - t0
                    return
                if now - returned_s > DOWN_GRACE_S:
                    self.note = f"its /health kept answering for {DOWN_GRACE_S:g} s: the kill did not take it down"
                    self.end_s = self.start_s
                    return
            else:
                seen_down = True
            self._stop.wait(self.poll_s)

    def shift(self, seconds: float) -> None:
        """Move the fault's times onto the window's own clock (`seconds` later than its t0's)."""
        if self.start_s is not None:
            self.start_s += seconds
        if self.end_s is not None:
            self.end_s += seconds

    def finish(self) -> None:
        """Wait for the server to answer again (at most the restart timeout after the kill)."""
        if self._thread is None:
            return
        if self.start_s is None and self._thread.is_alive():
            self._stop.set()                    # the window ended before the kill was due
        self._thread.join(self.timeout_s + 5.0)
        self._stop.set()

    def account(self, outcome: HttpOutcome, failed_at: Mapping[int, float], limits, cutoff_s: float
                ) -> tuple[dict[str, Any], list[str]]:
        """The record's `fault` and the reasons it makes the window invalid."""
        base: dict[str, Any] = {"kill": self.fault.text, "target": self.fault.target, "at_s": self.fault.at_s,
                                "pid": self.pid}
        if self.health is not None:
            base["health"] = f"http://{self.health.host}:{self.health.port}/health"
        if self.error is not None or self.start_s is None:
            why = self.error or "the window ended before it was due"
            return {**base, "error": why}, [f"the fault {self.fault.text} did not happen: {why}"]
        out = {**base, **fault_accounting(outcome.requests, failed_at, self.start_s, self.end_s, limits, cutoff_s)}
        reasons = []
        if self.note:
            out["note"] = self.note
        if self.end_s is None and self.health is not None:
            reasons.append(f"{self.fault.target} did not answer /health within {self.timeout_s:g} s of the kill")
        return out, reasons


# ------------------------------------------------------------------ one stage's client


class EndpointClient:
    """The run's one client of one stage: the endpoint, its servers' counters, its faults."""

    def __init__(self, target: Target, spec: RunSpec, launch: EndpointLaunch):
        ep = spec.endpoint
        assert ep is not None
        self.target, self.spec, self.launch = target, spec, launch
        self.model = self.check(endpoint_of(target.url, launch.key, ca_file=launch.ca_file), target.url, launch.key)
        self.endpoint = endpoint_of(target.url, launch.key, self.model, launch.ca_file)
        # The servers' proxies take /metrics with the key, over TLS from the deployment's CA.
        self.meters = {url: endpoint_of(url, launch.key, "", launch.ca_file) for url in target.servers}
        self.faults = ep.fault_list
        self.server_name = spec.server.name if spec.server is not None else servers.VLLM.name
        missing = [f.target for f in self.faults if f.target not in target.programs]
        if self.faults and launch.kill is None:
            raise UsageError("--fault needs a way to kill a server: --deployment INVENTORY")
        if missing:
            known = ", ".join(sorted(target.programs)) or "none"
            raise BenchError(f"--fault {', '.join(missing)}: no such server behind the endpoint at "
                             f"{target.nodes} node(s) (servers: {known})")

    @staticmethod
    def check(endpoint: Endpoint, url: str, key: str) -> str:
        """The endpoint refuses a wrong key, takes the run's, and names the model it serves."""
        wrong = Endpoint(endpoint.host, endpoint.port, "not-" + key, "", endpoint.tls, endpoint.ca_file)
        try:
            status, _ = get(wrong, "/v1/models")
            if status != 401:
                raise BenchError(f"the endpoint {url} answered a wrong API key with HTTP {status}: "
                                 "it does not check the key, so anyone on that address could use it")
            status, body = get(endpoint, "/v1/models")
        except OSError as exc:
            raise BenchError(f"the endpoint {url} does not answer: {exc}") from None
        if status != 200:
            raise BenchError(f"the endpoint {url} refused the key: HTTP {status} {body[:200]}")
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise BenchError(f"the endpoint {url} lists no model: {body[:200]}") from None

    def counters(self) -> dict[str, dict[str, float] | None]:
        """Each server's /metrics, parsed (None: it did not answer)."""
        out: dict[str, dict[str, float] | None] = {}
        for url, ep in self.meters.items():
            try:
                status, body = get(ep, "/metrics", timeout_s=5.0)
            except OSError:
                out[url] = None
                continue
            out[url] = servers.parse_metrics(body) if status == 200 else None
        return out

    def body(self, seed: int, r: Request) -> dict[str, Any]:
        ep = self.spec.endpoint
        body = servers.completion_body(self.model, [], r.output_tokens)
        body["prompt"] = (request_prompt_ids(seed, r, ep.vocab) if ep.prompts == "ids" and ep.vocab
                          else text_prompt(seed, r))
        return body

    def window(self, serve: serving.ServeSpec, load: float, input_tokens: int, seed: int,
               limits: dict[str, Any], measured: bool = True) -> tuple[dict[str, Any], list[str]]:
        """One window: (the record's measured fields, why it is invalid). BenchError when the
        endpoint stopped answering. Only a measured window takes the faults (a warm-up's is
        discarded)."""
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

        before = self.counters()
        samples: list[dict[str, dict[str, float] | None]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(METRICS_EVERY_S):
                samples.append(self.counters())

        sampler = threading.Thread(target=sample, daemon=True, name="metrics")
        faults = [FaultRun(f, self._health(f), self.launch.kill, self.launch.health_poll_s,
                           self.launch.restart_timeout_s) for f in self.faults] if self.launch.kill and measured else []
        sampler.start()
        t0 = time.perf_counter()
        for f in faults:
            f.begin(t0)
        try:
            outcome = run_http_window(send, serve, load, input_tokens, random.Random(seed))
        finally:
            stop.set()
            sampler.join(10)
        for f in faults:
            f.finish()
        after = self.counters()
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
        version = None
        try:
            status, body = get(self.endpoint, "/version")
            version = json.loads(body).get("version") if status == 200 else None
        except (OSError, ValueError, AttributeError):
            pass
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
    file = run_dir / results.SERVE_RESULTS
    if launch.resume and not (run_dir / "meta.json").exists():
        raise RunFolderError([Problem(str(run_dir / "meta.json"), None, None, "",
                                      f"cannot resume {spec.run_id}: no such file")])
    if not launch.resume and run_dir.exists():
        raise UsageError(f"run folder {run_dir} already exists (choose another --run-id or --resume)")
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = results.read_meta(run_dir) if launch.resume else None
    kept = results.read_serve_records(file) if launch.resume and file.exists() else []
    meta = build_run_meta(spec, previous=previous, guests=dict(previous.guests) if previous else {})
    meta.failure = None
    results.write_meta(run_dir, meta)
    stages = Stages(spec, launch, run_dir, meta, kept, reporter)
    try:
        for n in ep.nodes:
            stages.stage(n)
    except BenchError as exc:
        meta.failure = str(exc)[:4000]
        raise
    finally:
        meta.complete = meta.failure is None and all(
            serve_complete([r for r in stages.records if r.endpoint_nodes == n], serve, 1) for n in ep.nodes)
        results.write_meta(run_dir, meta)
    return EndpointRun(run_dir, meta, list(stages.records))


class Stages:
    """The run's stages and their shared history: what is kept, what is measured next."""

    def __init__(self, spec: RunSpec, launch: EndpointLaunch, run_dir: Path, meta: results.RunMeta,
                 kept: list[ServeRecord], reporter: Reporter):
        self.spec, self.launch, self.run_dir, self.meta = spec, launch, run_dir, meta
        self.serve: serving.ServeSpec = spec.serve
        self.file = run_dir / results.SERVE_RESULTS
        self.limits = spec.serve_limits()
        self.reporter = reporter
        self.records = list(kept)
        self.tracker = BenchTracker(self.serve.warmup_windows + self.serve.repeats, started=time.monotonic())

    def stage(self, n: int) -> None:
        """Every load of one node count (and the sweep's), kept ones skipped."""
        serve = self.serve
        mine = [r for r in self.records if r.endpoint_nodes == n]
        finished = results.finished_scenarios(mine, serve.repeats)
        partial = {r.scenario for r in mine} - finished
        if partial:
            # A load the stopped run had only partly measured is measured again from its first window.
            self.records = [r for r in self.records if not (r.endpoint_nodes == n and r.scenario in partial)]
            results.write_records(self.file, self.records)
        subject = f"{n} node(s)"
        state: dict[str, Any] = {"client": None, "windows": 0}

        def client() -> EndpointClient:
            if state["client"] is None:
                target = self.launch.scale(n) if self.launch.scale else self._fixed(n)
                if target.nodes != n:
                    raise BenchError(f"asked for {n} node(s) behind the endpoint, the deployment has {target.nodes}")
                state["client"] = EndpointClient(target, self.spec, self.launch)
                facts = state["client"].facts()
                self.meta.guests.setdefault(NODE, {}).setdefault("stages", {})[str(n)] = facts
                results.write_meta(self.run_dir, self.meta)
                self.reporter.log(f"{n} node(s) behind {target.url}: {len(target.servers)} server(s), "
                                  f"model {facts['model']}, prompts as {facts['prompts']}")
            return state["client"]

        def history(input_tokens: int) -> list[ServeRecord]:
            return [r for r in self.records if r.endpoint_nodes == n and r.input_tokens == input_tokens
                    and r.output_tokens == serve.output_tokens and r.load_kind == serve.load_kind]

        def measure(load: float, input_tokens: int, extra: int | None = None) -> None:
            scenario = (serve.load_kind, float(load), input_tokens, serve.output_tokens)
            if extra is None and scenario in finished:
                self._event(subject, {"phase": "skip", "load": load, "input_tokens": input_tokens, "window": 0})
                return
            windows = (range(extra, extra + 1) if extra is not None else
                       range(-serve.warmup_windows if state["windows"] == 0 else 0, serve.repeats))
            for window in windows:
                self._window(client(), n, load, input_tokens, window, subject)
                if window >= 0:
                    state["windows"] += 1

        for input_tokens in serve.input_tokens:
            sweep_input(serve, self.limits, input_tokens, measure, lambda _i=input_tokens: history(_i),
                        lambda name, why, _i=input_tokens: self.reporter.log(
                            f"sweep {name}, input {_i}: stopped: {why}"))
            self._event(subject, {"phase": "done", "input_tokens": input_tokens, "window": serve.repeats})

    def _window(self, client: EndpointClient, n: int, load: float, input_tokens: int, window: int,
                subject: str) -> None:
        serve = self.serve
        seed = serving.window_seed(serve.seed, n, load, input_tokens, window)
        measured, reasons = client.window(serve, load, input_tokens, seed, self.limits, measured=window >= 0)
        record = ServeRecord(
            run_id=self.spec.run_id, node=NODE, node_rank=0, rank=0, local_rank=0, world_size=1,
            ranks_per_node=1, nodes=n, load_kind=serve.load_kind, load=float(load), arrival=serve.arrival_kind,
            slots=serve.slots, input_tokens=input_tokens, output_tokens=serve.output_tokens, window=max(window, 0),
            seed=seed, burstiness=serve.burstiness, think_s=serve.think_s,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            valid=not reasons, invalid_reasons=reasons,
            placement={"client": {"pid": os.getpid(), "cpus": len(os.sched_getaffinity(0))}}, **measured)
        warm = window < 0
        if not warm:
            results.append_record(self.file, record)
            self.records.append(record)
        event = {"phase": "warmup" if warm else "serve", "window": max(window, 0), "load": load,
                 "input_tokens": input_tokens, "offered": record.offered, "completed": record.completed,
                 "unfinished": record.unfinished,
                 "ttft_s_p90": _rounded(serving.tail(record.ttft_s, record.unfinished), 4),
                 "tpot_ms_p90": _rounded(serving.tail(record.tpot_ms, record.unfinished), 3),
                 "mean_active": round(record.mean_active, 3), "valid": record.valid}
        self._event(subject, event)
        if record.fault:
            f = record.fault
            self.reporter.log(f"{subject}, {load:g} {serve.load_kind}: fault {f.get('kill')}: "
                              + (f"failed: {f['error']}" if "error" in f else
                                 f"down {f.get('start_s')}–{f.get('end_s')} s, {f.get('failed_all')} request(s) "
                                 f"failed, detected {f.get('detect_s')} s, restarted {f.get('restart_s')} s"))
        if any("did not answer /health" in why for why in reasons):
            raise BenchError(f"{subject}: {'; '.join(reasons)} (the window is kept; --resume continues once it is back)")

    def _event(self, subject: str, event: dict[str, Any]) -> None:
        report_event(self.reporter, self.tracker, subject,
                     {"rank": 0, "load_kind": self.serve.load_kind, "output_tokens": self.serve.output_tokens,
                      **event})

    def _fixed(self, n: int) -> Target:
        ep = self.spec.endpoint
        return Target(ep.url or "", n, tuple(ep.servers))


def _rounded(value: float, digits: int) -> float | None:
    import math

    return round(value, digits) if math.isfinite(value) else None
