"""Autoregressive and speculative decoding over OpenVINO KV caches.

Both modes share one loop and one sampling rule. A speculative round drafts K
tokens, scores all K+1 positions with one target pass, applies the accept/reject
rule, then rolls both KV caches back to the accepted prefix before anything is
yielded, so stopping between rounds always leaves the caches consistent. The first
round of every request is a plain target step over the prompt, in every mode, so
greedy speculative decoding runs the very passes autoregressive decoding runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from engine.core.drafters import Drafter
from engine.core.metrics import Stats
from engine.core.runtime import Runtime, common_prefix
from engine.core.sampling import SamplingParams, logits_to_probs, next_token
from engine.core.speculative import accept_draft, accept_greedy
from engine.errors import ContextLimitError

# Prompt tokens per prefill pass: a Stop during a long prompt waits for one chunk at most. Every
# mode prefills this way; with a past, a pass's width does not change its rows' rounding.
PREFILL_CHUNK = 256


class Provenance(StrEnum):
    DRAFT = "draft"  # drafted and accepted by the target
    TARGET = "target"  # the target's correction after a rejection
    BONUS = "bonus"  # the target's extra token after a fully accepted draft
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class DecodeConfig:
    speculative: bool = True
    k: int = 4
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    cancelled: Callable[[], bool] = lambda: False  # checked between rounds and prefill chunks
    progress: Callable[[], None] = lambda: None  # called after every prefill chunk
    paced: bool = False  # speculate only while it pays (Pacer)


@dataclass
class Pacer:
    """Whether a request's next round speculates: only while speculation pays, as measured.

    Keeps the seconds per new token of the request's speculative rounds and of its plain target
    steps (exponential averages; a round's time includes its rollback), and runs the cheaper
    kind. The other kind runs once after ``interval`` rounds, so both figures follow the answer
    (acceptance changes along it, costs grow with the context); a probe's measurement replaces
    its kind's stale figure. A probe that confirms the order doubles the interval (up to
    ``max_interval``: a probe of the slower kind costs time), one that reverses it resets it.
    Speculation is measured first, then one plain step. Which kind runs changes the passes only:
    every round's tokens follow the target's rule, so greedy output is the same and sampled
    output keeps its distribution.
    """

    min_interval: int = 8
    max_interval: int = 64
    weight: float = 0.3
    cost: dict[bool, float] = field(default_factory=dict)  # seconds per token; True: speculative
    streak: int = 0  # rounds of the cheaper kind since the last probe
    interval: int = 8

    def _cheaper(self) -> bool:
        return self.cost[True] <= self.cost[False]

    def speculate(self) -> bool:
        if len(self.cost) < 2:
            return True not in self.cost
        return self._cheaper() if self.streak < self.interval else not self._cheaper()

    def record(self, speculative: bool, seconds: float, tokens: int) -> None:
        per_token = seconds / max(tokens, 1)
        if len(self.cost) == 2 and speculative == self._cheaper():  # the cheaper kind again
            self.cost[speculative] += self.weight * (per_token - self.cost[speculative])
            self.streak += 1
            return
        order = self._cheaper() if len(self.cost) == 2 else None
        self.cost[speculative] = per_token  # a first measurement, or a probe: the old figure is stale
        if order is not None:
            self.streak = 0
            confirmed = self._cheaper() == order
            self.interval = min(2 * self.interval, self.max_interval) if confirmed else self.min_interval


@dataclass
class Round:
    tokens: list[int]
    provenance: list[Provenance]


def decode(
    target: Runtime, drafter: Drafter | None, prompt: Sequence[int], config: DecodeConfig, stats: Stats
) -> Iterator[Round]:
    """Yield the tokens of each round until a stop token, the token budget or the context limit."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= target.max_context:
        raise ContextLimitError(
            f"the conversation is {len(prompt)} tokens long; the model's context holds {target.max_context}. "
            f"Clear the chat or shorten the message."
        )
    speculative = config.speculative and drafter is not None and config.k > 0
    pacer = Pacer() if config.paced else None
    rng = np.random.default_rng(config.sampling.seed)
    context = list(prompt)
    stats.prompt_tokens = len(prompt)
    stats.cached_tokens = min(common_prefix(target.tokens, context), len(context) - 1)
    start, passes = time.perf_counter(), target.passes
    prefilled = _until_cancelled(target.feed(context, PREFILL_CHUNK), config)
    stats.target_seconds += time.perf_counter() - start
    stats.target_passes += target.passes - passes
    if not prefilled:
        stats.finish_reason = "cancelled"
        return
    while stats.new_tokens < config.max_new_tokens:
        room = target.max_context - len(context)
        if room <= 0:
            stats.finish_reason = "context"
            return
        # The first round is a plain step over the prompt in every mode, so the target runs the
        # same passes in every mode (docs/design.md, "Why greedy speculative output is exact").
        limit = min(config.max_new_tokens - stats.new_tokens - 1, room - 1)  # drafted tokens that fit
        if speculative and drafter is not None and stats.rounds == 1:  # the draft's own long prefill
            start = time.perf_counter()
            caught_up = _until_cancelled(drafter.catch_up(context, PREFILL_CHUNK), config)
            stats.draft_seconds += time.perf_counter() - start
            if not caught_up:
                stats.finish_reason = "cancelled"
                return
        spec = speculative and stats.rounds > 0 and limit > 0 and (pacer is None or pacer.speculate())
        round_start = time.perf_counter()
        round_ = (
            _speculative_round(target, drafter, context, config.k, limit, config.sampling, rng, stats)
            if drafter is not None and spec
            else _autoregressive_step(target, context, config.sampling, rng, stats)
        )
        stop_at = next((i for i, t in enumerate(round_.tokens) if t in config.stop_ids), None)
        if stop_at is not None:
            round_ = Round(round_.tokens[:stop_at], round_.provenance[:stop_at])
        context += round_.tokens
        # Roll both caches back to the accepted prefix (rejected drafts leave no trace).
        target.trim(common_prefix(target.tokens, context))
        if drafter is not None:
            drafter.rollback(context)
        if pacer is not None and stats.rounds > 0:
            pacer.record(spec, time.perf_counter() - round_start, len(round_.tokens))
            stats.plain_rounds += not spec
        stats.rounds += 1
        stats.add_tokens(len(round_.tokens))
        stats.target_kv_bytes = target.kv_cache_bytes
        stats.draft_kv_bytes = drafter.kv_cache_bytes if drafter is not None else 0
        yield round_
        if stop_at is not None:
            stats.finish_reason = "stop"
            return
    stats.finish_reason = "length"


