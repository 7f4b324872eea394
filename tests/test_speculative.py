"""The accept/reject rule as a pure function, and the draft head cut to some ids."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.runtime import EXACT_CONFIG, Runtime
from engine.core.sampling import SamplingParams, logits_to_probs
from engine.core.speculative import accept_draft, accept_greedy
from engine.prepare.pipeline import draft_compression, prepare_one


def test_greedy_acceptance_is_the_zero_temperature_limit_of_the_rule():
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(200):
        k = int(rng.integers(1, 6))
        target = rng.normal(size=(k + 1, 12))
        draft_logits = rng.normal(size=(k, 12))
        agree = int(rng.integers(0, k + 1))  # drafts that match the target for a while, then maybe not
        draft = [int(t) for t in target.argmax(-1)[:agree]] + [int(t) for t in draft_logits.argmax(-1)[agree:]]
        q = np.zeros((k, 12))
        q[np.arange(k), draft] = 1.0
        expected = accept_draft(draft, q, logits_to_probs(target, greedy), rng)
        assert accept_greedy(draft, target) == expected


def test_a_rejected_token_is_resampled_from_the_residual():
    p = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[0.0, 1.0, 0.0]])
    rng = np.random.default_rng(1)
    outcomes = [accept_draft([1], q, p, rng) for _ in range(4000)]
    accepted = np.mean([n == 1 for n, _ in outcomes])
    assert abs(accepted - 0.5) < 0.03  # min(1, p/q) = 0.5
    assert {t for n, t in outcomes if n == 0} == {0}  # residual max(0, p - q) is all on token 0


def scattered_ids(vocab: int, count: int, seed: int = 0) -> np.ndarray:
    """``count`` distinct ids of a ``vocab``-id vocabulary in no order (a ranking is not id order)."""
    return np.random.default_rng(seed).permutation(vocab)[:count]


@pytest.mark.parametrize("head", ["fp16", "int4 (packed, rows not byte-aligned)"])
def test_a_draft_head_cut_to_some_ids_gives_their_logits_unchanged_and_the_others_probability_zero(
    head, ir_draft, hf_draft, tiny_cache
):
    ir = ir_draft if head == "fp16" else prepare_one(str(hf_draft), draft_compression(group_size=64), tiny_cache).path
    full = Runtime(ir, config=EXACT_CONFIG)
    kept = scattered_ids(full.vocab_size, 101)
    cut = Runtime(ir, config=EXACT_CONFIG, kept_ids=kept)
    tokens = [5, 17, 42, 99, 3, 77]
    logits, expected = cut.forward(tokens, rows=6), full.forward(tokens, rows=6)
    assert cut.vocab_size == full.vocab_size
    left_out = np.setdiff1d(np.arange(full.vocab_size), kept)
    np.testing.assert_allclose(logits[:, kept], expected[:, kept], atol=1e-5)
    assert (logits[:, left_out] == -np.inf).all()
    warped = SamplingParams(temperature=0.8, top_p=0.95)
    q = logits_to_probs(logits, warped)
    assert (q[:, left_out] == 0).all()
    np.testing.assert_allclose(q[:, kept], logits_to_probs(expected[:, kept], warped), atol=1e-6)
