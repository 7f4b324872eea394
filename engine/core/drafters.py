"""Drafters propose tokens for the target to verify; the loop in
:mod:`engine.core.decoding` calls only this small interface, so other drafters (prompt
lookup, adaptive length, a cheaper draft head) plug in without touching it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from engine.core.runtime import Runtime, common_prefix
from engine.core.sampling import SamplingParams, logits_to_probs, sample, top_probability

# A windowed draft keeps this many tokens from the start of the conversation: the chat
# template's header and the system prompt's first words, which say what kind of text follows.
SINK = 32
# How many of the tokens a copying drafter offers are worth verifying: (offered, their acceptance,
# the context's length, the tokens per plain step's time the round must beat) -> how many.
Price = Callable[[int, float, int, float], int]


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray | None  # [len(tokens), V]: the distribution each token was drawn from (None when greedy)
    seconds: float
    # Tokens the draft model read first, what it had missed while it did not run (plain steps,
    # copies, the prompt), and the seconds that took (within ``seconds``): a cost of switching to
    # it, not of its rounds.
    read: int = 0
    read_seconds: float = 0.0
    acceptance: float = 0.0  # a copy's: the share of its drafter's copies the target accepted lately (its price's)

    def head(self, n: int) -> Draft:
        """The first ``n`` drafted tokens (the loop caps a draft at the token budget)."""
        probs = None if self.probs is None else self.probs[:n]
        return self if len(self.tokens) <= n else replace(self, tokens=self.tokens[:n], probs=probs)


class Drafter(Protocol):
    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator, copies: bool = True
    ) -> Draft:
        """Propose tokens to follow ``context``: ``k`` is the round's draft length (a drafter
        whose proposals cost nothing may propose more). ``copies``: False where the caller has
        already been offered this round's copies (:meth:`draft_free`) and turned them down or found
        none: only what a model drafts (nothing, for a drafter that only copies)."""

    def draft_free(self, context: Sequence[int], k: int, params: SamplingParams, bar: float = 1.0) -> Draft:
        """What this drafter proposes without running a model (prompt lookup), where that promises
        more tokens per plain step's time than ``bar``; empty where it has nothing such."""

    def observe(self, drafted: int, accepted: int) -> None:
        """Learn from the target's verdict on the last proposal: ``accepted`` of ``drafted`` kept."""

    def catch_up(self, context: Sequence[int], chunk: int) -> Iterator[int]:
        """Bring what the drafter caches up to ``context`` in passes of ``chunk`` tokens (a long
        prompt before the first draft), yielding between passes."""

    def behind(self, context: Sequence[int]) -> int:
        """How many tokens of ``context`` the drafter would read before its next draft (0 for a
        drafter that caches nothing)."""

    def rollback(self, accepted: Sequence[int]) -> None:
        """Forget every cached token that is not a prefix of ``accepted``."""

    @property
    def kv_cache_bytes(self) -> int: ...


class NextTokenGuesser:
    """Guesses the draft model's next token without running it, so that a 2-token draft pass can
    carry the guess in its second slot: where the guess is right, that pass drafts two tokens.

    The guess is the continuation of the context's longest earlier match of its last two tokens
    (code repeats names and idioms), else what the draft itself produced the last time it saw
    the same two tokens, else the same last token (learned as it drafts, across requests).
    """

    MAX_LEARNED = 200_000  # entries per table; both are cleared past this

    def __init__(self, vocab_size: int):
        self.lookup = LookupDrafter(vocab_size, min_ngram=2, max_ngram=8)
        self.after_pair: dict[tuple[int, int], int] = {}
        self.after_token: dict[int, int] = {}

    def guess(self, context: Sequence[int]) -> int | None:
        copied = self.lookup.lookup(np.asarray(context), 1)
        if copied:
            return copied[0]
        if len(context) >= 2 and (pair := (context[-2], context[-1])) in self.after_pair:
            return self.after_pair[pair]
        return self.after_token.get(context[-1]) if context else None

    def learn(self, previous: Sequence[int], token: int) -> None:
        """Record that the draft produced ``token`` after ``previous`` (only its last two tokens count)."""
        if len(self.after_pair) > self.MAX_LEARNED:
            self.after_pair.clear()
            self.after_token.clear()
        if len(previous) >= 2:
            self.after_pair[(previous[-2], previous[-1])] = token
        if previous:
            self.after_token[previous[-1]] = token


