"""The numerics gate: does every compiled graph compute what the model computes?

Every graph a window runs is gated before that graph's first window, by the run that
compiles it (no compile of its own): a static scenario's decode step (its batch rows at
its cache length) in the worker's scenario loop, and each of the serving slot step's
graphs (lane count, alone or with a prompt piece) while TokenSlots.prime compiles them.
A short teacher-forced sequence goes through the compiled graph and through the same
packed modules eagerly, and their logits are compared position by position. Teacher
forcing feeds both the same tokens, so the comparison is exact up to rounding;
free-running greedy tokens would diverge on near-ties (random weights have top-2 logit
gaps of ~0.1) and prove nothing.

Compiled against eager on the same packed modules cannot see a packing bug, so the gate
also compares against the unpacked model: `reference_logits`, transformers' own eager
forward over the same prompt and forced tokens, taken before the engine packs the weights
(a replica cannot hold two copies). Its first rows are compared at every static shape
(they do not depend on the shape) and with the slot step's one-lane decode.

The tolerance is stated, not tuned per run: the largest logit difference may be at most
`rtol` of the largest eager logit (bf16 keeps 8 bits of mantissa; fused kernels round
in another order, and the difference grows with depth), and the top-1 token must agree
at `min_top1` of the positions. Measured on the Phi-3-mini shape with random weights: a
correct compiled step differs by 0.025 of the largest logit with 8 layers and 0.053 with
32; decode positions off by one differ by 0.60 and 0.86, and logits one step off by 1.25.
0.15 sits ~3x above the first and ~4x below the second.

A top-1 flip counts against the step only beyond a near-tie: where the compared side's top
token is more than `tie` of the largest logit below the other side's top, in the other
side's own logits. Two tokens closer than that can swap places by rounding alone (each
moves by up to ~0.05 of the largest logit at 32 layers), and random weights put the top
two that close at most positions: on a 2-core AVX2 EPYC, the full shape's batch-16 graph
flipped 5 of 16 reference positions with its largest difference at 0.056, well within
`rtol`, and failed on flips alone. The raw agreement is still recorded beside it.

A failed gate does not stop the run: the windows of that graph are recorded as invalid
with the gate's reason (a serving window runs every slot graph, so a failed slot graph
invalidates every serving window of the rank), and the report names the rank
(vcfslm/verdicts.py writes that reason and recognises it again for the report).

With real weights (a model folder or hub id that has a tokenizer) the rank also records
a short greedy continuation of a fixed prompt as text: a person can read whether the
replica is the model it claims to be, which no logit comparison can tell.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..verdicts import numerics_gate_failed

DEFAULT_RTOL = 0.15
DEFAULT_MIN_TOP1 = 0.75
# A top-1 flip whose two tokens are within this share of the largest logit is a near-tie:
# about twice what a correct step moves a logit at 32 layers (0.053).
DEFAULT_TIE = 0.1
DEFAULT_STEPS = 8
# The gate's prompt, and the rows of the unpacked model's reference: a few seconds on a
# full Phi-3-mini, before the engine packs it.
GATE_PROMPT_TOKENS = 8
REFERENCE_ROWS = 2
GREEDY_PROMPT = "The capital of France is"
GREEDY_TOKENS = 16


@dataclass(frozen=True)
class GateResult:
    """The outcome of comparing compiled with eager logits."""

    passed: bool
    steps: int
    batch: int
    max_abs_diff: float
    max_rel_diff: float
    top1_agreement: float
    top1_beyond_ties: float           # with near-tie flips counted as agreeing: the one judged
    rtol: float
    min_top1: float
    tie: float
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def invalid_reason(self) -> str | None:
        """The reason the compared graph's windows are invalid, None when the gate passed."""
        return None if self.passed else numerics_gate_failed(self.reason)


