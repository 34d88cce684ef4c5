"""`vcfslm bench --serve --endpoint URL | --deployment INVENTORY`: load through one endpoint
from this machine, one process, no ranks (vcfslm.bench.endpoint).

The flags resolve into a RunSpec of mode "endpoint" (its EndpointSpec keeps where the load
went, the key file's path, the node counts, the servers and the faults; never the key).
With a deployment the real drivers are built here: `serve up --nodes N` between the node
counts of --scale-out, `serve status` for the endpoint and its servers, and kill_program
for --fault.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..bench.endpoint import EndpointLaunch, Target, run_endpoint, served_model
from ..deploy.material import client_ca
from ..deploy.service import UpOptions, kill_program, serve_status, serve_up
from ..errors import BenchError, Problem, UsageError
from ..guest.provision import default_run_dir
from ..runspec import EndpointSpec, RunSpec
from .bench_spec import Resumed, resolve
from .bench_summary import print_run_summary
from .common import RichReporter, err_console, load
from .guest_stage import bench_connector


def check_endpoint_flags(flags: dict[str, Any]) -> None:
    """A new endpoint run takes a serving load and one place it goes, with its key
    (bench_spec.check_flags refused what an endpoint run has no use for)."""
    if not flags.get("serve"):
        raise UsageError("--endpoint/--deployment load a serving endpoint: add --serve and --rates (or --users)")
    if bool(flags.get("endpoint")) == bool(flags.get("deployment")):
        raise UsageError("give the endpoint as --endpoint URL or --deployment INVENTORY (one of them)")
    if not flags.get("key_file"):
        raise UsageError("--key-file FILE: the endpoint takes requests only with its API key")
    if flags.get("endpoint"):
        needs = [flag for name, flag in (("scale_out", "--scale-out"), ("faults", "--fault")) if name in flags]
        if needs:
            raise UsageError(f"{', '.join(needs)} change or break the deployment: use --deployment INVENTORY")
    if flags.get("deployment") and flags.keys() & {"endpoint_nodes", "server_metrics"}:
        raise UsageError("--deployment names its own nodes and servers (from its status); "
                         "drop --endpoint-nodes and --server-metrics")
    if flags.get("scale_out") and len(set(flags["scale_out"])) != len(flags["scale_out"]):
        raise UsageError(f"--scale-out: each node count once, got {flags['scale_out']}")


def run_endpoint_bench(flags: dict[str, Any], opts: dict[str, Any], resumed: Resumed | None,
                       verbose: int = 0) -> None:
    """Resolve the endpoint run's spec (a resumed run's own), build its drivers, and run it."""
    command = ["vcfslm", *sys.argv[1:]]
    if resumed is None:
        check_endpoint_flags(flags)
    quiet = opts["output"] == "json"
    with RichReporter(err_console, quiet=quiet, verbose=verbose > 0) as reporter:
        if resumed is not None:
            spec = resolve(flags, None, resumed, "endpoint", command=command)
            runs_dir = resumed.run_dir.parent
        else:
            spec = _spec_for_a_new_run(flags, opts, reporter, command)
            runs_dir = Path(opts["runs_dir"])
        ep = spec.endpoint
        key = read_key(ep.key_file)
        scale = kill = None
        if ep.deployment:
            scale, kill = _deployment_drivers(ep, runs_dir / spec.run_id, reporter)
        if ep.prompts == "text":
            reporter.log("prompts go as text (one-token words): no model folder with a config.json was given "
                         "(--model), so the served vocab is not known")
        launch = EndpointLaunch(key=key, ca_file=_client_ca(ep), runs_dir=runs_dir, resume=resumed is not None,
                                scale=scale, kill=kill)
        run = run_endpoint(spec, launch, reporter)
    print_run_summary(run.meta, [], run.run_dir, opts["output"],
                      f"run {run.meta.run_id}: through {ep.url or 'the deployment endpoint'}, "
                      f"{', '.join(map(str, ep.nodes))} node(s) behind it")


def _spec_for_a_new_run(flags: dict[str, Any], opts: dict[str, Any], reporter, command: list[str]) -> RunSpec:
    """The flags over the deployment's (or -i's) inventory; what neither says, asked of the
    endpoint (the model it serves) or the deployment (its nodes)."""
    source = flags.get("deployment") or opts["inventory"]
    inv = load(source) if source else None
    ask = {"model": lambda: served_model(flags["endpoint"], read_key(flags["key_file"]), client_ca(flags["key_file"]))}
    if inv is not None and flags.get("deployment"):
        ask["endpoint.nodes"] = lambda: (len(_deployed(inv, reporter)["nodes"]),)
    spec = resolve(flags, inv, None, "endpoint", command=command, ask=ask)
    vocab = _vocab(spec.model)
    endpoint = EndpointSpec.model_validate({**spec.endpoint.model_dump(), "vocab": vocab,
                                            "prompts": "ids" if vocab else "text"})
    return spec.replaced(endpoint=endpoint)


def _client_ca(ep) -> str | None:
    """The CA the client verifies the door with: the deployment's, beside its key file."""
    return client_ca(ep.key_file, load(ep.deployment) if ep.deployment else None)


