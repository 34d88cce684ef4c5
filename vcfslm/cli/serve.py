"""`vcfslm serve up | status | down`: the sized service, running."""

from __future__ import annotations

import click
from rich.table import Table

from .common import console, err_console, inventory_argument, load, output_option, print_json
from .guest_stage import ssh_connector
from .guests import LiveHosts


def _hosts(value: str | None) -> list[str] | None:
    return [h.strip() for h in value.split(",") if h.strip()] if value else None


def _connect(inv, reporter, trust_new_hosts: bool, log_dir: str | None, wait_s: float = 30.0):
    from pathlib import Path

    from ..guest.provision import default_run_dir

    folder = Path(log_dir).expanduser() if log_dir else default_run_dir()
    connect = ssh_connector(inv, reporter, trust_new_hosts)
    return lambda node: connect(node, log_dir=folder, wait_s=wait_s)


def node_access_options(f):
    """--trust-new-hosts and --log-dir: how each serve command reaches the nodes."""
    f = click.option("--log-dir", type=click.Path(file_okay=False), default=None,
                     help="Folder for the per-node command logs (default ~/.vcfslm/guest-runs/<time>).")(f)
    return click.option("--trust-new-hosts", is_flag=True, help="Record unknown host keys (prints fingerprints).")(f)


@click.group("serve")
def serve() -> None:
    """The sized service: vLLM on every vNUMA node behind vLLM's router, one endpoint with a key.

    \b
    Examples:
      vcfslm serve up cluster.yaml --key-file ~/.vcfslm/slm.key     bring it up (or change it)
      vcfslm serve up cluster.yaml --nodes 2 --dry-run              what a 2-node service changes
      vcfslm serve status cluster.yaml                              health, versions, memory, KV use
      vcfslm serve key cluster.yaml                                 print the API key (alone)
      vcfslm serve down cluster.yaml                                stop it, remove units and key
    """


@serve.command("up")
@inventory_argument
@click.option("--nodes", "count", type=click.IntRange(min=1), default=None,
              help="Serve on the first N nodes (default: serve.nodes, else every node).")
@click.option("--hosts", "hosts", metavar="A,B", help="Serve on these nodes (comma-separated names).")
@click.option("--key-file", type=click.Path(dir_okay=False), default=None,
              help="The API key: read from this file when it exists (mode 0600, or it is refused), else "
                   "written to it (default ~/.vcfslm/keys/<deployment>.key). The deployment's CA goes "
                   "beside it (<name>-tls/ca.pem).")
@click.option("--rotate-key", is_flag=True,
              help="The nodes take a new key: the key file's when it differs from theirs, else a new one "
                   "written to it. With two servers or more it rolls: the door, the proxies and the servers "
                   "take the old and the new key while the servers restart one at a time, then the new one "
                   "only (a new key waits in <key file>.new until then).")
@click.option("--dry-run", is_flag=True, help="Print what would change on each node, change nothing.")
@click.option("--no-install", "no_install", is_flag=True,
              help="Skip the vllm and serve playbooks (vLLM, its router, supervisord and nginx are in place).")
@node_access_options
@output_option
def up(inventory: str | None, **options) -> None:
    """Bring the service up, or change it to match the inventory; a second run changes nothing.

    Only the programs whose settings changed restart; with two servers or more they
    restart one at a time, each out of the router until its streams finish and it is
    healthy again. Nodes that served before and are no longer chosen are taken down.
    """
    from ..deploy.service import UpOptions, serve_up

    inv = load(inventory)
    run = UpOptions(names=_hosts(options["hosts"]), count=options["count"], key_file=options["key_file"],
                    rotate_key=options["rotate_key"], dry_run=options["dry_run"],
                    install=not options["no_install"], log_dir=options["log_dir"])
    with LiveHosts() as reporter:
        result = serve_up(inv, _connect(inv, reporter, options["trust_new_hosts"], options["log_dir"]), run,
                          reporter)
    d = result.deployment
    doc = {"deployment": d.name, "endpoint": d.endpoint + "/v1", "model": d.model_name, "changed": result.changed,
           "dry_run": run.dry_run, "router_node": d.router_node, "policy": d.policy,
           "servers": [s.url for s in d.servers],
           "changes": {c.node: c.to_dict() for c in result.changes}, "dropped": result.dropped,
           "healthy_s": result.healthy_s, "checks": result.checks, "key_file": result.key_file,
           "new_key": bool(result.new_key), "tls": d.endpoint.startswith("https:"), "ca_file": result.ca_file,
           "rolled": result.rolls}
    if options["output"] == "json":
        print_json(doc)
        return
    verb = "would change" if run.dry_run else "changed"
    for c in result.changes:
        for line in c.lines():
            console.print(("would " if run.dry_run else "") + line, markup=False, highlight=False)
    for node, programs in result.dropped.items():
        console.print(f"{node}: taken down ({', '.join(programs)})", markup=False, highlight=False)
    if not result.changed:
        console.print(f"no change: deployment {d.name} is up to date on {len(d.nodes)} node(s)",
                      markup=False, highlight=False)
    elif not run.dry_run:
        console.print(f"deployment {d.name} {verb}: {len(d.servers)} server(s) on {len(d.nodes)} node(s), "
                      f"router on {d.router_node} ({d.policy})", markup=False, highlight=False)
    console.print(f"endpoint: {d.endpoint}/v1  model: {d.model_name}", markup=False, highlight=False)
    if not d.endpoint.startswith("https:"):
        console.print("the endpoint is plain HTTP (serve.front_door.tls: false): the key and the prompts cross "
                      "the network in clear", markup=False, highlight=False)
    elif result.ca_file:
        console.print(f"clients trust the deployment's CA: {result.ca_file}", markup=False, highlight=False)
    if result.new_key and run.dry_run:
        console.print(f"would make a new API key and write it to {result.key_file}", markup=False, highlight=False)
    elif result.new_key:
        console.print(f"a new API key is in {result.key_file} (mode 0600); `vcfslm serve key` prints it",
                      markup=False, highlight=False)


