"""`vcfslm validate` and `vcfslm schema`: check an inventory offline, print its JSON Schema."""

from __future__ import annotations

import json

import click
from rich.table import Table

from ..inventory import inventory_json_schema
from .common import console, inventory_argument, load, output_option, print_json


def summary(inv) -> dict:
    """What an inventory will build, as plain data (the JSON form of `validate`)."""
    slots = inv.rank_slots()
    return {
        "inventory": inv.source,
        "name": inv.name,
        "vcenter": f"{inv.vcenter.host}:{inv.vcenter.port}",
        "vms": [{"name": n.name, "host": n.host, "management_ip": str(n.management_ip),
                 "bench_ip": str(n.bench_ip)} for n in inv.nodes],
        "vm": {"vcpus": inv.vm.vcpus, "cores_per_socket": inv.vm.cores_per_socket,
               "vnuma_nodes": inv.vm.vnuma_nodes, "vcpus_per_vnuma_node": inv.vm.vnuma_node_size,
               "memory_gb": inv.vm.memory_gb, "host_numa_nodes": list(inv.vm.host_numa_nodes)},
        "ranks": [{"local_rank": s.local_rank, "vnuma_node": s.numa_node, "cpus": s.cpu_list,
                   "bind": s.bind} for s in slots],
        "bench": {"ranks_per_node": inv.bench.ranks_per_node,
                  "threads_per_rank": inv.bench.threads_per_rank,
                  "batch_sizes": inv.bench.batch_sizes, "input_tokens": inv.bench.input_tokens,
                  "output_tokens": inv.bench.output_tokens, "warmup": inv.bench.warmup,
                  "repeats": inv.bench.repeats,
                  "scenarios": len(inv.bench.batch_sizes) * len(inv.bench.input_tokens),
                  "streams_per_vm": [b * inv.bench.ranks_per_node for b in inv.bench.batch_sizes]},
        "model": inv.guest.model,
        "slos": {k: v.model_dump(exclude_none=True) for k, v in inv.slos.items()},
    }


@click.command()
@inventory_argument
@output_option
def validate(inventory: str | None, output: str) -> None:
    """Check an inventory without contacting anything; show what it describes.

    \b
    Examples:
      vcfslm validate inventories/vx650v4-4node.yaml
      vcfslm validate cluster.yaml --output json
    Exit 2 with one line per problem (file:line:column key: message) when invalid.
    """
    inv = load(inventory)
    data = summary(inv)
    if output == "json":
        print_json({"valid": True, **data})
        return
    console.print(f"[green]valid[/green] {data['inventory']}: cluster [bold]{inv.name}[/bold], "
                  f"{len(inv.nodes)} VM(s), vCenter {data['vcenter']}")
    vms = Table(title="VMs (one per ESXi host)")
    for col in ("VM", "ESXi host", "management IP", "bench IP"):
        vms.add_column(col)
    for vm in data["vms"]:
        vms.add_row(vm["name"], vm["host"], vm["management_ip"], vm["bench_ip"])
    console.print(vms)
    v = data["vm"]
    console.print(f"each VM: {v['vcpus']} vCPUs ({v['cores_per_socket']} cores/socket), "
                  f"{v['vnuma_nodes']} vNUMA node(s) of {v['vcpus_per_vnuma_node']} vCPUs, "
                  f"{v['memory_gb']} GiB, host NUMA affinity {v['host_numa_nodes'] or 'none'}")
    ranks = Table(title="Ranks per VM")
    for col in ("local rank", "vNUMA node", "CPUs", "numactl bind"):
        ranks.add_column(col)
    for r in data["ranks"]:
        ranks.add_row(str(r["local_rank"]), str(r["vnuma_node"]), r["cpus"], r["bind"])
    console.print(ranks)
    b = data["bench"]
    console.print(f"bench: model {data['model']}, batch/rank {b['batch_sizes']} "
                  f"(= {b['streams_per_vm']} streams/VM) x input {b['input_tokens']} tokens, "
                  f"{b['output_tokens']} output tokens, {b['warmup']} warmup + {b['repeats']} "
                  f"measured windows, {b['scenarios']} scenarios")
    console.print("SLOs: " + "; ".join(f"{k}: TPOT <= {s['tpot_ms']:g} ms, TTFT <= {s['ttft_s']:g} s"
                                       for k, s in data["slos"].items()))


@click.command()
def schema() -> None:
    """Print the inventory's JSON Schema (for yaml-language-server and editors).

    \b
    Example:
      vcfslm schema > inventory.schema.json
      # then, first line of cluster.yaml:
      # yaml-language-server: $schema=inventory.schema.json
    """
    click.echo(json.dumps(inventory_json_schema(), indent=2))


COMMANDS = [validate, schema]
