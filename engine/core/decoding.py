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

from engine.core.drafters import CopyDrafter, Draft, Drafter
from engine.core.metrics import FinishReason, Stats
from engine.core.pacing import Choice, Pacer, Pacing, RoundKind, TextKind
from engine.core.reader import PromptReader, read_pass
from engine.core.reading import ReadPath, read_plan, resume_at, steps_only
from engine.core.requests import DEFAULT_K, DEFAULT_MAX_NEW_TOKENS
from engine.core.runtime import Runtime, common_prefix
from engine.core.sampling import SamplingParams, logits_to_probs, next_token
from engine.core.speculative import accept_draft, accept_greedy
from engine.errors import ContextLimitError

# Prompt tokens per prefill pass of the target's own (the reader's are its plan's): a Stop during a
# long prompt waits for one chunk at most. Every mode prefills this way; with a past, a pass's
# width does not change its rows' rounding.
PREFILL_CHUNK = 256


class Provenance(StrEnum):
    DRAFT = "draft"  # drafted and accepted by the target
    TARGET = "target"  # the target's correction after a rejection
    BONUS = "bonus"  # the target's extra token after a fully accepted draft
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class DecodeConfig:
    speculative: bool = True
    k: int = DEFAULT_K
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: until the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    cancelled: Callable[[], bool] = lambda: False  # checked between rounds and prefill chunks
    progress: Callable[[], None] = lambda: None  # called after every prefill chunk
    pacing: Pacing | None = None  # paced: the draft model runs only while its rounds pay (None: always)
    # Tokens that open or close a code block (they hold a ```): a paced request keeps one pacer for
    # code and one for the text around it.
    fence_ids: frozenset[int] = frozenset()
    # A paced request's n-gram pool (engine.core.pool): drafts from earlier answers where the
    # drafter's own copies (the conversation's context) find none.
    pool: CopyDrafter | None = None
    # The prompt reader (engine.core.reader), if one reads faster here than the target's own
    # passes; ``spoken``: the prompt's spans the decoding path reads (answers, each with the token
    # before it); ``breaks``: where the reader's runs restart (the end of the template's opening).
    reader: PromptReader | None = None
    spoken: tuple[tuple[int, int], ...] = ()
    breaks: tuple[int, ...] = ()


@dataclass
class Round:
    tokens: list[int]
    provenance: list[Provenance]


