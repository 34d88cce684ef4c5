"""The serving window's scheduler on a fake engine and a fake clock: queueing, continuous
admission, closed-loop users, the measured span, unfinished requests."""

from __future__ import annotations

import random

import pytest

from vcfslm.serve.scheduler import record_fields, run_window
from vcfslm.serving.decisions import ServeSpec


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += max(s, 1e-6)


class FakeStep:
    def __init__(self, decoded, firsts, tokens, prompt_tokens):
        self.decoded, self.firsts, self.tokens, self.prompt_tokens = decoded, firsts, tokens, prompt_tokens


class FakeSlots:
    """A step costs `step_s` whatever the occupancy, plus `token_s` per prompt token it
    carries (a whole 128-token prompt: 0.05 s in all, by default)."""

    def __init__(self, clock, slots, chunk=128, batched=2048, step_s=0.01, token_s=0.04 / 128):
        self.clock, self.n, self.step_s, self.token_s = clock, slots, step_s, token_s
        self.chunk_tokens, self.batched_tokens = chunk, batched
        self.busy: set[int] = set()
        self.admitted: list[int] = []
        self.pieces: list[tuple[int, int, int]] = []    # (slot, start, stop)
        self.steps: list[tuple[int, list[tuple[int, int, int]]]] = []   # (decoding, its pieces)
        self.max_busy = 0

    def free(self):
        return [s for s in range(self.n) if s not in self.busy]

    def step(self, pieces):
        assert self.busy or pieces
        decoded = {s: 1 for s in self.busy}
        n = sum(p.stop - p.start for p in pieces)
        assert n <= self.batched_tokens and len({p.slot for p in pieces}) == len(pieces)
        assert all(p.slot not in self.busy for p in pieces)
        self.pieces += [(p.slot, p.start, p.stop) for p in pieces]
        self.steps.append((len(self.busy), [(p.slot, p.start, p.stop) for p in pieces]))
        self.clock.t += self.step_s + n * self.token_s
        firsts = {}
        for p in pieces:
            if p.last:
                self.busy.add(p.slot)
                self.admitted.append(p.slot)
                firsts[p.slot] = 1
        self.max_busy = max(self.max_busy, len(self.busy))
        return FakeStep(decoded, firsts, len(decoded) + n, n)

    def evict(self, slot):
        self.busy.remove(slot)

    def reset(self):
        self.busy.clear()


def _serve(spec, load, slots=4, input_tokens=128, **kw):
    clock = Clock()
    engine = FakeSlots(clock, slots, **kw)
    out = run_window(engine, spec, load, input_tokens, random.Random(5), lambda r: r.input_tokens,
                     clock=clock, sleep=clock.sleep)
    return out, engine, record_fields(out, spec, {"A": {"tpot_ms": 20.0, "ttft_s": 0.5}})