class ModelDrafter:
    """A small language model with its own KV cache drafts token by token.

    ``p_min`` stops a round early once the draft's own confidence in the token it
    just drafted (its top probability) falls below it; ``adaptive`` moves the draft
    length (:attr:`k`) between 1 and the requested K from the last round's outcome
    (two longer after a fully accepted draft, one shorter after a rejection). Neither
    changes the output: how many tokens are drafted depends only on the draft.

    On a runtime that feeds 2 tokens per pass, a step whose context lacks only its last
    token feeds that token and a :class:`NextTokenGuesser` guess; where the draft's token
    equals the guess, the second row is the draft's distribution for the token after it,
    exactly as the next step would compute it, so the step drafts two tokens. Where it
    differs, the guess is rolled back like any rejected token (by masking, for free).

    With a ``window``, the draft model sees a long conversation's first :data:`SINK` tokens and
    its last ``window`` to ``3 * window`` tokens only (:meth:`cut_view`): what it drafts depends on
    recent text, and a 3,000-token conversation would otherwise cost it a 3,000-token prefill
    before its first draft and slower steps after (docs/design.md, "Long conversations").
    """

    def __init__(
        self,
        runtime: Runtime,
        p_min: float = 0.0,
        adaptive: bool = False,
        vocab_size: int | None = None,
        window: int | None = None,
    ):
        """``vocab_size``: the target's vocabulary rows, where the draft's head has fewer (two sizes of
        one model family may pad their embeddings to different row counts). A draft head cut to
        frequent ids still gives every id a logit (engine.core.graph.keep_vocabulary)."""
        self.runtime = runtime
        self.vocab_size = vocab_size or runtime.vocab_size
        self.p_min = p_min
        self.adaptive = adaptive
        self.window = window
        self.guesser = NextTokenGuesser(self.vocab_size) if runtime.pass_width >= 2 else None
        self.k: int | None = None  # the adaptive draft length (None: not adapted yet)
        self._cut = 0  # where the view's tail starts in the context
        self._step: float | None = None  # seconds of a pass that reads nothing it missed (a running mean)

    def cut_view(self, context: Sequence[int]) -> list[int]:
        """What the draft model is shown of ``context``: all of it up to ``SINK + 2 * window``
        tokens; past that, its first SINK tokens (the chat template's header) and a tail from a
        cut. A cut is made where the tail is ``window`` tokens (the draft's catch-up reads that
        much) and kept while the cache holds its view and the tail is at most ``3 * window``
        tokens, so the view the draft caches stays a prefix of the next one for ``2 * window``
        tokens. (A cut set by the length alone moved every ``window`` tokens, so an answer after a
        catch-up often paid a second one: docs/design.md, "Long conversations".)"""
        w, n = self.window, len(context)
        if w is None or n - SINK <= 2 * w:
            return list(context)
        if not self.runtime.tokens or self._cut < SINK or not w <= n - self._cut <= 3 * w:
            self._cut = n - w
        return [*context[:SINK], *context[self._cut :]]

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator, copies: bool = True
    ) -> Draft:
        start = time.perf_counter()
        budget = min(k, self.k or k) if self.adaptive else k
        tokens: list[int] = []
        rows = []
        done = False
        context = self.cut_view(context)
        read, read_seconds = self._missed(context), 0.0
        while not done and len(tokens) < budget:
            sequence = [*context, *tokens]
            guess = self._guess(sequence)
            fed = sequence if guess is None else [*sequence, guess]
            pass_start = time.perf_counter()
            passed = self.runtime.sync(fed, rows=len(fed) - len(sequence) + 1)
            if not tokens:
                read_seconds = self._time_first_pass(time.perf_counter() - pass_start, read)
            for logits in passed:
                if params.greedy:
                    token = int(np.argmax(logits))
                else:
                    rows.append(logits_to_probs(logits, params))
                    token = sample(rows[-1], rng)
                if self.guesser is not None:  # the last two tokens before it, without copying the context
                    self.guesser.learn([*context[-2:], *tokens][-2:], token)
                tokens.append(token)
                done = self.p_min > 0 and top_probability(logits) < self.p_min
                if done or len(tokens) >= budget or token != guess:
                    break
        probs = self._padded(rows) if rows else None
        return Draft(tokens, probs, time.perf_counter() - start, read, read_seconds)

    def _missed(self, view: list[int]) -> int:
        """Tokens of ``view`` the draft missed while it did not run: past the two a round leaves
        it to read (the last drafted token and the target's own)."""
        return max(0, len(view) - common_prefix(self.runtime.tokens, view) - 2)

    def _time_first_pass(self, seconds: float, missed: int) -> float:
        """Of a round's first pass, the seconds spent reading ``missed`` tokens: what it took past
        a pass that reads none (a running mean of those; before one is timed, the missed tokens'
        share of the pass's width). Learns that mean from passes that read nothing missed."""
        if missed <= 0:
            self._step = seconds if self._step is None else 0.8 * self._step + 0.2 * seconds
            return 0.0
        if self._step is None:
            return seconds * missed / (missed + self.runtime.pass_width)
        return max(seconds - self._step, 0.0)

    def _guess(self, sequence: list[int]) -> int | None:
        """A guess to feed after ``sequence``, only when the pass would otherwise re-feed a cached
        token (exactly one token of ``sequence`` is not cached): the pass keeps its 2-token width."""
        if self.guesser is None or len(sequence) - common_prefix(self.runtime.tokens, sequence) != 1:
            return None
        return self.guesser.guess(sequence)

    def _padded(self, rows: list[np.ndarray]) -> np.ndarray:
        """Rows over the target's vocabulary: ids past the draft head's rows have q = 0."""
        probs = np.zeros((len(rows), self.vocab_size))
        probs[:, : self.runtime.vocab_size] = np.stack(rows)
        return probs

    def draft_free(self, context: Sequence[int], k: int, params: SamplingParams, bar: float = 1.0) -> Draft:
        return Draft([], None, 0.0)

    def catch_up(self, context: Sequence[int], chunk: int) -> Iterator[int]:
        return self.runtime.feed(self.cut_view(context), chunk)

    def behind(self, context: Sequence[int]) -> int:
        return self._missed(self.cut_view(context))

    def observe(self, drafted: int, accepted: int) -> None:
        if self.adaptive and drafted:
            current = self.k or drafted
            self.k = current + 2 if accepted == drafted else max(1, current - 1)

    def rollback(self, accepted: Sequence[int]) -> None:
        self.runtime.trim(common_prefix(self.runtime.tokens, self.cut_view(accepted)))

    @property
    def kv_cache_bytes(self) -> int:
        return self.runtime.kv_cache_bytes


