"""The decode engine on the tiny model: exact output length, compiled-vs-eager logits,
compile counting, the lm_head at batch > 1, and the metrics a window record derives
from its timestamps.

One compiled engine is shared by the module (each compile of the tiny model costs seconds).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vcfslm.bench.rank import RankArgs, TorchrunEnv, rank_window  # noqa: E402
from vcfslm.bench.windows import Alone, StaticWindows  # noqa: E402
from vcfslm.bench.worker import static_fields  # noqa: E402
from vcfslm.contract import normalize_compile_mode  # noqa: E402
from vcfslm.engine.decode import DecodeEngine, Generation, synthetic_prompt  # noqa: E402
from vcfslm.engine.linear import DENSE_BF16, KernelPlan, PackedLinear  # noqa: E402
from vcfslm.matrix import Matrix  # noqa: E402
from vcfslm.runspec import RunSpec, WorkerSpec  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from vcfslm.engine.model import load_model

    return load_model("synthetic:tiny", seed=0, max_context=64)


@pytest.fixture(scope="module")
def engine(tiny):
    return DecodeEngine(tiny.model, "compile")


@pytest.fixture(scope="module")
def eager(tiny, engine):
    # The same (already packed) modules, run without compile.
    return DecodeEngine(tiny.model, "eager")


def prompt(batch=2, length=6, seed=1):
    return synthetic_prompt(batch, length, 16384, seed)


def test_exactly_output_tokens_and_one_compile_per_shape(engine):
    first = engine.generate(prompt(), 7)
    assert tuple(first.tokens.shape) == (2, 7)
    assert first.compiles == 1  # the warmup window compiles
    again = engine.generate(prompt(), 7)
    assert again.compiles == 0  # same shape: the graph is reused, cache addresses kept
    assert torch.equal(first.tokens, again.tokens)
    assert again.request_start < again.first_token < again.last_token


def test_eos_is_ignored(eager, tiny):
    p = prompt(batch=1, length=4)
    first = eager.generate(p, 2).tokens[0, 0].item()
    saved = tiny.model.config.eos_token_id
    tiny.model.config.eos_token_id = first  # the very first token is now "end of sequence"
    try:
        gen = eager.generate(p, 9)
    finally:
        tiny.model.config.eos_token_id = saved
    assert gen.tokens.shape == (1, 9) and gen.tokens[0, 0].item() == first


def test_compiled_logits_match_eager(engine):
    p = prompt(batch=2, length=6, seed=5)
    forced = synthetic_prompt(2, 8, 16384, seed=9)
    compiled = engine.step_logits(p, forced, compiled=True)
    eager = engine.step_logits(p, forced, compiled=False)
    assert compiled.shape == (2, 8, 16384)
    scale = eager.abs().max().item()
    diff = (compiled - eager).abs().max().item()
    assert diff <= 0.05 * scale, (diff, scale)
    # the comparison can fail: logits one position off differ by far more than the tolerance
    shifted = (compiled[:, 1:] - eager[:, :-1]).abs().max().item()
    assert shifted > 0.05 * scale


def test_every_linear_is_packed_and_the_modes_have_names(engine, tiny):
    assert not any(type(m) is torch.nn.Linear for m in tiny.model.modules())
    # the replica's weight bytes (rooflines use them) are the same before and after packing
    assert tiny.weight_bytes == tiny.facts["weight_bytes"]
    assert tiny.step_weight_bytes == tiny.facts["step_weight_bytes"]
    assert sum(isinstance(m, PackedLinear) for m in tiny.model.modules()) == engine.pack.linears == 9
    assert engine.is_measurement_mode and "compile" in engine.label
    assert normalize_compile_mode("autotune") == "compile" == normalize_compile_mode("freezing")
    with pytest.raises(ValueError, match="unknown compile mode"):
        normalize_compile_mode("fast")


def test_compiled_greedy_tokens_match_eager_on_the_tiny_model(engine, eager):
    p = prompt(batch=2, length=6, seed=11)
    a = engine.generate(p, 12).tokens
    b = eager.generate(p, 12).tokens
    agree = (a == b).float().mean().item()
    assert agree >= 0.9, (a, b)


def test_a_new_shape_compiles_inside_its_generation(engine):
    gen = engine.generate(prompt(batch=3, length=6), 5)
    assert gen.compiles == 1
    assert engine.generate(prompt(batch=3, length=6), 5).compiles == 0


def test_prefill_logits_at_batch_above_one_match_the_unpacked_model():
    """The lm_head at batch > 1 reads a strided last-position slice: it must give each
    stream its own logits (the unpacked eager model is the reference)."""
    from vcfslm.engine.model import load_model

    fresh = load_model("synthetic:tiny", seed=3, max_context=64)
    p = prompt(batch=4, length=9, seed=2)
    with torch.inference_mode():
        want = fresh.model(input_ids=p).logits[:, -1, :].float()
        packed = DecodeEngine(fresh.model, "eager")
        got = packed.prefill(p, packed.store_for(4, 16)).float()
        one = packed.prefill(p[2:3], packed.store_for(1, 16)).float()
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    assert (got[2] - one[0]).abs().max().item() <= 0.02 * want.abs().max().item()


def test_dense_plan_prefill_and_decode_match_the_unpacked_model():
    """The plan for CPUs without oneDNN bf16: ATen's bf16 GEMV per row for decode, fp32 SGEMM for prefill."""
    from vcfslm.engine.model import load_model

    ref = load_model("synthetic:tiny", seed=4, max_context=80)
    dense = load_model("synthetic:tiny", seed=4, max_context=80)
    wide = prompt(batch=4, length=32, seed=2)  # 128 rows: the SGEMM path
    forced = synthetic_prompt(4, 3, 16384, seed=6)
    with torch.inference_mode():
        full = torch.cat([wide, forced], dim=1)
        want = ref.model(input_ids=full).logits[:, -4:, :].float()
        engine = DecodeEngine(dense.model, "eager", plan=KernelPlan(DENSE_BF16))
        got = engine.step_logits(wide, forced)  # logits after each forced token
        last_prefill = engine.prefill(wide, engine.store_for(4, 40)).float()
    scale = want.abs().max().item()
    assert engine.pack.plan.kernel == DENSE_BF16
    assert (last_prefill - want[:, 0]).abs().max().item() <= 0.02 * scale
    assert (got - want[:, 1:]).abs().max().item() <= 0.03 * scale


