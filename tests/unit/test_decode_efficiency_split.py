"""benchmarks/decode_efficiency.py's split of a decode step: the linears' kernels timed inside
the step (never the prefill's), and the same step with those kernels skipped."""

from __future__ import annotations

import time

import pytest
import torch

from tests.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("decode_efficiency")


@pytest.fixture(scope="module")
def engine():
    from vcfslm.engine.decode import DecodeEngine
    from vcfslm.engine.model import load_model

    loaded = load_model("synthetic:tiny", seed=0, max_context=32)
    return DecodeEngine(loaded.model, "eager"), loaded.config


def test_the_kernels_are_timed_only_while_on_and_skipped_ones_keep_their_shape(bench, monkeypatch):
    from vcfslm.engine import linear

    calls = []

    def real(x2, weight, bias, out_features, kernel, min_rows):
        calls.append(out_features)
        return torch.ones(x2.shape[0], out_features, dtype=x2.dtype)

    monkeypatch.setattr(linear, "run_kernel", real)
    x2 = torch.zeros(3, 8, dtype=torch.bfloat16)
    with bench.linear_kernels(skip=False) as timing:
        assert linear.run_kernel(x2, None, None, 5, "k", 1).sum() == 15
        counted = timing.seconds
        timing.pause()
        linear.run_kernel(x2, None, None, 5, "k", 1)
        assert timing.seconds == counted > 0
        timing.reset()
        assert timing.seconds == 0
    assert linear.run_kernel is real and calls == [5, 5]
    with bench.linear_kernels(skip=True):
        y = linear.run_kernel(x2, None, None, 7, "k", 1)
    assert y.shape == (3, 7) and y.dtype == torch.bfloat16 and calls == [5, 5]
    assert linear.run_kernel is real


def test_the_wrapped_kernel_is_the_one_the_compiled_op_reaches(bench):
    """A compiled graph calls vcfslm::linear; its kernel is linear.run_kernel, looked up at
    each call, so a block's wrapper times (and skips) the compiled step's linears too."""
    from vcfslm.engine import linear

    packed = linear.PackedLinear(torch.ones(12, 8, dtype=torch.bfloat16), None, linear.KernelPlan(linear.DENSE_BF16))
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    op = torch.ops.vcfslm.linear.default
    with bench.linear_kernels(skip=True) as timing:
        y = op(x, packed.packed_weight, None, 12, packed.kernel, packed.min_rows)
    assert y.shape == (2, 12) and timing.seconds > 0
    with bench.linear_kernels(skip=False) as timing:
        y = op(x, packed.packed_weight, None, 12, packed.kernel, packed.min_rows)
    assert torch.equal(y, torch.full((2, 12), 8.0, dtype=torch.bfloat16)) and timing.seconds > 0


class _AheadClock:
    """Real time plus `ahead` seconds: what a test adds to it, the benchmark sees as time spent."""

    def __init__(self):
        self.ahead = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.ahead


def test_a_step_splits_into_its_linears_and_the_rest_and_the_prefill_is_not_counted(bench, engine, monkeypatch):
    from vcfslm.engine import linear
    from vcfslm.engine.decode import synthetic_prompt

    eng, config = engine
    prompt = synthetic_prompt(1, 6, config.vocab_size, seed=3)
    rows_seen = []
    real = linear.run_kernel
    # The benchmark's clock runs 50 s ahead inside each prefill linear instead of sleeping:
    # counted, the prefill's 8 would add 8 x 50 s over 3 steps to each, which no real
    # kernel comes near however loaded the machine is (~370 ms a step has been seen).
    clock = _AheadClock()
    monkeypatch.setattr(bench, "time", clock)

    def watched(x2, *rest):
        rows_seen.append(x2.shape[0])
        if x2.shape[0] == 6:
            clock.ahead += 50.0   # a slow prefill linear: it must not show in the step's share
        return real(x2, *rest)

    monkeypatch.setattr(linear, "run_kernel", watched)
    split = bench.step_split(eng, prompt, tokens=4, windows=1)
    assert set(split) == {"tpot", "linears", "skipped"}
    assert 0 < split["linears"] < split["tpot"] and split["skipped"] > 0
    assert split["linears"] < 10_000
    # The timed window ran the real kernels for its prefill (6 rows; the lm_head at the last
    # position only) and its 3 steps (1 row); the skipped window never reached them.
    linears = sum(isinstance(m, linear.PackedLinear) for m in eng.model.modules())
    assert rows_seen.count(6) == linears - 1 and rows_seen.count(1) == 1 + 3 * linears
    assert len(rows_seen) == 4 * linears
    assert linear.run_kernel is watched and "prefill" not in vars(eng)


