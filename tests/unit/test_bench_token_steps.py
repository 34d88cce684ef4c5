"""The engine's serving steps on the tiny model: every request computes what its prompt
computes alone, whenever it is admitted and however its prompt is cut into pieces; one
graph per token count, compiled by prime() and never again; free lanes stay finite; bad
pieces are refused before anything runs.

The reference is the static path (DecodeEngine.generate at batch 1) with the slots'
context as its store length. Greedy tokens must be equal, and teacher-forced logits within
0.02 of the largest logit with every top-1 equal. Both hold exactly on this CPU: a lane or
a prompt token goes through the same kernels as a lone stream (the packed linear computes
each row alike; attention is per request over its own row). On another kernel plan a
row's rounding may depend on the row count; the 0.02 still separates a right answer from
a wrong position (logits one step off fail it, tested). Exact tokens are asked where a
request runs the same kernels as its reference (the eager tests). A compiled step fuses
its own way (the query in fp32 or bf16, sums in another order), and the tiny model has
top-2 gaps of 0-2 bf16 steps at some positions: there the greedy tokens must be equal up to
a first divergence, which must fall on a near-tie of the reference's logits (within TIE of
the largest, the runner-up taken), the rule the peers' equivalence check applies.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vcfslm.engine.decode import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.engine.slots import TokenSlots  # noqa: E402
from vcfslm.engine.step_cost import (  # noqa: E402
    chunk_for_probes,
    chunk_tokens_for,
    decode_buckets,
    free_rows,
    lanes_for,
)
from vcfslm.serving.decisions import Piece  # noqa: E402

SLOTS = 3
CONTEXT = 40
VOCAB = 16384
RTOL = 0.02
TIE = 0.01   # of the largest logit: ~2.5 bf16 steps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The tiny model is all per-op overhead: one thread is as fast, and stays fast on a
    # machine whose cores other processes share.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny():
    from vcfslm.engine.model import load_model

    return load_model("synthetic:tiny", seed=0, max_context=64)


@pytest.fixture(scope="module")
def eager(tiny):
    return DecodeEngine(tiny.model, "eager")


def prompt(length, seed):
    return synthetic_prompt(1, length, VOCAB, seed)[0]


def alone(engine, p):
    """The prompt's greedy tokens on the static path at batch 1, store length CONTEXT."""
    return engine.generate(p[None], CONTEXT - p.numel()).tokens[0].tolist()


PROMPTS = {"a": (5, 1), "b": (9, 2), "c": (5, 3), "d": (12, 4), "e": (4, 5), "f": (7, 6)}


class Server:
    """A tiny FIFO scheduler over TokenSlots (what serve/scheduler.py's loop does, without its
    clock): one request admitted at a time, chunk by chunk, while the others decode; or,
    `batched`, pieces of every waiting request that has a slot, up to batched_tokens in all."""

    def __init__(self, slots: TokenSlots, batched: bool = False):
        self.slots, self.batched = slots, batched
        self.held: dict[int, str] = {}
        self.got: dict[str, list[int]] = {}
        self.queue: list[str] = []
        self.admitting: list[list] = []          # [name, slot, tokens in], oldest first

    def step(self):
        free = [s for s in self.slots.free() if s not in {a[1] for a in self.admitting}]
        while self.queue and free and (self.batched or not self.admitting):
            self.admitting.append([self.queue.pop(0), free.pop(0), 0])
        budget = self.slots.batched_tokens if self.batched else self.slots.chunk_tokens
        pieces = []
        for name, slot, done in self.admitting:
            p = prompt(*PROMPTS[name])
            take = min(p.numel() - done, budget)
            if take > 0:
                pieces.append(Piece(slot, p, done, done + take, p.numel()))
                budget -= take
        out = self.slots.step(pieces)
        assert sorted(out.decoded) == sorted(self.held)
        assert out.compiled == (len(pieces) <= 1 and out.prompt_tokens <= self.slots.chunk_tokens)
        for slot, token in out.decoded.items():
            self.got[self.held[slot]].append(token)
        for piece in pieces:
            entry = next(a for a in self.admitting if a[1] == piece.slot)
            entry[2] = piece.stop
            assert (piece.slot in out.firsts) == piece.last
            if piece.last:
                self.admitting.remove(entry)
                self.held[piece.slot] = entry[0]
                self.got[entry[0]] = [out.firsts[piece.slot]]
        return out

    def evict(self, name):
        slot = next(s for s, n in self.held.items() if n == name)
        self.slots.evict(slot)
        del self.held[slot]


