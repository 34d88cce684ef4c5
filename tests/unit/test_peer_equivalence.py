"""benchmarks/peer_equivalence.py: a peer's greedy continuation judged against HF eager's."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import peer_equivalence as eq  # noqa: E402

VOCAB, STEPS = 64, 6


def reference(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(2, STEPS, VOCAB))
    return logits.argmax(-1), logits


def test_the_same_tokens_and_logits_are_equivalent():
    tokens, logits = reference()
    got = eq.compare("peer", tokens, logits, tokens.copy(), first_logits=logits[:, 0] + 1e-3)
    assert got.equivalent and got.agreement == 1.0 and got.prefixes == [STEPS, STEPS]
    assert got.correlation > 0.999 and got.margins == []
    assert "peer: equivalent" in got.line()


def test_a_divergence_at_a_near_tie_is_bf16_noise_not_a_break():
    tokens, logits = reference()
    row, step = 1, 3
    runner_up = int(np.argsort(logits[row, step])[-2])
    logits[row, step, runner_up] = logits[row, step, tokens[row, step]] - 0.01 * logits[row, step].std()
    got_tokens = tokens.copy()
    got_tokens[row, step:] = runner_up  # after the tie, a different context: anything may follow
    got = eq.compare("peer", tokens, logits, got_tokens)
    assert got.equivalent, got.reasons
    assert got.prefixes == [STEPS, step] and got.agreement == (STEPS + step) / (2 * STEPS)
    assert got.correlation is None and "tokens only" in got.line()


def test_a_confident_different_token_is_a_break():
    tokens, logits = reference()
    got_tokens = tokens.copy()
    got_tokens[0, 0] = int(logits[0, 0].argmin())
    got = eq.compare("peer", tokens, logits, got_tokens)
    assert not got.equivalent
    assert got.reasons[0].startswith("prompt 0 breaks at token 0")
    assert "NOT EQUIVALENT" in got.line()


def test_uncorrelated_logits_fail_even_when_the_tokens_agree():
    tokens, logits = reference()
    other = np.random.default_rng(9).normal(size=(2, VOCAB))
    got = eq.compare("peer", tokens, logits, tokens, first_logits=other)
    assert not got.equivalent and "logit correlation" in got.reasons[0]


def test_top_k_log_probs_are_compared_with_the_reference_log_softmax():
    tokens, logits = reference()
    ids = np.argsort(-logits[:, 0], axis=-1)[:, :8]
    lsm = logits[:, 0] - np.log(np.exp(logits[:, 0]).sum(-1, keepdims=True))
    good = eq.compare("peer", tokens, logits, tokens, topk_ids=ids, topk_logprobs=np.take_along_axis(lsm, ids, -1))
    assert good.equivalent and good.correlation > 0.999 and "top 8" in good.correlation_kind
    shuffled = eq.compare("peer", tokens, logits, tokens, topk_ids=ids,
                          topk_logprobs=np.take_along_axis(lsm, ids[:, ::-1], -1))
    assert not shuffled.equivalent


def test_a_wrong_number_of_tokens_is_not_equivalent():
    tokens, logits = reference()
    got = eq.compare("peer", tokens, logits, tokens[:, :3])
    assert not got.equivalent and "tokens" in got.reasons[0]
