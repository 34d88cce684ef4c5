"""The two record kinds a run writes, their checks, their one order and the one merge.

`WindowRecord` fields (JSON, one object per line; times in seconds unless the name
says `_ms`):

    schema            int, SCHEMA_VERSION
    run_id            str
    node              str   node name from the inventory ("local" for --local)
    node_rank         int   torchrun node rank
    rank              int   global rank
    local_rank        int   rank within its node (its vNUMA node index)
    world_size        int
    ranks_per_node    int
    nodes             int   number of nodes in the run
    batch_per_rank    int   concurrent streams on this rank
    input_tokens      int   prompt length per stream
    output_tokens     int   generated tokens per stream (EOS ignored)
    window            int   0..repeats-1 (warmup windows are not recorded)
    start_skew_s      float time from the first rank leaving the barrier to this one
    wall_s            float window wall time (request start -> last token)
    generated_tokens  int   batch_per_rank x output_tokens
    rank_tps          float generated_tokens / wall_s (input tokens never count)
    ttft_s            list[float] per stream
    tpot_ms           list[float] per stream: (e2e - ttft) / (output_tokens - 1)
    e2e_s             list[float] per stream
    peak_rss_bytes    int   the rank's peak resident set so far (compile transients included)
    rss_bytes         int   its resident set at the window's end (the steady footprint)
    recompiles        int   compilations that happened inside this window
    valid             bool  false when something makes the window untrustworthy
    invalid_reasons   list[str]
    roofline_tpot_ms  float | null  bytes read per step / measured bandwidth
    roofline_ttft_s   float | null  prompt FLOPs / measured bf16 GEMM rate (the prefill floor)
    placement         dict  cpu affinity, numa node, threads, versions, cpu capability

Each field's annotation is its check (see schema.py); the rules across fields are
record_findings' and serve_record_findings'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, TypeVar

from ..serving import arrivals
from .schema import (
    SCHEMA_VERSION,
    AtLeastOne,
    Count,
    Counts,
    Findings,
    Flag,
    Number,
    NumberLists,
    Numbers,
    Object,
    SchemaError,
    Text,
    Texts,
    Version,
    one_of,
    schema_findings,
)


@dataclass
class RankWindow:
    """Which run, node and rank a measured window (static or serving) belongs to."""

    run_id: Text
    node: Text
    node_rank: Count
    rank: Count
    local_rank: Count
    world_size: AtLeastOne
    ranks_per_node: AtLeastOne
    nodes: AtLeastOne

    @property
    def order(self) -> tuple:
        """Where a record goes in a merged file: node rank, rank, scenario, window.

        The one order of both kinds (each kind's `scenario` says what identifies its
        scenarios); merge_records is the only place records are put in it.
        """
        return (self.node_rank, self.rank, *self.scenario, self.window)


@dataclass
class WindowRecord(RankWindow):
    """One measured window of one rank for one scenario."""

    batch_per_rank: AtLeastOne
    input_tokens: AtLeastOne
    output_tokens: AtLeastOne
    window: Count
    start_skew_s: Number
    wall_s: Number
    generated_tokens: Count
    rank_tps: Number
    ttft_s: Numbers
    tpot_ms: Numbers
    e2e_s: Numbers
    peak_rss_bytes: Count = 0
    rss_bytes: Count = 0
    recompiles: Count = 0
    valid: Flag = True
    invalid_reasons: Texts = field(default_factory=list)
    roofline_tpot_ms: Number | None = None
    roofline_ttft_s: Number | None = None
    placement: Object = field(default_factory=dict)
    schema: Version = SCHEMA_VERSION

    @property
    def scenario(self) -> tuple[int, int, int]:
        """(batch_per_rank, input_tokens, output_tokens): what identifies a scenario."""
        return (self.batch_per_rank, self.input_tokens, self.output_tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowRecord:
        """A record from its JSON object; SchemaError (a ValueError) lists every field that breaks the schema."""
        return checked(cls, data, record_findings)


# Serving mode (bench --serve): one record per rank x load window. Requests arrive on
# their own (open loop: Poisson or gamma at `load` requests/s per rank; closed loop:
# `load` users per rank, each waiting `think_s` after its reply) and join a continuous
# batch of `slots` streams between decode steps. Times are seconds from the window's
# start (the barrier) unless the name says `_ms`; the request lists are parallel, one
# entry per request that arrived inside the measured span [warmup_s, duration_s -
# cooldown_s] and finished (`unfinished` counts those that did not by the window's end:
# they fail every SLO).
# The names a record may carry, from the one registry of arrival processes.
SERVE_LOAD_KINDS = arrivals.LOAD_KINDS
SERVE_ARRIVALS = arrivals.RECORDED


@dataclass
class ServeRecord(RankWindow):
    """One measured serving window of one rank at one load."""

    load_kind: Annotated[Text, one_of(SERVE_LOAD_KINDS)]  # "rate" (requests/s per rank) | "users" (per rank)
    load: Number
    arrival: Annotated[Text, one_of(SERVE_ARRIVALS)]      # one of arrivals.RECORDED
    slots: AtLeastOne              # the batch cap: streams decoded together at most
    input_tokens: AtLeastOne       # the context's nominal prompt length (its largest when drawn)
    output_tokens: AtLeastOne      # the nominal output length (its largest when drawn)
    window: Count                  # 0..repeats-1 at this load
    seed: Count                    # this rank's arrival/length seed for the window
    duration_s: Number             # arrivals are generated over [0, duration_s)
    warmup_s: Number
    cooldown_s: Number
    span_s: Number                 # the measured span's length
    wall_s: Number                 # barrier -> last request done (or the window's cutoff)
    offered: Count                 # requests that arrived in the measured span
    completed: Count               # of them, finished
    unfinished: Count              # of them, not finished by the cutoff
    arrival_s: Numbers             # per finished measured request
    queue_s: Numbers               # arrival -> its prefill started
    ttft_s: Numbers                # arrival -> first token (the queue included)
    tpot_ms: Numbers               # (e2e - ttft) / (output tokens - 1)
    e2e_s: Numbers                 # arrival -> last token
    request_input_tokens: Counts
    request_output_tokens: Counts
    generated_tokens: Count        # tokens produced inside the measured span (every request)
    rank_tps: Number               # generated_tokens / span_s
    mean_active: Number            # time-averaged busy slots over the measured span
    max_queue: Count               # most requests waiting for a slot at once
    burstiness: Number = 1.0       # gamma shape (1 = Poisson); for "closed", unused
    think_s: Number = 0.0          # closed loop: mean think time between a reply and the next request
    goodput: Object = field(default_factory=dict)   # SLO name -> requests/s that met it
    start_skew_s: Number = 0.0
    peak_rss_bytes: Count = 0
    rss_bytes: Count = 0
    recompiles: Count = 0
    valid: Flag = True
    invalid_reasons: Texts = field(default_factory=list)
    placement: Object = field(default_factory=dict)
    # An HTTP server's window (vcfslm.serving.servers): which server, what its client saw, and
    # the server's own /metrics over the window. The in-process engine leaves them empty.
    server: Text = "vcfslm"
    sent_s: Numbers = field(default_factory=list)          # per finished request: when it went out
    token_s: NumberLists = field(default_factory=list)     # per finished request: each token's time
    max_send_lag_s: Number = 0.0   # the latest a counted request went out after its planned arrival
    failed: Count = 0              # counted requests the server refused, dropped or never answered
    errors: Texts = field(default_factory=list)            # the distinct failures (a few)
    server_metrics: Object = field(default_factory=dict)
    # The in-process engine's steps over the window: the most prompt tokens one step took
    # (its chunk; 0 for an HTTP server), how many steps ran, the mean real tokens per step,
    # and the prompt tokens' share of them.
    chunk_tokens: Count = 0
    # How the chunk was chosen: "slo:tpot<=580ms" (sized from the tightest TPOT limit, per
    # lane count in chunk_by_lanes), "kernel" (the probe's decode-linears curve) or "flag"
    # (--chunk-tokens); "" for an HTTP server and in records written before the rule was kept.
    chunk_rule: Text = ""
    chunk_by_lanes: Object = field(default_factory=dict)   # lane count (as text) -> its chunk
    batched_tokens: Count = 0      # the most under a backlog
    batched_steps: Count = 0       # steps that took several prompts or more than a chunk
    steps: Count = 0
    step_tokens_mean: Number = 0.0
    prefill_share: Number = 0.0
    # The same steps by what they carried: "<lanes>+<prompt tokens>" -> [steps, seconds,
    # context tokens] summed (serving/step_log.py); what the simulator is checked against.
    step_costs: Object = field(default_factory=dict)
    # Load through one endpoint (bench --serve --endpoint): the URL the operator's one client
    # loaded, the nodes and the servers behind it, and each server's share of the window's
    # requests by its own counter (vllm:request_success_total; null: its /metrics did not
    # answer). `load` is then the whole deployment's. A rank's own window leaves them empty.
    endpoint: Text = ""
    endpoint_nodes: Count = 0
    endpoint_servers: Texts = field(default_factory=list)
    server_requests: Object = field(default_factory=dict)
    server_resets: Texts = field(default_factory=list)     # servers whose counter restarted in the window
    window_finished: Count = 0     # every request of the window that finished, counted or not
    # A fault injected into the window (bench --fault): what was killed, when, when it answered
    # /health again, the requests that failed, and attainment during and after (endpoint/faults.py).
    fault: Object = field(default_factory=dict)
    # What the requests looked like (vcfslm.serving.workloads): its name ("" in records written before
    # workloads: the spec's fixed lengths), the digest of its definition (a file's bytes), the
    # replay's time scale (0: not a replay), and per finished counted request the prompt tokens
    # its conversation had sent before (its prefix) and those the server's prefix cache held
    # (empty where the server does not say: vcfslm's engine has no prefix cache).
    workload: Text = ""
    workload_digest: Text = ""
    time_scale: Number = 0.0
    request_prefix_tokens: Counts = field(default_factory=list)
    request_cached_tokens: Counts = field(default_factory=list)
    schema: Version = SCHEMA_VERSION

    @property
    def scenario(self) -> tuple[str, float, int, int]:
        """(load kind, load, input tokens, output tokens): what identifies a serving scenario."""
        return (self.load_kind, float(self.load), self.input_tokens, self.output_tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeRecord:
        """A record from its JSON object; SchemaError lists every field that breaks the schema."""
        return checked(cls, data, serve_record_findings)


def record_findings(data: Any) -> Findings:
    """What is wrong with one results.jsonl object, field by field (empty: a good record)."""
    if isinstance(data, dict) and data.get("output_tokens") == 1 and isinstance(data.get("tpot_ms"), list):
        # TPOT is undefined for one output token: stream_metrics writes NaN there.
        data = {**data, "tpot_ms": [0.0 if isinstance(v, float) and math.isnan(v) else v
                                    for v in data["tpot_ms"]]}
    return schema_findings(WindowRecord, data)


# A serving record's per-request lists: parallel, one entry per finished measured request.
REQUEST_LISTS = ("arrival_s", "queue_s", "ttft_s", "tpot_ms", "e2e_s", "request_input_tokens",
                 "request_output_tokens")


def serve_record_findings(data: Any) -> Findings:
    """What is wrong with one serving.jsonl object, field by field (empty: a good record)."""
    found = schema_findings(ServeRecord, data)
    if not isinstance(data, dict):
        return found
    lengths = {len(data[k]) for k in REQUEST_LISTS if isinstance(data.get(k), list)}
    if len(lengths) > 1:
        found.append(("", "the per-request lists differ in length: " + ", ".join(
            f"{k} {len(data[k])}" for k in REQUEST_LISTS if isinstance(data.get(k), list))))
    return found


FINDINGS = {WindowRecord: record_findings, ServeRecord: serve_record_findings}


def checked(cls, data: dict[str, Any], findings):
    """`cls` from `data` once `findings` has nothing against it, else SchemaError."""
    found = findings(data)
    if found:
        raise SchemaError(found)
    return build(cls, data)


def build(cls, data: dict[str, Any]):
    """An instance of dataclass `cls` from the keys it knows, the values as the file had them."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


R = TypeVar("R", WindowRecord, ServeRecord)


def merge_records(per_rank: Iterable[Iterable[R]]) -> list[R]:
    """Every rank's records as one list in their one order (RankWindow.order).

    Rank 0's gather, the launcher's collect and read_run's reading of ranks/ all merge
    through here, so a merged file is the same whoever wrote it.
    """
    return sorted((r for records in per_rank for r in records), key=lambda r: r.order)


def finished_scenarios(records: Iterable[WindowRecord | ServeRecord], repeats: int) -> set[tuple]:
    """Scenarios for which `repeats` windows are recorded (what --resume skips)."""
    counts: dict[tuple, set[int]] = {}
    for r in records:
        counts.setdefault(r.scenario, set()).add(r.window)
    return {s for s, windows in counts.items() if len(windows) >= repeats}
