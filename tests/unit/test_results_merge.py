"""One record order for every merged file: rank 0's gather, the cluster collect and
read_run's reading of ranks/ all go through results.merge_records."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

from test_analysis_support import make_run, record, serve_record
from test_bench_cluster_driver import bench_for, inv, scripted  # noqa: F401  (inv: the fixture)

from vcfslm.bench import worker
from vcfslm.results import (
    SERVE_RESULTS,
    merge_records,
    read_records,
    read_run,
    read_serve_records,
    write_records,
)

NODES = 3          # 12 ranks: rank-10.jsonl sorts before rank-2.jsonl by name, not by rank
RANKS = 4


def windows_by_rank() -> dict[int, list]:
    return {n * RANKS + lr: [record(node=f"slm-0{n + 1}", node_rank=n, local_rank=lr, nodes=NODES, ranks=RANKS,
                                    batch=b, window=w) for b in (4, 1) for w in (1, 0)]
            for n in range(NODES) for lr in range(RANKS)}


def serving_by_rank() -> dict[int, list]:
    return {n * RANKS + lr: [serve_record(node=f"slm-0{n + 1}", node_rank=n, local_rank=lr, nodes=NODES,
                                          ranks=RANKS, load=load, inp=inp, window=w)
                             for load in (8.0, 2.0) for inp in (512, 128) for w in (1, 0)]
            for n in range(NODES) for lr in range(RANKS)}


def shuffled(by_rank: dict[int, list], seed: int = 7) -> list[list]:
    rng = random.Random(seed)
    per_rank = [rng.sample(recs, len(recs)) for recs in by_rank.values()]
    rng.shuffle(per_rank)
    return per_rank


def expected_windows() -> list[tuple]:
    return [(r // RANKS, r, b, 128, 64, w) for r in range(NODES * RANKS) for b in (1, 4) for w in (0, 1)]


def expected_serving() -> list[tuple]:
    return [(r // RANKS, r, "rate", load, inp, 64, w) for r in range(NODES * RANKS)
            for load in (2.0, 8.0) for inp in (128, 512) for w in (0, 1)]


def window_keys(records) -> list[tuple]:
    return [(r.node_rank, r.rank, *r.scenario, r.window) for r in records]


def test_merge_puts_both_kinds_in_node_rank_scenario_window_order():
    assert window_keys(merge_records(shuffled(windows_by_rank()))) == expected_windows()
    assert window_keys(merge_records(shuffled(serving_by_rank()))) == expected_serving()
    assert merge_records([]) == []


def test_rank_zeros_gather_writes_the_one_order(tmp_path):
    gathered = iter([shuffled(windows_by_rank()), [{"rank": 1}, {"rank": 0}]])

    class Dist:
        def gather_object(self, obj, out, dst):
            out[:] = next(gathered)

        def barrier(self):
            pass

    env = SimpleNamespace(rank=0, world_size=NODES * RANKS, local_rank=0)
    args = SimpleNamespace(spec=SimpleNamespace(out=str(tmp_path)), node="n0")
    assert worker._finish(args, env, Dist(), [], {"rank": 0}, "results.jsonl", n=2) == 0
    assert window_keys(read_records(tmp_path / "results.jsonl")) == expected_windows()


def test_read_run_merges_rank_files_in_the_one_order(tmp_path):
    run = make_run(tmp_path / "r", "r", ["slm-01", "slm-02", "slm-03"], {(1, 128): (0.1, 100.0, 10.0)})
    (run / "results.jsonl").unlink()
    for recs in shuffled(windows_by_rank()):
        write_records(run / "ranks" / f"rank-{recs[0].rank}.jsonl", recs)
    for recs in shuffled(serving_by_rank()):
        write_records(run / "ranks" / f"serve-{recs[0].rank}.jsonl", recs)
    loaded = read_run(run)
    assert window_keys(loaded.records) == expected_windows()
    assert window_keys(loaded.serve_records) == expected_serving()


def test_collect_merges_every_nodes_rank_files_in_the_one_order(inv, tmp_path):  # noqa: F811
    windows, serving = shuffled(windows_by_rank()), shuffled(serving_by_rank())
    transports = {f"slm-0{n + 1}": scripted(f"slm-0{n + 1}", ["EXIT 0\n"], ranks=range(n * RANKS, (n + 1) * RANKS))
                  for n in range(NODES)}
    for n, t in enumerate(transports.values()):     # each node lists its serving files too
        t.add(re.compile(r"ls .*/ranks 2>/dev/null"), "".join(
            f"{kind}-{r}.jsonl\n" for r in range(n * RANKS, (n + 1) * RANKS) for kind in ("rank", "serve")))
    bench = bench_for(inv, transports, tmp_path)
    for la in bench.launches:
        t = transports[la.name]
        for recs in windows + serving:
            if recs[0].rank in la.global_ranks:
                kind = "serve" if recs in serving else "rank"
                t.files[f"{la.run_dir}/ranks/{kind}-{recs[0].rank}.jsonl"] = "".join(
                    r.to_json() + "\n" for r in recs).encode()
    records = bench.collect()
    assert window_keys(records) == expected_windows()
    assert window_keys(read_records(tmp_path / "r" / "results.jsonl")) == expected_windows()
    assert window_keys(read_serve_records(tmp_path / "r" / SERVE_RESULTS)) == expected_serving()
