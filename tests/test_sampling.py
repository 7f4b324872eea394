"""The sampling rule every mode shares: temperature, top-k and top-p warp the target's logits."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from engine.core.sampling import BLOCK, SamplingParams, logits_to_probs, next_token, sample

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_temperature_divides_the_logits(temperature):
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=temperature))
    np.testing.assert_allclose(probs, softmax(LOGITS / temperature), rtol=1e-12)


def test_a_low_temperature_sharpens_and_a_high_one_flattens():
    entropies = [entropy(logits_to_probs(LOGITS, SamplingParams(temperature=t))) for t in (0.3, 1.0, 2.0)]
    assert entropies[0] < entropies[1] < entropies[2]
    cold = logits_to_probs(LOGITS, SamplingParams(temperature=0.3))
    assert cold[0] > softmax(LOGITS)[0] > logits_to_probs(LOGITS, SamplingParams(temperature=2.0))[0]


def test_zero_temperature_is_one_hot_on_the_argmax():
    probs = logits_to_probs(LOGITS[::-1], SamplingParams(temperature=0.0))
    assert probs.tolist() == [0, 0, 0, 0, 0, 1.0]
    assert next_token(LOGITS[::-1], SamplingParams(), np.random.default_rng(0)) == 5


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_keeps_the_k_most_likely_tokens_renormalized(k):
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=k))
    np.testing.assert_allclose(probs[:k], softmax(LOGITS[:k]), rtol=1e-12)
    assert not probs[k:].any()


@pytest.mark.parametrize("top_p, kept", [(0.5, 1), (0.6, 2), (0.8, 3), (0.95, 4), (1.0, 6)])
def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_with_the_mass(top_p, kept):
    full = softmax(LOGITS)  # 0.561, 0.206, 0.125, 0.076, 0.028, 0.004: cumulative 0.561, 0.767, 0.892, 0.968
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    np.testing.assert_allclose(probs[:kept], full[:kept] / full[:kept].sum(), rtol=1e-12)
    assert not probs[kept:].any()


def test_top_p_applies_to_the_tempered_distribution():
    tempered = softmax(LOGITS / 0.5)  # 0.83, 0.11, ...: 0.8 of the mass is the first token alone
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5, top_p=0.8))
    assert tempered[0] > 0.8 and probs.tolist() == [1.0, 0, 0, 0, 0, 0]


def nucleus_by_full_sort(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p as defined: every token sorted, most likely first (ties: the lower id first), kept
    while the mass before it is below ``top_p``, then renormalized."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    ordered = np.take_along_axis(probs, order, -1)
    drop = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(drop, order, np.cumsum(ordered, -1) - ordered >= top_p, -1)
    kept = np.where(drop, 0.0, probs)
    return kept / kept.sum(-1, keepdims=True)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 0.95), (1.5, 0.95), (1.0, 0.999), (2.0, 0.5)])
def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps(temperature, top_p):
    """Top-p sorts the likeliest tokens only where they hold the mass: the same tokens, the same
    probabilities, as sorting the whole vocabulary, in every row (a batch's, or a verify pass's)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 20_000)) * 4 - np.abs(rng.standard_normal((4, 20_000))) * 6
    logits[:, rng.integers(0, 20_000, 40)] += 12  # a few likely tokens, a long tail
    logits[1, 5000:5100] = logits[1, 5000]  # ties
    params = SamplingParams(temperature=temperature, top_p=top_p)
    warped = logits_to_probs(logits, params)
    np.testing.assert_array_equal(
        warped, nucleus_by_full_sort(logits_to_probs(logits, SamplingParams(temperature)), top_p)
    )


def test_top_p_sorts_every_token_when_the_likeliest_ones_do_not_hold_the_mass():
    """One token of 0.94 and a tail of 200,000 tied ones, each below a millionth of it: top-p 0.99
    needs part of the tail, the lowest ids first."""
    logits = np.full(200_001, -15.0)
    logits[7] = 0.0
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.99))
    full = softmax(logits)
    assert 0.9 < full[7] < 0.99
    np.testing.assert_array_equal(probs, nucleus_by_full_sort(full, 0.99))
    kept = np.flatnonzero(probs)
    assert kept[0] == 0 and 7 in kept and kept[-1] < 200_000 and np.all(np.diff(kept) == 1)


def test_samples_follow_the_warped_distribution():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    rng = np.random.default_rng(0)
    counts = np.bincount([next_token(LOGITS, params, rng) for _ in range(20000)], minlength=len(LOGITS))
    np.testing.assert_allclose(counts / counts.sum(), logits_to_probs(LOGITS, params), atol=0.01)


def test_a_draw_over_many_blocks_follows_the_distribution_and_never_takes_an_impossible_token():
    """A vocabulary of several blocks (a block, then an id within it): the counts follow the
    probabilities (chi-square), and tokens of probability 0 (cut by top-k or top-p) never come."""
    rng = np.random.default_rng(7)
    probs = rng.random(3 * BLOCK + 100) ** 4
    probs[rng.random(len(probs)) < 0.3] = 0.0
    probs[BLOCK : 2 * BLOCK] = 0.0  # a whole block cut
    probs /= probs.sum()
    counts = np.bincount([sample(probs, rng) for _ in range(100_000)], minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    likely = probs * counts.sum() >= 5
    expected = probs[likely] / probs[likely].sum() * counts[likely].sum()
    assert scipy_stats.chisquare(counts[likely], expected).pvalue > 0.001


def test_a_plain_steps_draw_is_the_draw_from_the_warped_distribution_whatever_came_before():
    """``next_token`` warps in a buffer its thread keeps: each draw equals one from a freshly built
    distribution with the same generator state, across settings and vocabulary sizes."""
    rng = np.random.default_rng(11)
    for vocab, params in [
        (3000, SamplingParams(temperature=1.0)),
        (3000, SamplingParams(temperature=0.7, top_k=40)),
        (500, SamplingParams(temperature=1.3, top_p=0.9)),
        (3000, SamplingParams(temperature=1.0)),
    ]:
        logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
        drawn, expected = np.random.default_rng(vocab), np.random.default_rng(vocab)
        for _ in range(20):
            assert next_token(logits, params, drawn) == sample(logits_to_probs(logits, params), expected)