def _args():
    run = RunSpec(run_id="r", mode="local", model="synthetic:tiny", matrix=Matrix((1,), (8,), 4))
    return RankArgs(WorkerSpec(run=run, out="/tmp/r", model="synthetic:tiny", nodes=1), "n0")


class RecordedGeneration:
    """A static driver whose every window is one recorded generation."""

    def __init__(self, gen: Generation):
        self.gen, self.compiles = gen, 0

    def window(self, w):
        self.compiles += self.gen.compiles
        return static_fields(w.scenario, self.gen, (150.0, None))

    def rss(self):
        return 123, 0


def measured(tmp_path, env: TorchrunEnv, scenario: tuple[int, int, int], gen: Generation):
    """The record the window loop makes of one measured window of `gen`."""
    loop = StaticWindows(RecordedGeneration(gen), Alone(rank_window(_args(), env), env.rank, lambda *_: None),
                         tmp_path / "rank-0.jsonl", resume=False, placement={"cpu_affinity": "0-1"})
    loop.run([scenario], 0, 1, lambda *_: [])
    (rec,) = loop.records
    return rec


def test_window_metrics_from_recorded_timestamps(tmp_path):
    gen = Generation(tokens=torch.zeros(4, 11, dtype=torch.long), request_start=100.0,
                     first_token=100.5, last_token=102.5)
    env = TorchrunEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, group_rank=1,
                      master_addr="x", master_port=1)
    rec = measured(tmp_path, env, (4, 128, 11), gen)
    assert rec.ttft_s == [0.5] * 4
    assert rec.e2e_s == [2.5] * 4
    assert rec.tpot_ms == pytest.approx([200.0] * 4)  # (2.5 - 0.5) / (11 - 1) s
    assert rec.generated_tokens == 44
    assert rec.rank_tps == pytest.approx(44 / 2.5)
    assert rec.wall_s == pytest.approx(2.5)
    assert (rec.rank, rec.local_rank, rec.node_rank, rec.ranks_per_node) == (3, 1, 1, 2)
    assert rec.valid and rec.invalid_reasons == []


def test_a_compile_or_a_short_output_invalidates_the_window(tmp_path):
    gen = Generation(tokens=torch.zeros(2, 9, dtype=torch.long), request_start=0.0, first_token=1.0,
                     last_token=2.0, compiles=1)
    env = TorchrunEnv(0, 0, 1, 1, 0, "x", 1)
    rec = measured(tmp_path, env, (2, 16, 10), gen)
    assert not rec.valid
    assert any("compilation" in r for r in rec.invalid_reasons)
    assert any("(2, 9)" in r for r in rec.invalid_reasons)
    assert rec.recompiles == 1
