"""The run spec: everything a benchmark run was asked to do, in one typed value.

`RunSpec` is built once, in `cli/`, from the inventory and the flags (a resumed run's from
its own meta.json, the flags over it) and checked there; below the CLI each stage takes
the slice it needs (the matrix, the serving settings, a node's worker spec). Where a
cluster run goes is not the spec's: the CLI hands the bench one `contract.NodeTarget` per
node (addresses, ports, guest layout, rank slots), never the inventory. It is
written whole into meta.json (`spec`), so `--resume` reads back exactly what the run was
asked, whatever the inventory says since. `WorkerSpec` is one node's share of it: the
one JSON file its workers read (`python -m vcfslm.bench.worker --spec FILE --node NAME`);
what torchrun gives each rank (its rank, its node's place in the run) stays in the
environment.

Pure: no I/O, no third-party imports beyond pydantic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
)

from .contract import COLLECTIVE_TIMEOUT_S, Matrix, matrix_record, serve_limits
from .errors import Problem, UsageError
from .servers import ServerSpec
from .serving import ServeSpec

# What the worker gates each compiled graph with, in teacher-forced steps (0: no gate).
DEFAULT_GATE_STEPS = 8
# The bandwidth probe's buffer when a run names none (the worker's default).
DEFAULT_PROBE_MIB = 1024

class ProbeSpec(BaseModel):
    """The rank probes: on or off, and the bandwidth probe's buffer (None: the worker's default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    mib: int | None = Field(default=None, ge=16)

    @classmethod
    def of_flags(cls, mib: int | None) -> ProbeSpec:
        """`--probe-mib N` / `--no-probe` (0) / neither (None)."""
        return cls(enabled=False) if mib == 0 else cls(mib=mib)


@dataclass(frozen=True)
class Fault:
    """One fault a window takes: kill `program` on `node` (a crash: SIGKILL, its supervisor
    restarts it) `at_s` seconds after the window starts, on the window's own clock."""

    node: str
    program: str
    at_s: float

    @property
    def target(self) -> str:
        return f"{self.node}/{self.program}"

    @property
    def text(self) -> str:
        return f"kill:{self.target}@{self.at_s:g}"


_FAULT = re.compile(r"^kill:([^/@\s]+)/([^/@\s]+)@([0-9]+(?:\.[0-9]*)?|\.[0-9]+)$")


def parse_fault(text: str) -> Fault:
    """`kill:NODE/PROGRAM@SECONDS` as a Fault; ValueError saying the form otherwise."""
    m = _FAULT.match(text.strip())
    if not m:
        raise ValueError(f"a fault is kill:NODE/PROGRAM@SECONDS (e.g. kill:slm-01/vllm-node0@20), got {text!r}")
    return Fault(m.group(1), m.group(2), float(m.group(3)))


