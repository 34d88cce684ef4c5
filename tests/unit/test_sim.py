"""The serving simulator: its closed-form runs against step-by-step sums, vcfslm's scheduler
against the bench's own loop (serve/scheduler.run_window) driven by the same step costs on
a modelled clock, vLLM's token budget on a hand-worked case, and the router's policies."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vcfslm.analysis import perfmodel as P
from vcfslm.analysis.calibration import KNOWN_DIMS
from vcfslm.roofline import mean_decode_context
from vcfslm.serve.scheduler import run_window
from vcfslm.serving import decisions as serving
from vcfslm.serving.decisions import ServeSpec
from vcfslm.sim.cost import LinearRun, StepModel, relative_half_widths, scaled, step_model
from vcfslm.sim.fleet import POWER_OF_TWO, ROUND_ROBIN, Fleet, simulate_window
from vcfslm.sim.server import Policy, Server

DIMS = KNOWN_DIMS["phi-3-mini"]
LIMITS = {"B": {"tpot_ms": 200.0, "ttft_s": 5.0}}


def cost(lane_base=0.10, per_lane=0.002, kv=2e-7, prompt=2e-3, attention=1e-13) -> StepModel:
    lanes = (0.0, *(lane_base + per_lane * b for b in range(1, 33)))
    return StepModel(lanes, kv, prompt, 0.01, attention, lane_base + 0.01, DIMS, 32, attention_pair=1e9)


VCFSLM_POLICY = Policy("vcfslm", 16, 2048, chunks=((1, 64), (2, 48), (4, 32), (8, 24), (16, 16)),
                       lane_buckets=(1, 2, 4, 8, 16), capped=True)


@pytest.mark.parametrize("first,slope", [(0.1, 0.0), (0.1, 1e-4), (0.03, 0.02)])
def test_a_run_sums_in_closed_form_what_its_steps_sum_one_by_one(first, slope):
    run = LinearRun(first, slope)
    ends, t = [0.0], 0.0
    for k in range(200):
        t += first + slope * k
        ends.append(t)
    for budget in (0.0, 0.05, 0.1 + 1e-9, 0.35, 1.0 - 1e-9, 7.33, ends[57] + 1e-9, ends[57] - 1e-9):
        expected = max(n for n, e in enumerate(ends) if e <= budget + 1e-12)
        assert run.steps_within(budget) == expected, budget
        reach = min(n for n, e in enumerate(ends) if n >= 1 and e >= budget - 1e-12)
        assert run.steps_to_reach(budget) == reach, budget
        assert run.elapsed(expected) == pytest.approx(ends[expected])


def test_step_costs_are_the_fits_own_tpot_and_ttft():
    """A plain decode step at batch b over the mean context costs the TPOT `predict` gives for
    that cell, and a lone prompt in one piece the TTFT; the fit interval's ends scale them."""
    from test_perfmodel import PHI3_2L, RATES, synthetic

    model = P.fit_model(synthetic([1, 4, 8, 16], [128, 512], noise=0.02, seed=3))
    m = step_model(model, PHI3_2L, RATES, 16)
    for b, inp, out in ((1, 128, 16), (4, 512, 16), (16, 128, 64)):
        p = P.predict(model, PHI3_2L, RATES, P.Scenario(b, inp, out))
        context = b * mean_decode_context(inp, out)
        assert m.lanes_s(b) + context * m.kv_token_s == pytest.approx(p.tpot_ms / 1000.0, rel=1e-9)
        if b == 1:
            assert m.decode_s(0, 0) + m.piece_s(0, inp, inp) == pytest.approx(p.ttft_s, rel=1e-9)
    d_rel, p_rel = relative_half_widths(model, PHI3_2L, RATES, 16, 128, 16)
    assert 0 < d_rel < 0.5 and 0 < p_rel < 0.5
    low, high = (scaled(model, PHI3_2L, RATES, 16, d_rel, p_rel, end) for end in ("optimistic", "pessimistic"))
    assert low.lanes_s(4) == pytest.approx(m.lanes_s(4) * (1 - d_rel))
    assert high.piece_s(0, 128, 128) == pytest.approx(m.piece_s(0, 128, 128) * (1 + p_rel))