@serve.command("status")
@inventory_argument
@node_access_options
@output_option
def status(inventory: str | None, trust_new_hosts: bool, log_dir: str | None, output: str) -> None:
    """Each server's health, model, version, peak RSS and KV-cache use; the router's view;
    the endpoint. Exit 1 when anything is unhealthy or a node cannot be reached (the rest is
    reported), 3 when nothing is deployed."""
    from ..deploy.service import serve_status
    from ..progress import NullReporter

    inv = load(inventory)
    doc = serve_status(inv, _connect(inv, NullReporter(), trust_new_hosts, log_dir))
    if output == "json":
        print_json(doc)
    else:
        _print_status(doc)
    if not doc["deployed"] and not doc.get("unreachable"):
        raise SystemExit(3)
    if not doc["healthy"]:
        raise SystemExit(1)


def _print_status(doc: dict) -> None:
    for node, why in (doc.get("unreachable") or {}).items():
        err_console.print(f"{node}: unreachable: {why}", markup=False, highlight=False, soft_wrap=True)
    if not doc["deployed"]:
        console.print(f"deployment {doc['deployment']}: not deployed", markup=False, highlight=False)
        return
    table = Table(title=f"deployment {doc['deployment']}")
    for col in ("node", "server", "state", "health", "model", "version", "peak RSS", "KV use", "running"):
        table.add_column(col)
    for node, info in doc["nodes"].items():
        for s in info["servers"]:
            rss = s["peak_rss_bytes"]
            kv = s["kv_cache_usage"]
            table.add_row(node, s["url"], s["state"], "ok" if s["healthy"] else "DOWN", str(s["model"]),
                          str(s["version"] or "-"), f"{rss / 1e9:.2f} GB" if rss else "-",
                          f"{kv:.0%}" if kv is not None else "-",
                          f"{s['running_requests']:.0f}" if s["running_requests"] is not None else "-")
    console.print(table)
    for node, info in doc["nodes"].items():
        if "router" in info:
            r = info["router"]
            console.print(f"router on {node} ({r['state']}): {len(r['workers'])} worker(s): "
                          f"{', '.join(r['workers'])}", markup=False, highlight=False, soft_wrap=True)
    endpoint = doc["endpoint"] or {}
    console.print(f"endpoint: {endpoint.get('url')}/v1 ({endpoint.get('transport', 'TLS')}, health "
                  f"{endpoint.get('health')})", markup=False, highlight=False)


@serve.command("key")
@inventory_argument
@click.option("--key-file", type=click.Path(dir_okay=False), default=None,
              help="The key file serve up wrote (default ~/.vcfslm/keys/<deployment>.key).")
def key(inventory: str | None, key_file: str | None) -> None:
    """Print the deployment's API key, alone on its line (for `$(vcfslm serve key ...)`).

    The file must be private (mode 0600): one readable by others is refused, as ssh
    refuses such a private key."""
    from ..deploy.keys import default_key_file, read_key_file

    inv = load(inventory)
    path = key_file or default_key_file(inv.serve.name or inv.name)
    click.echo(read_key_file(path))


@serve.command("down")
@inventory_argument
@node_access_options
@output_option
def down(inventory: str | None, trust_new_hosts: bool, log_dir: str | None, output: str) -> None:
    """Stop every program serve up started and remove its units, configs and key (logs stay).
    Exit 1 when a node cannot be reached (the others are taken down all the same)."""
    from ..deploy.service import serve_down
    from ..progress import NullReporter

    inv = load(inventory)
    done = serve_down(inv, _connect(inv, NullReporter(), trust_new_hosts, log_dir))
    if output == "json":
        print_json({"stopped": done.stopped, "unreachable": done.unreachable})
    else:
        if not done.stopped and not done.unreachable:
            console.print("nothing to take down", markup=False, highlight=False)
        for node, programs in done.stopped.items():
            console.print(f"{node}: stopped {', '.join(programs)}", markup=False, highlight=False)
        for node, why in done.unreachable.items():
            err_console.print(f"{node}: unreachable, not taken down: {why}", markup=False, highlight=False,
                              soft_wrap=True)
    if done.unreachable:
        raise SystemExit(1)


COMMANDS = [serve]