class Decoder:
    """One request's decoding state: its context, counters, sampler and pacer. ``prefill`` fills
    the target's cache with the prompt (then :meth:`finish_if_full`); then each :meth:`round`
    (alone on the request's own caches, after :meth:`catch_up`) or :meth:`take` (a row of a
    batched target pass) adds a round's tokens, until :attr:`done`. Either way every token follows
    the target's rule, so a request can move between the two at any round boundary."""

    def __init__(
        self, target: Runtime, drafter: Drafter | None, prompt: Sequence[int], config: DecodeConfig, stats: Stats
    ):
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= target.max_context:
            raise ContextLimitError(
                f"the conversation is {len(prompt)} tokens long; the model's context holds {target.max_context}. "
                f"Clear the chat or shorten the message."
            )
        self.target, self.drafter, self.config, self.stats = target, drafter, config, stats
        self.speculative = config.speculative and drafter is not None and config.k > 0
        # Where no round of the draft model can pay on this machine (its break-even above what the
        # draft reaches), a paced request never runs it: only its free drafts remain.
        pacing = config.pacing
        self.modelled = self.speculative and (pacing is None or pacing.draft_model_may_pay)
        # The draft agrees with the target far more often in code than in the prose around it
        # (docs/design.md, "Speculating only while it pays"): what a pacer learned on one says little
        # about the other, so each keeps its own.
        self._pacers = (
            {text: pacing.pacer(text, config.k + 1) for text in TextKind}
            if pacing is not None and self.modelled
            else None
        )
        self.in_code = False  # inside a code block of the answer (an odd number of fences so far)
        self.rng = np.random.default_rng(config.sampling.seed)
        self.context = list(prompt)
        self.done = False
        self.prefill_chunk = PREFILL_CHUNK  # the next prefill pass's width (a scheduler may narrow it)
        self._caught_up = False  # the draft has read the conversation (before its first speculative round)
        # How the prompt is read, all but its last token (the first round's): a function of the
        # conversation alone, and what of the cache that reading keeps.
        length = len(self.context) - 1
        reader = config.reader
        self.plan = (
            read_plan(length, config.spoken, config.breaks, shortest=reader.shortest) if reader else steps_only(length)
        )
        self._kept = resume_at(self.plan, self.context, target)
        stats.prompt_tokens = len(prompt)
        stats.cached_tokens = min(self._kept, length)
        stats.prompt_read = stats.cached_tokens

    @property
    def text(self) -> TextKind:
        """The kind of text the answer is in."""
        return TextKind.CODE if self.in_code else TextKind.PROSE

    @property
    def pacer(self) -> Pacer | None:
        """The pacer of the kind of text the answer is in (code or not), if paced."""
        return None if self._pacers is None else self._pacers[self.text]

    def prefill(self) -> Iterator[int]:
        """The prompt's passes by its :attr:`plan` (the reader's, and the target's own in chunks of
        :attr:`prefill_chunk`) but the last token, the first round's; where only the target's own
        passes are left and one chunk or less, the first round reads them with it. Yields the
        prompt tokens read after each pass, so a caller can show progress and stop between them."""
        target = self.target
        target.trim(self._kept)
        # (where the reader's last pass ends: past it, only the target's own passes are left)
        readers_end = max((p.stop for p in self.plan if p.path is ReadPath.READER), default=0)
        for part in self.plan:
            while (held := len(target.tokens)) < part.stop:
                if held >= readers_end and len(self.context) - held <= self.prefill_chunk:
                    return
                start, before = time.perf_counter(), target.passes
                read_pass(target, self.config.reader, self.context, part, self.prefill_chunk)
                seconds = time.perf_counter() - start
                self.stats.target_seconds += seconds
                self.stats.prefill_seconds += seconds
                self.stats.target_passes += max(1, target.passes - before)  # (the reader's: one)
                read = len(target.tokens)
                self.stats.prefill_read += read - self.stats.prompt_read
                self.stats.prompt_read = read
                yield read

    @property
    def unread(self) -> int:
        """Prompt tokens not yet in the target's cache (all but the last are read by prefill)."""
        return len(self.context) - self.stats.prompt_read

    def room(self) -> int:
        """Drafted tokens that fit in the next round beside its own token (the budget and the
        context): negative where not even that token fits."""
        return min(self._budget_left(), self.target.max_context - len(self.context)) - 1

    def _budget_left(self) -> int:
        """Answer tokens the request's cap still allows (without a cap, the context bounds them)."""
        cap = self.config.max_new_tokens
        return self.target.max_context if cap is None else cap - self.stats.new_tokens

    def finish_if_full(self) -> None:
        """Mark the request :attr:`done` where not even one more token fits (its budget or the
        context), with the reason."""
        if self.room() < 0:
            self.stats.finish_reason = FinishReason.LENGTH if self._budget_left() <= 0 else FinishReason.CONTEXT
            self.done = True

    def _choice(self, limit: int) -> Choice:
        """Whether the next round drafts with the drafter's model (``limit``: drafted tokens that
        fit): the pacer's choice where paced. A query: :meth:`catch_up` asks it to know whether the
        draft must read first, and :meth:`round` asks it again once the draft has."""
        if not (self.modelled and self.stats.rounds > 0 and limit > 0):
            return Choice(RoundKind.PLAIN)
        if self.pacer is None:
            return Choice(RoundKind.DRAFT)
        assert self.drafter is not None and self.config.pacing is not None
        switch = self.config.pacing.reading(self.drafter.behind(self.context))
        return self.pacer.choose(switch, limit + 1)

    def _free_draft(self, limit: int) -> tuple[Draft, Drafter] | None:
        """A paced request's draft that costs no model pass, and who made it: prompt lookup in
        the conversation, else its n-gram pool, each copy priced against this machine's pass
        costs and what the round would gain otherwise (the pacer's measured pace of draft-model
        rounds where it runs them). Tried at every round whatever the pacer says: only its choice
        between the draft model and plain steps has a price to learn."""
        if self.config.pacing is None:
            return None
        copied = self._copy(limit, self.pacer.bar() if self.pacer is not None else 1.0)
        return copied if copied is None or self.pacer is None or self.pacer.offer_copy() else None

    def _copy(self, limit: int, bar: float) -> tuple[Draft, Drafter] | None:
        """The first copy the drafter (prompt lookup) or the pool offers at its price against
        ``bar``, cut to ``limit``, and who made it; None where neither has one."""
        if not (self.speculative and self.stats.rounds > 0 and limit > 0):
            return None
        assert self.drafter is not None
        k = min(self.config.k, limit)
        for copier in (self.drafter, self.config.pool):
            if (
                copier is not None
                and (draft := copier.draft_free(self.context, k, self.config.sampling, bar).head(limit)).tokens
            ):
                return draft, copier
        return None

    def copy_for_batch(self) -> tuple[Draft, Drafter] | None:
        """What this request verifies in the next batched pass beside the context's last token: a
        copy that costs no model pass (the draft model's cache is freed while its request is
        batched), priced against a plain step, or None (a plain step). Each batched pass's
        width is then priced for all its rows together (:class:`engine.core.pacing.BatchPrices`)."""
        return self._copy(self.room(), 1.0)

    def catch_up(self) -> Iterator[int]:
        """The draft's own long prefill, before the first speculative round (in chunks)."""
        if self.drafter is None or self._caught_up or self._choice(self.room()).kind is not RoundKind.DRAFT:
            return
        self._caught_up = True
        behind, seconds = self.drafter.behind(self.context), 0.0
        passes = self.drafter.catch_up(self.context, PREFILL_CHUNK)
        while True:
            start = time.perf_counter()
            read = next(passes, None)
            seconds += time.perf_counter() - start
            if read is None:
                break
            yield read
        self.stats.draft_seconds += seconds
        if self.config.pacing is not None:
            self.config.pacing.learn_reading(seconds, behind - self.drafter.behind(self.context))

    def round(self) -> Round:
        """One round on the request's own caches: speculative (while it pays, when paced) or a
        plain target step. The first round is a plain step over the prompt in every mode, so the
        target runs the same passes in every mode (docs/design.md, "Why greedy speculative output
        is exact")."""
        limit = self.room()
        pacer, drafter = self.pacer, self.drafter
        free = self._free_draft(limit)
        choice = Choice(RoundKind.PLAIN) if free is not None else self._choice(limit)
        spec = choice.kind is RoundKind.DRAFT
        start, read_seconds = time.perf_counter(), 0.0
        if drafter is not None and (free or spec):
            # (a paced round has been offered the free drafts already: the drafter's model's turn)
            copies = self.config.pacing is None
            draft, proposer = free or (
                drafter.propose(self.context, min(self.config.k, limit), self.config.sampling, self.rng, copies),
                drafter,
            )
            draft, accepted = draft.head(limit), self.stats.accepted
            read_seconds = draft.read_seconds
            if self.config.pacing is not None:
                self.config.pacing.learn_reading(draft.read_seconds, draft.read)
            logits = _target_logits(self.target, self.context + draft.tokens, len(draft.tokens) + 1, self.stats)
            round_ = _judged(proposer, draft, logits, self.config.sampling, self.rng, self.stats)
            self._count_pool(proposer, draft, accepted)
        else:
            logits = _target_logits(self.target, self.context, 1, self.stats)
            round_ = self._plain(logits[-1])
        round_ = self._accept(round_)
        # Roll both caches back to the accepted prefix (rejected drafts leave no trace).
        self.target.trim(common_prefix(self.target.tokens, self.context))
        if drafter is not None:
            drafter.rollback(self.context)
        if pacer is not None and free is not None:
            pacer.record_copy(time.perf_counter() - start, len(round_.tokens))
        elif pacer is not None and self.stats.rounds > 1:
            # (the draft's catch-up is a cost of switching to it, weighed by Pacer.speculate)
            pacer.record(choice.kind, time.perf_counter() - start - read_seconds, len(round_.tokens), choice.held)
            self.stats.plain_rounds += not spec
        return round_

    def take(self, logits: np.ndarray, seconds: float, copied: tuple[Draft, Drafter] | None = None) -> Round:
        """A round from this request's rows of a batched target pass, which fed the context's
        last token and ``copied``'s draft (:meth:`copy_for_batch`, if any): the logits after each
        token fed; ``seconds``: that pass's time. The target's cache holds what the round fed;
        what it keeps is the context but its last token (the batch cuts the rest)."""
        self.stats.target_seconds += seconds
        self.stats.target_passes += 1
        if copied is None:
            self.stats.plain_rounds += self.stats.rounds > 0 and self.speculative
            return self._accept(self._plain(logits[0]))
        draft, copier = copied
        accepted = self.stats.accepted
        round_ = _judged(copier, draft, logits, self.config.sampling, self.rng, self.stats)
        self._count_pool(copier, draft, accepted)
        return self._accept(round_)

    def _count_pool(self, proposer: Drafter, draft: Draft, accepted: int) -> None:
        """Count a draft the pool made (``accepted``: the request's accepted count before its round)."""
        if proposer is self.config.pool:
            self.stats.pool_drafted += len(draft.tokens)
            self.stats.pool_accepted += self.stats.accepted - accepted

    def _plain(self, logits: np.ndarray) -> Round:
        return Round([next_token(logits, self.config.sampling, self.rng)], [Provenance.AUTOREGRESSIVE])

    def _accept(self, round_: Round) -> Round:
        """Cut the round at a stop token, add it to the context and the counters."""
        stop_at = next((i for i, t in enumerate(round_.tokens) if t in self.config.stop_ids), None)
        if stop_at is not None:
            round_ = Round(round_.tokens[:stop_at], round_.provenance[:stop_at])
            self.stats.finish_reason = FinishReason.STOP
            self.done = True
        self.context += round_.tokens
        self.stats.prompt_read = self.stats.prompt_tokens
        self.in_code ^= sum(token in self.config.fence_ids for token in round_.tokens) % 2 == 1
        self.stats.rounds += 1
        self.stats.add_tokens(len(round_.tokens))
        self.stats.target_kv_bytes = self.target.kv_cache_bytes
        self.stats.draft_kv_bytes = self.drafter.kv_cache_bytes if self.drafter is not None else 0
        if not self.done:
            self.finish_if_full()
        return round_


def _target_logits(target: Runtime, tokens: list[int], rows: int, stats: Stats) -> np.ndarray:
    start = time.perf_counter()
    logits = target.sync(tokens, rows)
    stats.target_seconds += time.perf_counter() - start
    stats.target_passes += 1
    return logits


def _judged(
    drafter: Drafter, draft: Draft, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, stats: Stats
) -> Round:
    """Keep what the rule accepts of ``draft`` (``drafter``'s proposal), given the target's
    ``logits`` after the context's last token and after each drafted token (one verify pass)."""
    stats.draft_seconds += draft.seconds
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
