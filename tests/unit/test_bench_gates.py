"""The numerics gate inside a real rank (the worker in this process, a one-rank gloo group,
the tiny model): each graph is gated before its first window, a failed graph invalidates
its own windows only, and a serving rank whose slot step fails has every serving window
invalid."""

from __future__ import annotations

import json
import logging
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vcfslm import results  # noqa: E402
from vcfslm.bench import worker  # noqa: E402
from vcfslm.bench.rank import RankArgs, TorchrunEnv  # noqa: E402
from vcfslm.contract import parse_progress  # noqa: E402
from vcfslm.engine.decode import DecodeEngine  # noqa: E402
from vcfslm.matrix import Matrix  # noqa: E402
from vcfslm.runspec import ProbeSpec, RunSpec, WorkerSpec  # noqa: E402
from vcfslm.serving.decisions import ServeSpec  # noqa: E402
from vcfslm.verdicts import NUMERICS_GATE_PREFIX  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(tmp_path, monkeypatch, capsys, matrix: Matrix | None = None,
             compile_mode: str = "compile", **extra):
    """One rank of a run in this process; its progress events."""
    port = str(free_port())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    matrix = matrix or Matrix((1, 2), (8,), 4, warmup=0, repeats=2)
    run = RunSpec(run_id="g", mode="local", model="synthetic:tiny", matrix=matrix, threads=1,
                  probe=ProbeSpec(enabled=False), compile_mode=compile_mode, **extra)
    args = RankArgs(WorkerSpec(run=run, out=str(tmp_path), model="synthetic:tiny", nodes=1, gate_steps=6), "n0")
    env = TorchrunEnv.from_environ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    threads = torch.get_num_threads()
    package = logging.getLogger("vcfslm")
    handlers, level = list(package.handlers), package.level
    try:
        assert worker.run(args, env, tmp_path, {"rank": 0, "node": "n0", "local_rank": 0}, {}) == 0
    finally:
        torch.set_num_threads(threads)
        for handler in set(package.handlers) - set(handlers):   # the rank's log file
            package.removeHandler(handler)
            handler.close()
        package.setLevel(level)
    out = capsys.readouterr().out.splitlines()
    return [parse_progress(line) for line in out if line.startswith("VCFSLM-PROGRESS ")]


def perturb_compiled_step(monkeypatch, tokens: int, scale: float = 0.5) -> None:
    """Every engine's compiled step at `tokens` tokens returns noisy logits (its tokens as
    computed): a wrong graph of that one shape."""
    step = DecodeEngine.run_step
    gen = torch.Generator().manual_seed(0)

    def perturbed(self, tok, *args, eager=False, **kwargs):
        nxt, out = step(self, tok, *args, eager=eager, **kwargs)
        if not eager and tok.shape[1] == tokens:
            out = out + scale * float(out.abs().max()) * torch.randn(out.shape, generator=gen).to(out.dtype)
        return nxt, out

    monkeypatch.setattr(DecodeEngine, "run_step", perturbed)


def test_a_perturbed_second_shape_fails_its_gate_and_invalidates_only_its_windows(tmp_path, monkeypatch, capsys):
    perturb_compiled_step(monkeypatch, tokens=2)          # the batch-2 decode graph
    events = run_rank(tmp_path, monkeypatch, capsys)
    recs = results.read_records(tmp_path / "results.jsonl")
    by_batch = {b: [r for r in recs if r.batch_per_rank == b] for b in (1, 2)}
    assert len(by_batch[1]) == len(by_batch[2]) == 2
    assert all(r.valid and r.recompiles == 0 for r in by_batch[1]), [(r.valid, r.recompiles, r.invalid_reasons) for r in recs]
    assert all(not r.valid and r.invalid_reasons[0].startswith(NUMERICS_GATE_PREFIX + "static 2x8: against eager: ")
               for r in by_batch[2])
    facts = json.loads((tmp_path / "ranks.json").read_text())[0]["numerics"]
    assert not facts["passed"] and facts["failed"] == ["static 2x8"]
    graphs = {g["graph"]: g for g in facts["graphs"]}
    assert set(graphs) == {"static 1x8", "static 2x8"}
    assert graphs["static 1x8"]["passed"] and graphs["static 1x8"]["reference"]["passed"]
    assert graphs["static 2x8"]["decode_rows"] == 2 and graphs["static 2x8"]["context"] == 12
    assert not graphs["static 2x8"]["compiled"]["passed"]
    # each gate comes before its scenario's first window, by the compile its windows use
    order = [(e["phase"], e.get("batch")) for e in events if e["phase"] in ("gated", "measure")]
    assert order == [("gated", 1), ("measure", 1), ("measure", 1), ("gated", 2), ("measure", 2), ("measure", 2)]
    assert all(e["compiles"] == 0 for e in events if e["phase"] == "measure")


def test_a_perturbed_slot_step_fails_the_serving_rank(tmp_path, monkeypatch, capsys):
    spec = ServeSpec(loads=(2.0,), input_tokens=(8,), output_tokens=4, slots=2, chunk_tokens=4, batched_tokens=8,
                     duration_s=1.0, warmup_s=0.2, cooldown_s=0.2, warmup_windows=0, repeats=1, seed=1)
    perturb_compiled_step(monkeypatch, tokens=2 + 4)      # two lanes with a prompt piece
    events = run_rank(tmp_path, monkeypatch, capsys, serve=spec,
                      matrix=Matrix((2,), (8,), 4, 0, 1), compile_mode="eager")
    served = results.read_serve_records(tmp_path / "serving.jsonl")
    assert served and all(not r.valid for r in served)
    assert all(any(w.startswith(NUMERICS_GATE_PREFIX + "slot step 6 tokens (2 lanes + a 4-token piece): ")
                   for w in r.invalid_reasons) for r in served)
    facts = json.loads((tmp_path / "ranks.json").read_text())[0]["numerics"]
    assert not facts["passed"] and facts["failed"] == ["slot step 6 tokens (2 lanes + a 4-token piece)"]
    assert {g["tokens"]: g["passed"] for g in facts["graphs"]} == {1: True, 5: True, 2: True, 6: False}
    one_lane = next(g for g in facts["graphs"] if g["tokens"] == 1)
    assert one_lane["reference"]["passed"] and one_lane["reference"]["steps"] == 5   # slot_gate_fit(8, 6, 12)
    gated = [e for e in events if e["phase"] == "gated"]
    assert [e["passed"] for e in gated] == [True, True, True, False]
    first_window = next(i for i, e in enumerate(events) if e["phase"] == "serve")
    assert max(i for i, e in enumerate(events) if e["phase"] == "gated") < first_window