ARRIVALS = [(0, "a"), (0, "c"), (3, "b"), (6, "d"), (6, "e"), (10, "f")]   # (step, request)
WANTED = 10                                                                 # tokens per request


def staggered(slots: TokenSlots, batched: bool = False) -> dict[str, list[int]]:
    """Requests arriving at different steps, queueing for the slots, each evicted when it has
    its tokens (freed slots re-used by longer and shorter prompts), until all are done."""
    slots.reset()
    server = Server(slots, batched)
    for step in range(300):
        server.queue += [name for at, name in ARRIVALS if at == step]
        if step > 10 and not server.queue and not server.admitting and not server.held:
            break
        server.step()
        for name in [n for n in server.held.values() if len(server.got[n]) >= WANTED]:
            server.evict(name)
    return server.got


@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
def test_every_request_generates_what_its_prompt_generates_alone_in_any_chunking(eager, chunk):
    slots = TokenSlots(eager, SLOTS, CONTEXT, chunk)
    got = staggered(slots)
    assert set(got) == set(PROMPTS)
    for name, tokens in got.items():
        assert len(tokens) == WANTED, name
        assert tokens == alone(eager, prompt(*PROMPTS[name]))[:len(tokens)], (chunk, name)


@pytest.mark.parametrize("chunk,batched", [(3, 7), (4, 64)])
def test_several_prompts_per_step_generate_what_each_generates_alone(eager, chunk, batched):
    # (3, 7): pieces of two or three prompts share a step and split across steps;
    # (4, 64): whole prompts, several per step.
    slots = TokenSlots(eager, SLOTS, CONTEXT, chunk, batched)
    got = staggered(slots, batched=True)
    assert set(got) == set(PROMPTS)
    for name, tokens in got.items():
        assert len(tokens) == WANTED, name
        assert tokens == alone(eager, prompt(*PROMPTS[name]))[:len(tokens)], (chunk, batched, name)


def test_compiled_steps_generate_the_same_and_never_recompile_after_priming(tiny):
    engine = DecodeEngine(tiny.model, "compile")
    slots = TokenSlots(engine, 2, CONTEXT, 4, 16)
    with torch.inference_mode():
        slots.prime(prompt(6, 9))
    graphs = slots.compiles
    assert graphs == len(slots.buckets()) == 4          # lanes 1, 2; each alone and with a piece
    assert slots.buckets() == (1, 2, 1 + 4, 2 + 4)
    keys = engine.store.layers[0][0].data_ptr()
    got = staggered(slots)
    batched = staggered(slots, batched=True)            # several pieces: eager steps, no graph
    assert set(got) == set(batched) == set(PROMPTS)
    assert slots.compiles == graphs, "an admission, an eviction or an occupancy recompiled a step"
    assert engine.store.layers[0][0].data_ptr() == keys
    reference = DecodeEngine(tiny.model, "eager", check_packing=False)
    for name, tokens in got.items():
        p = prompt(*PROMPTS[name])
        want = alone(reference, p)
        for run in (tokens, batched[name]):
            assert same_or_diverging_at_a_near_tie(reference, p, run, want) is None, (name, run, want)


def same_or_diverging_at_a_near_tie(reference, p, tokens, want) -> str | None:
    """None when `tokens` are `want`, or leave it first where the reference's top two
    logits are within TIE of its largest and `tokens` took the runner-up; else why not."""
    first = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)  # want is longer
    if first is None:
        return None
    if first == 0:
        return "the first token (the prefill's) differs"
    logits = reference.step_logits(p[None], torch.tensor(want[:first])[None], max_len=CONTEXT)[0, first - 1]
    top = logits.topk(2)
    gap = (top.values[0] - top.values[1]).item() / logits.abs().max().item()
    if gap > TIE or tokens[first] != int(top.indices[1]):
        return f"token {first}: {tokens[first]} for {want[first]}, top-2 gap {gap:.4f} of the largest logit"
    return None