class ModelledSlots:
    """The engine's TokenSlots as the scheduler sees it, each step timed by the step model on
    a modelled clock: what the bench's loop would measure if every step took the model's time."""

    def __init__(self, model: StepModel, policy: Policy, clock: SimpleNamespace):
        self.model, self.policy, self.clock = model, policy, clock
        self.chunks = dict(policy.chunks)
        self.chunk_tokens, self.batched_tokens = max(self.chunks.values()), policy.batched_tokens
        self.capped, self.rule = policy.capped, "slo:tpot<=200ms"
        self.context: dict[int, int] = {}

    def free(self):
        return [s for s in range(self.policy.slots) if s not in self.context]

    def _lanes(self):
        return self.policy.lanes(max(self.context)) if self.context else 0

    def step_chunk(self):
        return self.policy.chunk(self._lanes() or 1)

    def step(self, pieces):
        lanes, chunk = self._lanes(), self.step_chunk()
        padded = chunk if len(pieces) == 1 and pieces[0].stop - pieces[0].start <= chunk else 0
        took = self.model.decode_s(lanes, sum(self.context.values()))
        prompt = sum(self.model.piece_s(p.start, p.stop, p.length, padded) for p in pieces)
        took += prompt * (self.model.idle_piece_scale if not lanes else 1.0)
        self.clock.t += took
        for s in self.context:
            self.context[s] += 1
        for p in pieces:
            if p.last:
                self.context[p.slot] = p.length + 1
        prompt = sum(p.stop - p.start for p in pieces)
        return SimpleNamespace(decoded={}, firsts={}, tokens=len(self.context) + prompt, prompt_tokens=prompt,
                               lanes=lanes or 1)

    def evict(self, slot):
        del self.context[slot]

    def reset(self):
        self.context.clear()


def modelled_bench_window(model: StepModel, spec: ServeSpec, load: float, input_tokens: int = 128):
    """The bench's own loop (serve/scheduler.run_window) for rank 0's first window at `load`,
    every step taking `model`'s time on a modelled clock."""
    clock = SimpleNamespace(t=0.0)

    def sleep(d):
        clock.t += d

    seed = serving.window_seed(spec.seed, 0, load, input_tokens, 0)
    return run_window(ModelledSlots(model, VCFSLM_POLICY, clock), spec, load, input_tokens, random.Random(seed),
                      lambda r: None, clock=lambda: clock.t, sleep=sleep)


@pytest.mark.parametrize("load,output", [(0.3, 16), (0.7, 16), (1.5, 8), (0.4, 64)])
def test_vcfslm_scheduler_decides_as_the_bench_loop_does(load, output):
    """The same arrivals (rank 0, window 0 seed), the same step costs: every counted request's
    first and last token at the same time as the bench's own loop gives them, step by step."""
    spec = ServeSpec(loads=(load,), input_tokens=(128,), output_tokens=output, duration_s=300.0,
                     warmup_s=5.0, cooldown_s=5.0, slots=16)
    model = cost()
    bench = modelled_bench_window(model, spec, load)
    sim = simulate_window(model, VCFSLM_POLICY, spec, load, 128, LIMITS)[0]
    expected = [(r.arrival_s, r.first_s - r.arrival_s, r.last_s - r.first_s) for r in bench.counted if r.done]
    assert len(expected) > 20
    assert sim.completed == len(expected)
    assert sim.unfinished == sum(1 for r in bench.counted if not r.done)
    for (arrival, ttft, decode), t, f, p, n in zip(expected, sim.ttft_s, sim.arrival_s, sim.tpot_ms,
                                                  sim.request_output_tokens, strict=True):
        assert f == pytest.approx(arrival, abs=1e-9)
        assert t == pytest.approx(ttft, rel=1e-6, abs=1e-6)
        assert p == pytest.approx(decode / (n - 1) * 1000.0, rel=1e-6, abs=1e-6)
    # The steps the loop ran, all of them accounted for by the jumps.
    assert abs(sim.steps - bench.steps) <= 2