def test_a_light_load_never_queues_and_ttft_is_the_prefill():
    spec = ServeSpec(loads=(0.5,), output_tokens=10, duration_s=100, warmup_s=10, cooldown_s=10)
    # a prompt that arrives with nothing decoding goes in whole, whatever the chunk
    out, engine, rec = _serve(spec, 0.5, chunk=32)
    assert rec["offered"] == rec["completed"] > 20 and rec["unfinished"] == 0
    # 0.5 req/s, each busy for 0.05 (one step with its whole prompt) + 9 x 0.01 s: queueing is rare.
    assert sorted(rec["ttft_s"])[len(rec["ttft_s"]) // 2] == pytest.approx(0.05, abs=1e-6)
    assert all(t == pytest.approx(10.0, rel=1e-6) or t >= 10.0 for t in rec["tpot_ms"])
    assert rec["request_output_tokens"] == [10] * rec["completed"]
    assert all(10 <= a <= 90 for a in rec["arrival_s"])
    assert rec["goodput"]["A"] == pytest.approx(rec["completed"] / 80, rel=0.2)
    assert 0 < rec["mean_active"] < 0.2


def test_an_overload_queues_and_leaves_counted_requests_unfinished():
    # 4 slots each busy 0.05 + 49 x 0.01 s serve ~7.4 requests/s; 12 arrive per second.
    spec = ServeSpec(loads=(12.0,), output_tokens=50, duration_s=10, warmup_s=2, cooldown_s=2, drain_s=2)
    out, engine, rec = _serve(spec, 12.0)
    assert rec["unfinished"] > 0 and rec["completed"] > 0
    assert rec["offered"] == rec["completed"] + rec["unfinished"]
    assert rec["max_queue"] > 20
    assert out.wall_s >= spec.cutoff_s
    assert engine.max_busy == 4 and rec["mean_active"] == pytest.approx(4.0, rel=0.05)
    assert max(rec["queue_s"]) > 0.5


def test_requests_join_between_steps_and_reuse_freed_slots():
    spec = ServeSpec(loads=(20.0,), output_tokens=5, duration_s=10, warmup_s=1, cooldown_s=1)
    out, engine, rec = _serve(spec, 20.0, slots=2)
    assert len(engine.admitted) > 100 and set(engine.admitted) == {0, 1}
    joined_mid_stream = [r for r in out.requests if r.started_s is not None and r.started_s > r.arrival_s]
    assert joined_mid_stream   # some waited for a slot, then joined the running batch


def test_closed_loop_users_keep_their_slots_busy():
    spec = ServeSpec(load_kind="users", loads=(3,), output_tokens=20, duration_s=30, warmup_s=5, cooldown_s=5)
    out, engine, rec = _serve(spec, 3, slots=4)
    assert engine.max_busy == 3
    assert rec["mean_active"] == pytest.approx(3.0, rel=0.05)
    assert rec["max_queue"] == 0 and rec["unfinished"] == 0
    # each user's next request arrives when its previous one ends (no think time)
    by_user = {}
    for r in out.requests:
        by_user.setdefault(r.user, []).append(r)
    for reqs in by_user.values():
        for a, b in zip(reqs, reqs[1:], strict=False):
            assert b.arrival_s == pytest.approx(a.last_s)


def test_closed_loop_think_time_lowers_occupancy():
    spec = ServeSpec(load_kind="users", loads=(4,), output_tokens=10, think_s=1.0, duration_s=60,
                     warmup_s=5, cooldown_s=5)
    _out, _engine, rec = _serve(spec, 4, slots=4)
    # busy ~0.14 s per request, thinking ~1 s: each user occupies a slot ~12 % of the time
    assert 0.2 < rec["mean_active"] < 1.0


def test_a_window_starts_with_every_slot_free_after_an_overloaded_one():
    spec = ServeSpec(loads=(50.0,), output_tokens=50, duration_s=4, warmup_s=1, cooldown_s=1, drain_s=0)
    clock = Clock()
    engine = FakeSlots(clock, 4)
    first = run_window(engine, spec, 50.0, 64, random.Random(1), lambda r: r, clock=clock, sleep=clock.sleep)
    assert [r for r in first.requests if r.started_s is not None and not r.done]   # cut off mid-decode
    second = run_window(engine, spec, 50.0, 64, random.Random(2), lambda r: r, clock=clock, sleep=clock.sleep)
    assert sum(r.done for r in second.requests) > 0


def test_only_requests_inside_the_span_count():
    spec = ServeSpec(loads=(2.0,), output_tokens=4, duration_s=40, warmup_s=10, cooldown_s=10)
    out, _engine, rec = _serve(spec, 2.0)
    assert all(10 <= r.arrival_s <= 30 for r in out.counted)
    assert len(out.requests) > len(out.counted)
    assert rec["generated_tokens"] <= sum(r.produced for r in out.requests)


def test_a_prompt_goes_in_pieces_riding_on_the_running_streams_steps():
    # Two users start together (no think time) with a step budget of one chunk: the first's
    # 128-token prompt takes four 32-token steps, then the second's goes in as four pieces
    # while the first decodes, and the first gets a token on every one of those steps.
    spec = ServeSpec(load_kind="users", loads=(2,), output_tokens=40, duration_s=3, warmup_s=0,
                     cooldown_s=0.1, think_s=0.0)
    out, engine, rec = _serve(spec, 2, slots=4, chunk=32, batched=32)
    assert engine.pieces[:4] == [(0, 0, 32), (0, 32, 64), (0, 64, 96), (0, 96, 128)]
    assert all(stop - start <= 32 for _, start, stop in engine.pieces)
    first, second = out.requests[0], out.requests[1]
    step_with_piece = 0.01 + 32 * 0.04 / 128
    assert first.first_s - first.arrival_s == pytest.approx(4 * step_with_piece)
    # FIFO: the second's pieces follow the first's; it comes in while the first decodes
    assert engine.steps[4:8] == [(1, [(1, start, start + 32)]) for start in (0, 32, 64, 96)]
    assert second.first_s - first.first_s == pytest.approx(4 * step_with_piece)
    assert first.produced == 40 and rec["chunk_tokens"] == 32 and rec["batched_tokens"] == 32
    assert 0 < rec["prefill_share"] < 1 and rec["steps"] == out.steps
    assert rec["step_tokens_mean"] == pytest.approx(out.step_tokens / out.steps)


def test_admission_is_fifo_and_decode_tokens_always_ride_first():
    spec = ServeSpec(loads=(30.0,), output_tokens=8, duration_s=4, warmup_s=0.5, cooldown_s=0.5)
    out, engine, rec = _serve(spec, 30.0, slots=3, chunk=48, batched=48)
    started = [r for r in out.requests if r.started_s is not None]
    assert [r.index for r in sorted(started, key=lambda r: (r.started_s, r.index))] == \
        [r.index for r in started]                          # admitted in arrival order
    firsts = sorted((r.first_s, r.index) for r in started if r.first_s is not None)
    assert [i for _, i in firsts] == sorted(i for _, i in firsts)   # ... and in by it
    # a step budget of 48: the oldest prompt's piece first, the next one's from what is left
    assert all(sum(stop - start for _, start, stop in pieces) <= 48 for _, pieces in engine.steps)
    assert rec["max_queue"] > 0 and engine.max_busy == 3


def test_a_backlog_takes_several_prompts_in_one_step_and_a_lone_arrival_a_chunk():
    spec = ServeSpec(loads=(20.0,), output_tokens=20, duration_s=6, warmup_s=1, cooldown_s=1)
    out, engine, rec = _serve(spec, 20.0, slots=8, chunk=16, batched=200)
    backlog = [pieces for _, pieces in engine.steps if len(pieces) > 1]
    assert backlog and max(len(p) for p in backlog) >= 2
    # whole prompts side by side, and a split one continued first in the next step
    assert any(sum(b - a for _, a, b in pieces) == 200 for pieces in backlog)
    split = next(i for i, (_, pieces) in enumerate(engine.steps) if pieces and pieces[-1][2] not in (0, 128))
    assert engine.steps[split + 1][1][0][:2] == (engine.steps[split][1][-1][0], engine.steps[split][1][-1][2])
    assert rec["batched_steps"] >= len(backlog) and rec["batched_tokens"] == 200
    # streams decoding and only one prompt going in: one chunk
    light, light_engine, _ = _serve(ServeSpec(loads=(0.3,), output_tokens=60, duration_s=60, warmup_s=1,
                                              cooldown_s=1), 0.3, slots=8, chunk=16, batched=300)
    beside = [pieces for decoding, pieces in light_engine.steps if decoding and pieces]
    assert beside and all(len(p) == 1 and p[0][2] - p[0][1] <= 16 for p in beside)
    alone = [pieces for decoding, pieces in light_engine.steps if not decoding and pieces]
    assert alone and all(p == [(p[0][0], 0, 128)] for p in alone)   # nothing decoding: whole


class CappedSlots(FakeSlots):
    """The SLO rule's engine: a chunk per lane count (more with fewer streams decoding), and
    every step beside running streams kept to it, a backlog's too."""

    rule = "slo:tpot<=30ms"
    capped = True
    chunks = {1: 48, 4: 24}

    def step_chunk(self):
        return self.chunks[1 if len(self.busy) <= 1 else 4]


def test_the_slo_rule_keeps_every_step_beside_decodes_to_its_chunk_even_under_a_backlog():
    spec = ServeSpec(loads=(20.0,), output_tokens=20, duration_s=6, warmup_s=1, cooldown_s=1)
    clock = Clock()
    engine = CappedSlots(clock, 8, chunk=48, batched=200)
    out = run_window(engine, spec, 20.0, 128, random.Random(5), lambda r: r.input_tokens, clock=clock,
                     sleep=clock.sleep)
    rec = record_fields(out, spec, {"A": {"tpot_ms": 30.0, "ttft_s": 5}})
    beside = [(decoding, pieces) for decoding, pieces in engine.steps if decoding and pieces]
    assert beside and all(len(p) == 1 for _, p in beside)                  # one piece, oldest first
    assert all(p[0][2] - p[0][1] <= (48 if d <= 1 else 24) for d, p in beside)
    assert any(p[0][2] - p[0][1] == 24 for _, p in beside)                # fewer tokens beside more streams
    alone = [pieces for decoding, pieces in engine.steps if not decoding and pieces]
    assert alone and max(sum(b - a for _, a, b in p) for p in alone) > 48   # nothing decoding: batched
    assert rec["chunk_rule"] == "slo:tpot<=30ms" and rec["chunk_by_lanes"] == {"1": 48, "4": 24}
    # the kernel rule, same load: a backlog goes in batched beside the running streams
    _, kernel, plain = _serve(spec, 20.0, slots=8, chunk=48, batched=200)
    assert any(decoding and sum(b - a for _, a, b in p) > 48 for decoding, p in kernel.steps)
    assert plain["chunk_rule"] == "" and plain["chunk_by_lanes"] == {}


def test_old_serving_records_read_without_the_chunk_rule():
    from dataclasses import asdict

    from vcfslm.results import ServeRecord

    spec = ServeSpec(loads=(0.5,), output_tokens=10, duration_s=30, warmup_s=5, cooldown_s=5)
    _, _, fields = _serve(spec, 0.5)
    rank = {"run_id": "r", "node": "n", "node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1,
            "ranks_per_node": 1, "nodes": 1}
    record = ServeRecord(**rank, load_kind="rate", load=0.5, arrival="poisson", slots=4, input_tokens=128,
                         output_tokens=10, window=0, seed=1, **fields)
    old = {k: v for k, v in asdict(record).items() if k not in ("chunk_rule", "chunk_by_lanes")}
    back = ServeRecord.from_dict(old)
    assert back.chunk_rule == "" and back.chunk_by_lanes == {}
    assert ServeRecord.from_dict(asdict(record)).chunk_by_lanes == record.chunk_by_lanes


def test_each_window_keeps_its_steps_by_lanes_and_prompt_tokens_with_their_seconds():
    from vcfslm.serving.step_log import groups_of

    spec = ServeSpec(loads=(2.0,), output_tokens=10, duration_s=30, warmup_s=2, cooldown_s=2)
    out, engine, rec = _serve(spec, 2.0, chunk=32)
    groups = groups_of(rec["step_costs"])
    assert sum(g.steps for g in groups) == rec["steps"] == len(engine.steps)
    # The fake's steps cost 0.01 s plus 0.04/128 s per prompt token: each group's mean says so.
    for g in groups:
        assert g.mean_s == pytest.approx(0.01 + g.prompt_tokens * 0.04 / 128, rel=1e-6)
    # A fake step has no lanes of its own: the group counts the streams decoding.
    by_key = {(g.lanes, g.prompt_tokens): g for g in groups}
    assert sum(g.steps for g in groups if g.prompt_tokens == 0) == sum(1 for busy, p in engine.steps if not p)
    assert any(lanes >= 1 and prompt == 0 for lanes, prompt in by_key)
    # Context: each decoding stream's prompt plus what it produced, summed over the steps.
    lone = [g for g in groups if g.lanes == 1 and g.prompt_tokens == 0]
    assert lone and 128 < lone[0].mean_context < 128 + 10