def test_a_divergence_counts_only_at_a_near_tie(eager):
    p = prompt(*PROMPTS["d"])
    want = alone(eager, p)
    assert same_or_diverging_at_a_near_tie(eager, p, want[:10], want) is None
    logits = eager.step_logits(p[None], torch.tensor(want[:10])[None], max_len=CONTEXT)[0]
    gaps = [(lg.topk(2).values[0] - lg.topk(2).values[1]).item() / lg.abs().max().item() for lg in logits]
    near = next(i for i, g in enumerate(gaps) if g <= TIE) + 1      # a step the tiny model nearly ties
    wide = next(i for i, g in enumerate(gaps) if g > 5 * TIE) + 1   # and one it does not
    for at, ok in ((near, True), (wide, False)):
        runner_up = int(logits[at - 1].topk(2).indices[1])
        diverged = want[:at] + [runner_up] + want[at + 1:10]
        assert (same_or_diverging_at_a_near_tie(eager, p, diverged, want) is None) is ok, at
    third = int(logits[near - 1].topk(3).indices[2])              # not the runner-up: a wrong token
    assert same_or_diverging_at_a_near_tie(eager, p, want[:near] + [third], want) is not None
    assert same_or_diverging_at_a_near_tie(eager, p, [want[0] + 1] + want[1:10], want) is not None


def test_teacher_forced_logits_match_the_prompt_run_alone(eager):
    slots = TokenSlots(eager, SLOTS, CONTEXT, 4)
    prompts = [prompt(5, 11), prompt(9, 12), prompt(12, 13)]
    forced = [synthetic_prompt(1, 12, VOCAB, seed=20 + i)[0] for i in range(3)]
    want = [eager.step_logits(p[None], f[None], max_len=CONTEXT)[0] for p, f in zip(prompts, forced, strict=True)]
    got: list[list[torch.Tensor]] = [[], [], []]
    held: dict[int, int] = {}

    def step(piece=None):
        # Each held slot is fed its next forced token; its logits are those of that token.
        feed = {slot: int(forced[r][len(got[r])]) for slot, r in held.items()}
        out = slots.step(piece, forced=feed)
        for slot, r in held.items():
            got[r].append(slots.last_logits[slot].float().clone())
        return out

    def admit(slot, r):
        p = prompts[r]
        for start in range(0, p.numel(), 4):
            step(Piece(slot, p, start, min(p.numel(), start + 4), p.numel()))
        held[slot] = r

    admit(2, 0)
    for _ in range(3):
        step()
    admit(0, 1)                                  # comes in, piece by piece, while slot 2 decodes
    admit(1, 2)
    slots.evict(2)
    del held[2]
    for _ in range(6):
        step()
    for r in range(3):
        mine = torch.stack(got[r])
        ref = want[r][:len(mine)]
        assert len(mine) >= 6
        scale = ref.abs().max().item()
        assert (mine - ref).abs().max().item() <= RTOL * scale, r
        assert torch.equal(mine.argmax(-1), ref.argmax(-1)), r
        # the check can fail: logits one position off are far outside the tolerance
        assert (mine[1:] - ref[:-1]).abs().max().item() > RTOL * scale


def test_free_lanes_stay_finite_and_a_step_says_what_it_carried(eager):
    slots = TokenSlots(eager, SLOTS, CONTEXT, 4)
    slots.admit(1, prompt(10, 40))
    for _ in range(3):
        out = slots.step()
        # slot 1 needs lanes 0..1: 2 lanes, or the plan's row padding when it pads more
        assert (out.tokens, out.prompt_tokens, out.bucket) == (1, 0, lanes_for(1, SLOTS, slots.growth))
        assert all(torch.isfinite(v.float()).all() for v in slots.last_logits.values())
    assert [slots.position(s) for s in range(SLOTS)] == [0, 13, 0]
    out = slots.step(Piece(0, prompt(6, 41), 0, 3, 6))
    assert (out.tokens, out.prompt_tokens, out.bucket, out.firsts) == (4, 3, lanes_for(1, SLOTS, slots.growth) + 4, {})
    assert slots.active == [1] and out.compiled   # not in until its last piece
    out = slots.step(Piece(0, prompt(6, 41), 3, 6, 6))
    assert list(out.firsts) == [0] and slots.active == [0, 1]
    slots.reset()
    assert slots.step().decoded == {}


def test_bad_pieces_are_refused_before_anything_runs(eager):
    slots = TokenSlots(eager, SLOTS, CONTEXT, 4, 6)
    slots.admit(0, prompt(4, 50))
    before = slots.position(0)
    p = prompt(6, 51)
    for piece, match in [
        (Piece(0, p, 0, 4, 6), "slot 0 is occupied"),
        (Piece(SLOTS, p, 0, 4, 6), "out of range"),
        ([Piece(1, p, 0, 4, 6), Piece(2, prompt(6, 52), 0, 3, 6)], "exceed batched_tokens 6"),
        ([Piece(1, p, 0, 2, 6), Piece(1, p, 2, 4, 6)], "two pieces in one step"),
        (Piece(1, p, 4, 4, 6), "non-empty"),
        (Piece(1, p, 0, 4, 7), "1-D tensor of its length"),
        (Piece(1, prompt(CONTEXT, 53), 0, 4, CONTEXT), "exceeds max_context"),
    ]:
        with pytest.raises(ValueError, match=match):
            slots.step(piece)
    assert slots.position(0) == before and slots.active == [0]
    slots.admit(2, prompt(CONTEXT - 1, 55))       # room for exactly one step
    assert sorted(slots.step().decoded) == [0, 2]
    with pytest.raises(ValueError, match=r"slots \[2\] are at max_context"):
        slots.step()
    slots.evict(2)
    assert list(slots.step().decoded) == [0]