def read_key(path: str) -> str:
    try:
        key = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise UsageError([Problem(path, None, None, "--key-file",
                                  f"cannot read the API key: {exc.strerror or exc} (`vcfslm serve up INVENTORY "
                                  f"--key-file FILE` writes it there)")]) from None
    if not key:
        raise UsageError([Problem(path, None, None, "--key-file", "is empty")])
    return key


def _vocab(model: str | None) -> int | None:
    """The served model's vocab from its folder's config.json on this machine (None: no folder here)."""
    if not model or not (Path(model).expanduser() / "config.json").is_file():
        return None
    try:
        return int(json.loads((Path(model).expanduser() / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError([Problem(str(Path(model) / "config.json"), None, None, "--model",
                                  "a model folder's config.json with a vocab_size")]) from None


# ------------------------------------------------------------------ the deployment's drivers


def _deployed(inv, reporter, log_dir: Path | None = None) -> dict[str, Any]:
    """`serve status` of the deployment; BenchError when nothing is deployed or it is unhealthy."""
    doc = serve_status(inv, bench_connector(inv, reporter, log_dir or default_run_dir()))
    if not doc.get("deployed"):
        raise BenchError(f"deployment {doc.get('deployment')} is not up: `vcfslm serve up {inv.source}` first")
    if not doc.get("healthy"):
        down = [f"{node}/{s['program']}" for node, info in doc["nodes"].items() for s in info["servers"]
                if not s["healthy"]] + [f"{node} (unreachable)" for node in doc.get("unreachable") or {}]
        raise BenchError(f"deployment {doc.get('deployment')} is not healthy ({', '.join(down) or 'its endpoint'}): "
                         f"see `vcfslm serve status {inv.source}`")
    return doc


def target_of(doc: dict[str, Any]):
    """Where the load goes, from `serve status --output json`'s document."""
    endpoint = (doc.get("endpoint") or {}).get("url")
    if not endpoint:
        raise BenchError(f"deployment {doc.get('deployment')} names no endpoint")
    serving = {node: info for node, info in doc["nodes"].items() if info.get("servers")}
    servers = tuple(s["url"] for info in serving.values() for s in info["servers"])
    programs = {f"{node}/{s['program']}": s["url"] for node, info in serving.items() for s in info["servers"]}
    return Target(endpoint, len(serving), servers, programs)


def _deployment_drivers(ep: EndpointSpec, run_dir: Path, reporter):
    """scale(n): `serve up --nodes n` (no install) and the endpoint it leaves; kill(fault): kill_program."""
    inv = load(ep.deployment)
    log_dir = run_dir / "logs" / "ssh"
    connect = bench_connector(inv, reporter, log_dir)
    several = len(ep.nodes) > 1

    def scale(n: int):
        if several:
            reporter.log(f"serve up: {n} node(s) behind the endpoint")
            serve_up(inv, connect, UpOptions(count=n, key_file=ep.key_file, install=False), reporter)
        return target_of(_deployed(inv, reporter, log_dir))

    def kill(fault) -> int:
        return kill_program(inv, connect, fault.node, fault.program)

    return scale, (kill if ep.faults else None)
