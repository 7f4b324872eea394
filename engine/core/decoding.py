"""Autoregressive and speculative decoding over OpenVINO KV caches.

Both modes share one loop and one sampling rule. A speculative round drafts K
tokens, scores all K+1 positions with one target pass, applies the accept/reject
rule, then rolls both KV caches back to the accepted prefix before anything is
yielded, so stopping between rounds always leaves the caches consistent. The first
round of every request is a plain target step over the prompt, in every mode, so
greedy speculative decoding runs the very passes autoregressive decoding runs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import ClassVar

import numpy as np

from engine.core.drafters import Draft, Drafter
from engine.core.metrics import Stats
from engine.core.runtime import Runtime, common_prefix
from engine.core.sampling import SamplingParams, logits_to_probs, next_token, top_probability
from engine.core.speculative import accept_draft, accept_greedy
from engine.errors import ContextLimitError

# What a speculative round must promise over plain steps before a request tries one: its passes
# leave out the draft's catch-up over the conversation, the first pass of each new shape and the
# trims after rejections, which a first try pays too (0.5-1.0 s per answer on an AVX2 CPU where a
# round promised 9% at most; docs/benchmarks.md, "An AVX2 machine").
TRY_MARGIN = 1.1
# Contexts at which the engine times what a rejection costs the target (PassCosts.rejection).
REJECTION_CONTEXTS = (1000, 4000, 8000)
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
    # The acceptance a speculative round needs to pay on this machine after a context of so many
    # tokens (PassCosts.break_even).
    break_even: Callable[[int], float] = lambda context: 0.0  # no machine figures: any round may pay
    # Tokens that open or close a code block (they hold a ```): a paced request keeps one pacer for
    # code and one for the text around it.
    fence_ids: frozenset[int] = frozenset()


def expected_tokens(alpha: float, k: int) -> float:
    """The tokens a round of ``k`` drafted tokens keeps on average where each is accepted with
    probability ``alpha``, the target's own token included: (1 − α^(k+1)) / (1 − α) (Leviathan
    et al. 2023)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even_acceptance(ratio: float, k: int, rejection: float = 0.0) -> float:
    """The per-token acceptance rate at which a round of ``k`` drafted tokens that costs ``ratio``
    plain target steps, and ``rejection`` more where not all of them are accepted, yields as many
    tokens per second as plain steps: its expected tokens equal its expected cost. 0 where any
    round pays; infinite where not even a round that keeps every drafted token does."""

    def cost(alpha: float) -> float:
        return ratio + (1 - alpha**k) * rejection

    if cost(0.0) <= 1:
        return 0.0
    if ratio >= k + 1:
        return math.inf
    low, high = 0.0, 1.0
    for _ in range(40):
        alpha = (low + high) / 2
        if expected_tokens(alpha, k) < cost(alpha):
            low = alpha
        else:
            high = alpha
    return high


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a plain target step, of target passes over a few widths (``verify``: width,
    seconds) and of a draft step, timed on this machine at start. What a speculative round costs
    against a plain step differs from CPU to CPU far more than the draft's agreement does: a
    5-token verify pass cost 1.4 plain steps on an AVX-512 machine, 2.5 on an AVX2 one
    (docs/benchmarks.md, "An AVX2 machine"), where drafts must land nine times in ten to pay."""

    step: float
    verify: tuple[tuple[int, float], ...]
    draft: float
    k: int
    # (context, plain steps at that context) a rejection adds after that many tokens: the exact
    # trim of the target's cache (a copy of every state) and the plugin regrowing its buffers.
    rejection: tuple[tuple[int, float], ...] = ()
    # (context, plain steps at that context) a pass over K + 1 tokens costs after that many tokens:
    # attention for several rows grows with the context faster than a single row's (on an AVX-512
    # CPU 1.3 steps after 16 tokens, 2.4 after 2,000; docs/benchmarks.md, "What a pass costs as the
    # context grows").
    long_verify: tuple[tuple[int, float], ...] = ()

    @classmethod
    def measure(
        cls, target: Runtime, draft: Runtime, k: int, widths: Sequence[int] = (), repeats: int = 3
    ) -> PassCosts:
        """Time each pass ``repeats`` times after a short context (the medians): the target's at
        width 1, 2, ``k`` + 1 and ``widths``; and, at each of :data:`REJECTION_CONTEXTS`, a
        rejection's rollback and a pass over ``k`` + 1 tokens. Both caches are left empty."""

        def timed(runtime: Runtime, width: int) -> float:
            start = time.perf_counter()
            runtime.forward([0] * width, rows=width)
            return time.perf_counter() - start

        def median_pass(runtime: Runtime, width: int) -> float:
            runtime.reset()
            runtime.forward([0] * 16)
            seconds = []
            for _ in range(repeats + 1):  # the first pass of a shape sets it up: not counted
                seconds.append(timed(runtime, width))
                runtime.trim(16)
            runtime.reset()
            return statistics.median(seconds[1:])

        def at_context(runtime: Runtime, context: int) -> tuple[float, float]:
            """What a trim after ``context`` tokens (states set directly: no prefill) adds to the
            next step, the trim included, and what a pass over K + 1 tokens costs there, both in
            plain steps at that context (timed once: at 8,000 tokens a try costs a second on AVX2)."""
            runtime.fill(context)
            runtime.forward([0])  # the plugin regrows its buffers after the states were set
            plain = timed(runtime, 1)
            start = time.perf_counter()
            runtime.trim(context + 1)
            runtime.forward([0])
            extra = time.perf_counter() - start - plain
            runtime.forward([0] * (k + 1), rows=k + 1)  # the first pass of this shape sets it up
            verify = timed(runtime, k + 1)
            runtime.release()  # (a reset would keep the plugin's buffers for this many tokens)
            return max(extra, 0.0) / plain, verify / plain

        verify = tuple((width, median_pass(target, width)) for width in sorted({2, k + 1, *widths}))
        contexts = sorted({min(c, target.max_context // 2) for c in REJECTION_CONTEXTS})
        long = [(c, at_context(target, c)) for c in contexts]
        return cls(
            median_pass(target, 1),
            verify,
            median_pass(draft, draft.pass_width),
            k,
            rejection=tuple((c, rejection) for c, (rejection, _) in long),
            long_verify=tuple((c, ratio) for c, (_, ratio) in long),
        )

    def ratio(self, width: int, context: int = 0) -> float:
        """What a target pass over ``width`` tokens costs in plain steps after ``context`` tokens:
        interpolated between the widths measured after a short context (on both kinds of CPU
        measured, nearly linear past 2), plus what the context adds to a pass of K + 1 tokens,
        shared evenly among its rows past the first."""
        return self._short_ratio(width) + (width - 1) / self.k * _over_contexts(context, self._context_added)

    @cached_property
    def _context_added(self) -> tuple[tuple[int, float], ...]:
        """(context, what it adds to a pass over K + 1 tokens, in plain steps): worked out once, as
        :meth:`ratio` is asked for every width a lookup copy might take, every round."""
        verify = self._short_ratio(self.k + 1)
        return tuple((c, max(ratio - verify, 0.0)) for c, ratio in self.long_verify)

    def _short_ratio(self, width: int) -> float:
        widths, seconds = zip(*((1, self.step), *self.verify), strict=True)
        return float(np.interp(width, widths, seconds)) / self.step

    def break_even(self, context: int = 0) -> float:
        """The draft's acceptance rate at which a round of K drafted tokens after ``context``
        tokens promises :data:`TRY_MARGIN` over plain steps: its draft steps and verify pass, and
        the target's rollback where a drafted token is rejected."""
        round_ = self.k * self.draft / self.step + self.ratio(self.k + 1, context)
        return break_even_acceptance(TRY_MARGIN * round_, self.k, TRY_MARGIN * self.rejection_cost(context))

    def rejection_cost(self, context: int) -> float:
        """What a rejected token adds after ``context`` tokens, in plain steps."""
        return _over_contexts(context, self.rejection)

    def worth_copying(self, offered: int, acceptance: float, context: int = 0) -> int:
        """How many of ``offered`` tokens that cost no draft pass (prompt lookup) to verify after
        ``context`` tokens, each accepted with probability ``acceptance``: the count whose round
        promises the most tokens per plain step's time, if that is at least :data:`TRY_MARGIN`;
        else 0. A round costs its verify pass and, where a token is rejected, the rollback of the
        target's cache (on an AVX2 CPU 0.4 plain steps at 1,000 tokens, 2 at 4,000, 7 at 8,000).
        Where the verify pass grows fast with its width (AVX2: 17 tokens cost 5.4 steps) a long
        copy pays only where copies land, and where it does not (AVX-512: 2 steps) the whole copy
        is taken."""
        trim = self.rejection_cost(context)
        best, promised = 0, TRY_MARGIN
        for n in range(1, offered + 1):
            cost = self.ratio(n + 1, context) + (1 - acceptance**n) * trim
            if (gain := expected_tokens(acceptance, n) / cost) >= promised:
                best, promised = n, gain
        return best


def _over_contexts(context: int, measured: tuple[tuple[int, float], ...]) -> float:
    """A figure measured at a few contexts (none: 0), at ``context``: interpolated between them
    from 0 at an empty cache, proportional to the context past the last."""
    if not measured:
        return 0.0
    contexts, values = zip(*measured, strict=True)
    if context > contexts[-1]:
        return values[-1] * context / contexts[-1]
    return float(np.interp(context, (0, *contexts), (0.0, *values)))


@dataclass
class Pacer:
    """Whether a request's next round speculates: only while speculation pays, as measured.

    Keeps the seconds per new token of the request's speculative rounds and of its plain target
    steps (exponential averages of seconds and of tokens per round; a round's time includes its
    rollback), and runs the cheaper kind. The other kind runs once after ``interval`` rounds, so
    both figures follow the answer (acceptance changes along it, costs grow with the context); a
    probe weighs half against its kind's stale figure. A probe that confirms the order doubles the
    interval (up to ``max_interval``: a probe of the slower kind costs time), one that reverses it
    resets it.

    Trying speculation costs a round that may not pay and, the first time, the draft's catch-up
    over the whole conversation; so speculation is tried (and probed) only where the target looks
    predictable. The draft model agrees with the target's greedy token about as often as the
    target's own top probability says (per prompt, 24 prompts: docs/design.md, "Speculating only
    while it pays"), so the pacer keeps an average of that probability over the plain steps and
    tries speculation only while it is at least ``floor``, and at least the acceptance a round
    needs to pay on this machine (``break_even``, from :class:`PassCosts`); a request starts with
    ``lead`` plain steps to measure it. That confidence runs ahead of the draft where the target is
    sure of code: teacher-forced on held-out coding answers the draft agrees with 0.89 of the
    target's tokens (docs/benchmarks.md, "A layer-pruned draft"), so where a round needs more than
    ``ceiling`` (an AVX2 CPU, thousands of tokens of history) speculation is not tried at all: every
    try measured there lost time. Which kind runs changes the passes only: every round's
    tokens follow the target's rule, so greedy output is the same and sampled output keeps its
    distribution.
    """

    lead: ClassVar[int] = 2
    floor: ClassVar[float] = 0.75
    ceiling: ClassVar[float] = 0.9  # the most acceptance a round may need (the draft's agreement on code)
    most: int = 5  # the most tokens a speculative round can keep (K + 1)
    break_even: float = 0.0  # the acceptance a round needs to pay here (PassCosts.break_even)
    min_interval: int = 8
    max_interval: int = 64
    weight: float = 0.3
    seconds: dict[bool, float] = field(default_factory=dict)  # average seconds per round; True: speculative
    tokens: dict[bool, float] = field(default_factory=dict)  # average new tokens per round
    streak: int = 0  # rounds of the cheaper kind since the last probe
    interval: int = 8
    confidence: float = 0.0  # average top probability of the target at plain steps
    observed: int = 0  # plain steps behind it

    def cost(self, speculative: bool) -> float:
        """Seconds per new token: averaged over rounds as a ratio of averages, so one round that
        keeps a single token does not outweigh the rounds that keep five."""
        return self.seconds[speculative] / self.tokens[speculative]

    def _cheaper(self) -> bool:
        return self.cost(True) <= self.cost(False)

    def _could_pay(self) -> bool:
        """Whether a speculative round of the average duration beats plain steps if it keeps
        ``most`` tokens (at long contexts a verify pass and a trim can cost more than that)."""
        return self.seconds[True] / self.most < self.cost(False)

    def _promising(self) -> bool:
        reachable = self.break_even <= self.ceiling
        return reachable and self.observed >= self.lead and self.confidence >= max(self.floor, self.break_even)

    def observe(self, top_probability: float) -> None:
        """The target's top probability at a plain step."""
        first = not self.observed
        self.confidence += (1.0 if first else self.weight) * (top_probability - self.confidence)
        self.observed += 1

    def speculate(self) -> bool:
        if True not in self.seconds:  # not tried yet
            return self._promising()
        if False not in self.seconds:
            return False
        if self.streak < self.interval:
            return self._cheaper()
        # Time for a probe of the other kind; one of speculation waits until it looks promising,
        # and is skipped while even a round that kept every drafted token would not pay.
        return not self._cheaper() and self._promising() and self._could_pay()

    def record(self, speculative: bool, seconds: float, tokens: int) -> None:
        both = len(self.seconds) == 2
        if both and speculative == self._cheaper():  # the cheaper kind again
            self._average(speculative, seconds, tokens, self.weight)
            if self._cheaper() != speculative:  # its own average says the other kind is cheaper now
                self.streak, self.interval = 0, self.min_interval
            else:
                self.streak += 1
            return
        order = self._cheaper() if both else None
        # A first measurement, or a probe: it weighs half against a figure that has gone stale.
        self._average(speculative, seconds, tokens, 0.5)
        if order is not None:
            self.streak = 0
            confirmed = self._cheaper() == order
            self.interval = min(2 * self.interval, self.max_interval) if confirmed else self.min_interval

    def _average(self, speculative: bool, seconds: float, tokens: int, weight: float) -> None:
        """Move the kind's averages toward this round by ``weight`` (a first round sets them)."""
        for figures, value in ((self.seconds, seconds), (self.tokens, max(tokens, 1))):
            old = figures.get(speculative, value)
            figures[speculative] = old + weight * (value - old)


@dataclass
class Round:
    tokens: list[int]
    provenance: list[Provenance]


class Decoder:
    """One request's decoding state: its context, counters, sampler and pacer. ``prefill`` fills
    the target's cache with the prompt; then each :meth:`round` (alone on the request's own
    caches) or :meth:`take` (a row of a batched target pass) adds a round's tokens, until
    :attr:`done`. Either way every token follows the target's rule, so a request can move
    between the two at any round boundary."""

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
        # draft reaches), a paced request never runs it, nor watches for a chance to: only its free
        # drafts remain.
        self.modelled = self.speculative and not (config.paced and config.break_even(0) > Pacer.ceiling)
        # The draft agrees with the target far more often in code than in the prose around it
        # (docs/design.md, "Speculating only while it pays"): what a pacer learned on one says little
        # about the other, so each keeps its own, and an answer moving into a code block starts
        # trying speculation there at once, without waiting out an interval learned on prose.
        self._pacers = (Pacer(most=config.k + 1), Pacer(most=config.k + 1)) if config.paced and self.modelled else None
        self.in_code = False  # inside a code block of the answer (an odd number of fences so far)
        self.rng = np.random.default_rng(config.sampling.seed)
        self.context = list(prompt)
        self.done = False
        self._caught_up = False  # the draft has read the conversation (before its first speculative round)
        stats.prompt_tokens = len(prompt)
        stats.cached_tokens = min(common_prefix(target.tokens, self.context), len(self.context) - 1)

    @property
    def pacer(self) -> Pacer | None:
        """The pacer of the kind of text the answer is in (code or not), if paced."""
        return None if self._pacers is None else self._pacers[self.in_code]

    def prefill(self) -> Iterator[int]:
        """The prompt's passes but the last (which gives the first token's logits), in chunks;
        yields the prompt tokens read after each, so a caller can show progress and stop between
        them."""
        passes = self.target.feed(self.context, PREFILL_CHUNK)
        while True:
            start, before = time.perf_counter(), self.target.passes
            read = next(passes, None)
            self.stats.target_seconds += time.perf_counter() - start
            self.stats.target_passes += self.target.passes - before
            if read is None:
                return
            yield read

    def room(self) -> int:
        """Drafted tokens that fit in this round (the budget and the context); marks the request
        :attr:`done` when not even the round's own token fits."""
        left = min(self.config.max_new_tokens - self.stats.new_tokens, self.target.max_context - len(self.context))
        if left <= 0:
            self.stats.finish_reason = "length" if self.stats.new_tokens >= self.config.max_new_tokens else "context"
            self.done = True
        return left - 1

    def _speculates(self, limit: int) -> bool:
        """Whether the next round drafts with the drafter's model (``limit``: drafted tokens that
        fit)."""
        if self.pacer is not None:  # a round costs more the longer the context
            self.pacer.break_even = self.config.break_even(len(self.context))
        paced = self.pacer is None or self.pacer.speculate()
        return self.modelled and self.stats.rounds > 0 and limit > 0 and paced

    def _free_draft(self, limit: int) -> Draft | None:
        """A paced request's draft that costs no model pass (prompt lookup, priced by the drafter
        against this machine's pass costs), tried at every round whatever the pacer says: only
        the pacer's choice between the draft model and plain steps has a price to learn."""
        if not (self.config.paced and self.speculative and self.stats.rounds > 0 and limit > 0):
            return None
        assert self.drafter is not None
        draft = self.drafter.free(self.context, min(self.config.k, limit), self.config.sampling).head(limit)
        return draft if draft.tokens else None

    def catch_up(self) -> Iterator[int]:
        """The draft's own long prefill, before the first speculative round (in chunks)."""
        if self.drafter is None or self._caught_up or not self._speculates(self.room()):
            return
        self._caught_up = True
        start = time.perf_counter()
        yield from self.drafter.catch_up(self.context, PREFILL_CHUNK)
        self.stats.draft_seconds += time.perf_counter() - start

    def round(self) -> Round:
        """One round on the request's own caches: speculative (while it pays, when paced) or a
        plain target step. The first round is a plain step over the prompt in every mode, so the
        target runs the same passes in every mode (docs/design.md, "Why greedy speculative output
        is exact")."""
        limit = self.room()
        pacer, drafter = self.pacer, self.drafter
        free = self._free_draft(limit)
        spec = free is None and self._speculates(limit)
        start = time.perf_counter()
        if drafter is not None and (free or spec):
            draft = free or drafter.propose(self.context, min(self.config.k, limit), self.config.sampling, self.rng)
            round_ = _speculative_round(
                self.target, drafter, self.context, draft.head(limit), self.config.sampling, self.rng, self.stats
            )
        else:
            logits = _target_logits(self.target, self.context, 1, self.stats)
            if pacer is not None:  # (not in a batch's rows: a softmax each would cost ~2% of a batched step)
                pacer.observe(top_probability(logits[-1]))
            round_ = self._plain(logits[-1])
        round_ = self._accept(round_)
        # Roll both caches back to the accepted prefix (rejected drafts leave no trace).
        self.target.trim(common_prefix(self.target.tokens, self.context))
        if drafter is not None:
            drafter.rollback(self.context)
        if pacer is not None and self.stats.rounds > 1 and free is None:
            pacer.record(spec, time.perf_counter() - start, len(round_.tokens))
            self.stats.plain_rounds += not spec
        return round_

    def take(self, logits: np.ndarray, seconds: float) -> Round:
        """A plain round from the logits of this request's row in a batched target pass (which fed
        the context's last token); ``seconds``: that pass's time."""
        self.stats.target_seconds += seconds
        self.stats.target_passes += 1
        self.stats.plain_rounds += self.stats.rounds > 0 and self.speculative
        return self._accept(self._plain(logits))

    def _plain(self, logits: np.ndarray) -> Round:
        return Round([next_token(logits, self.config.sampling, self.rng)], [Provenance.AUTOREGRESSIVE])

    def _accept(self, round_: Round) -> Round:
        """Cut the round at a stop token, add it to the context and the counters."""
        stop_at = next((i for i, t in enumerate(round_.tokens) if t in self.config.stop_ids), None)
        if stop_at is not None:
            round_ = Round(round_.tokens[:stop_at], round_.provenance[:stop_at])
            self.stats.finish_reason = "stop"
            self.done = True
        self.context += round_.tokens
        self.in_code ^= sum(token in self.config.fence_ids for token in round_.tokens) % 2 == 1
        self.stats.rounds += 1
        self.stats.add_tokens(len(round_.tokens))
        self.stats.target_kv_bytes = self.target.kv_cache_bytes
        self.stats.draft_kv_bytes = self.drafter.kv_cache_bytes if self.drafter is not None else 0
        if not self.done:
            self.room()
        return round_


def decode(
    target: Runtime, drafter: Drafter | None, prompt: Sequence[int], config: DecodeConfig, stats: Stats
) -> Iterator[Round]:
    """Yield the tokens of each round until a stop token, the token budget or the context limit,
    on the request's own caches."""
    decoder = Decoder(target, drafter, prompt, config, stats)
    if not _until_cancelled(decoder.prefill(), config):
        stats.finish_reason = "cancelled"
        return
    decoder.room()
    while not decoder.done:
        if not _until_cancelled(decoder.catch_up(), config):
            stats.finish_reason = "cancelled"
            return
        yield decoder.round()


def _until_cancelled(passes: Iterator[int], config: DecodeConfig) -> bool:
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


def _speculative_round(
    target: Runtime,
    drafter: Drafter,
    context: list[int],
    draft: Draft,
    params: SamplingParams,
    rng: np.random.Generator,
    stats: Stats,
) -> Round:
    """Verify ``draft`` (``drafter``'s proposal) with one target pass and keep what the rule accepts."""
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
