"""`vcfslm bench --serve --endpoint URL | --deployment INVENTORY`: load through one endpoint
from this machine, one process, no ranks (vcfslm.bench.endpoint).

The flags resolve into a RunSpec of mode "endpoint" (its EndpointSpec keeps where the load
went, the key file's path, the node counts, the servers and the faults; never the key).
With a deployment the real drivers are built here: `serve up --nodes N` between the node
counts of --scale-out, `serve status` for the endpoint and its servers, and kill_program
for --fault.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import BenchError, Problem, UsageError
from ..inventory_load import serve_settings
from ..matrix import serve_matrix
from ..run_meta import new_run_id
from ..runspec import EndpointSpec, RunSpec, parse_fault
from ..servers import VLLM, ServerSpec
from .bench_serve import serve_spec
from .common import RichReporter, err_console, int_list

ENDPOINT_FLAGS = ("endpoint", "deployment", "key_file", "endpoint_nodes", "scale_out", "faults", "server_metrics")
# What an endpoint run has no use for: it starts no rank, no server, no probe.
NOT_WITH_ENDPOINT = ("local", "nodes", "hosts", "dry_run", "ranks", "threads", "batch_sizes", "scenarios", "warmup",
                     "no_numactl", "compile_mode", "no_probe", "probe_mib", "server", "server_python",
                     "chunk_tokens", "batched_tokens", "timeout", "trust_new_hosts")
DEFAULT_INPUT_TOKENS = (512,)
DEFAULT_OUTPUT_TOKENS = 128


def url_list(ctx, param, value: str | None) -> list[str] | None:
    """click callback: 'http://a:1,http://b:2' -> the URLs, each without a trailing slash."""
    if value is None:
        return None
    urls = [v.strip().rstrip("/") for v in value.split(",") if v.strip()]
    bad = [u for u in urls if not u.startswith("http://")]
    if not urls or bad:
        raise click.BadParameter(f"expected comma-separated http:// URLs, got {value!r}")
    return urls


def fault_text(ctx, param, value: str | None) -> str | None:
    """click callback: a fault as the spec keeps it (`kill:NODE/PROGRAM@SECONDS`)."""
    if value is None:
        return None
    try:
        return parse_fault(value).text
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def endpoint_options(f):
    """The endpoint flags of `bench --serve`, in the order --help shows them."""
    options = [
        click.option("--endpoint", default=None, metavar="URL",
                     help="Serve: load one endpoint from this machine (e.g. http://10.0.0.11:8000, a "
                          "`serve up` front door) instead of each rank's server; --rates are then the "
                          "whole deployment's requests/s."),
        click.option("--deployment", default=None, metavar="INVENTORY", type=click.Path(dir_okay=False),
                     help="Serve: load the endpoint of this inventory's `serve up` deployment (its "
                          "status names the endpoint and the servers; SSH to its nodes)."),
        click.option("--key-file", default=None, metavar="FILE", type=click.Path(dir_okay=False),
                     help="Serve --endpoint/--deployment: the file holding the endpoint's API key."),
        click.option("--endpoint-nodes", type=click.IntRange(min=1), default=None, metavar="N",
                     help="Serve --endpoint: nodes behind it, as the records and the scale-out table "
                          "count them (default 1; with --deployment: the deployed ones)."),
        click.option("--scale-out", callback=int_list, default=None, metavar="LIST",
                     help="Serve --deployment: node counts to measure one after the other (e.g. 1,2), "
                          "`serve up --nodes N` before each; the report's scale-out table reads them."),
        click.option("--fault", "faults", default=None, callback=fault_text, metavar="kill:NODE/PROGRAM@S",
                     help="Serve --deployment: in each measured window, kill that server S seconds after "
                          "the window starts (e.g. kill:slm-01/vllm-node0@20); its supervisor restarts it."),
        click.option("--server-metrics", callback=url_list, default=None, metavar="URL,URL",
                     help="Serve --endpoint: the servers behind it, whose /metrics split each window's "
                          "requests (default with --deployment: its servers)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def endpoint_run(opts: dict[str, Any], given: set[str]) -> bool:
    """Is this `bench` an endpoint run (its flags, or --resume of a run of that mode)?"""
    if given & set(ENDPOINT_FLAGS):
        return True
    return bool(opts.get("resume")) and _resumed_mode(_run_path(opts)) == "endpoint"


def _run_path(opts: dict[str, Any]) -> Path:
    given = Path(opts["resume"])
    return given if given.is_dir() else Path(opts["runs_dir"]) / opts["resume"]


def _resumed_mode(run_dir: Path) -> str | None:
    from ..results import read_meta

    if not (run_dir / "meta.json").exists():
        return None
    return read_meta(run_dir).mode


def check_endpoint_flags(opts: dict[str, Any], given: set[str]) -> None:
    """An endpoint run takes a serving load and where it goes; nothing of ranks or servers."""
    stray = sorted(given & set(NOT_WITH_ENDPOINT))
    if stray:
        raise UsageError(f"{_flags(stray)} do not apply to a run through an endpoint (no rank, no server of its own)")
    if opts.get("resume"):
        extra = sorted(given & (set(ENDPOINT_FLAGS) - {"key_file"}))
        if extra:
            raise UsageError(f"--resume continues an endpoint run where it went; drop {_flags(extra)}")
        return
    if not opts.get("serve"):
        raise UsageError("--endpoint/--deployment load a serving endpoint: add --serve and --rates (or --users)")
    if bool(opts.get("endpoint")) == bool(opts.get("deployment")):
        raise UsageError("give the endpoint as --endpoint URL or --deployment INVENTORY (one of them)")
    if not opts.get("key_file"):
        raise UsageError("--key-file FILE: the endpoint takes requests only with its API key")
    if opts.get("endpoint"):
        needs = sorted(given & {"scale_out", "faults"})
        if needs:
            raise UsageError(f"{_flags(needs)} change or break the deployment: use --deployment INVENTORY")
    if opts.get("deployment") and given & {"endpoint_nodes", "server_metrics"}:
        raise UsageError("--deployment names its own nodes and servers (from its status); "
                         "drop --endpoint-nodes and --server-metrics")
    if opts.get("scale_out") and len(set(opts["scale_out"])) != len(opts["scale_out"]):
        raise UsageError(f"--scale-out: each node count once, got {opts['scale_out']}")


def run_endpoint_bench(inventory: str | None, opts: dict[str, Any], given: set[str],
                       slos: dict[str, Any] | None, verbose: int = 0) -> None:
    """Build the endpoint run's spec (a resumed run's own), its drivers, and run it."""
    from ..bench.endpoint import EndpointLaunch, run_endpoint
    from .bench_summary import print_run_summary

    check_endpoint_flags(opts, given)
    quiet = opts["output"] == "json"
    with RichReporter(err_console, quiet=quiet, verbose=verbose > 0) as reporter:
        if opts.get("resume"):
            run_dir = _run_path(opts)
            spec = _resumed_spec(run_dir, opts)
            runs_dir, resume = run_dir.parent, True
        else:
            spec = _new_spec(inventory, opts, slos, reporter)
            runs_dir, resume = Path(opts["runs_dir"]), False
        ep = spec.endpoint
        key = read_key(ep.key_file)
        scale = kill = None
        if ep.deployment:
            scale, kill = _deployment_drivers(ep, runs_dir / spec.run_id, reporter)
        if ep.prompts == "text":
            reporter.log("prompts go as text (one-token words): no model folder with a config.json was given "
                         "(--model), so the served vocab is not known")
        launch = EndpointLaunch(key=key, runs_dir=runs_dir, resume=resume, scale=scale, kill=kill)
        run = run_endpoint(spec, launch, reporter)
    print_run_summary(run.meta, [], run.run_dir, opts["output"],
                      f"run {run.meta.run_id}: through {ep.url or 'the deployment endpoint'}, "
                      f"{', '.join(map(str, ep.nodes))} node(s) behind it")


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


def _new_spec(inventory: str | None, opts: dict[str, Any], slos: dict[str, Any] | None, reporter) -> RunSpec:
    """A new endpoint run's spec: the flags over the deployment's (or -i's) inventory over the defaults."""
    from .common import load

    source = opts.get("deployment") or inventory
    inv = load(source) if source else None
    bench_serve = serve_settings(inv) if inv is not None else None
    if inv is not None and inv.serve.max_num_seqs:
        bench_serve = {**bench_serve, "slots": inv.serve.max_num_seqs}
    input_tokens = opts.get("input_tokens") or (list(inv.bench.input_tokens) if inv else list(DEFAULT_INPUT_TOKENS))
    output_tokens = opts.get("output_tokens") or (inv.bench.output_tokens if inv else DEFAULT_OUTPUT_TOKENS)
    repeats = opts.get("repeats") or (inv.bench.repeats if inv else 1)
    seed = opts.get("seed") if opts.get("seed") is not None else 0
    serve = serve_spec(opts, inventory=bench_serve, previous=None, input_tokens=input_tokens,
                       output_tokens=output_tokens, repeats=repeats, seed=seed,
                       attainment=inv.slo.attainment if inv else None)
    model = opts.get("model") or (inv.guest.model if inv else None)
    vocab = _vocab(model)
    if model is None:
        from ..bench.endpoint import served_model

        # Without a model folder, the series are named by what the endpoint says it serves.
        model = served_model(opts["endpoint"], read_key(opts["key_file"]))
    if opts.get("deployment"):
        nodes = tuple(opts.get("scale_out") or ())
        if not nodes:
            nodes = (len(_deployed(inv, reporter)["nodes"]),)
    else:
        nodes = (opts.get("endpoint_nodes") or 1,)
    try:
        endpoint = EndpointSpec(url=opts.get("endpoint"), deployment=str(Path(source).resolve()) if opts.get(
            "deployment") else None, key_file=str(Path(opts["key_file"]).expanduser().resolve()), nodes=nodes,
            servers=tuple(opts.get("server_metrics") or ()), faults=(opts["faults"],) if opts.get("faults") else (),
            prompts="ids" if vocab else "text", vocab=vocab)
    except ValueError as exc:
        raise UsageError([Problem("", None, None, "--endpoint", str(exc).splitlines()[-1])]) from None
    label = opts.get("label")
    return RunSpec.from_cli({
        "run_id": opts.get("run_id") or new_run_id("endpoint", max(nodes)), "mode": "endpoint",
        "model": model, "matrix": serve_matrix(serve), "seed": seed,
        "ranks": 1, "threads": 1, "nodes": (), "label": label,
        "slos": slos or ({k: v.model_dump(exclude_none=True) for k, v in inv.slos.items()} if inv else {}),
        "percentile": opts.get("percentile") or (inv.slo.percentile if inv else None),
        "serve": serve, "server": ServerSpec(name=VLLM.name), "endpoint": endpoint,
        "command": ["vcfslm", *sys.argv[1:]]})


def _vocab(model: str | None) -> int | None:
    """The served model's vocab from its folder's config.json on this machine (None: no folder here)."""
    import json

    if not model or not (Path(model).expanduser() / "config.json").is_file():
        return None
    try:
        return int(json.loads((Path(model).expanduser() / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError([Problem(str(Path(model) / "config.json"), None, None, "--model",
                                  "a model folder's config.json with a vocab_size")]) from None


def _resumed_spec(run_dir: Path, opts: dict[str, Any]) -> RunSpec:
    """The spec the run recorded, whole; a new --key-file may stand for the recorded one."""
    from ..results import read_meta

    meta = read_meta(run_dir)
    spec = RunSpec.of_meta(meta, str(run_dir / "meta.json"))
    if spec.endpoint is None:
        raise UsageError(f"--resume: {run_dir} is not a run through an endpoint")
    changes: dict[str, Any] = {"run_id": run_dir.name, "command": ["vcfslm", *sys.argv[1:]]}
    if opts.get("key_file"):
        changes["endpoint"] = spec.endpoint.model_copy(
            update={"key_file": str(Path(opts["key_file"]).expanduser().resolve())})
    return spec.replaced(**changes)


# ------------------------------------------------------------------ the deployment's drivers


def _connector(inv, reporter, log_dir: Path):
    from .guest_stage import bench_connector

    return bench_connector(inv, reporter, log_dir)


def _deployed(inv, reporter, log_dir: Path | None = None) -> dict[str, Any]:
    """`serve status` of the deployment; BenchError when nothing is deployed or it is unhealthy."""
    from ..deploy.service import serve_status
    from ..guest.provision import default_run_dir

    doc = serve_status(inv, _connector(inv, reporter, log_dir or default_run_dir()))
    if not doc.get("deployed"):
        raise BenchError(f"deployment {doc.get('deployment')} is not up: `vcfslm serve up {inv.source}` first")
    if not doc.get("healthy"):
        down = [f"{node}/{s['program']}" for node, info in doc["nodes"].items() for s in info["servers"]
                if not s["healthy"]]
        raise BenchError(f"deployment {doc.get('deployment')} is not healthy ({', '.join(down) or 'its endpoint'}): "
                         f"see `vcfslm serve status {inv.source}`")
    return doc


def target_of(doc: dict[str, Any]):
    """Where the load goes, from `serve status --output json`'s document."""
    from ..bench.endpoint import Target

    endpoint = (doc.get("endpoint") or {}).get("url")
    if not endpoint:
        raise BenchError(f"deployment {doc.get('deployment')} names no endpoint")
    serving = {node: info for node, info in doc["nodes"].items() if info.get("servers")}
    servers = tuple(s["url"] for info in serving.values() for s in info["servers"])
    programs = {f"{node}/{s['program']}": s["url"] for node, info in serving.items() for s in info["servers"]}
    return Target(endpoint, len(serving), servers, programs)


def _deployment_drivers(ep: EndpointSpec, run_dir: Path, reporter):
    """scale(n): `serve up --nodes n` (no install) and the endpoint it leaves; kill(fault): kill_program."""
    from ..deploy.service import UpOptions, kill_program, serve_up
    from .common import load

    inv = load(ep.deployment)
    log_dir = run_dir / "logs" / "ssh"
    connect = _connector(inv, reporter, log_dir)
    several = len(ep.nodes) > 1

    def scale(n: int):
        if several:
            reporter.log(f"serve up: {n} node(s) behind the endpoint")
            serve_up(inv, connect, UpOptions(count=n, key_file=ep.key_file, install=False), reporter)
        return target_of(_deployed(inv, reporter, log_dir))

    def kill(fault) -> int:
        return kill_program(inv, connect, fault.node, fault.program)

    return scale, (kill if ep.faults else None)


def _flags(names: list[str]) -> str:
    return ", ".join("--" + n.replace("_", "-").replace("compile-mode", "compile").replace("faults", "fault")
                     for n in names)