class EndpointSpec(BaseModel):
    """A serving run through one endpoint (bench --serve --endpoint URL | --deployment INV):
    the operator's one client loads the front door of a deployment, not each server.

    Where it goes: `url` (None: the deployment's own, read from `deployment`, the inventory
    whose `serve up` made it). The key is read from `key_file` and never kept. `nodes`: the
    node counts behind the endpoint, one stage each (several only with a deployment, which
    `serve up` changes between them). `servers`: the servers whose /metrics split each
    window's requests (empty with a deployment: its status names them). Prompts go as
    token ids drawn below `vocab` (the served model's config.json), else as text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = None
    deployment: str | None = None
    key_file: str
    nodes: tuple[int, ...] = (1,)
    servers: tuple[str, ...] = ()
    faults: tuple[str, ...] = ()
    prompts: Literal["ids", "text"] = "ids"
    vocab: int | None = Field(default=None, ge=4)
    max_lag_s: float = Field(default=0.5, gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        # `serve up` prints the endpoint with its API root (…/v1); the client adds that itself.
        base = value.rstrip("/").removesuffix("/v1")
        if not re.match(r"^https?://[^/\s]+$", base):
            raise ValueError(f"the endpoint is a URL like https://10.0.0.11:8000, got {value!r}")
        return base

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(n < 1 for n in value) or len(set(value)) != len(value):
            raise ValueError(f"node counts behind the endpoint are distinct positive numbers, got {list(value)}")
        return tuple(value)

    @field_validator("faults")
    @classmethod
    def _faults(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # One fault per window: its record accounts one start, one end, one set of failures.
        if len(value) > 1:
            raise ValueError(f"one fault per window, got {len(value)}: {', '.join(value)}")
        return tuple(parse_fault(v).text for v in value)

    @property
    def fault_list(self) -> list[Fault]:
        return [parse_fault(v) for v in self.faults]


class RunSpec(BaseModel):
    """What a run measures and how, as the CLI resolved it (flags > resumed run > inventory >
    defaults). meta.json keeps it whole (`spec`); its `matrix` and the other fields the
    report reads are derived from it (`matrix_record`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    run_id: str
    mode: Literal["local", "cluster", "endpoint"]
    model: str                              # the model source as the operator names it
    matrix: Matrix
    compile_mode: str = "compile"
    scenarios: str | None = None            # --scenarios filter
    seed: int | None = None                 # weights/prompt seed (None: not set, the workers' 0)
    ranks: int = Field(default=1, ge=1)     # ranks per node
    threads: int | None = Field(default=None, ge=1)   # per rank (None: this machine's share)
    nodes: tuple[str, ...] = ()             # the nodes that run it, by name
    label: str | None = None
    slos: dict[str, dict[str, Any]] = Field(default_factory=dict)
    percentile: str | None = None           # the static rule the run records
    probe: ProbeSpec = ProbeSpec()
    serve: ServeSpec | None = None          # serving mode: the load each rank takes
    server: ServerSpec | None = None        # serving mode: who serves
    timeout_s: float | None = Field(default=None, gt=0)   # the whole run's
    numactl: bool = True                    # local: pin ranks with numactl
    command: tuple[str, ...] = ()
    endpoint: EndpointSpec | None = None    # serving through one endpoint (mode "endpoint")

    @field_validator("matrix", mode="before")
    @classmethod
    def _matrix(cls, value: Any) -> Matrix:
        if isinstance(value, Matrix):
            return value
        if isinstance(value, Mapping):
            return Matrix.from_json(json.dumps(dict(value)))
        raise ValueError(f"expected the matrix as an object, got {type(value).__name__}")

    @field_validator("serve", mode="before")
    @classmethod
    def _serve(cls, value: Any) -> ServeSpec | None:
        return ServeSpec.of_record(value) if isinstance(value, Mapping) else value

    @field_validator("server", mode="before")
    @classmethod
    def _server(cls, value: Any) -> ServerSpec | None:
        return ServerSpec.of_record(value) if isinstance(value, Mapping) else value

    @field_validator("percentile")
    @classmethod
    def _percentile(cls, value: str | None) -> str | None:
        if value is not None and value not in ("p50", "p90", "p99"):
            raise ValueError(f"expected p50, p90 or p99, got {value!r}")
        return value

    @field_serializer("matrix")
    def _dump_matrix(self, matrix: Matrix) -> dict[str, Any]:
        return matrix.to_dict()

    @field_serializer("serve")
    def _dump_serve(self, serve: ServeSpec | None) -> dict[str, Any] | None:
        return None if serve is None else serve.to_dict()

    @field_serializer("server")
    def _dump_server(self, server: ServerSpec | None) -> dict[str, Any] | None:
        return None if server is None else server.to_dict()

    # -- building and reading back ----------------------------------------------------

    @classmethod
    def from_cli(cls, settings: Mapping[str, Any], source: str = "",
                 flags: Mapping[str, str] | None = None) -> RunSpec:
        """The spec from the CLI's resolved settings (the spec's own field names), checked;
        UsageError names the flag that sets the field (`flags`: field -> flag; the field's
        name without it) and `source`, the file the value came from, when known."""
        try:
            return cls.model_validate(dict(settings))
        except ValidationError as exc:
            problems = []
            for error in exc.errors(include_url=False):
                field = str(error["loc"][0]) if error["loc"] else ""
                message = str(error["msg"]).removeprefix("Value error, ")
                problems.append(Problem(source, None, None, (flags or {}).get(field, field), message))
            raise UsageError(problems) from None

    def record(self) -> dict[str, Any]:
        """The spec as meta.json keeps it (`spec`): JSON types only."""
        return self.model_dump(mode="json")

    @classmethod
    def of_record(cls, data: Mapping[str, Any], source: str = "") -> RunSpec:
        """A recorded spec, read back whole (meta.json's `spec`)."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise UsageError([Problem(source, None, None, "spec." + ".".join(str(p) for p in e["loc"]),
                                      str(e["msg"]).removeprefix("Value error, "))
                              for e in exc.errors(include_url=False)]) from None

    @classmethod
    def of_meta(cls, meta, source: str = "") -> RunSpec:
        """The spec a run recorded: meta.json's `spec`, or, for a run written before runs kept
        one, the spec its other fields imply."""
        if meta.spec:
            return cls.of_record(meta.spec, source)
        m = meta.matrix
        serve = m.get("serve")
        return cls.of_record({
            "run_id": meta.run_id, "mode": meta.mode, "model": meta.model, "nodes": list(meta.nodes),
            "ranks": meta.ranks_per_node, "threads": meta.threads_per_rank,
            "matrix": {"batch_sizes": m["batch_sizes"], "input_tokens": m["input_tokens"],
                       "output_tokens": m["output_tokens"], "warmup": m.get("warmup", 1), "repeats": m["repeats"]},
            "seed": m.get("seed", 0 if meta.mode == "local" else None),
            "compile_mode": m.get("compile") or "compile", "scenarios": m.get("scenarios"),
            "label": meta.label, "slos": meta.slos or {},
            "percentile": (m.get("judging") or {}).get("percentile") or ("p90" if meta.mode == "local" else None),
            "serve": serve, "server": m.get("server") if serve else None, "command": list(meta.command)}, source)

    @classmethod
    def of_inventory(cls, inv, nodes: Sequence[str], run_id: str, **changes: Any) -> RunSpec:
        """A cluster run of the inventory's bench settings on `nodes`, with `changes` (the
        flags' values, by field) over them; checked as from_cli checks."""
        bench = inv.bench
        settings = {"run_id": run_id, "mode": "cluster", "model": inv.guest.model,
                    "matrix": Matrix.of_inventory(bench), "compile_mode": bench.compile,
                    "ranks": bench.ranks_per_node, "threads": bench.threads_per_rank, "nodes": tuple(nodes),
                    "slos": {k: v.model_dump(exclude_none=True) for k, v in inv.slos.items()},
                    "percentile": inv.slo.percentile, "timeout_s": bench.timeout_s}
        return cls.from_cli({**settings, **changes}, inv.source)

    def replaced(self, **changes: Any) -> RunSpec:
        """This spec with some fields changed, checked again."""
        return type(self).model_validate({**self.model_dump(), **changes})

    # -- the slices below the CLI -----------------------------------------------------

    def matrix_record(self) -> dict[str, Any]:
        """meta.json's `matrix` (contract.matrix_record)."""
        return matrix_record(self.matrix, compile_mode=self.compile_mode, scenarios=self.scenarios,
                             seed=self.seed, serve=self.serve, percentile=self.percentile, server=self.server)

    def serve_limits(self) -> dict[str, dict[str, float | None]]:
        """The SLO limits a serving run's workers judge by (contract.serve_limits)."""
        return serve_limits(self.slos)


class WorkerSpec(BaseModel):
    """One node's share of a run: the file its workers read (`worker --spec FILE`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunSpec
    out: str                                 # the run folder where the workers run
    model: str                               # the model as that machine names it (a guest's staged path)
    nodes: int = Field(default=1, ge=1)      # nodes in the run
    resume: bool = False
    timeout_s: float = Field(default=float(COLLECTIVE_TIMEOUT_S), gt=0)   # a collective's wait
    server: ServerSpec | None = None         # serving with an HTTP server: this node's
    gate_steps: int = Field(default=DEFAULT_GATE_STEPS, ge=0)

    @field_validator("server", mode="before")
    @classmethod
    def _server(cls, value: Any) -> ServerSpec | None:
        return ServerSpec.of_record(value) if isinstance(value, Mapping) else value

    @field_serializer("server")
    def _dump_server(self, server: ServerSpec | None) -> dict[str, Any] | None:
        return None if server is None else server.to_dict()

    @field_validator("run")
    @classmethod
    def _measurable(cls, run: RunSpec) -> RunSpec:
        if run.matrix.output_tokens < 2:
            raise ValueError("matrix: output_tokens must be >= 2 (TPOT needs two tokens)")
        if run.matrix.repeats < 1 or run.matrix.warmup < 0:
            raise ValueError("matrix: repeats must be >= 1 and warmup >= 0")
        return run

    @property
    def matrix(self) -> Matrix:
        return self.run.matrix

    @property
    def seed(self) -> int:
        return self.run.seed or 0

    @property
    def probe_mib(self) -> int:
        return self.run.probe.mib or DEFAULT_PROBE_MIB

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        """`to_json`'s inverse; ValueError says what is wrong (the worker's usage error)."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise ValueError("; ".join(f"{'.'.join(str(p) for p in e['loc'])}: "
                                       f"{str(e['msg']).removeprefix('Value error, ')}"
                                       for e in exc.errors(include_url=False))) from None


__all__ = ["DEFAULT_GATE_STEPS", "DEFAULT_PROBE_MIB", "EndpointSpec", "Fault", "ProbeSpec", "RunSpec", "WorkerSpec",
           "parse_fault"]
