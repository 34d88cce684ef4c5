"""Builders of synthetic run dirs and hand-made tables for the analysis tests (plus their own checks)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from vcfslm.results import (
    SERVE_RESULTS,
    RunMeta,
    ServeRecord,
    WindowRecord,
    load_run,
    read_run,
    write_meta,
    write_records,
)
from vcfslm.serving.decisions import ServeSpec

# A hand-made single-VM table shaped like the brief's prose (not its Table 3, which
# the brief does not print): under SLO-B the thresholds are 64 / 32 / 16 streams per VM
# at 128 / 512 / 1024 input tokens, all TPOT-bound; under SLO-A 16 at 128 tokens.
# (input tokens, streams per VM) -> (TTFT s, TPOT ms, rank t/s)
BRIEF_SHAPED = {
    (128, 4): (0.30, 116.0, 8.4), (128, 16): (0.60, 125.0, 31.0),
    (128, 32): (1.00, 140.0, 55.0), (128, 64): (2.00, 178.6, 86.4),
    (512, 4): (1.00, 120.0, 8.0), (512, 16): (2.00, 150.0, 26.0),
    (512, 32): (3.00, 190.0, 40.0), (512, 64): (4.50, 260.0, 55.0),
    (1024, 4): (1.50, 125.0, 7.5), (1024, 16): (3.50, 180.0, 21.0),
    (1024, 32): (4.90, 240.0, 30.0), (1024, 64): (23.6, 1000.0, 16.0),
}


def brief_shaped_csv(scope: str = "single", vms: int = 1, extra: str = "") -> str:
    rows = ["scope,vms,ranks_per_vm,batch_per_rank,input_tokens,output_tokens,ttft_s,tpot_ms,rank_tps" + extra]
    for (inp, streams), (ttft, tpot, tps) in sorted(BRIEF_SHAPED.items()):
        rows.append(f"{scope},{vms},4,{streams // 4},{inp},256,{ttft},{tpot},{tps}")
    return "\n".join(rows) + "\n"


def record(run_id: str = "run", node: str = "vm1", node_rank: int = 0, local_rank: int = 0, nodes: int = 1,
           ranks: int = 4, batch: int = 1, inp: int = 128, out: int = 64, window: int = 0,
           ttft: float | list[float] = 0.1, tpot: float | list[float] = 100.0, tps: float | None = None,
           skew: float = 0.0, wall: float = 10.0, valid: bool = True, reasons: tuple[str, ...] = (),
           recompiles: int = 0, roofline: float | None = None, roofline_ttft: float | None = None
           ) -> WindowRecord:
    ttfts = ttft if isinstance(ttft, list) else [ttft] * batch
    tpots = tpot if isinstance(tpot, list) else [tpot] * batch
    return WindowRecord(
        run_id=run_id, node=node, node_rank=node_rank, rank=node_rank * ranks + local_rank,
        local_rank=local_rank, world_size=nodes * ranks, ranks_per_node=ranks, nodes=nodes,
        batch_per_rank=batch, input_tokens=inp, output_tokens=out, window=window, start_skew_s=skew,
        wall_s=wall, generated_tokens=batch * out, rank_tps=tps if tps is not None else batch * out / wall,
        ttft_s=ttfts, tpot_ms=tpots, e2e_s=[a + b * (out - 1) / 1000 for a, b in zip(ttfts, tpots, strict=True)],
        recompiles=recompiles, valid=valid, invalid_reasons=list(reasons), roofline_tpot_ms=roofline,
        roofline_ttft_s=roofline_ttft)


def make_run(run_dir: Path, run_id: str, nodes: list[str], table: Mapping[tuple[int, int], tuple[float, float, float]],
             repeats: int = 1, ranks: int = 4, out: int = 64, complete: bool = True, roofline: float | None = None,
             roofline_ttft: float | None = None,
             slos: dict | None = None, created: str = "2025-01-01T00:00:00", guests: dict | None = None,
             tweak=None, model: str = "synthetic:tiny") -> Path:
    """A run dir whose every rank and window reports `table[(batch, input)] = (ttft, tpot, tps)`.

    `tweak(record) -> record | None` may change or drop records (None drops).
    """
    batches = sorted({b for b, _ in table})
    inputs = sorted({i for _, i in table})
    meta = RunMeta(run_id=run_id, created=created, command=["vcfslm", "bench"],
                   mode="local" if len(nodes) == 1 else "cluster", nodes=nodes, ranks_per_node=ranks,
                   threads_per_rank=24, model=model,
                   matrix={"batch_sizes": batches, "input_tokens": inputs, "output_tokens": out,
                           "warmup": 1, "repeats": repeats},
                   complete=complete, slos=slos or {},
                   guests=guests if guests is not None else {n: {"vnuma_nodes": 4, "numa_ok": True} for n in nodes})
    records = []
    for (batch, inp), (ttft, tpot, tps) in sorted(table.items()):
        for window in range(repeats):
            for node_rank, node in enumerate(nodes):
                for local_rank in range(ranks):
                    r = record(run_id, node, node_rank, local_rank, len(nodes), ranks, batch, inp, out, window,
                               ttft, tpot, tps, roofline=roofline, roofline_ttft=roofline_ttft)
                    r = tweak(r) if tweak else r
                    if r is not None:
                        records.append(r)
    write_meta(run_dir, meta)
    write_records(Path(run_dir) / "results.jsonl", records)
    return Path(run_dir)


def test_make_run_round_trips(tmp_path):
    run = make_run(tmp_path / "r", "r", ["a", "b"], {(1, 128): (0.1, 100.0, 9.0)}, repeats=2)
    meta, records = load_run(run)
    assert meta.nodes == ["a", "b"] and len(records) == 2 * 2 * 4
    assert {r.rank for r in records} == set(range(8))


def serve_record(run_id: str = "serve", node: str = "vm1", node_rank: int = 0, local_rank: int = 0,
                 nodes: int = 1, ranks: int = 4, kind: str = "rate", load: float = 1.0, inp: int = 128,
                 out: int = 64, window: int = 0, ttft: float | list[float] = 0.5,
                 tpot: float | list[float] = 100.0, requests: int = 10, unfinished: int = 0,
                 mean_active: float = 2.0, span: float = 10.0, slots: int = 16, valid: bool = True,
                 reasons: tuple[str, ...] = ()) -> ServeRecord:
    """One serving window: `requests` finished requests (or as many as the lists given) and
    `unfinished` more, over a measured span of `span` seconds."""
    ttfts = ttft if isinstance(ttft, list) else [ttft] * requests
    tpots = tpot if isinstance(tpot, list) else [tpot] * len(ttfts)
    n = len(ttfts)
    arrivals = [5.0 + i * span / max(n, 1) for i in range(n)]
    return ServeRecord(
        run_id=run_id, node=node, node_rank=node_rank, rank=node_rank * ranks + local_rank,
        local_rank=local_rank, world_size=nodes * ranks, ranks_per_node=ranks, nodes=nodes, load_kind=kind,
        load=load, arrival="closed" if kind == "users" else "poisson", slots=slots, input_tokens=inp,
        output_tokens=out, window=window, seed=window, duration_s=span + 10.0, warmup_s=5.0, cooldown_s=5.0,
        span_s=span, wall_s=span + 12.0, offered=n + unfinished, completed=n, unfinished=unfinished,
        arrival_s=arrivals, queue_s=[0.0] * n, ttft_s=ttfts, tpot_ms=tpots,
        e2e_s=[a + b * (out - 1) / 1000 for a, b in zip(ttfts, tpots, strict=True)],
        request_input_tokens=[inp] * n, request_output_tokens=[out] * n, generated_tokens=n * out,
        rank_tps=n * out / span, mean_active=mean_active, max_queue=0, valid=valid,
        invalid_reasons=list(reasons))


def make_serve_run(run_dir: Path, run_id: str, nodes: list[str],
                   table: Mapping[tuple[float, int], tuple[float, float, float]], kind: str = "rate",
                   repeats: int = 1, ranks: int = 4, out: int = 64, requests: int = 10,
                   slos: dict | None = None, complete: bool = True, tweak=None, model: str = "synthetic:tiny"
                   ) -> Path:
    """A serving run whose every rank and window reports `table[(load, input)] = (ttft, tpot,
    mean active slots)`; `tweak(record) -> record | None` may change or drop records."""
    loads = sorted({load for load, _ in table})
    inputs = sorted({i for _, i in table})
    spec = ServeSpec(load_kind=kind, loads=tuple(loads), input_tokens=tuple(inputs), output_tokens=out,
                     repeats=repeats, duration_s=20.0)
    meta = RunMeta(run_id=run_id, created="2025-01-01T00:00:00", command=["vcfslm", "bench", "--serve"],
                   mode="local" if len(nodes) == 1 else "cluster", nodes=nodes, ranks_per_node=ranks,
                   threads_per_rank=24, model=model, matrix={"serve": spec.to_dict()},
                   complete=complete, slos=slos or {},
                   guests={n: {"vnuma_nodes": 4, "numa_ok": True} for n in nodes})
    records = []
    for (load, inp), (ttft, tpot, active) in sorted(table.items()):
        for window in range(repeats):
            for node_rank, node in enumerate(nodes):
                for local_rank in range(ranks):
                    r = serve_record(run_id, node, node_rank, local_rank, len(nodes), ranks, kind, load, inp,
                                     out, window, ttft, tpot, requests, mean_active=active)
                    r = tweak(r) if tweak else r
                    if r is not None:
                        records.append(r)
    write_meta(run_dir, meta)
    write_records(Path(run_dir) / SERVE_RESULTS, records)
    return Path(run_dir)


def test_make_serve_run_round_trips(tmp_path):
    run = make_serve_run(tmp_path / "s", "s", ["a"], {(1.0, 128): (0.5, 100.0, 2.0)}, repeats=2)
    got = read_run(run)
    assert got.records == [] and len(got.serve_records) == 2 * 4
    assert got.meta.matrix["serve"]["loads"] == [1.0]
