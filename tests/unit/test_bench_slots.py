"""Continuous batching on the tiny model: every slot computes what its prompt computes alone
(greedy tokens and teacher-forced logits, requests joining and leaving at different times),
one compiled graph whatever the occupancy, free slots stay finite, and admission errors.

The reference is DecodeEngine at batch 1 with the slots' context as its cache length, in
the same mode. Tolerance: teacher-forced logits within 0.02 of the largest logit (what the
engine's batch-4 vs batch-1 prefill test allows) and every top-1 equal; free-running greedy
tokens must be equal. Both hold exactly on this CPU: a slot row goes through the same
kernels as a lone stream (the packed linear computes each row alike, and the mask and key
length match), so the logits are bit-identical. On another kernel plan a row's rounding may
depend on the row count (dense-bf16 turns GEMVs into an SGEMM above 4 rows); the 0.02 then
still separates a right answer from a wrong position (logits one step off fail it, tested),
while exact tokens are asked of the tiny model only, whose top-2 gaps are wide.

Each mode builds one SlotEngine (one graph) for the module; tests reset it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vcfslm.bench.engine import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.bench.slots import SlotEngine  # noqa: E402

SLOTS = 3
CONTEXT = 40
VOCAB = 16384
RTOL = 0.02


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
    from vcfslm.bench.model import load_model

    return load_model("synthetic:tiny", seed=0, max_context=64)


@pytest.fixture(scope="module", params=["eager", "compile"])
def pair(request, tiny):
    engine = DecodeEngine(tiny.model, request.param)
    return engine, SlotEngine(engine, SLOTS, CONTEXT)


def prompt(length, seed):
    return synthetic_prompt(1, length, VOCAB, seed)[0]


def column_major(tokens):
    """[1, n] forced tokens whose [:, i:i+1] slices look like generate's tokens to the graph.

    step_logits feeds forced[:, i:i+1]; the compiled step (dynamic=False) guards on
    strides and on inference-ness, so a plain row's slices (stride n, a normal tensor)
    would compile a second graph for the reference. An inference tensor laid out
    column-major has [1, 1] slices of stride 1, as generate's tokens are.
    """
    with torch.inference_mode():
        return tokens.view(-1, 1).clone().t()


def alone(engine, p):
    """The prompt's greedy tokens at batch 1, cache length CONTEXT (one graph for every prompt)."""
    return engine.generate(p[None], CONTEXT - p.numel()).tokens[0].tolist()


def test_staggered_slots_generate_what_each_prompt_generates_alone(pair):
    engine, slots = pair
    slots.reset()
    prompts = {"a": prompt(5, 1), "b": prompt(9, 2), "c": prompt(5, 3), "d": prompt(12, 4),
               "e": prompt(4, 5)}
    want = {name: alone(engine, p) for name, p in prompts.items()}
    got: dict[str, list[int]] = {}
    held: dict[int, str] = {}

    def admit(*pairs):
        firsts = slots.admit([(slot, prompts[name]) for slot, name in pairs])
        for (slot, name), first in zip(pairs, firsts, strict=True):
            held[slot] = name
            got[name] = [first]

    def run(steps):
        for _ in range(steps):
            out = slots.step()
            assert sorted(out) == sorted(held)
            for slot, token in out.items():
                got[held[slot]].append(token)

    def evict(slot):
        slots.evict(slot)
        del held[slot]

    admit((0, "a"), (2, "c"))           # equal lengths: one prefill batch
    run(1)
    warm = slots.compiles
    run(2)
    admit((1, "b"))                     # joins two running slots
    run(4)
    evict(0)
    assert slots.active == [1, 2] and slots.free() == [0]
    run(2)
    admit((0, "d"))                     # a freed slot, re-used by a longer prompt
    run(5)
    evict(1)
    admit((1, "e"))                     # shorter than b: b's stale rows 4..19 stay masked
    run(6)
    evict(2)
    run(3)
    assert slots.position(1) == 4 + 9
    assert slots.compiles == warm, "an admit, evict or occupancy change recompiled the step"
    if engine.mode == "compile":
        assert warm >= 1
    for name, tokens in got.items():
        assert len(tokens) > 1
        assert tokens == want[name][:len(tokens)], name