def test_buckets_and_the_default_chunk():
    assert decode_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_buckets(3) == (1, 2, 3) and decode_buckets(1) == (1,)
    assert [lanes_for(s, 16) for s in (0, 1, 2, 3, 4, 7, 8, 15)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert decode_buckets(16, 4) == (1, 4, 16) and decode_buckets(20, 4) == (1, 4, 16, 20)
    assert [lanes_for(s, 16, 4) for s in (0, 1, 3, 4, 15)] == [1, 4, 4, 16, 16]
    # 7.5 GB read at 30 GB/s is a 0.25 s floor; 2.4 TFLOP/s fills it with 80 tokens of 3.75 B params
    assert chunk_tokens_for(7_500_000_000, 30.0, 2.4) == 80
    assert chunk_tokens_for(7_500_000_000, 30.0, 0.3) == 16          # compute-poor: the floor
    assert chunk_tokens_for(7_500_000_000, 10.0, 40.0) == 512        # clamped
    assert chunk_tokens_for(7_500_000_000, None, 2.4) == 64          # no probe: the default
    # the decode-linears curve: flat to 16 rows (noise within 10 % of the best so far), then not
    rows, gbs = (1, 2, 4, 8, 16, 32, 64), (12.2, 10.9, 11.5, 12.0, 11.9, 7.8, 7.1)
    assert free_rows(rows, gbs) == 16
    assert chunk_for_probes(7_500_000_000, 30.0, 2.4, rows, gbs) == 16     # the kernel overrules the model
    assert chunk_for_probes(7_500_000_000, 30.0, 2.4, rows, (30,) * 7) == 80   # flat to its end: the balance
    assert chunk_for_probes(7_500_000_000, 30.0, 0.3, rows, (30,) * 7) == 64   # ... or the curve, if larger
    assert chunk_for_probes(7_500_000_000, 30.0, 2.4, None, None) == 80
    assert free_rows((1, 2), (10.0, 5.0)) == 1 and chunk_for_probes(1, 30.0, 2.4, (1, 2), (10.0, 5.0)) == 16


def test_a_chunk_per_lane_count_primes_its_own_graphs_and_times_its_steps(tiny):
    """The SLO rule's chunks: one per lane count, each lane count's piece graph at its own
    chunk; timing the decode steps before priming and the piece steps after compiles
    nothing the windows would not, and admission keeps to the next step's chunk."""
    engine = DecodeEngine(tiny.model, "compile")
    slots = TokenSlots(engine, 2, CONTEXT, 4, 16)
    assert slots.rule == "kernel" and not slots.capped and slots.step_chunk() == 4
    with pytest.raises(ValueError, match="every lane count"):
        slots.set_chunks({1: 8}, "slo:tpot<=100ms")
    with pytest.raises(ValueError, match="exceed batched_tokens"):
        slots.set_chunks({1: 32, 2: 4}, "slo:tpot<=100ms")
    slots.set_chunks({1: 8, 2: 4}, "slo:tpot<=100ms")
    assert slots.chunk_tokens == 8 and slots.capped and slots.buckets() == (1, 2, 1 + 8, 2 + 4)
    p = prompt(6, 9)
    with torch.inference_mode():
        decode = slots.time_steps(p)
        assert set(decode) == {1, 2} and all(v > 0 for v in decode.values())
        slots.prime(p)
        graphs = slots.compiles
        assert graphs == len(slots.buckets()) == 4
        pieces = slots.time_steps(p, pieces=True)
        assert set(pieces) == {1, 2} and slots.compiles == graphs
        assert slots.free() == [0, 1]
        first = slots.admit(1, prompt(12, 4))                 # 12 tokens at one lane: 8 + 4
        assert slots.step_chunk() == 4                          # slot 1 busy: two lanes
        out = slots.step(Piece(0, prompt(9, 2), 0, 4, 9))
        assert out.compiled and out.bucket == 2 + 4 and 1 in out.decoded
    assert first is not None and slots.compiles == graphs