def compare_logits(compiled, eager, *, rtol: float = DEFAULT_RTOL, min_top1: float = DEFAULT_MIN_TOP1,
                   tie: float = DEFAULT_TIE) -> GateResult:
    """Compare two float logit tensors [batch, steps, vocab] against the stated tolerance."""
    if tuple(compiled.shape) != tuple(eager.shape):
        return GateResult(False, 0, 0, math.inf, math.inf, 0.0, 0.0, rtol, min_top1, tie,
                          f"shape {tuple(compiled.shape)} != eager {tuple(eager.shape)}")
    batch, steps = int(eager.shape[0]), int(eager.shape[1])
    diff = (compiled - eager).abs()
    max_abs = float(diff.max())
    scale = float(eager.abs().max()) or 1.0
    rel = max_abs / scale
    picked = compiled.argmax(-1)
    same = picked == eager.argmax(-1)
    top1 = float(same.float().mean())
    # How far below eager's own top the compiled step's pick sits, in eager's logits.
    behind = eager.amax(-1) - eager.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
    beyond_ties = float((same | (behind <= tie * scale)).float().mean())
    problems = []
    if not math.isfinite(max_abs) or not rel <= rtol:
        problems.append(f"max logit difference {max_abs:.4g} is {rel:.3g} of the largest logit "
                        f"(tolerance {rtol})")
    if not beyond_ties >= min_top1:
        problems.append(f"top-1 agreement {beyond_ties:.2f} < {min_top1} (flips within {tie} of the largest "
                        f"logit counted as ties; {top1:.2f} without)")
    return GateResult(not problems, steps, batch, max_abs, rel, top1, beyond_ties, rtol, min_top1, tie,
                      "; ".join(problems))


@dataclass(frozen=True)
class GraphGate:
    """One compiled graph's gate: compiled against eager on the same packed modules, and
    (where a reference was given) compiled against the unpacked model."""

    graph: str                          # what identifies the graph (static_graph, slot_graph)
    compiled: GateResult
    reference: GateResult | None = None
    shape: dict = field(default_factory=dict)   # the graph's shape, as fields

    @property
    def passed(self) -> bool:
        return self.compiled.passed and (self.reference is None or self.reference.passed)

    @property
    def reason(self) -> str:
        parts = [] if self.compiled.passed else [f"against eager: {self.compiled.reason}"]
        if self.reference is not None and not self.reference.passed:
            parts.append(f"against the unpacked model: {self.reference.reason}")
        return "; ".join(parts)

    @property
    def invalid_reason(self) -> str | None:
        """The reason this graph's windows are invalid, None when the gate passed."""
        return None if self.passed else numerics_gate_failed(self.reason, graph=self.graph)

    def to_dict(self) -> dict:
        return {"graph": self.graph, **self.shape, "passed": self.passed, "reason": self.reason,
                "compiled": self.compiled.to_dict(),
                "reference": None if self.reference is None else self.reference.to_dict()}

    def progress(self) -> dict:
        """The fields of its `gated` progress line."""
        out = {"graph": self.graph, "passed": self.passed, "max_rel_diff": round(self.compiled.max_rel_diff, 5),
               "top1_agreement": round(self.compiled.top1_agreement, 3),
               "top1_beyond_ties": round(self.compiled.top1_beyond_ties, 3), "reason": self.reason}
        if self.reference is not None:
            out["reference_rel_diff"] = round(self.reference.max_rel_diff, 5)
        return out


def static_graph(batch: int, input_tokens: int) -> str:
    """The key of a static scenario's decode graph: its batch rows and its input length
    (with the output length, the cache length the graph is compiled at)."""
    return f"static {batch}x{input_tokens}"


def slot_graph(lanes: int, piece_tokens: int) -> str:
    """The key of a serving slot-step graph: its lane count, and the chunk it carries (0: none)."""
    tokens = lanes + piece_tokens
    return (f"slot step {tokens} tokens ({lanes} lanes + a {piece_tokens}-token piece)" if piece_tokens
            else f"slot step {tokens} tokens ({lanes} lanes)")


def static_gate_fit(prompt_tokens: int, steps: int, context: int) -> tuple[int, int]:
    """The (prompt tokens, forced steps) of a static gate within a scenario's `context` (pure):
    the gate's store then has the scenario's shape, so it compiles the scenario's graph."""
    steps = max(1, min(steps, context - 1))
    return max(1, min(prompt_tokens, context - steps)), steps


