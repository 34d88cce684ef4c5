"""The serving slots on the engine (`TokenSlots`): streams decoding together in the rows of
one KV store, prompts admitted in pieces that ride on the decode steps, every step shape
compiled before a window (`prime`, also the numerics gate's run) and timed for the SLO
rule (`time_steps`). The step itself is `DecodeEngine.run_step` (vcfslm.engine.decode)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..serving.decisions import Piece
from .decode import DecodeEngine, PromptPieces
from .step_cost import decode_buckets, lanes_for


@dataclass
class StepOut:
    """One serving step: each decoding slot's next token, the first token of each request
    whose prompt's last piece this step took, and what the step carried."""

    decoded: dict[int, int]
    firsts: dict[int, int]    # slot -> first token, for the prompts this step completed
    tokens: int               # real tokens (decodes + prompt), not the padding
    prompt_tokens: int
    bucket: int               # the token count it ran at
    compiled: bool = True     # a primed graph (False: an eager step of several or long pieces)
    lanes: int = 0            # the decode lanes it ran at (over the highest occupied slot)


class TokenSlots:
    """Serving on the engine: `slots` streams decoding together, prompts admitted in pieces
    that ride on the decode steps.

    A step takes either one piece of at most `chunk_tokens` (padded to it: a primed graph),
    or several pieces of up to `batched_tokens` prompt tokens together (an eager step of
    their exact token count; at that size the step is the pieces' GEMMs, which eager runs
    as fast). A piece writes its K/V straight into its slot's row; the slot decodes from
    the step that takes its prompt's last piece. The store has slots + 1 rows: the slots
    and a junk row (what free lanes and padding write). A slot's context is `max_context`
    (prompt plus generated tokens).
    """

    def __init__(self, engine: DecodeEngine, slots: int, max_context: int, chunk_tokens: int,
                 batched_tokens: int | None = None, *, chunks: dict[int, int] | None = None,
                 rule: str = "kernel"):
        batched_tokens = chunk_tokens if batched_tokens is None else batched_tokens
        if slots < 1 or max_context < 2 or chunk_tokens < 1:
            raise ValueError("slots and chunk_tokens must be >= 1 and max_context >= 2")
        if batched_tokens < chunk_tokens:
            raise ValueError(f"batched_tokens {batched_tokens} < chunk_tokens {chunk_tokens}")
        window = getattr(engine.model.config, "sliding_window", None)
        if window is not None and window < max_context:
            raise ValueError(f"sliding window {window} < max_context {max_context}: "
                             "the engine supports full attention only")
        self.engine, self.slots, self.max_context = engine, slots, max_context
        self.chunk_tokens, self.batched_tokens = chunk_tokens, batched_tokens
        self.junk = slots
        self.growth = max(2, engine.plan.min_rows)
        self.chunks: dict[int, int] = {}     # lane count -> its chunk (set_chunks); else chunk_tokens
        self.rule = rule
        if chunks:
            self.set_chunks(chunks, rule)
        self._length = [0] * slots           # each slot's next position (0: free)
        self._occupied = [False] * slots
        self._last = [0] * slots             # each occupied slot's last token
        self.last_logits: dict[int, torch.Tensor] = {}
        self.twin_logits: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None

    @property
    def compiles(self) -> int:
        return self.engine.compiles

    @property
    def active(self) -> list[int]:
        return [i for i, used in enumerate(self._occupied) if used]

    def free(self) -> list[int]:
        return [i for i, used in enumerate(self._occupied) if not used]

    def position(self, slot: int) -> int:
        return self._length[slot]

    def set_chunks(self, chunks: dict[int, int], rule: str) -> None:
        """A chunk per lane count (the SLO rule's: more room beside fewer decodes), before
        priming; `chunk_tokens` becomes the largest. rule: how they were chosen (records)."""
        lanes = decode_buckets(self.slots, self.growth)
        missing = [n for n in lanes if n not in chunks]
        if missing or any(v < 1 for v in chunks.values()):
            raise ValueError(f"chunks {chunks} must give every lane count {lanes} at least 1 token")
        if max(chunks.values()) > self.batched_tokens:
            raise ValueError(f"chunks {chunks} exceed batched_tokens {self.batched_tokens}")
        self.chunks = {n: int(chunks[n]) for n in lanes}
        self.chunk_tokens, self.rule = max(self.chunks.values()), rule

    def chunk_at(self, lanes: int) -> int:
        """The prompt tokens a primed step at `lanes` decode lanes takes (its graph's piece)."""
        return self.chunks.get(lanes, self.chunk_tokens)

    @property
    def capped(self) -> bool:
        """Under the SLO rule every step beside running decodes keeps to its lanes' chunk,
        a backlog's too (the scheduler's plan_pieces)."""
        return self.rule.startswith("slo:")

    def step_chunk(self) -> int:
        """The chunk of the next step (its lanes: over the highest occupied slot)."""
        active = self.active
        return self.chunk_at(lanes_for(max(active), self.slots, self.growth) if active else 1)

    @property
    def budget(self) -> int:
        """The most tokens one step carries: every slot's decode and the batched pieces."""
        return self.slots + self.batched_tokens

    def buckets(self) -> tuple[int, ...]:
        """Every token count a primed graph runs at: the decode lanes alone, and the lanes
        with one chunk (a piece shorter than the chunk is padded to it)."""
        lanes = decode_buckets(self.slots, self.growth)
        return (*lanes, *(n + self.chunk_at(n) for n in lanes))

    @torch.inference_mode()
    def step(self, pieces: Piece | list[Piece] | tuple[Piece, ...] | None = None,
             forced: dict[int, int] | None = None, *, twin: bool = False, eager: bool = False) -> StepOut:
        """One step: every occupied slot decodes a token; pieces of prompts ride along.

        forced: feed these tokens to the listed slots instead of their last ones (teacher
        forcing, for numerics checks). twin: a primed step also runs eagerly on the same
        inputs, and `twin_logits` keeps (graph, compiled, eager) logits of its real tokens
        (the busy lanes, then the pieces), for the numerics gate. Nothing runs when no slot
        is occupied and no piece is given. eager: run pieces eagerly at their exact size
        (no graph: for measuring before the piece graphs exist)."""
        pieces = [] if pieces is None else [pieces] if isinstance(pieces, Piece) else list(pieces)
        self._check_pieces(pieces)
        active = self.active
        if not pieces and not active:
            return StepOut({}, {}, 0, 0, 0)
        full = [s for s in active if self._length[s] >= self.max_context]
        if full:
            raise ValueError(f"slots {full} are at max_context {self.max_context}: evict them first")
        for slot, token in (forced or {}).items():
            if not self._occupied[slot]:
                raise ValueError(f"slot {slot} is free")
            self._last[slot] = token
        self.engine.store_for(self.slots + 1, self.max_context)
        lanes = lanes_for(max(active), self.slots, self.growth) if active else 1
        sizes = [p.stop - p.start for p in pieces]
        prompt = sum(sizes)
        chunk = self.chunk_at(lanes)
        primed = len(pieces) <= 1 and prompt <= chunk and not (eager and pieces)
        total = lanes + (0 if not pieces else chunk if primed else prompt)
        tokens = torch.zeros(1, total, dtype=torch.long)
        positions = torch.zeros(1, total, dtype=torch.long)
        rows = torch.full((total,), self.junk, dtype=torch.long)
        live = torch.zeros(lanes, dtype=torch.bool)
        for s in active:
            tokens[0, s], positions[0, s], rows[s], live[s] = self._last[s], self._length[s], s, True
        keep = list(range(lanes))
        spans, offset = [], 0
        for piece, n in zip(pieces, sizes, strict=True):
            at = lanes + offset
            tokens[0, at:at + n] = piece.prompt[piece.start:piece.stop]
            positions[0, at:at + n] = torch.arange(piece.start, piece.stop)
            rows[at:at + n] = piece.slot
            keep.append(at + n - 1)
            # A primed step's one span covers the padding too (it sees key 0 of the row).
            spans.append((offset, chunk if primed else n))
            offset += n
        flat_pieces = (PromptPieces(torch.tensor([p.slot for p in pieces], dtype=torch.long), tuple(spans))
                       if pieces else None)
        nxt, logits = self.engine.run_step(tokens, positions, rows, live, torch.tensor(keep), lanes=lanes,
                                           pieces=flat_pieces, eager=not primed)
        if twin and primed:
            # The eager twin rewrites the same K/V at the same places: the next step sees
            # one history whichever ran last.
            _, again = self.engine.run_step(tokens, positions, rows, live, torch.tensor(keep), lanes=lanes,
                                            pieces=flat_pieces, eager=True)
            real = torch.tensor([*active, *range(lanes, lanes + len(pieces))], dtype=torch.long)
            graph = (lanes, chunk if pieces else 0)
            self.twin_logits = (graph, logits[real].float().clone(), again[real].float().clone())
        values = nxt.tolist()
        decoded, firsts = {}, {}
        self.last_logits = {}
        for s in active:
            decoded[s] = self._last[s] = values[s]
            self._length[s] += 1
            self.last_logits[s] = logits[s]
        for j, piece in enumerate(pieces):
            if piece.last:
                firsts[piece.slot] = self._last[piece.slot] = values[lanes + j]
                self._occupied[piece.slot], self._length[piece.slot] = True, piece.length
                self.last_logits[piece.slot] = logits[lanes + j]
        return StepOut(decoded, firsts, len(active) + prompt, prompt, total, primed, lanes)

    def _check_pieces(self, pieces: list[Piece]) -> None:
        seen = set()
        for piece in pieces:
            self._check_piece(piece)
            if piece.slot in seen:
                raise ValueError(f"slot {piece.slot}: two pieces in one step")
            seen.add(piece.slot)
        prompt = sum(p.stop - p.start for p in pieces)
        if prompt > self.batched_tokens:
            raise ValueError(f"{len(pieces)} pieces of {prompt} tokens exceed batched_tokens {self.batched_tokens}")

    def _check_piece(self, piece: Piece) -> None:
        if not 0 <= piece.slot < self.slots:
            raise ValueError(f"slot {piece.slot} out of range 0..{self.slots - 1}")
        if self._occupied[piece.slot]:
            raise ValueError(f"slot {piece.slot} is occupied")
        length = piece.length
        if piece.prompt.dim() != 1 or length < 1 or piece.prompt.numel() != length:
            raise ValueError(f"slot {piece.slot}: prompt must be a non-empty 1-D tensor of its length")
        if length + 1 > self.max_context:
            raise ValueError(f"slot {piece.slot}: prompt of {length} tokens + 1 exceeds "
                             f"max_context {self.max_context}")
        if not 0 <= piece.start < piece.stop <= length:
            raise ValueError(f"slot {piece.slot}: piece [{piece.start}, {piece.stop}) of a {length}-token "
                             "prompt must be non-empty and inside it")

    def admit(self, slot: int, prompt: torch.Tensor) -> int:
        """Admit a whole prompt into a free slot in chunks, each riding on a step that decodes
        the occupied slots; its first greedy token. For checks and priming, not windows."""
        first, length, start = None, prompt.numel(), 0
        while start < length:
            stop = min(length, start + self.step_chunk())
            first = self.step(Piece(slot, prompt, start, stop, length)).firsts.get(slot, first)
            start = stop
        return first

    def evict(self, slot: int) -> None:
        """Free the slot; its rows are left as they are (its lane's mask hides them)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range 0..{self.slots - 1}")
        self._occupied[slot] = False
        self._length[slot] = 0

    def reset(self) -> None:
        """All slots free; the store (same addresses) and the compiled graphs are kept."""
        self._occupied = [False] * self.slots
        self._length = [0] * self.slots

    def prime(self, prompt: torch.Tensor, forced: torch.Tensor | None = None
              ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """Compile every bucket before a window: at each lane count a decode step and a step
        with a prompt piece (one that does not finish its prompt), then all slots free.
        (Batched steps run eagerly: nothing to compile.)

        Lane count b is reached with slot b-1 alone busy, so a slot below it is free for
        the piece (with one slot, the admission's own pieces ran at one lane).

        forced: 1-D teacher-forced tokens; with them priming is also the numerics gate's
        run (the compiles the windows need, nothing more): at each lane count the busy slot
        decodes each forced token, alone and then beside a piece, and every primed step runs
        its eager twin. Returned, per graph (lanes, piece tokens: 0 or the chunk), the
        logits of its real tokens, compiled and eager, [positions, vocab] each; lane count
        1's are slot 0's forced decode, position by position. The prompt and the forced
        tokens must then fit (slot_gate_fit); without forced the prompt is cut to fit."""
        gate = forced is not None
        steps = forced.numel() if gate else 1
        room = self.max_context - 1 - 2 * steps
        if gate and (forced.dim() != 1 or steps < 1 or not 1 <= prompt.numel() <= room):
            raise ValueError(f"a {prompt.numel()}-token prompt and {steps} forced tokens do not fit "
                             f"max_context {self.max_context} (slot_gate_fit)")
        prompt = prompt[: max(1, min(prompt.numel(), room))]
        probe = prompt[:2] if prompt.numel() >= 2 else torch.cat([prompt, prompt])
        feeds = [None] if not gate else [[int(t)] for t in forced]
        pairs: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

        def run(slot: int, piece: Piece | None = None, feed: list[int] | None = None) -> None:
            out = self.step(piece, forced=None if feed is None else {slot: feed[0]}, twin=gate)
            if gate and out.compiled and out.bucket:
                graph, compiled, eager = self.twin_logits
                pairs.setdefault(graph, []).append((compiled, eager))

        for bucket in decode_buckets(self.slots, self.growth):
            self.reset()
            slot = bucket - 1
            # Nothing is occupied while slot b-1's prompt goes in: one-lane steps.
            for start in range(0, prompt.numel(), self.chunk_at(1)):
                run(slot, Piece(slot, prompt, start, min(prompt.numel(), start + self.chunk_at(1)),
                                prompt.numel()))
            for feed in feeds:
                run(slot, None, feed)
            free = self.free()
            if free:
                for feed in feeds:
                    run(slot, Piece(free[0], probe, 0, 1, 2), feed)
        self.reset()
        self.twin_logits = None
        return {graph: (torch.cat([c for c, _ in got]), torch.cat([e for _, e in got]))
                for graph, got in pairs.items()}

    def time_steps(self, prompt: torch.Tensor, *, pieces: bool = False, repeats: int = 3) -> dict[int, float]:
        """Per lane count, the median of `repeats` steps (seconds), after one untimed step
        (a decode graph not yet compiled compiles in it): decode steps, or with `pieces` a
        decode step with a primed piece of the lanes' chunk (after prime). The lane count is
        reached with slot b-1 busy, its prompt put in by eager steps; all slots free
        after. The SLO rule's decode times and the check of its estimate."""
        room = self.max_context - 2 - (repeats + 1)
        prompt = prompt[: max(1, min(prompt.numel(), room))]
        probe = prompt[:2] if prompt.numel() >= 2 else torch.cat([prompt, prompt])
        out = {}
        for lanes in decode_buckets(self.slots, self.growth):
            self.reset()
            slot = lanes - 1
            # The prompt goes in by eager steps of at most the batched budget (a workload's
            # longest prompt can be longer than one step takes).
            for start in range(0, prompt.numel(), self.batched_tokens):
                stop = min(prompt.numel(), start + self.batched_tokens)
                self.step(Piece(slot, prompt, start, stop, prompt.numel()), eager=True)
            free = self.free()
            if pieces and not free:
                continue
            times = []
            for _ in range(repeats + 1):
                piece = Piece(free[0], probe, 0, 1, 2) if pieces else None
                started = time.perf_counter()
                self.step(piece)
                times.append(time.perf_counter() - started)
            times = sorted(times[1:])
            out[lanes] = times[len(times) // 2]
        self.reset()
        return out

    def release(self) -> None:
        """Drop the store and every compiled graph (like DecodeEngine.release)."""
        self.reset()
        self.last_logits = {}
        self.engine.release()


def slot_gate_fit(prompt_tokens: int, steps: int, max_context: int) -> tuple[int, int]:
    """The (prompt tokens, forced steps) of a slot gate within `max_context` (pure): the
    gate's slot decodes `steps` tokens alone and `steps` beside a piece after its prompt,
    and keeps one position spare; steps shrink only when a 1-token prompt does not fit."""
    steps = max(0, min(steps, (max_context - 2) // 2))
    return max(1, min(prompt_tokens, max_context - 1 - 2 * steps)), steps