class CopyDrafter:
    """A drafter that copies tokens from text seen before instead of running a model: its
    proposals cost no pass, only verify rows, and are deterministic (a one-hot draft
    distribution). Subclasses say where a copy comes from (:meth:`lookup`).

    A ``price`` (the machine's :meth:`engine.core.pacing.PassCosts.worth_copying`) cuts each copy
    to the length whose verify pass pays best at the acceptance its copies have had (an
    exponential average over their verdicts, starting at 0.75), and drops it where none beats
    the round's ``bar`` (what the alternative gains: a plain step's pace, or the draft model's
    where it runs faster); each copy dropped moves that average a step back toward 0.75, so a few
    early misses do not stop copying for the rest of the conversation. Where even 0.75 does not
    pay (a 2-token pass costs 1.5 plain steps on ggml's kernels), every :data:`PROBE_AFTER`-th
    copy in a row that would be dropped is verified anyway, at the length that promises the most
    at any bar: without verdicts the average could never learn that copies land (on edits, 0.9)."""

    DECAY = 0.9  # the weight of the earlier verdicts at each new one
    PRIOR = (3.0, 1.0)  # accepted and rejected copied tokens before any verdict: 0.75
    PROBE_AFTER = 8  # copies dropped in a row before one is verified to learn from

    def __init__(self, vocab_size: int, span: int | None = None, price: Price | None = None):
        """``span``: copy up to this many tokens per round (default: the round's k). A copied run
        costs no draft pass, only verify rows, so it pays to copy further than a model drafts.
        ``price``: how many of the offered tokens to copy at a given acceptance, context length
        and bar."""
        self.vocab_size = vocab_size
        self.span = span
        self.price = price
        self._accepted, self._rejected = self.PRIOR
        self._dropped = 0  # copies dropped in a row

    def lookup(self, context: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens to copy after ``context`` (none: nothing seen fits)."""
        raise NotImplementedError

    @property
    def acceptance(self) -> float:
        """The share of copied tokens the target accepts: accepted / (accepted + rejections),
        each copy ending in at most one rejection."""
        return self._accepted / (self._accepted + self._rejected)

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator, copies: bool = True
    ) -> Draft:
        return self.draft_free(context, k, params) if copies else Draft([], None, 0.0)

    def draft_free(self, context: Sequence[int], k: int, params: SamplingParams, bar: float = 1.0) -> Draft:
        start = time.perf_counter()
        tokens = self.lookup(np.asarray(context), self.span or k)
        if self.price is not None and tokens:
            priced = self.price(len(tokens), self.acceptance, len(context), bar)
            self._dropped = 0 if priced else self._dropped + 1
            if self._dropped >= self.PROBE_AFTER:  # a probe, for a verdict
                priced, self._dropped = max(1, self.price(len(tokens), self.acceptance, len(context), 0.0)), 0
            elif not priced:  # no verdict comes in while none is copied: drift back toward the prior
                self._weigh(0.0, 0.0, prior=True)
            tokens = tokens[:priced]
        probs = None
        if not params.greedy:
            probs = np.zeros((len(tokens), self.vocab_size))
            probs[np.arange(len(tokens)), tokens] = 1.0
        return Draft(tokens, probs, time.perf_counter() - start, acceptance=self.acceptance)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._weigh(accepted, float(accepted < drafted))

    def _weigh(self, accepted: float, rejected: float, prior: bool = False) -> None:
        """Age the counts by :data:`DECAY` and add a verdict (or, with ``prior``, a share of the prior)."""
        share = 1 - self.DECAY if prior else 0.0
        self._accepted = self.DECAY * self._accepted + accepted + share * self.PRIOR[0]
        self._rejected = self.DECAY * self._rejected + rejected + share * self.PRIOR[1]

    def catch_up(self, context: Sequence[int], chunk: int) -> Iterator[int]:
        return iter(())

    def behind(self, context: Sequence[int]) -> int:
        return 0

    def rollback(self, accepted: Sequence[int]) -> None:
        pass

    @property
    def kv_cache_bytes(self) -> int:
        return 0


class LookupDrafter(CopyDrafter):
    """Prompt-lookup drafting: find where the context's last ``min_ngram`` tokens occurred
    before, pick the occurrence whose preceding tokens match the context's furthest back
    (up to ``max_ngram``; the latest on a tie), and propose what followed it."""

    def __init__(
        self,
        vocab_size: int,
        min_ngram: int = 2,
        max_ngram: int = 32,
        min_match: int | None = None,
        span: int | None = None,
        price: Price | None = None,
    ):
        """``min_match``: propose only when at least this many tokens match (default ``min_ngram``)."""
        super().__init__(vocab_size, span, price)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.min_match = min_match or min_ngram

    def lookup(self, context: np.ndarray, k: int) -> list[int]:
        n = self.min_ngram
        if len(context) <= n:
            return []
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        best, best_length = -1, -1
        for hit in hits[::-1]:
            length = self._match_length(context, int(hit) + n)
            if length > best_length:
                best, best_length = int(hit) + n, length
        return [int(t) for t in context[best : best + k]] if best_length >= self.min_match else []

    def _match_length(self, context: np.ndarray, end: int) -> int:
        """How many tokens before ``end`` equal the context's last tokens (capped at ``max_ngram``)."""
        length, limit = 0, min(self.max_ngram, end)
        while length < limit and context[end - 1 - length] == context[len(context) - 1 - length]:
            length += 1
        return length


class HybridDrafter:
    """Prompt lookup where the context repeats itself, the draft model elsewhere."""

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter):
        self.lookup = lookup
        self.model = model
        self._model_proposed = False  # who made the last proposal: the verdict is for them

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator, copies: bool = True
    ) -> Draft:
        # A paced round is offered draft_free() first and proposes without copies after it: the copy
        # found nothing or the pacer refused it (copies slower than this text's pace).
        draft = self.draft_free(context, k, params) if copies else Draft([], None, 0.0)
        self._model_proposed = not draft.tokens
        return self.model.propose(context, k, params, rng) if self._model_proposed else draft

    def draft_free(self, context: Sequence[int], k: int, params: SamplingParams, bar: float = 1.0) -> Draft:
        self._model_proposed = False
        return self.lookup.draft_free(context, k, params, bar)

    def observe(self, drafted: int, accepted: int) -> None:
        (self.model if self._model_proposed else self.lookup).observe(drafted, accepted)

    def catch_up(self, context: Sequence[int], chunk: int) -> Iterator[int]:
        return self.model.catch_up(context, chunk)

    def behind(self, context: Sequence[int]) -> int:
        return self.model.behind(context)

    def rollback(self, accepted: Sequence[int]) -> None:
        self.model.rollback(accepted)

    @property
    def kv_cache_bytes(self) -> int:
        return self.model.kv_cache_bytes
