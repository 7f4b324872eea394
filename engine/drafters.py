"""Drafters propose tokens for the target to verify; the loop in
:mod:`engine.decoding` calls only this small interface, so other drafters (prompt
lookup, adaptive length, a cheaper draft head) plug in without touching it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from engine.runtime import Runtime, common_prefix
from engine.sampling import SamplingParams, logits_to_probs, sample


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray  # [len(tokens), V]: the distribution each token was drawn from
    seconds: float


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Propose up to ``k`` tokens to follow ``context``."""

    def rollback(self, accepted: Sequence[int]) -> None:
        """Forget every cached token that is not a prefix of ``accepted``."""

    @property
    def kv_cache_bytes(self) -> int: ...


class ModelDrafter:
    """A small language model with its own KV cache drafts token by token."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        start = time.perf_counter()
        tokens: list[int] = []
        rows = []
        for _ in range(k):
            probs = logits_to_probs(self.runtime.score([*context, *tokens])[-1], params)
            tokens.append(sample(probs, rng))
            rows.append(probs)
        return Draft(tokens, np.stack(rows), time.perf_counter() - start)

    def rollback(self, accepted: Sequence[int]) -> None:
        self.runtime.trim(common_prefix(self.runtime.tokens, accepted))

    @property
    def kv_cache_bytes(self) -> int:
        return self.runtime.kv_cache_bytes
