"""The rank worker with an HTTP server as its backend (`worker --serve JSON --server JSON`):
no model is loaded in the rank; it starts its vNUMA node's server, runs the same serving
windows and sweep as the in-process engine (bench/windows.py), and stops the server
whatever happens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import results, topology
from ..serve.http_backend import HttpDriver
from .rank import RankArgs, facts_file, progress, rank_base, serve_windows


def run_http_serving(args: RankArgs, env, dist, binding: dict[str, str], finish) -> int:
    """Serve this rank's windows from its vNUMA node's HTTP server (the spec's server)."""
    import torch

    from .placement import placement_facts

    spec, server, model = args.spec.run.serve, args.spec.server, args.spec.model
    if spec is None or server is None:
        raise ValueError("run_http_serving: the run's spec has no serving settings or server")
    out, base = Path(args.spec.out), rank_base(args, env)
    numa_node = int(os.environ.get("VCFSLM_NUMA_NODE") or 0)
    # numactl's CPUs as the rank started (OpenMP has since bound this thread to one core).
    node_cpus = sorted(topology.parse_cpu_list(binding["cpus"])) if binding.get("cpus") \
        else sorted(os.sched_getaffinity(0))
    driver = HttpDriver(server, spec, model_dir=model, numa_node=numa_node, node_cpus=node_cpus,
                        log_path=out / "logs" / args.node / f"server-{env.rank}.log",
                        limits=args.spec.run.serve_limits())
    progress({**base, "phase": "server", "server": server.name, "numa_node": numa_node,
              "port": driver.endpoint.port, "log": str(driver.log_path)})
    # Where the rank was put, read before the client moves to the node's reserved CPUs.
    placement = placement_facts(torch, binding)
    try:
        driver.start()
        progress({**base, "phase": "loaded", "model": model, "load_s": round(driver.startup_s or 0.0, 1),
                  "engine": f"{server.name} server"})
        placement["engine"] = f"{server.name} server"
        placement["measurement_mode"] = True
        placement["server_cpus"] = driver.server_cpus
        placement["client_cpus"] = driver.client_cpus
        rank_invalid = list(placement["problems"])
        facts: dict[str, Any] = {
            "rank": env.rank, "local_rank": env.local_rank, "node": args.node, "node_rank": env.group_rank,
            "placement": placement, "engine": f"{server.name} server",
            "model": {"source": model, **driver.facts_model},
            "server": driver.facts(), "sweep": []}
        results.atomic_write_json(facts_file(out, env.rank), facts)
        mine = serve_windows(args, env, dist, driver, placement, rank_invalid, stops=facts["sweep"])
        facts["server"] = driver.facts()      # with the peak RSS of the whole run
        results.atomic_write_json(facts_file(out, env.rank), facts)
    finally:
        driver.stop()
    return finish(args, env, dist, mine, facts, results.SERVE_RESULTS, n=len(mine))
