"""One sampling rule for every mode: logits -> (warped) probabilities -> token.

Greedy decoding is the temperature -> 0 limit: the distribution becomes one-hot on
the argmax, so the speculative accept/reject rule needs no special case for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def top_probability(logits: np.ndarray) -> float:
    """The largest probability of a row of logits at temperature 1 (how sure the model is)."""
    z = logits - logits.max()
    return float(1.0 / np.exp(z).sum())


def logits_to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rows of logits [..., V] -> rows of probabilities after temperature, top-k and top-p."""
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        probs = np.zeros_like(logits)
        np.put_along_axis(probs, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return probs
    z = (logits - logits.max(-1, keepdims=True)) / params.temperature  # no inf - inf at a tiny temperature
    if 0 < params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    order = np.argsort(-probs, axis=-1)
    sorted_probs = np.take_along_axis(probs, order, -1)
    cumulative = np.cumsum(sorted_probs, -1)
    drop_sorted = cumulative - sorted_probs >= top_p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, -1)
    kept = np.where(drop, 0.0, probs)
    return kept / kept.sum(-1, keepdims=True)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability row."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one row of logits: the argmax when greedy (no distribution is built)."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(logits_to_probs(logits, params), rng)
