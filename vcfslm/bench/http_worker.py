"""The rank worker with an HTTP server as its backend (`worker --serve JSON --server JSON`):
no model is loaded in the rank; it starts its vNUMA node's server, runs the same serving
windows and sweep as the in-process engine (bench/serve_worker.py), and stops the server
whatever happens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import results, topology
from ..serve.http_backend import HttpDriver
from ..servers import ServerSpec
from ..serving import ServeSpec
from .rank import facts_file, progress
from .serve_worker import serve_windows


def run_http_serving(args, env, out: Path, base: dict[str, Any], dist, binding: dict[str, str],
                     server: ServerSpec, finish) -> int:
    import torch

    from .placement import placement_facts

    spec = ServeSpec.of_record(json.loads(args.serve))
    numa_node = int(os.environ.get("VCFSLM_NUMA_NODE") or 0)
    # numactl's CPUs as the rank started (OpenMP has since bound this thread to one core).
    node_cpus = sorted(topology.parse_cpu_list(binding["cpus"])) if binding.get("cpus") \
        else sorted(os.sched_getaffinity(0))
    driver = HttpDriver(server, spec, model_dir=args.model, numa_node=numa_node, node_cpus=node_cpus,
                        out=out, node=args.node, rank=env.rank)
    progress({**base, "phase": "server", "server": server.name, "numa_node": numa_node,
              "port": driver.endpoint.port, "log": str(driver.log_path)})
    # Where the rank was put, read before the client moves to the node's reserved CPUs.
    placement = placement_facts(torch, binding)
    try:
        driver.start()
        progress({**base, "phase": "loaded", "model": args.model, "load_s": round(driver.startup_s or 0.0, 1),
                  "engine": f"{server.name} server"})
        placement["engine"] = f"{server.name} server"
        placement["measurement_mode"] = True
        placement["server_cpus"] = driver.server_cpus
        placement["client_cpus"] = driver.client_cpus
        rank_invalid = list(placement["problems"])
        facts: dict[str, Any] = {
            "rank": env.rank, "local_rank": env.local_rank, "node": args.node, "node_rank": env.group_rank,
            "placement": placement, "engine": f"{server.name} server",
            "model": {"source": args.model, **driver.facts_model},
            "server": driver.facts(), "sweep": []}
        results.atomic_write_json(facts_file(out, env.rank), facts)
        mine = serve_windows(args, env, out, base, driver, placement, rank_invalid, dist, progress,
                             None, stops=facts["sweep"])
        facts["server"] = driver.facts()      # with the peak RSS of the whole run
        results.atomic_write_json(facts_file(out, env.rank), facts)
    finally:
        driver.stop()
    return finish(args, env, out, base, dist, mine, facts, results.SERVE_RESULTS, n=len(mine))