def gate_inputs(rows: int, steps: int, vocab: int, seed: int, prompt_tokens: int = GATE_PROMPT_TOKENS):
    """The gate's prompt [rows, prompt_tokens] and forced tokens [rows, steps]. Row by row
    from its own seed, so a row is the same whatever the batch: the reference, taken at
    REFERENCE_ROWS before packing, is the first rows of every static shape's gate."""
    import torch

    from .decode import synthetic_prompt

    prompt = torch.cat([synthetic_prompt(1, prompt_tokens, vocab, seed=seed * 7919 + 2 * i + 1)
                        for i in range(rows)])
    forced = torch.cat([synthetic_prompt(1, steps, vocab, seed=seed * 7919 + 2 * i + 2) for i in range(rows)])
    return prompt, forced


def reference_logits(model, prompt, forced):
    """Teacher-forced logits of the model as transformers runs it (eager, its own attention,
    unpacked weights): at each forced token, the logits after it, float32 [rows, steps, vocab].
    Call it before the engine packs the model."""
    import torch

    steps = int(forced.shape[1])
    with torch.inference_mode():
        out = model(input_ids=torch.cat([prompt, forced], dim=1), use_cache=False, logits_to_keep=steps)
    return out.logits[:, -steps:, :].float()


@dataclass(frozen=True)
class Tolerance:
    """How far a graph's logits may stray and still pass its gate (see compare_logits):
    rtol, of the largest logit; min_top1, the share of positions whose top-1 must agree."""

    rtol: float = DEFAULT_RTOL
    min_top1: float = DEFAULT_MIN_TOP1

    def compare(self, compiled, eager) -> GateResult:
        return compare_logits(compiled, eager, rtol=self.rtol, min_top1=self.min_top1)


def _against_reference(compiled, reference, tolerance: Tolerance) -> GateResult | None:
    if reference is None:
        return None
    rows = min(int(compiled.shape[0]), int(reference.shape[0]))
    return tolerance.compare(compiled[:rows], reference[:rows])


def run_gate(engine, prompt, forced, *, max_len: int | None = None, tolerance: Tolerance = Tolerance(),
             reference=None, graph: str = "", shape: dict | None = None) -> GraphGate:
    """Teacher-force `forced` [batch, steps] after `prompt` through the engine's compiled step
    and its eager modules at a store of `max_len` (a scenario's context: its graph); compare,
    and compare the first rows with `reference` (reference_logits of the same rows) if given."""
    compiled = engine.step_logits(prompt, forced, compiled=True, max_len=max_len)
    eager = engine.step_logits(prompt, forced, compiled=False, max_len=max_len)
    return GraphGate(graph, tolerance.compare(compiled, eager),
                     _against_reference(compiled, reference, tolerance), shape or {})


def slot_gates(checks: dict, reference=None, *, tolerance: Tolerance = Tolerance()) -> list[GraphGate]:
    """The gate of every slot-step graph from TokenSlots.prime's compiled and eager logits;
    the one-lane decode graph is also compared with `reference` [1, steps, vocab] (the
    unpacked model on the prime's prompt and forced tokens)."""
    out = []
    for (lanes, piece), (compiled, eager) in sorted(checks.items()):
        against = reference if (lanes, piece) == (1, 0) else None
        out.append(GraphGate(slot_graph(lanes, piece), tolerance.compare(compiled[None], eager[None]),
                             _against_reference(compiled[None], against, tolerance),
                             {"lanes": lanes, "piece_tokens": piece, "tokens": lanes + piece}))
    return out


def rank_numerics(gates: list[GraphGate], greedy: dict | None = None) -> dict:
    """A rank's numerics facts: one result per graph, and `passed` when every graph passed
    (None before any graph was gated)."""
    return {"passed": all(g.passed for g in gates) if gates else None, "graphs": [g.to_dict() for g in gates],
            "failed": [g.graph for g in gates if not g.passed], "greedy": greedy}


def greedy_text(engine, tokenizer, prompt: str = GREEDY_PROMPT, tokens: int = GREEDY_TOKENS) -> dict:
    """A short greedy continuation of `prompt`, decoded to text (eager decode step)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    gen = engine.generate(ids, tokens, eager=True)
    return {"prompt": prompt, "tokens": tokens,
            "text": tokenizer.decode(gen.tokens[0].tolist(), skip_special_tokens=True)}