def test_teacher_forced_logits_match_the_prompt_run_alone(pair):
    engine, slots = pair
    slots.reset()
    prompts = [prompt(5, 11), prompt(9, 12), prompt(12, 13)]
    forced = [synthetic_prompt(1, 12, VOCAB, seed=20 + i)[0] for i in range(3)]
    want = [engine.step_logits(p[None], column_major(f), max_len=CONTEXT)[0]
            for p, f in zip(prompts, forced, strict=True)]
    got: list[list[torch.Tensor]] = [[], [], []]
    held: dict[int, int] = {}

    def run(steps):
        for _ in range(steps):
            slots.step({slot: int(forced[r][len(got[r])]) for slot, r in held.items()})
            for slot, r in held.items():
                got[r].append(slots.last_logits[slot].float().clone())

    slots.admit([(2, prompts[0])])
    held[2] = 0
    run(3)
    slots.admit([(0, prompts[1]), (1, prompts[2])])
    held.update({0: 1, 1: 2})
    run(4)
    slots.evict(2)
    del held[2]
    run(8)
    for r in range(3):
        mine = torch.stack(got[r])
        ref = want[r][:len(mine)]
        scale = ref.abs().max().item()
        assert (mine - ref).abs().max().item() <= RTOL * scale, r
        assert torch.equal(mine.argmax(-1), ref.argmax(-1)), r
        # the check can fail: logits one position off are far outside the tolerance
        assert (mine[1:] - ref[:-1]).abs().max().item() > RTOL * scale


def test_no_recompile_at_any_occupancy_and_reset_keeps_the_graph(pair):
    engine, slots = pair
    slots.reset()
    slots.admit([(1, prompt(6, 30))])
    slots.step()  # warm-up (compiles once per mode and shape, at most)
    warm = slots.compiles
    keys = slots._cache.layers[0].keys.data_ptr()
    slots.admit([(0, prompt(3, 31)), (2, prompt(7, 32))])
    slots.step()                                   # full
    for slot in (0, 1, 2):                         # two, one, none occupied
        slots.evict(slot)
        assert sorted(slots.step()) == slots.active
    assert slots.active == [] and slots.step() == {}  # nothing to decode: nothing runs
    slots.reset()
    assert slots.free() == [0, 1, 2] and slots.active == []
    slots.admit([(2, prompt(8, 33))])
    assert list(slots.step()) == [2]
    assert slots.compiles == warm
    assert slots._cache.layers[0].keys.data_ptr() == keys


def test_free_slots_stay_finite_and_at_position_zero(pair):
    engine, slots = pair
    slots.reset()
    slots.admit([(1, prompt(10, 40))])
    for _ in range(3):
        slots.step()
        assert torch.isfinite(slots.last_logits.float()).all()
    assert [slots.position(s) for s in range(SLOTS)] == [0, 13, 0]
    assert slots._cache.positions.tolist() == [0, 13, 0]


@pytest.fixture()
def eager_slots(tiny):
    return SlotEngine(DecodeEngine(tiny.model, "eager"), SLOTS, CONTEXT)


def test_admit_rejects_occupied_slots_and_prompts_past_the_context(eager_slots):
    slots = eager_slots
    slots.admit([(0, prompt(4, 50))])
    with pytest.raises(ValueError, match="slot 0 is occupied"):
        slots.admit([(0, prompt(4, 51))])
    with pytest.raises(ValueError, match="slot 1 is occupied"):
        slots.admit([(1, prompt(4, 51)), (1, prompt(5, 52))])
    with pytest.raises(ValueError, match="out of range"):
        slots.admit([(SLOTS, prompt(4, 51))])
    with pytest.raises(ValueError, match="exceeds max_context"):
        slots.admit([(2, prompt(CONTEXT, 53))])
    with pytest.raises(ValueError, match="exceeds max_context"):  # a bad request admits none
        slots.admit([(1, prompt(4, 54)), (2, prompt(CONTEXT, 53))])
    assert slots.active == [0]
    slots.admit([(2, prompt(CONTEXT - 1, 55))])  # room for exactly one step
    assert sorted(slots.step()) == [0, 2]
    with pytest.raises(ValueError, match=r"slots \[2\] are at max_context"):
        slots.step()
    slots.evict(2)
    assert list(slots.step()) == [0]


def test_release_drops_the_cache_and_admits_again(eager_slots):
    slots = eager_slots
    first = slots.admit([(0, prompt(6, 60))])
    slots.release()
    assert slots._cache is None and slots.active == []
    assert slots.admit([(0, prompt(6, 60))]) == first
    assert list(slots.step()) == [0]