def test_vllm_scheduler_spends_its_token_budget_decodes_first():
    """max_num_batched_tokens 100, two 80-token prompts at t=0, one decoding stream: step 1
    decodes the stream and takes 80 + 19 prompt tokens, step 2 the stream, the first prompt's
    first token, and the second prompt's last 61 tokens."""
    model = StepModel((0.0, 1.0, 1.0, 1.0, 1.0), 0.0, 0.01, 0.0, 0.0, 1.0, DIMS, 4, attention_pair=0.0)
    server = Server(model, Policy("vllm", 4, 100))

    def req(i, arrival, inp, out):
        from vcfslm.serve.scheduler import Request
        return Request(i, None, arrival, inp, out, True)

    stream, a, b = req(0, 0.0, 10, 5), req(1, 0.5, 80, 3), req(2, 0.5, 80, 3)
    for r in (stream, a, b):
        server.submit(r)
    server.advance(100.0)
    # t=0: the stream's 10-token prefill alone (1 + 0.10 s); its first token at 1.1.
    assert stream.first_s == pytest.approx(1.1)
    # t=1.1: one decode + 80 of a + 19 of b (1 + 0.99); a's first token at 3.09.
    assert a.first_s == pytest.approx(3.09)
    # t=3.09: the stream's and a's decodes + b's 61 left (1 + 0.61).
    assert b.first_s == pytest.approx(4.70)
    # then plain decode steps of 1 s: the stream's 5th token two steps after b's first...
    assert stream.last_s == pytest.approx(4.70 + 2.0)
    assert a.last_s == pytest.approx(4.70 + 1.0)
    assert b.last_s == pytest.approx(4.70 + 2.0)


def test_vllm_admits_no_more_than_max_num_seqs():
    model = StepModel((0.0, 1.0, 1.0), 0.0, 0.0, 0.0, 0.0, 1.0, DIMS, 2, attention_pair=0.0)
    server = Server(model, Policy("vllm", 2, 100))
    from vcfslm.serve.scheduler import Request
    rs = [Request(i, None, 0.0, 4, 3, True) for i in range(3)]
    for r in rs:
        server.submit(r)
    server.advance(100.0)
    assert rs[0].first_s == rs[1].first_s == pytest.approx(1.0)
    # the third waits for a sequence to finish (at 3.0), then prefills alone.
    assert rs[2].started_s == pytest.approx(3.0)
    assert rs[2].first_s == pytest.approx(4.0)


def fleet(router, servers=8, load=0.7):
    spec = ServeSpec(loads=(load,), input_tokens=(128,), output_tokens=16, duration_s=300.0)
    return simulate_window(cost(), VCFSLM_POLICY, spec, load, 128, LIMITS, fleet_of=Fleet(servers, router))


def test_round_robin_deals_requests_in_turn():
    records = fleet(ROUND_ROBIN)
    offered = [r.offered for r in records]
    assert max(offered) - min(offered) <= 1
    assert sum(offered) > 8 * 0.7 * 250


def test_power_of_two_shortens_the_queue_tail_of_round_robin():
    """Near capacity, routing to the less busy of two servers shortens the TTFT tail."""
    rr = serving.load_results(fleet(ROUND_ROBIN, load=0.6))[0.6]
    p2 = serving.load_results(fleet(POWER_OF_TWO, load=0.6))[0.6]
    assert rr.requests == p2.requests
    assert p2.ttft_tail(90) < rr.ttft_tail(90) < float("inf")


def test_closed_loops_are_one_server_only():
    spec = ServeSpec(load_kind="users", loads=(2,), input_tokens=(128,), output_tokens=16, duration_s=60.0)
    one = simulate_window(cost(), VCFSLM_POLICY, spec, 2, 128, LIMITS)
    assert one[0].completed > 10
    with pytest.raises(ValueError, match="one server"):
        simulate_window(cost(), VCFSLM_POLICY, spec, 2, 128, LIMITS, fleet_of=Fleet(2))