class _Clock:
    """The benchmark's `time`, replaced: it moves only when told, so the tiny model's own
    work counts as nothing and the ratios are exact however loaded the machine is (the
    suite runs on parallel workers, where a real 10 ms sleep has been seen to take 80)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Slow(torch.nn.Module):
    """An activation that takes `seconds` longer on `clock`: work of the step outside its linears."""

    def __init__(self, inner, clock: _Clock, seconds: float):
        super().__init__()
        self.inner, self.clock, self.seconds = inner, clock, seconds

    def forward(self, x):
        self.clock.advance(self.seconds)
        return self.inner(x)


def _on_a_clock(bench, engine, monkeypatch, seed: int):
    """The engine, a 6-token prompt, and the _Clock the benchmark now reads."""
    from vcfslm.engine.decode import synthetic_prompt

    eng, config = engine
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    return eng, synthetic_prompt(1, 6, config.vocab_size, seed=seed), clock


def test_each_step_is_paired_with_a_pass_of_its_linears_alone(bench, engine, monkeypatch):
    from vcfslm.engine import linear

    eng, prompt, clock = _on_a_clock(bench, engine, monkeypatch, seed=4)
    real = linear.run_kernel

    def slow_kernels(x2, *rest):
        # 1-row kernels slow in the step and in the pass alike; the prefill's (6 rows) far
        # slower, which must not count in any step.
        clock.advance(0.05 if x2.shape[0] == 6 else 0.01)
        return real(x2, *rest)

    monkeypatch.setattr(linear, "run_kernel", slow_kernels)
    even = bench.step_against_linears(eng, prompt, tokens=4, windows=2)
    assert even["pairs"] == 2 * 3
    assert even["kernels"] == pytest.approx(1.0) and even["step"] == pytest.approx(1.0)
    assert "run_step" not in vars(eng)

    # The same kernels, and 100 ms more per layer outside them: only the step grows.
    layers = eng.model.model.layers
    for layer in layers:
        monkeypatch.setattr(layer.mlp, "activation_fn", _Slow(layer.mlp.activation_fn, clock, 0.1))
    slowed = bench.step_against_linears(eng, prompt, tokens=4, windows=2)
    assert slowed["pairs"] == 6 and slowed["kernels"] == pytest.approx(1.0)
    # Each step takes 2 x 100 ms beyond a pass of 9 x 10 ms kernels.
    assert len(layers) == 2 and sum(isinstance(m, linear.PackedLinear) for m in eng.model.modules()) == 9
    assert slowed["step"] == pytest.approx((9 * 0.01 + 2 * 0.1) / (9 * 0.01))


class _Read:
    """A sustained read that takes `seconds` on `clock` and says it read at `gbs`, noting
    each call in `log`."""

    def __init__(self, clock: _Clock, log: list, gbs: float):
        self.clock, self.log, self.rate = clock, log, gbs

    def gbs(self, nbytes: int) -> float:
        self.log.append(("read", nbytes))
        self.clock.advance(1.0)
        self.fastest_pass_gbs = self.rate * (1 + len(self.log) / 100)
        return self.rate


def test_each_pass_is_judged_against_a_read_of_as_many_bytes_beside_it_the_order_flipping(bench, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    log: list = []
    passes = iter([0.5, 0.5, 0.25, 1.0])   # seconds: the warm-up pass, then three turns

    def run():
        log.append(("pass",))
        clock.advance(next(passes))

    turns = bench.beside_reads(run, 10_000_000_000, _Read(clock, log, 40.0), turns=3)
    # The warm-up pass is not a turn; then pass-read, read-pass, pass-read.
    assert log == [("pass",), ("pass",), ("read", 10**10), ("read", 10**10), ("pass",), ("pass",),
                   ("read", 10**10)]
    # Each turn: the pass's own GB/s (the read's second on the clock is not the pass's), the
    # read's, and the read's fastest pass (as the read left it: its 3rd, 4th and 7th call).
    assert turns == [(20.0, 40.0, 40 * 1.03), (40.0, 40.0, 40 * 1.04), (10.0, 40.0, 40 * 1.07)]


def test_the_linears_alone_are_called_as_the_step_calls_them(bench, monkeypatch):
    """A compiled step calls every linear through vcfslm::linear, so the pass does too; an
    eager step calls the module. Either way each linear runs once, at the rows asked."""
    from vcfslm.engine import linear

    plan = linear.KernelPlan(linear.DENSE_BF16)
    model = torch.nn.Sequential(*(linear.PackedLinear(torch.ones(n, 64, dtype=torch.bfloat16), None, plan)
                                  for n in (128, 192)))
    op_calls, kernel_calls = [], []
    real_op = torch.ops.vcfslm.linear.default
    real = linear.run_kernel

    def kernel(x2, weight, bias, out_features, kernel, min_rows):
        kernel_calls.append((x2.shape[0], out_features))
        return real(x2, weight, bias, out_features, kernel, min_rows)

    monkeypatch.setattr(linear, "run_kernel", kernel)
    with monkeypatch.context() as m:   # the pass takes the op when it is made
        m.setattr(torch.ops.vcfslm.linear, "default", lambda *a: op_calls.append(a[3]) or real_op(*a))
        bench.linears_pass(model, rows=1, compiled=True)()
    assert op_calls == [128, 192] and kernel_calls == [(1, 128), (1, 192)]
    op_calls.clear()
    kernel_calls.clear()
    bench.linears_pass(model, rows=5, compiled=False)()
    assert op_calls == [] and kernel_calls == [(5, 128), (5, 192)]


def test_each_step_gets_a_read_of_its_bytes_beside_it_and_the_loops_own_time_is_kept(bench, engine, monkeypatch):
    from vcfslm.engine import linear

    eng, prompt, clock = _on_a_clock(bench, engine, monkeypatch, seed=5)
    real = linear.run_kernel
    log: list = []

    def kernels(x2, *rest):
        log.append("kernel")
        clock.advance(0.01)
        return real(x2, *rest)

    monkeypatch.setattr(linear, "run_kernel", kernels)
    got = bench.step_against_linears(eng, prompt, tokens=4, windows=2, read=_Read(clock, log, 40.0), nbytes=123)
    assert got["pairs"] == 6 and got["read_gbs"] == [40.0] * 6
    # Each step: its 9 kernels of 10 ms; the read's second on the clock is never the step's.
    assert got["step_s"] == pytest.approx([0.09] * 6) and got["step"] == pytest.approx(1.0)
    # Kernel calls between reads: each window is a prefill (9 calls) and 3 steps (9 each),
    # each step followed by its read and a pass of the linears (9), the two swapping places
    # every step: read first at steps 0, 2 and 4.
    runs, count = [], 0
    for entry in log:
        if entry == "kernel":
            count += 1
        else:
            assert entry == ("read", 123)
            runs.append(count)
            count = 0
    runs.append(count)
    assert runs == [9 + 9, 9 + 9 + 9, 9, 9 + 9 + 9 + 9, 9, 9 + 9 + 9, 0]
    # The generate loop's own code between steps takes no time on this clock.
    assert got["between_s"] == 0.0 and "run_step" not in vars(eng)
