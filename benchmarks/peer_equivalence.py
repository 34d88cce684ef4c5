"""Is a peer computing the same model? Its greedy continuation against HF eager's.

The reference is the HF checkpoint run by transformers' eager attention in float32
(the bf16 weights upcast), greedy, EOS ignored, its logits kept at every position.
Each engine continues the same prompt ids greedily. Per prompt:

- the tokens match up to the first divergence. Free-running greedy decoding must
  diverge somewhere on a random-weight model, whose top two logits are often a few
  hundredths apart: a divergence is a *tie* when the reference's own logits put the
  two tokens within TIE_MARGIN of one logit standard deviation, and a *break* otherwise;
- where the engine exposes logits, their Pearson correlation with the reference's at
  the first generated position, where every engine has seen the very same tokens (full
  logits: over the vocabulary; top-k log-probs: over the engine's k tokens).

Calibrated on the 2-layer synthetic Phi-3-mini: bf16 against the float32 reference
correlates at 0.9998 and diverges at margins <= 0.02 std; the same checkpoint with its
rope theta changed correlates at 0.3-0.6 and breaks at the first token with margins of
1.7-4.8 std. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TIE_MARGIN = 0.1   # in standard deviations of the reference's logits at that position
MIN_CORRELATION = 0.99


@dataclass
class Verdict:
    engine: str
    equivalent: bool
    agreement: float                  # matched leading tokens / generated tokens, over all prompts
    prefixes: list[int]               # matched leading tokens per prompt
    margins: list[float]              # reference margin at each divergence (std units)
    correlation: float | None         # lowest over the prompts; None: the engine exposes no logits
    correlation_kind: str = ""
    reasons: list[str] = field(default_factory=list)

    def line(self) -> str:
        corr = (f"logit correlation {self.correlation:.4f} ({self.correlation_kind})" if self.correlation is not None
                else "no logits exposed: tokens only")
        ties = ", ".join(f"{m:.3f}" for m in self.margins) or "none"
        word = "equivalent" if self.equivalent else "NOT EQUIVALENT"
        why = f": {'; '.join(self.reasons)}" if self.reasons else ""
        return (f"{self.engine}: {word}{why} | top-1 agreement {self.agreement:.2f} (prefixes "
                f"{'/'.join(map(str, self.prefixes))}); divergence margins {ties}; {corr}")


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64) - a.mean(), b.astype(np.float64) - b.mean()
    denom = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denom) if denom else 0.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max()
    return x - top - np.log(np.exp(x - top).sum())


def compare(engine: str, ref_tokens: np.ndarray, ref_logits: np.ndarray, tokens: np.ndarray,
            first_logits: np.ndarray | None = None, topk_ids: np.ndarray | None = None,
            topk_logprobs: np.ndarray | None = None) -> Verdict:
    """ref_tokens/tokens [prompts, steps]; ref_logits [prompts, steps, vocab];
    first_logits [prompts, vocab] (full logits), or topk_ids/topk_logprobs [prompts, k]."""
    tokens = np.asarray(tokens)
    if tokens.shape != ref_tokens.shape:
        return Verdict(engine, False, 0.0, [], [], None,
                       reasons=[f"{tokens.shape} tokens, the reference has {ref_tokens.shape}"])
    steps = ref_tokens.shape[1]
    prefixes, margins, reasons = [], [], []
    for row, (want, got) in enumerate(zip(ref_tokens, tokens, strict=True)):
        differ = np.nonzero(want != got)[0]
        prefix = int(differ[0]) if differ.size else steps
        prefixes.append(prefix)
        if prefix < steps:
            logits = ref_logits[row, prefix].astype(np.float64)
            margin = float((logits[want[prefix]] - logits[got[prefix]]) / (logits.std() or 1.0))
            margins.append(margin)
            if margin > TIE_MARGIN:
                reasons.append(f"prompt {row} breaks at token {prefix} (margin {margin:.2f} std > {TIE_MARGIN})")
    correlation, kind = None, ""
    if first_logits is not None:
        correlation = min(_pearson(np.asarray(first_logits)[r], ref_logits[r, 0]) for r in range(len(tokens)))
        kind = "full vocabulary, first generated position"
    elif topk_ids is not None and topk_logprobs is not None:
        ids, lps = np.asarray(topk_ids), np.asarray(topk_logprobs)
        correlation = min(_pearson(lps[r], _log_softmax(ref_logits[r, 0])[ids[r]]) for r in range(len(tokens)))
        kind = f"log-probs of the engine's top {ids.shape[1]}, first generated position"
    if correlation is not None and correlation < MIN_CORRELATION:
        reasons.append(f"logit correlation {correlation:.4f} < {MIN_CORRELATION}")
    agreement = sum(prefixes) / (steps * len(prefixes))
    return Verdict(engine, not reasons, agreement, prefixes, margins, correlation, kind, reasons)
