"""The serving half of the rank worker: vcfslm's own engine under the continuous-batching
scheduler (serve/scheduler.py), a driver of the window loop (bench/windows.py), which runs
its windows and sweep through bench/rank.serve_windows.
"""

from __future__ import annotations

import random
from typing import Any

from ..serve.scheduler import record_fields, run_window
from ..serving.decisions import ServeSpec
from .windows import Window


class SlotDriver:
    """The in-process backend (a bench/windows.WindowDriver): vcfslm's own engine (TokenSlots)
    under serve/scheduler.py's scheduler, at the spec's loads judged by `limits`.

    chunk_tokens: the most prompt tokens a step takes beside running streams (the spec's, else
    the probes'); batched_tokens: under a backlog (the worker's, at least the chunk).
    gate: (prompt, forced tokens, the unpacked model's logits on them or None), 1-D, 1-D and
    [1, steps, vocab]: priming then gates every slot graph it compiles (`gates`, one per
    graph), the one-lane decode also against the unpacked model. None: no gate.
    slo: (the tightest TPOT limit in ms, the rank's StepCost without decode times) for the
    SLO rule: the decode step is timed at each lane count, each lane count's chunk is what
    fits under the limit (engine.decode.slo_chunks), and after priming a step with each
    chunk is timed against its estimate (`sizing`). None: `chunk_tokens` for every step."""

    def __init__(self, engine, spec: ServeSpec, vocab: int, chunk_tokens: int, batched_tokens: int,
                 gate: tuple | None = None, slo: tuple | None = None, limits: dict[str, Any] | None = None):
        from ..engine.decode import synthetic_prompt
        from ..engine.numerics import slot_gates
        from ..engine.slots import TokenSlots

        engine.release()                  # a static store and its graph are not used here
        self.slots = TokenSlots(engine, spec.slots, spec.max_context, chunk_tokens, batched_tokens)
        self.spec, self.limits = spec, limits or {}
        self.vocab, self._prompt = vocab, synthetic_prompt
        self.sizing: dict[str, Any] = {}
        sample = synthetic_prompt(1, min(spec.input_tokens), vocab, seed=spec.seed + 11)[0]
        if slo is not None:
            self._size_chunks(sample, *slo)
        # Compile every token count before any window (a compile inside one marks it invalid),
        # and gate each graph on the way.
        if gate is None:
            self.slots.prime(sample)
            self.gates = []
        else:
            prompt, forced, reference = gate
            self.gates = slot_gates(self.slots.prime(prompt, forced), reference)
        if slo is not None:
            measured = self.slots.time_steps(sample, pieces=True)
            self.sizing["piece_step_s"] = {str(k): round(v, 4) for k, v in measured.items()}

    def _size_chunks(self, sample, tpot_limit_ms: float, cost) -> None:
        """The SLO rule's chunks, from decode steps timed on this engine at each lane count."""
        from dataclasses import replace

        from ..engine.step_cost import SLO_MARGIN, chunk_rule, slo_chunks

        cost = replace(cost, decode_s=self.slots.time_steps(sample))
        chunks = slo_chunks(cost, tpot_limit_ms, most=self.slots.batched_tokens)
        self.slots.set_chunks(chunks, chunk_rule(tpot_limit_ms))
        self.sizing = {"rule": self.slots.rule, "margin": SLO_MARGIN, "chunks": {str(k): v for k, v in chunks.items()},
                       "decode_step_s": {str(k): round(v, 4) for k, v in cost.decode_s.items()},
                       "estimated_step_s": {str(k): round(cost.step_s(k, v), 4) for k, v in chunks.items()}}

    @property
    def compiles(self) -> int:
        return self.slots.compiles

    def window(self, w: Window) -> tuple[dict[str, Any], list[str]]:
        _, load, input_tokens, _ = w.scenario

        def prompt_for(req):
            return self._prompt(1, req.input_tokens, self.vocab, seed=w.seed + req.index)[0]

        outcome = run_window(self.slots, self.spec, load, input_tokens, random.Random(w.seed), prompt_for)
        return record_fields(outcome, self.spec, self.limits), []

    def rss(self) -> tuple[int, int]:
        """(peak, current) resident bytes of the replica: this process."""
        from ..engine.decode import current_rss_bytes, peak_rss_bytes

        return peak_rss_bytes(), current_rss_bytes()

    def stop(self) -> None:
        self.slots.release()
