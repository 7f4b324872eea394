"""When the paced mode (``best``) runs the draft model: what passes cost on this machine, and what
each kind of round has gained, measured while it runs.

:class:`PassCosts` times the target's passes and the draft's step at start. From them comes the
one decision made before anything runs: where even a round whose drafts all land could not beat
plain steps by :data:`TRY_MARGIN` against the draft's best agreement (:data:`CEILING`; an AVX2 CPU,
where a verify pass costs several plain steps), the draft model is never run; and the price of a prompt
lookup copy (:meth:`PassCosts.worth_copying`). Everything else is measured while requests run:
each :class:`Pacer` compares the seconds per new token of the rounds it ran with the draft model
and of its plain steps, runs the cheaper kind and probes the other now and then. Start-up timings
are one reading on a machine that may be busy; the rounds themselves are the truth.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property

import numpy as np

from engine.core.runtime import Runtime

# What a speculative round must promise over plain steps before a request tries one: its passes
# leave out the draft's catch-up over the conversation, the first pass of each new shape and the
# trims after rejections, which a first try pays too (docs/benchmarks.md, "An AVX2 machine").
TRY_MARGIN = 1.1
# The widths a batched pass may take (its rows' copies cut to fit): a few, each measured as it runs.
BATCH_WIDTHS = (1, 2, 3, 5, 9, 17)
# Contexts at which the engine times what a rejection costs the target (PassCosts.rejection).
REJECTION_CONTEXTS = (1000, 4000, 8000)


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
    against a plain step differs from CPU to CPU far more than the draft's agreement does
    (docs/benchmarks.md, "An AVX2 machine": there drafts must land nine times in ten to pay)."""

    step: float
    verify: tuple[tuple[int, float], ...]
    draft: float
    k: int
    # (context, plain steps at that context) a rejection adds after that many tokens: the exact
    # trim of the target's cache (a copy of every state) and the plugin regrowing its buffers.
    rejection: tuple[tuple[int, float], ...] = ()
    # (context, plain steps at that context) a pass over K + 1 tokens costs after that many tokens:
    # attention for several rows grows with the context faster than a single row's (docs/benchmarks.md,
    # "What a pass costs as the context grows").
    long_verify: tuple[tuple[int, float], ...] = ()

    @classmethod
    def measure(
        cls, target: Runtime, draft: Runtime, k: int, widths: Sequence[int] = (), repeats: int = 7
    ) -> PassCosts:
        """Time each pass ``repeats`` times after a short context: the target's at width 1, 2,
        ``k`` + 1 and ``widths`` and a draft step, in rounds that take each once, each against its
        round's plain step (the medians of those ratios: a machine's speed may drift by 10% within
        minutes, and passes timed a second apart still compare); and, at each of
        :data:`REJECTION_CONTEXTS`, a rejection's rollback and a pass over ``k`` + 1 tokens. Both
        caches are left empty."""

        def timed(runtime: Runtime, width: int) -> float:
            start = time.perf_counter()
            runtime.forward([0] * width, rows=width)
            return time.perf_counter() - start

        def at_context(runtime: Runtime, context: int) -> tuple[float, float]:
            """What a trim after ``context`` tokens (states set directly: no prefill) adds to the
            next step, the trim included, and what a pass over K + 1 tokens costs there, both in
            plain steps at that context (timed once: a try at a long context is slow)."""
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

        passes = [(target, width) for width in sorted({1, 2, k + 1, *widths})] + [(draft, draft.pass_width)]
        seconds: list[list[float]] = [[] for _ in passes]
        for runtime in (target, draft):
            runtime.reset()
            runtime.forward([0] * 16)
        for runtime, width in passes:
            runtime.settle(width)
        for _ in range(repeats + 1):  # the first pass of a shape sets it up: not counted
            for (runtime, width), timings in zip(passes, seconds, strict=True):
                if runtime is target and width == 1:  # a plain step after a plain step, as decoding runs them
                    runtime.forward([0])  # (the first after a trim regrows the plugin's buffers)
                timings.append(timed(runtime, width))
                runtime.trim(16)
        target.reset()
        draft.reset()
        # Each pass against the plain step of its own round (the medians of those ratios), in
        # seconds of the median step: passes a second apart compare, minutes apart they do not.
        step = statistics.median(seconds[0][1:])
        medians = [step * statistics.median(t / s for t, s in zip(timings[1:], seconds[0][1:])) for timings in seconds]
        contexts = sorted({min(c, target.max_context // 2) for c in REJECTION_CONTEXTS})
        long = [(c, at_context(target, c)) for c in contexts]
        return cls(
            medians[0],
            tuple((width, median) for (_, width), median in zip(passes[1:-1], medians[1:-1], strict=True)),
            medians[-1],
            k,
            rejection=tuple((c, rejection) for c, (rejection, _) in long),
            long_verify=tuple((c, ratio) for c, (_, ratio) in long),
        )

    @staticmethod
    def draft_round(draft: Runtime, width: int, k: int, repeats: int = 7) -> float:
        """Seconds of the draft's passes in a round of ``k`` drafts fed ``width`` tokens at least
        (:attr:`Runtime.pass_width`; the median of ``repeats``): at width 1 a round's first pass
        catches up 2 tokens and the next go 1 by 1, changing the pass's shape twice a round; at
        width 2 every pass has one shape and re-feeds a token. Which costs less is the CPU's."""
        draft.reset()
        draft.forward([0] * 16)
        for fed in {2, width}:
            draft.settle(fed)
        rounds = []
        for _ in range(repeats + 1):  # (the first sets the shapes up: not counted)
            start = time.perf_counter()
            for fed in [2] + [width] * (k - 1):
                draft.forward([0] * fed)
            rounds.append(time.perf_counter() - start)
            draft.trim(16)
        draft.reset()
        return statistics.median(rounds[1:])

    @classmethod
    def from_figures(cls, figures: dict) -> PassCosts:
        """The costs kept as JSON (:mod:`engine.core.measured`): its lists back to tuples."""

        def pairs(name: str) -> tuple[tuple[int, float], ...]:
            return tuple((int(a), float(b)) for a, b in figures.get(name, ()))

        return cls(
            float(figures["step"]),
            pairs("verify"),
            float(figures["draft"]),
            int(figures["k"]),
            rejection=pairs("rejection"),
            long_verify=pairs("long_verify"),
        )

    @classmethod
    def read(cls, target: Runtime, draft: Runtime, k: int, widths: Sequence[int] = ()) -> PassCosts:
        """The costs the server paces by: one :meth:`measure`, and where that reading would keep
        the draft model off for the server's life (a break-even above :data:`CEILING`), a second,
        keeping the one that prices a round lower. A moment's load can price a round above what
        it costs (on the AVX-512 AMD VM one start read 0.96 where others read 0.83-0.94); below
        the ceiling the pacer judges the draft model's rounds as they run, and where rounds do
        cost that much (AVX2) both readings stay above it."""
        first = cls.measure(target, draft, k, widths)
        if first.break_even() <= CEILING:
            return first
        return min(first, cls.measure(target, draft, k, widths), key=lambda costs: costs.break_even())

    def describe(self) -> str:
        """The figures, for the log."""
        contexts = "/".join(str(context) for context, _ in self.rejection)
        return (
            f"target step {1e3 * self.step:.1f} ms; passes of {'/'.join(str(w) for w, _ in self.verify)} tokens "
            f"{'/'.join(f'{self.ratio(w):.2f}' for w, _ in self.verify)} steps; draft step {1e3 * self.draft:.1f} ms; "
            f"after {contexts} tokens a rejection adds {'/'.join(f'{r:.2f}' for _, r in self.rejection)} steps "
            f"and a {self.k + 1}-token pass costs {'/'.join(f'{r:.2f}' for _, r in self.long_verify)}: the draft "
            f"model pays above {self.break_even():.2f} acceptance after a short context"
            + ("" if self.break_even() <= CEILING else f", more than it reaches ({CEILING}): it is not run")
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

    def worth_copying(self, offered: int, acceptance: float, context: int = 0, bar: float = 1.0) -> int:
        """How many of ``offered`` tokens that cost no draft pass (prompt lookup) to verify after
        ``context`` tokens, each accepted with probability ``acceptance``: the count whose round
        promises the most tokens per plain step's time, if that is at least :data:`TRY_MARGIN`
        times ``bar`` (what the round would gain otherwise: 1 for a plain step); else 0. A round
        costs its verify pass and, where a token is rejected, the rollback of the target's cache
        (growing with the context: docs/benchmarks.md, "What a pass costs as the context grows").
        Where the verify pass grows fast with its width (AVX2) a long copy pays only where copies
        land, and where it does not (AVX-512) the whole copy is taken."""
        trim = self.rejection_cost(context)
        best, promised = 0, TRY_MARGIN * bar
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


class RoundKind(Enum):
    """What a pacer measures and chooses between."""

    DRAFT = "draft"  # a round whose tokens the draft model proposed
    PLAIN = "plain"  # a plain target step
    COPY = "copy"  # a round that verified a copy (prompt lookup or the n-gram pool)


class TextKind(Enum):
    """The kind of text an answer is in: the draft agrees with the target far more often in code
    than in the prose around it, so each has its own pacer and the server's memory of its own."""

    PROSE = "prose"
    CODE = "code"


DRAFT, PLAIN, COPY = RoundKind.DRAFT, RoundKind.PLAIN, RoundKind.COPY


@dataclass(frozen=True)
class Choice:
    """A pacer's choice for the next round: the draft model or a plain step. ``held``: a plain
    step only because the draft's catch-up would not pay over the rest of the answer, not because
    plain steps are cheaper (it is no probe of them)."""

    kind: RoundKind
    held: bool = False


# The most acceptance a round may need, by the start-up timings and with TRY_MARGIN, before the
# draft model is never run. On AVX-512 (AMD, ggml's kernels) the timings read 0.83-0.94 from start
# to start, and at 0.94 the draft model's rounds still made `sd` 1.14x `ar` on the coding prompts
# (rounds measured cheaper than the start-up timings price them); on AVX2
# a round costs 4.4-4.6 plain steps (0.98 and more), where every try measured lost time
# (docs/benchmarks.md, "An AVX2 machine"). Below it the pacer judges by the rounds.
CEILING = 0.95


@dataclass
class Figures:
    """Exponential averages of one kind of round: its seconds and its new tokens."""

    seconds: float
    tokens: float
    rounds: int = 1  # averaged so far: the server's memory is a running mean down to its weight

    @property
    def cost(self) -> float:
        """Seconds per new token: a ratio of averages, so one round that keeps a single token does
        not outweigh the rounds that keep five."""
        return self.seconds / self.tokens

    def move(self, seconds: float, tokens: int, weight: float) -> None:
        self.seconds += weight * (seconds - self.seconds)
        self.tokens += weight * (max(tokens, 1) - self.tokens)


@dataclass
class Pacer:
    """Whether a request's next round runs the draft model: where its rounds have kept more tokens
    per second than plain steps, as measured while the request runs.

    A new pacer starts from ``memory``, what the server's earlier rounds on this kind of text
    measured (shared by every request's pacer, and moved by each round), so it runs the kind that
    has been cheaper from its first round and probes plain steps only every :attr:`MAX_INTERVAL`
    rounds, or the draft model after :attr:`MIN_INTERVAL` and then up to every
    :attr:`MAX_SPECULATIVE_INTERVAL` (its probes dearer); with no memory it tries the draft
    model, then one plain step to compare. It runs the cheaper kind and
    the other once after ``interval`` rounds, as acceptance changes along an answer and costs grow
    with the context. A probe is one more round of its kind in the running mean; one that confirms
    the order doubles the interval (up to :meth:`_longest`), one that reverses it, or alone beat
    the preferred kind, starts it over. A probe of the draft model is skipped while even a round
    that kept every drafted token would not beat a plain step.

    :meth:`choose` only answers; :meth:`record` and :meth:`record_copy` count a round, and
    :meth:`offer_copy` counts an offer. Which kind runs changes the passes only: every token
    follows the target's rule, so greedy output is the same and sampled output keeps its
    distribution."""

    # How far one round moves its kind's averages: a running mean over the request's rounds of that
    # kind, what the server measured before counting as PRIOR_ROUNDS of them, down to WEIGHT. Each
    # request learns its own text fast, and a long one is not swayed by a few unlucky rounds: a
    # speculative round keeps 1 to K + 1 tokens, and a fixed weight turned requests on code, where
    # the draft model paid, to plain steps (docs/design.md, "Speculating only while it pays").
    PRIOR_ROUNDS = 2
    WEIGHT = 0.1
    MEMORY_WEIGHT = 0.05  # the server's memory of a kind of text: its rounds' mean, then the last twenty-odd
    MIN_INTERVAL = 8
    MAX_INTERVAL = 32
    # A probe of the draft model where plain steps pay costs several times what a probe of a plain
    # step costs where the draft model pays (its catch-up, draft steps, a verify and the reshapes
    # after it, for a token or two on prose; docs/design.md, "Speculating only while it pays"):
    # so the draft model is probed at most half as often.
    MAX_SPECULATIVE_INTERVAL = 2 * MAX_INTERVAL
    PROBE_CATCH_UP = 4.0
    HYSTERESIS = 0.05
    FAR = 0.25  # how much dearer the draft model's rounds were where its first probe waits longest

    most: int = 5  # the most tokens a speculative round can keep (K + 1)
    memory: dict[RoundKind, Figures] = field(default_factory=dict)
    figures: dict[RoundKind, Figures] = field(default_factory=dict)
    streak: int = 0  # rounds of the cheaper kind since the last probe
    interval: int = MIN_INTERVAL
    offers: int = 0  # copies offered while copies were the dearer kind
    rounds: dict[RoundKind, int] = field(default_factory=dict)  # of each kind, in this request
    _preferred: RoundKind | None = field(default=None, init=False)  # (see _update_preference)

    def __post_init__(self) -> None:
        self.figures = {kind: replace(figures) for kind, figures in self.memory.items()} | self.figures
        if self._both():  # the server knows which kind pays on this text: probes of plain steps seldom;
            # where plain steps paid before, the draft model is probed on this request's own text
            # after MIN_INTERVAL rounds (where its rounds came close), then less and less often
            # (starting at the longest interval, short answers never met it: docs/design.md,
            # "Speculating only while it pays")
            self._update_preference()
            self.interval = self.MAX_INTERVAL if self.preferred is DRAFT else self._first_speculative_interval()

    def _first_speculative_interval(self) -> int:
        """Where plain steps paid on this kind of text, the rounds before the first probe of the
        draft model: soon where its rounds came close (this request's text may be the kind it
        pays on), at the longest interval where they were far dearer (prose, on which each probe
        lost about two plain steps and almost none paid)."""
        far = self.figures[DRAFT].cost > (1 + self.FAR) * self.figures[PLAIN].cost
        return self.MAX_SPECULATIVE_INTERVAL if far else self.MIN_INTERVAL

    def _longest(self) -> int:
        """The longest interval between probes, by what a probe costs: of a plain step where the
        draft model pays, of the draft model where plain steps do."""
        return self.MAX_INTERVAL if self.preferred is DRAFT else self.MAX_SPECULATIVE_INTERVAL

    def _both(self) -> bool:
        return DRAFT in self.figures and PLAIN in self.figures

    @property
    def preferred(self) -> RoundKind:
        """The kind to run between probes, the draft model or plain steps (once both are measured)."""
        assert self._preferred is not None, "the preferred kind is known once both kinds are measured"
        return self._preferred

    def _update_preference(self) -> None:
        """Weigh the two kinds' figures again (called whenever they move, once both are measured):
        the draft model stays preferred until plain steps are cheaper by :attr:`HYSTERESIS`, and
        becomes so as soon as it is cheaper; the first comparison (from the memory, or a try and a
        step) gives it the margin. A switch to plain steps lasts eight rounds or more, then pays new
        pass shapes and the draft's catch-up, so a few unlucky rounds (1 to 5 tokens each) should
        not make it; but where the draft model's rounds merely break even (code on ggml's kernels,
        2 cores) a wider margin kept them running a few percent dearer than plain steps
        (docs/design.md, "Speculating only while it pays")."""
        draft, plain = self.figures[DRAFT].cost, self.figures[PLAIN].cost
        if self._preferred is None:
            prefers_draft = draft <= (1 + self.HYSTERESIS) * plain
        elif self._preferred is PLAIN:
            prefers_draft = draft <= plain
        else:
            prefers_draft = not plain * (1 + self.HYSTERESIS) < draft
        self._preferred = DRAFT if prefers_draft else PLAIN

    def _could_pay(self) -> bool:
        """Whether a round of the draft model's average duration that kept ``most`` tokens would
        beat plain steps (after thousands of tokens a verify pass and a trim can cost more)."""
        return self.figures[DRAFT].seconds / self.most < self.figures[PLAIN].cost

    def bar(self) -> float:
        """What the kind of round this pacer prefers gains, in tokens per plain step's time: the
        draft model's measured pace where its rounds have been the cheaper kind, else 1 (plain
        steps). A copied draft must beat it to be worth its verify rows."""
        if not self._both() or self.preferred is PLAIN:
            return 1.0
        return max(1.0, self.figures[PLAIN].cost / self.figures[DRAFT].cost)  # (within the hysteresis: 1)

    def offer_copy(self) -> bool:
        """Offer this round's copy (priced worth its rows): whether to verify it. Yes where copies
        have kept more tokens per second than the kind this pacer prefers, or are not measured
        yet; else one offer in :attr:`MIN_INTERVAL` (counted here), to measure them again. Their
        price comes from start-up timings of passes of one width each; what they really cost here
        (the widths changing from round to round, the draft catching up after them) only rounds
        measure (docs/design.md, "Speculating only while it pays")."""
        known = [self.figures[kind].cost for kind in (DRAFT, PLAIN) if kind in self.figures]
        if COPY not in self.figures or not known or self.figures[COPY].cost <= min(known):
            return True
        self.offers += 1
        return self.offers % self.MIN_INTERVAL == 0

    def choose(self, switch: float = 0.0, remaining: int = 0) -> Choice:
        """Which kind the next round runs (it changes nothing). ``switch``: the seconds the draft
        model would first spend reading what it missed while it did not run (the prompt, plain
        steps); ``remaining``: the tokens the answer may still take. A switch to the draft model
        may cost :attr:`PROBE_CATCH_UP` plain steps of catch-up; one that costs more must earn it
        back over the rest of the answer at the measured pace (after thousands of tokens of
        history the draft's first read of its window costs more than the rounds it could run win
        back): else a plain step runs, ``held``."""
        if DRAFT not in self.figures:  # not measured yet: try it
            return Choice(DRAFT)
        if PLAIN not in self.figures:  # then a plain step, to compare
            return Choice(PLAIN)
        if self.streak < self.interval:
            if self.preferred is PLAIN:
                return Choice(PLAIN)
            gain = (self.figures[PLAIN].cost - self.figures[DRAFT].cost) * remaining
            return Choice(PLAIN, held=True) if switch > max(gain, self._probe_budget()) else Choice(DRAFT)
        affordable = switch <= self._probe_budget()
        probe = self.preferred is PLAIN and self._could_pay() and affordable  # a probe of the other kind
        return Choice(DRAFT if probe else PLAIN)

    def _probe_budget(self) -> float:
        """The catch-up a switch to the draft model may cost whatever it gains: a few plain steps."""
        return self.PROBE_CATCH_UP * self.figures[PLAIN].seconds

    def record(self, kind: RoundKind, seconds: float, tokens: int, held: bool = False) -> None:
        """Count a round of ``kind`` (the draft model or a plain step; ``held``: as
        :meth:`choose` chose it): ``seconds`` for ``tokens`` new tokens, without the draft's
        catch-up (a cost of switching, weighed in :meth:`choose`: counted in its round, a probe
        after many plain steps looked dearer than plain steps and confirmed them)."""
        assert kind is not COPY, "a copy's round is counted by record_copy"
        both = self._both()
        order = self.preferred if both else None
        probe = both and kind is not order and not held  # (a held plain step is no probe)
        # A probe that alone beat the preferred kind's average (a plain step, by the hysteresis) is
        # not a confirmation, even where it did not yet move its own kind's average past it: the
        # next probe comes soon.
        # A probe of the draft model counts only where all its drafts but one landed: on prose one
        # that kept two or three tokens often beat a plain step by luck, and restarting the draft's
        # mean from it ran it on for rounds (`best` 0.93× `ar` on general chat).
        margin = 1.0 if kind is DRAFT else 1 + self.HYSTERESIS
        other = PLAIN if kind is DRAFT else DRAFT
        landed = kind is PLAIN or tokens >= self.most - 1
        promising = probe and landed and margin * seconds / max(tokens, 1) < self.figures[other].cost
        if promising:  # what changed may make the older rounds of its kind stale: it weighs as a first
            self.rounds[kind] = 0
        self._measure(kind, seconds, tokens)
        if not both:
            return
        if held and self.preferred is order:
            return
        if probe:
            self.streak = 0
            confirmed = self.preferred is order and not promising
            self.interval = min(2 * self.interval, self._longest()) if confirmed else self.MIN_INTERVAL
        elif self.preferred is not order:  # its own average says the other kind is cheaper now
            self.streak, self.interval = 0, self.MIN_INTERVAL
        else:
            self.streak += 1

    def record_copy(self, seconds: float, tokens: int) -> None:
        """Count a round that verified a copy: ``seconds`` for ``tokens`` new tokens."""
        self._measure(COPY, seconds, tokens)

    def _measure(self, kind: RoundKind, seconds: float, tokens: int) -> None:
        n = self.rounds[kind] = self.rounds.get(kind, 0) + 1
        self._move(self.figures, kind, seconds, tokens, max(self.WEIGHT, 1 / (n + self.PRIOR_ROUNDS)))
        if kind is not COPY and self._both():
            self._update_preference()
        # (a running mean from the server's first round: a fixed weight kept the first round's
        # figure, the dearest, with its new shapes, for the next twenty-odd requests, and no
        # request ran the draft model long enough to correct it: docs/design.md, "Speculating
        # only while it pays")
        seen = self.memory[kind].rounds + 1 if kind in self.memory else 1
        self._move(self.memory, kind, seconds, tokens, max(self.MEMORY_WEIGHT, 1 / seen))
        self.memory[kind].rounds = seen

    @staticmethod
    def _move(figures: dict[RoundKind, Figures], kind: RoundKind, seconds: float, tokens: int, weight: float) -> None:
        if kind in figures:
            figures[kind].move(seconds, tokens, weight)
        else:
            figures[kind] = Figures(seconds, max(tokens, 1))


class BatchPrices:
    """What a batched target pass costs by its rows and width, and so how wide the next runs: the
    rows' copies verified in it (each row's widest draft sets the pass's width; narrower rows are
    padded) against a plain batched step. Widths come from :data:`BATCH_WIDTHS` only: the CPU
    plugin pays a setup cost on every pass whose shape differs from the one before. Costs are
    measured as passes run, the cut of rejected drafts after each included, and priced until then
    from the lone passes' costs timed at start (a pass over all the rows' tokens against one over
    a token per row: :meth:`PassCosts.ratio`, growing in proportion past the widest timed; without
    them a width is free): a width is measured once it promises to pay."""

    WEIGHT = 0.2  # the weight of each new pass in a width's average

    def __init__(self, costs: PassCosts | None = None):
        self.costs = costs
        self._seconds: dict[tuple[int, int], float] = {}  # (rows, width): seconds of a pass and its cut

    def record(self, rows: int, width: int, seconds: float) -> None:
        """Count a pass over ``rows`` rows ``width`` tokens wide that took ``seconds``."""
        old = self._seconds.get((rows, width))
        self._seconds[rows, width] = seconds if old is None else old + self.WEIGHT * (seconds - old)

    def ratio(self, rows: int, width: int) -> float:
        """What a pass ``width`` wide costs in plain batched steps of as many rows."""
        plain, wide = self._seconds.get((rows, 1)), self._seconds.get((rows, width))
        if plain is not None and wide is not None:
            return wide / plain
        if self.costs is None:
            return 1.0
        return self._lone(rows * width) / self._lone(rows)

    def _lone(self, tokens: int) -> float:
        """A lone pass over ``tokens`` tokens, in plain steps (proportional past the widest timed)."""
        assert self.costs is not None
        widest = max((w for w, _ in self.costs.verify), default=1)
        return self.costs.ratio(min(tokens, widest)) * max(1.0, tokens / widest)

    def width(self, copies: Sequence[tuple[int, float]]) -> int:
        """The width of the next batched pass, one row per ``(tokens copied, their acceptance)``
        (no copy: 0 tokens): of :data:`BATCH_WIDTHS`, the one that promises the most tokens per
        second, a wider pass only where it promises :data:`TRY_MARGIN` over plain steps (1: a
        plain step for every row)."""
        rows, best, promised = len(copies), 1, TRY_MARGIN
        longest = max((n for n, _ in copies), default=0)
        for width in (w for w in BATCH_WIDTHS if 1 < w <= longest + 1):
            tokens = sum(expected_tokens(alpha, min(n, width - 1)) for n, alpha in copies)
            if (gain := tokens / (rows * self.ratio(rows, width))) >= promised:
                best, promised = width, gain
        return best


class Pacing:
    """The paced mode's policy on one server: the machine's pass costs (None: a round of the draft
    model may pay and every lookup copy is worth verifying) and what rounds have measured on each
    kind of text (code and the prose around it), which every new request's pacers start from."""

    def __init__(self, costs: PassCosts | None = None):
        self.costs = costs
        self._memory: dict[TextKind, dict[RoundKind, Figures]] = {text: {} for text in TextKind}
        self._reading: Figures | None = None  # the draft model catching up: seconds and tokens read

    def learn_reading(self, seconds: float, tokens: int) -> None:
        """Count ``seconds`` the draft model spent reading ``tokens`` it had missed."""
        if tokens <= 0:
            return
        if self._reading is None:
            self._reading = Figures(seconds, tokens)
            return
        self._reading.rounds += 1
        self._reading.move(seconds, tokens, max(Pacer.MEMORY_WEIGHT, 1 / self._reading.rounds))

    def reading(self, tokens: int) -> float:
        """What the draft model would take to read ``tokens`` it missed (0 before it ever has)."""
        return 0.0 if self._reading is None or tokens <= 0 else tokens * self._reading.cost

    @property
    def draft_model_may_pay(self) -> bool:
        """Whether a round of the draft model can pay here at all (after a short context)."""
        return self.costs is None or self.costs.break_even() <= CEILING

    def worth_copying(self, offered: int, acceptance: float, context: int = 0, bar: float = 1.0) -> int:
        """How many of ``offered`` copied tokens to verify (:meth:`PassCosts.worth_copying`)."""
        return offered if self.costs is None else self.costs.worth_copying(offered, acceptance, context, bar)

    def pacer(self, text: TextKind, most: int) -> Pacer:
        """A request's pacer for ``text`` (code or prose), starting from what the server measured."""
        return Pacer(most=most, memory=self._memory[text])