def _until_cancelled(passes: Iterator[None], config: DecodeConfig) -> bool:
    """Run a prefill's ``passes`` (a long prompt, in chunks), reporting progress and checking for
    a cancel between them: False if the request was cancelled."""
    for _ in passes:
        config.progress()
        if config.cancelled():
            return False
    return not config.cancelled()


def _target_logits(target: Runtime, tokens: list[int], rows: int, stats: Stats) -> np.ndarray:
    start = time.perf_counter()
    logits = target.sync(tokens, rows)
    stats.target_seconds += time.perf_counter() - start
    stats.target_passes += 1
    return logits


def _autoregressive_step(
    target: Runtime, context: list[int], params: SamplingParams, rng: np.random.Generator, stats: Stats
) -> Round:
    logits = _target_logits(target, context, 1, stats)
    return Round([next_token(logits[-1], params, rng)], [Provenance.AUTOREGRESSIVE])


def _speculative_round(
    target: Runtime,
    drafter: Drafter,
    context: list[int],
    k: int,
    limit: int,
    params: SamplingParams,
    rng: np.random.Generator,
    stats: Stats,
) -> Round:
    draft = drafter.propose(context, min(k, limit), params, rng).head(limit)
    stats.draft_seconds += draft.seconds
    logits = _target_logits(target, context + draft.tokens, len(draft.tokens) + 1, stats)
    if params.greedy:
        n, token = accept_greedy(draft.tokens, logits)
    else:
        assert draft.probs is not None  # a sampling drafter reports the distributions it drew from
        n, token = accept_draft(draft.tokens, draft.probs, logits_to_probs(logits, params), rng)
    drafter.observe(len(draft.tokens), n)
    stats.drafted += len(draft.tokens)
    stats.accepted += n
    if not draft.tokens:  # e.g. prompt lookup found nothing: a plain target step
        last = Provenance.AUTOREGRESSIVE
    else:
        last = Provenance.BONUS if n == len(draft.tokens) else Provenance.TARGET
    return Round([*draft.tokens[:n], token], [Provenance.DRAFT] * n + [last])
