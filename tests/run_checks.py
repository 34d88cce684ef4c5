"""Checks of a finished (or stopped) cluster run, shared by the lab's bench tests and the
README walkthrough."""

from __future__ import annotations

from pathlib import Path

from vcfslm.results import load_run


def run_processes(run_id: str) -> list[str]:
    """Command lines of live processes that belong to this run (torchrun or worker)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if f"--run-id {run_id}" in cmd and "vcfslm.cli" not in cmd and state != "Z":
            out.append(cmd)
    return out


def assert_complete(run_dir: Path, nodes: int, ranks_per_node: int, scenarios: int, repeats: int):
    """Every rank, scenario and window of the run is there and sound; returns (meta, records)
    for a caller's own checks."""
    meta, records = load_run(run_dir)
    assert meta.complete and meta.failure is None
    assert len(meta.nodes) == nodes
    ranks = set(range(nodes * ranks_per_node))
    assert {r.rank for r in records} == ranks
    per_rank_scenario = {}
    for r in records:
        per_rank_scenario.setdefault((r.rank, r.scenario), set()).add(r.window)
    assert len(per_rank_scenario) == len(ranks) * scenarios
    assert all(len(w) == repeats for w in per_rank_scenario.values())
    assert all(r.rank_tps > 0 and len(r.tpot_ms) == r.batch_per_rank for r in records)
    # every window of every rank records how far it left the barrier after the first rank
    assert all(r.start_skew_s >= 0 for r in records)
    if nodes * ranks_per_node == 1:
        assert all(r.start_skew_s == 0 for r in records)
    assert {r.node for r in records} == set(meta.nodes)
    assert (run_dir / "logs" / meta.nodes[0] / "torchrun.log").exists()
    # every rank's facts came back: the engine it ran and its numerics gate
    assert set(meta.ranks) == {str(r.rank) for r in records}
    assert all(f["numerics"]["passed"] and f["pack"]["linears"] == 9 for f in meta.ranks.values())
    return meta, records
