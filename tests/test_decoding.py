"""Exactness of speculative decoding and KV-cache handling on tiny f32 models."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as scipy_stats

from engine.core.decoding import DecodeConfig, Decoder, Provenance, Round
from engine.core.drafters import SINK, HybridDrafter, LookupDrafter, ModelDrafter
from engine.core.metrics import Stats
from engine.core.pacing import (
    CEILING,
    DRAFT,
    PLAIN,
    REJECTION_CONTEXTS,
    TRY_MARGIN,
    Choice,
    Pacer,
    Pacing,
    PassCosts,
    TextKind,
    break_even_acceptance,
    expected_tokens,
)
from engine.core.pool import NgramPool
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG, Runtime, common_prefix
from engine.core.sampling import SamplingParams, logits_to_probs
from engine.core.service import Engine
from engine.core.settings import Settings
from tests.serving import serve

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "héllo wörld 日本語",
    "class Stack:\n    def push",
]


DRAFTERS = ["model", "adaptive", "small-head", "lookup", "hybrid", "hybrid-span", "stop-early"]


def make_drafter(kind: str, pair):
    """Every drafter the engine offers, on the tiny pair."""
    target, model = pair
    vocab = target.forward([1]).shape[-1]
    target.reset()
    if kind == "model":
        return model
    if kind == "adaptive":
        return ModelDrafter(model.runtime, p_min=0.3, adaptive=True)
    if kind == "small-head":  # a head cut to half the ids, in no order: q = 0 on the others
        kept = np.random.default_rng(0).permutation(vocab)[: vocab // 2]
        return ModelDrafter(
            Runtime(model.runtime.ir_dir, config=EXACT_CONFIG, kept_ids=kept, masked_rollback=True, pass_width=2)
        )
    if kind == "lookup":
        return LookupDrafter(vocab, min_ngram=1)
    if kind == "stop-early":  # a hybrid whose draft model stops a round early when unsure
        return HybridDrafter(LookupDrafter(vocab), ModelDrafter(model.runtime, p_min=0.3))
    if kind == "pool":  # a lookup that never matches: a paced round drafts from its n-gram pool
        return HybridDrafter(LookupDrafter(vocab, min_match=10**6), model)
    if kind == "hybrid-span":  # lookup copies further than K, and past the token budget
        return HybridDrafter(LookupDrafter(vocab, min_ngram=1, span=12), model)
    return HybridDrafter(LookupDrafter(vocab), model)


def _reset(drafter) -> None:
    for runtime in (getattr(drafter, "runtime", None), getattr(getattr(drafter, "model", None), "runtime", None)):
        if runtime is not None:
            runtime.reset()


def run(target, drafter, prompt, **cfg):
    """The answer to ``prompt`` and its final metrics, served by the engine's scheduler."""
    return serve(target, drafter, prompt, **cfg)


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_matches_autoregressive(pair, tok, k, kind):
    target, _ = pair
    drafter = make_drafter(kind, pair)
    accepted = drafted = 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        ar, _ = run(target, drafter, prompt, speculative=False, max_new_tokens=40)
        sd, stats = run(target, drafter, prompt, speculative=True, k=k, max_new_tokens=40)
        assert sd == ar, f"k={k} drafter={kind} prompt={text!r}"
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    assert 0 < accepted < drafted, "the drafter should be right sometimes and wrong sometimes"


class RandomGuesser:
    """Guesses a random token: nearly always wrong."""

    def __init__(self, vocab_size: int):
        self.rng = np.random.default_rng(0)
        self.vocab_size = vocab_size

    def guess(self, context) -> int:
        return int(self.rng.integers(self.vocab_size))

    def learn(self, context, token) -> None:
        pass


def test_a_guess_changes_the_draft_passes_never_the_drafts(pair, tok):
    """A right guess's second row is the draft's distribution for the token after it, as the next
    step would compute it, so the draft drafts two tokens in one pass; a wrong guess is dropped."""
    target, model = pair
    prompt = tok.encode(PROMPTS[3] + "\n" + PROMPTS[3])  # repeated text gives the real guesser matches
    results = {}
    for guesser in ("none", "random", "real"):
        drafter = ModelDrafter(model.runtime)
        drafter.guesser = {"none": None, "random": RandomGuesser(model.runtime.vocab_size)}.get(
            guesser, drafter.guesser
        )
        before = model.runtime.passes
        tokens, stats = run(target, drafter, prompt, k=4, max_new_tokens=40)
        results[guesser] = (tokens, stats.drafted, stats.accepted), model.runtime.passes - before
    assert results["random"][0] == results["real"][0] == results["none"][0]
    assert results["real"][1] < results["none"][1]


def test_rejected_tokens_leave_no_trace_in_kv_cache(pair, tok):
    target, drafter = pair
    rounds = []

    def check(context: list[int]) -> None:
        rounds.append(len(context))
        assert target.tokens == context[: len(target.tokens)] and len(target.tokens) >= len(context) - 1
        assert drafter.runtime.tokens == context[: len(drafter.runtime.tokens)]

    _, stats = run(target, drafter, tok.encode(PROMPTS[0]), k=4, max_new_tokens=30, on_round=check)
    assert len(rounds) == stats.rounds > 1 and stats.drafted > stats.accepted


def test_logits_after_trim_equal_a_fresh_run(pair, tok):
    target, _ = pair
    tokens = tok.encode(PROMPTS[3] + " " + PROMPTS[1])
    target.reset()
    target.forward(tokens[:5])
    target.forward(tokens[5:12])  # extra tokens, then rolled back
    target.trim(5)
    after_trim = target.forward(tokens[5:9], rows=4)
    target.reset()
    target.forward(tokens[:5])
    fresh = target.forward(tokens[5:9], rows=4)
    np.testing.assert_array_equal(after_trim, fresh)


def target_outcomes(target, prompt: list[int], params: SamplingParams, n: int, draws: int) -> dict[tuple, float]:
    """The target's probability of every n-token continuation expected at least once in ``draws``."""
    outcomes: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, p in outcomes.items():
            probs = logits_to_probs(target.sync(prompt + list(prefix))[-1], params)
            for token in np.flatnonzero(p * probs * draws >= 1):
                grown[(*prefix, int(token))] = p * probs[token]
        outcomes = grown
    return outcomes


WARPED = SamplingParams(temperature=0.7, top_p=0.9)
# The chi-square test's runs, and the tokens of each outcome. At 1,500 runs the draft model's own
# outcomes score p ~ 1e-7 (the test's power); the speculative ones, 0.003-0.9 across the kinds.
DRAWS, OUTCOME = 1500, 3


def chi_square_prompt(tok) -> list[int]:
    return tok.encode(PROMPTS[1] + " fox fox")  # a repeated n-gram gives prompt lookup a match


@pytest.fixture(scope="module")
def draft_samples(pair, tok) -> Callable[[SamplingParams], dict[tuple, int]]:
    """The draft model's own outcomes by sampling setting, drawn from its exact probabilities:
    what the chi-square test must tell apart from the target's (its power)."""
    model = pair[1].runtime
    counted: dict[SamplingParams, dict[tuple, int]] = {}

    def samples(params: SamplingParams) -> dict[tuple, int]:
        if params not in counted:
            outcomes = target_outcomes(model, chi_square_prompt(tok), params, OUTCOME, DRAWS)
            model.reset()
            keys = [*outcomes, ("the others",)]
            probs = [*outcomes.values(), max(0.0, 1 - sum(outcomes.values()))]
            drawn = np.random.default_rng(0).multinomial(DRAWS, np.array(probs) / sum(probs))
            counted[params] = dict(zip(keys, (int(n) for n in drawn), strict=True))
        return counted[params]

    return samples


@pytest.mark.parametrize(
    "kind, params, paced",
    [(kind, SamplingParams(1.0), False) for kind in ("model", "small-head", "hybrid", "hybrid-span")]
    + [("model", WARPED, False), ("hybrid", WARPED, False), ("hybrid", SamplingParams(1.0), True)]
    + [("pool", SamplingParams(1.0), True), ("pool", WARPED, True)],
)
def test_sampled_tokens_follow_the_target_distribution(pair, tok, draft_samples, kind, params, paced):
    """Chi-square over three-token outcomes: speculative samples fit the target's p, the draft's do not.

    The first token comes from the prompt's own step; with 4 new tokens the next round drafts 2
    (all its length leaves), so tokens 2 and 3 come out of the accept/reject rule (accepted drafts, corrections, bonus).
    Paced, the round after that is a plain step (the pacer measures both kinds). The n-gram pool
    proposes after any token (each id follows the one before it), the target's greedy answer
    where it learned it."""
    target, _ = pair
    drafter = make_drafter(kind, pair)
    prompt = chi_square_prompt(tok)
    pool = None
    if kind == "pool":
        pool = NgramPool(target.vocab_size, n=1)
        pool.learn([*range(target.vocab_size), 0])
        pool.learn(prompt + run(target, None, prompt, speculative=False, max_new_tokens=8)[0])
    draws, n = DRAWS, OUTCOME
    sd_counts: dict[tuple, int] = {}
    drafted = 0
    for seed in range(draws):
        sampling, pacing = replace(params, seed=seed), Pacing() if paced else None
        tokens, stats = run(
            target, drafter, prompt, k=4, max_new_tokens=n + 1, sampling=sampling, pacing=pacing, pool=pool
        )
        sd_counts[tuple(tokens[:n])] = sd_counts.get(tuple(tokens[:n]), 0) + 1
        drafted += stats.drafted
    assert drafted >= draws, "every run should have drafted in its second round"

    target.reset()
    outcomes = target_outcomes(target, prompt, params, n, draws)

    def p_value(counts):
        keys = [k for k, p in outcomes.items() if p * draws >= 5]
        observed = [counts.get(k, 0) for k in keys]
        expected = [outcomes[k] * draws for k in keys]
        observed.append(draws - sum(observed))
        expected.append(draws - sum(expected))
        return scipy_stats.chisquare(observed, expected).pvalue

    assert p_value(sd_counts) > 0.001
    assert p_value(draft_samples(params)) < 1e-6


def test_a_stop_token_ends_the_answer_with_nothing_after_it(pair, tok):
    target, drafter = pair
    prompt = tok.encode(PROMPTS[0])
    free, _ = run(target, drafter, prompt, speculative=False, max_new_tokens=30)
    stop = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i])  # first seen mid-answer
    for speculative in (False, True):
        tokens, stats = run(
            target, drafter, prompt, speculative=speculative, k=4, max_new_tokens=30, stop_ids=frozenset({stop})
        )
        assert tokens == free[: free.index(stop)]
        assert stats.finish_reason == "stop"


def test_a_stop_string_ends_the_answer_just_before_it(engine):
    chat = ({"role": "user", "content": PROMPTS[0]},)
    full = engine.run(Request(chat, max_new_tokens=30, reuse_cache=False))
    text = engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert full.metrics["finish_reason"] == "length" and len(stop) == 3
    stream = engine.generate(Request(chat, max_new_tokens=30, stop_strings=("never there", stop)))
    events = list(stream)
    assert "".join(e.text for e in events) == text[: text.index(stop)]
    assert events[-1].metrics["finish_reason"] == "stop"


def idle(engine, within_s: float) -> bool:
    """Whether the engine has no request waiting or running, polled for up to ``within_s``
    (the final event is sent a moment before the worker lets go)."""
    deadline = time.monotonic() + within_s
    while engine.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.pending == 0


def slowed(monkeypatch, runtime, seconds: float) -> None:
    """Make every pass of ``runtime`` take at least ``seconds`` more (a big model on a CPU)."""
    forward = runtime.forward
    monkeypatch.setattr(runtime, "forward", lambda *a, **kw: (time.sleep(seconds), forward(*a, **kw))[1])


def test_cancelling_a_stream_stops_the_engine_within_one_round(engine, monkeypatch):
    slowed(monkeypatch, engine.target, 0.05)  # 200 tokens would take 10 s or more
    stream = engine.generate(Request(({"role": "user", "content": PROMPTS[1]},), max_new_tokens=200, reuse_cache=False))
    assert next(stream).kind == "delta"
    start = time.monotonic()
    stream.cancel()
    final = next(e for e in stream if e.final)
    assert time.monotonic() - start < 1.0
    assert final.kind == "done" and final.metrics["finish_reason"] == "cancelled"
    assert 0 < final.metrics["new_tokens"] < 200
    assert idle(engine, within_s=0.2)


def test_closing_a_stream_frees_the_engine_within_one_round(engine, monkeypatch):
    slowed(monkeypatch, engine.target, 0.05)
    stream = engine.generate(Request(({"role": "user", "content": PROMPTS[1]},), max_new_tokens=200))
    next(stream)
    stream.close()
    assert idle(engine, within_s=1.0)


def test_cancel_mid_stream_then_new_request_equals_fresh_run(engine):
    chat = ({"role": "user", "content": PROMPTS[0]},)
    fresh = engine.run(Request(chat, max_new_tokens=30, reuse_cache=False)).token_ids
    stream = engine.generate(Request(({"role": "user", "content": PROMPTS[1]},), max_new_tokens=60))
    next(stream)
    stream.close()
    again = engine.run(Request(chat, max_new_tokens=30))
    assert again.token_ids == fresh


def test_multi_turn_reuses_the_cache_and_equals_a_fresh_run(engine):
    turn1 = ({"role": "user", "content": PROMPTS[0]},)
    first = engine.run(Request(turn1, max_new_tokens=20, reuse_cache=False))
    answer = engine.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    turn2 = (*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": PROMPTS[3]})
    prompt1, prompt2 = engine.prompt_ids(Request(turn1)), engine.prompt_ids(Request(turn2))
    cached = common_prefix(engine.target.tokens, prompt2)
    widths = []
    forward = engine.target.forward
    engine.target.forward = lambda new, rows=1, gemm=False: widths.append(len(new)) or forward(new, rows, gemm)
    try:
        reused = engine.run(Request(turn2, max_new_tokens=20))
    finally:
        del engine.target.forward
    fresh = engine.run(Request(turn2, max_new_tokens=20, reuse_cache=False))
    assert reused.token_ids == fresh.token_ids
    # only the new suffix was prefilled: the cache kept the first turn and its answer
    assert cached > len(prompt1)
    assert widths[0] == len(prompt2) - cached


def test_over_long_prompt_gives_a_clear_error_and_engine_keeps_working(engine):
    long = " ".join(["speculative"] * 400)
    event = engine.run(Request(({"role": "user", "content": long},), max_new_tokens=5))
    assert event.kind == "error" and "context" in event.error
    ok = engine.run(Request(({"role": "user", "content": "hi"},), max_new_tokens=5))
    assert ok.kind == "done"


def test_empty_message_is_refused(engine):
    event = engine.run(Request(({"role": "user", "content": "   "},)))
    assert event.kind == "error" and "empty" in event.error


def test_generation_stops_at_the_context_limit(pair, tok):
    target, drafter = pair
    prompt = tok.encode(" ".join(["fox"] * 200))[: target.max_context - 10]
    tokens, stats = run(target, drafter, prompt, k=4, max_new_tokens=100)
    assert len(prompt) + len(tokens) == target.max_context
    assert stats.finish_reason == "context"


@pytest.mark.parametrize(
    "context, k, expected",
    [
        ([1, 2, 3, 4, 9, 1, 2], 3, [3, 4, 9]),  # the continuation of the earlier match, in order
        ([1, 2, 3, 4, 9, 1, 2], 8, [3, 4, 9, 1, 2]),  # up to the end of the context
        ([5, 1, 2, 7, 6, 5, 1, 2, 8, 6, 5, 1, 2], 2, [8, 6]),  # the match reaching furthest back (6 5 1 2)
        ([1, 2, 7, 1, 2, 8, 1, 2], 1, [8]),  # a tie goes to the latest occurrence
        ([1, 2, 3, 4, 5], 3, []),  # no earlier occurrence
    ],
)
def test_lookup_proposes_the_exact_continuation_of_the_best_earlier_match(context, k, expected):
    assert LookupDrafter(vocab_size=16).lookup(np.asarray(context), k) == expected


def test_lookup_proposes_nothing_below_its_minimum_match():
    context = np.asarray([4, 1, 2, 3, 9, 5, 1, 2, 3])
    assert LookupDrafter(16, min_match=3).lookup(context, 2) == [9, 5]
    assert LookupDrafter(16, min_match=4).lookup(context, 2) == []


def test_adaptive_k_grows_after_full_acceptance_and_shrinks_after_a_rejection(pair, tok):
    _, model = pair
    drafter = ModelDrafter(model.runtime, adaptive=True)
    context, rng, greedy = tok.encode(PROMPTS[0]), np.random.default_rng(0), SamplingParams()
    lengths = []
    for accepted_all in (False, False, True, True, False):
        draft = drafter.propose(context, 6, greedy, rng)
        lengths.append(len(draft.tokens))
        drafter.observe(len(draft.tokens), len(draft.tokens) if accepted_all else 1)
        drafter.rollback(context)
    assert lengths == [6, 5, 4, 6, 6]  # asked for 6: two shorter, two longer, capped at the round's 6
    assert drafter.k == 7


def test_a_hybrid_adapts_its_model_only_on_the_model_s_own_drafts(pair):
    target, model = pair
    adaptive = ModelDrafter(model.runtime, adaptive=True)
    hybrid = HybridDrafter(LookupDrafter(target.vocab_size), adaptive)
    rng, greedy = np.random.default_rng(0), SamplingParams()
    hybrid.propose([1, 2, 3, 1, 2], 4, greedy, rng)  # a lookup draft
    hybrid.observe(3, 0)
    assert adaptive.k is None
    hybrid.propose([1, 2, 3, 4, 5], 4, greedy, rng)  # no match: the model drafts
    hybrid.observe(4, 1)
    assert adaptive.k == 3


def test_a_draft_that_agrees_with_the_target_is_accepted_whole(pair, tok, ir_target):
    """The target drafting for itself (as the draft runs: masked rollback, 2-token passes with a
    guess): every drafted token is accepted and each round ends with a bonus token."""
    target, _ = pair
    itself = ModelDrafter(Runtime(ir_target, config=EXACT_CONFIG, masked_rollback=True, pass_width=2))
    prompt = tok.encode(PROMPTS[3] + "\n" + PROMPTS[3])
    _tokens, stats = run(target, itself, prompt, k=4, max_new_tokens=41)
    assert stats.accepted == stats.drafted == 32
    assert stats.target_passes == 1 + 40 // 5  # the prompt, then K + 1 = 5 tokens per pass


def paced_kinds(pacer: Pacer, rounds: int, cost) -> list[bool]:
    """Whether each of ``rounds`` rounds runs the draft model: ``cost(speculative)`` gives (seconds, tokens)."""
    kinds = []
    for _ in range(rounds):
        choice = pacer.choose()
        speculative = choice.kind is DRAFT
        kinds.append(speculative)
        pacer.record(choice.kind, *cost(speculative), held=choice.held)
    return kinds


def speculates(pacer: Pacer, switch: float = 0.0, remaining: int = 0) -> bool:
    return pacer.choose(switch, remaining).kind is DRAFT


def test_the_pacer_measures_both_kinds_then_runs_the_cheaper_and_probes_less_and_less():
    kinds = paced_kinds(Pacer(), 200, lambda spec: (0.3 if spec else 0.1, 1))  # speculation three times dearer
    assert kinds[:3] == [True, False, False]  # a try, a plain step to compare, then the cheaper
    plain_between_probes = np.diff([i for i, k in enumerate(kinds) if k]) - 1
    assert list(plain_between_probes[:4]) == [9, 16, 32, 64]
    assert set(plain_between_probes[4:]) == {Pacer.MAX_SPECULATIVE_INTERVAL}  # (a probe of the draft model costs most)


def test_the_pacer_comes_back_to_speculation_when_it_pays_again():
    pacer = Pacer()
    paced_kinds(pacer, 40, lambda spec: (0.3 if spec else 0.1, 1))  # plain is cheaper for a while
    assert pacer.interval > Pacer.MIN_INTERVAL
    # Then drafts start to land (code after prose): speculation is cheaper.
    kinds = paced_kinds(pacer, 80, lambda spec: (0.2 if spec else 0.1, 4 if spec else 1))
    assert kinds.index(True) <= Pacer.MAX_INTERVAL and sum(kinds[-40:]) >= 36  # back at the first probe


def test_a_new_requests_pacer_starts_from_what_the_server_measured_on_that_kind_of_text():
    """Prose where the draft model did not pay: the next request on prose starts with plain steps,
    without a try; on code, where nothing was measured yet, it tries the draft model first. Where
    the draft model paid, the next request speculates from its first round."""
    pacing = Pacing()
    paced_kinds(pacing.pacer(TextKind.PROSE, 5), 30, lambda spec: (0.3 if spec else 0.1, 1))
    assert paced_kinds(pacing.pacer(TextKind.PROSE, 5), 8, lambda spec: (0.3 if spec else 0.1, 1)) == [False] * 8
    assert speculates(pacing.pacer(TextKind.CODE, 5))
    paced_kinds(pacing.pacer(TextKind.CODE, 5), 30, lambda spec: (0.15 if spec else 0.1, 4 if spec else 1))
    code = paced_kinds(pacing.pacer(TextKind.CODE, 5), 40, lambda spec: (0.15 if spec else 0.1, 4 if spec else 1))
    assert code[: Pacer.MAX_INTERVAL] == [True] * Pacer.MAX_INTERVAL and code.count(False) == 1  # one probe


@pytest.mark.parametrize(
    ("draft_seconds", "first_probe"), [(0.11, Pacer.MIN_INTERVAL), (0.3, Pacer.MAX_SPECULATIVE_INTERVAL)]
)
def test_where_the_draft_model_was_far_dearer_a_new_request_probes_it_late(draft_seconds, first_probe):
    """Where plain steps paid on a kind of text, a new request probes the draft model after
    MIN_INTERVAL plain steps if its rounds came close (10% dearer a token), and only after the
    longest interval where they were far dearer (prose: three times)."""
    pacing = Pacing()
    costs = lambda spec: (draft_seconds if spec else 0.1, 1)  # noqa: E731
    paced_kinds(pacing.pacer(TextKind.PROSE, 5), 30, costs)
    kinds = paced_kinds(pacing.pacer(TextKind.PROSE, 5), 2 * first_probe, costs)
    assert kinds.index(True) == first_probe


def test_the_servers_memory_is_not_held_by_its_first_dearest_round():
    """The first round of the draft model on a server pays for new shapes and for the draft
    reading the conversation: not what its rounds cost on that text. A request that met it and a
    few cheap rounds leaves a memory in which the draft model pays, so the next request on that
    text speculates from its first round."""
    pacing = Pacing()
    first = pacing.pacer(TextKind.CODE, 5)
    assert speculates(first)
    first.record(DRAFT, 0.75, 4)  # new shapes, and the draft reading the prompt
    assert not speculates(first)
    first.record(PLAIN, 0.06, 1)
    for _ in range(6):  # rounds of the draft model as they run on code: 35 ms a token
        first.record(DRAFT, 0.175, 5)
    memory = pacing.pacer(TextKind.CODE, 5).figures
    assert memory[DRAFT].cost < memory[PLAIN].cost
    assert (
        paced_kinds(pacing.pacer(TextKind.CODE, 5), 8, lambda spec: (0.175 if spec else 0.06, 5 if spec else 1))
        == [True] * 8
    )


def test_a_probe_of_the_draft_model_is_skipped_where_its_catch_up_costs_more_than_a_few_steps():
    """Where plain steps pay, a probe of the draft model first reads what it missed. A probe may
    spend :attr:`Pacer.PROBE_CATCH_UP` plain steps on that (64 missed tokens after a short prompt),
    not more (the first read after 2,000 tokens of history, which no round it could run wins back)."""
    pacer = Pacer()
    assert paced_kinds(pacer, 12, lambda spec: (0.3 if spec else 0.1, 1))[:2] == [True, False]
    while pacer.streak < pacer.interval:
        pacer.record(PLAIN, 0.1, 1)
    assert speculates(pacer, switch=0.3, remaining=64)
    assert not speculates(pacer, switch=Pacer.PROBE_CATCH_UP * 0.1 + 0.05, remaining=64)


def test_the_preferred_draft_model_runs_only_where_the_rest_of_the_answer_repays_its_catch_up():
    """Where the draft model pays 70 ms a token against plain steps, a catch-up of 0.5 s is worth
    it over 100 more tokens and not over 5; plain steps run meanwhile, and they are no probe (the
    order and the probe schedule stay)."""
    pacer = Pacer()
    paced_kinds(pacer, 20, lambda spec: (0.15, 5) if spec else (0.1, 1))
    assert speculates(pacer, switch=0.5, remaining=100)
    streak, interval = pacer.streak, pacer.interval
    held = pacer.choose(switch=0.5, remaining=5)
    assert held == Choice(PLAIN, held=True)
    pacer.record(held.kind, 0.1, 1, held=held.held)
    assert (pacer.streak, pacer.interval) == (streak, interval) and speculates(pacer, remaining=5)


def test_the_draft_models_catch_up_is_timed_apart_from_its_rounds(pair, tok, monkeypatch):
    """The draft reading a prompt it missed (2 ms a token here) is learned as the cost of reading,
    not counted in the cost of its rounds: the pacer's figure for those stays what a round costs."""
    target, drafter = pair
    forward = drafter.runtime.forward

    def reading_slowly(tokens, *args, **kwargs):
        time.sleep(0.002 * max(len(tokens) - 3, 0))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(drafter.runtime, "forward", reading_slowly)
    prompt = tok.encode(" ".join(PROMPTS))[:80]
    target.reset()
    drafter.runtime.reset()
    pacing = Pacing()
    decoder = Decoder(target, drafter, prompt, DecodeConfig(k=4, max_new_tokens=6, pacing=pacing), Stats("t"))
    list(decoder.prefill())
    while not decoder.done:
        list(decoder.catch_up())
        decoder.round()
    assert decoder.pacer is not None and decoder.pacer.rounds.get(DRAFT)
    assert decoder.pacer.figures[DRAFT].seconds < 0.05  # (the prompt's read alone took 0.15 s)
    assert pacing.reading(100) == pytest.approx(0.2, rel=0.5)


def test_the_draft_model_is_not_run_where_a_round_needs_more_acceptance_than_the_draft_reaches():
    """Where a round costs 1.9 plain steps, drafts landing seven times in ten pay; where it costs
    four, nearly nine in ten. Where it costs four and a half (an AVX2 CPU) and must beat plain
    steps by the try margin, they must land more than 95 times in a hundred, more than the draft
    agrees with the target even on code: the draft model is not run there at all."""
    assert break_even_acceptance(0.9, 4) == 0.0 and break_even_acceptance(5.0, 4) == math.inf
    alpha = break_even_acceptance(4.0, 4)
    assert 0.88 < alpha < 0.9 and (1 - alpha**5) / (1 - alpha) == pytest.approx(4.0)
    assert AVX2_MEASURED.break_even() == pytest.approx(break_even_acceptance(TRY_MARGIN * 4.5, 4), rel=1e-3)
    assert AVX512.break_even() < CEILING < AVX2_MEASURED.break_even()
    assert Pacing(AVX512).draft_model_may_pay and not Pacing(AVX2_MEASURED).draft_model_may_pay
    assert Pacing().draft_model_may_pay  # no machine figures: any round may pay


def test_where_the_draft_cannot_reach_the_break_even_a_paced_request_never_runs_it(pair, tok):
    """A break-even above the ceiling (an AVX2 CPU) leaves only free drafts: the draft model never
    runs, nor reads the conversation."""
    target, drafter = pair
    prompt = tok.encode(PROMPTS[3])
    expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=20)
    _reset(drafter)
    passes = drafter.runtime.passes
    tokens, stats = run(target, drafter, prompt, k=4, max_new_tokens=20, pacing=Pacing(AVX2_MEASURED))
    assert tokens == expected and stats.drafted == 0 and drafter.runtime.passes == passes


def test_paced_decoding_where_no_round_can_pay_runs_plain_steps_only(pair, tok):
    target, drafter = pair
    prompt = tok.encode(PROMPTS[3])
    expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=20)
    tokens, stats = run(target, drafter, prompt, k=4, max_new_tokens=20, pacing=Pacing(HOPELESS))
    assert tokens == expected and stats.drafted == 0 and not drafter.runtime.tokens


def test_pass_costs_are_measured_on_the_engines_runtimes_and_leave_their_caches_empty(pair):
    target, drafter = pair
    costs = PassCosts.measure(target, drafter.runtime, k=4, widths=(9, 17), repeats=2)
    assert [width for width, _ in costs.verify] == [2, 5, 9, 17]
    assert min(costs.step, costs.draft, *(seconds for _, seconds in costs.verify)) > 0
    assert costs.ratio(1) == 1 and costs.ratio(5) == costs.verify[1][1] / costs.step
    assert [context for context, _ in costs.rejection] == [target.max_context // 2] < list(REJECTION_CONTEXTS)
    assert [context for context, _ in costs.long_verify] == [target.max_context // 2]
    assert not target.tokens and not drafter.runtime.tokens


def test_a_draft_round_is_timed_at_each_width_and_leaves_the_cache_empty(pair):
    _, drafter = pair
    assert min(PassCosts.draft_round(drafter.runtime, width, k=4, repeats=2) for width in (1, 2)) > 0
    assert not drafter.runtime.tokens


@pytest.mark.parametrize("faster", [1, 2])
def test_the_draft_passes_at_the_width_whose_rounds_cost_less_and_a_restart_keeps_it(
    ir_target, ir_draft, monkeypatch, faster
):
    """Timed per machine (injected here): at width 1 the draft drafts without guessing its next
    token, and every answer is still the target's."""
    monkeypatch.setattr(PassCosts, "draft_round", lambda draft, width, k: 1.0 if width == faster else 2.0)
    settings = Settings(config=EXACT_CONFIG, draft_config=EXACT_CONFIG, prompt_reader="off")
    request = Request(prompt_ids=tuple(range(5, 30)), max_new_tokens=16, reuse_cache=False)
    with Engine(ir_target, ir_draft, replace(settings, remeasure=True)) as engine:
        assert engine.draft.pass_width == faster
        drafter = engine.sessions.sessions[0].drafters["speculative"]
        assert (drafter.guesser is not None) == (faster == 2)
        plain = engine.run(replace(request, mode="autoregressive")).token_ids
        assert engine.run(replace(request, mode="speculative", k=4)).token_ids == plain
    monkeypatch.setattr(PassCosts, "draft_round", lambda *_: pytest.fail("a restart timed the draft's rounds again"))
    with Engine(ir_target, ir_draft, settings) as engine:
        assert engine.draft.pass_width == faster


def test_a_rejection_costs_more_the_longer_the_context():
    assert AVX2.rejection_cost(0) == 0 and AVX2.rejection_cost(500) == pytest.approx(0.175)
    assert AVX2.rejection_cost(16000) == pytest.approx(12.2) and PassCosts(1.0, (), 0.3, 4).rejection_cost(9000) == 0


# A target pass over 1, 2, 5, 9 and 17 tokens, and what a rejection adds after 1,000, 4,000 and
# 8,000 tokens, in plain steps, as measured on two CPUs (docs/benchmarks.md).
AVX2 = PassCosts(1.0, ((2, 1.41), (5, 2.54), (9, 3.2), (17, 5.44)), 0.36, 4, ((1000, 0.35), (4000, 1.6), (8000, 6.1)))
AVX512 = PassCosts(1.0, ((2, 1.05), (5, 1.4), (9, 1.6), (17, 2.0)), 0.3, 4, ((1000, 0.5), (4000, 2.0), (8000, 4.0)))
# (a round of 4 two-token draft steps and its verify: 4.5 plain steps, as docs/benchmarks.md, "An AVX2 machine")
AVX2_MEASURED = PassCosts(step=0.072, verify=((5, 0.184),), draft=0.035, k=4)
HOPELESS = PassCosts(1.0, ((5, 6.0),), 0.5, 4)  # a verify pass dearer than K + 1 plain steps


@pytest.mark.parametrize(
    ("readings", "kept", "taken"),
    [
        ((AVX512,), AVX512, 1),  # the draft model may run: one reading
        ((AVX2_MEASURED, AVX512), AVX512, 2),  # a busy moment priced it off: the second kept
        ((HOPELESS, AVX2_MEASURED), AVX2_MEASURED, 2),  # off either way: the cheaper kept
    ],
)
def test_a_reading_that_would_keep_the_draft_model_off_is_taken_again(monkeypatch, readings, kept, taken):
    """One reading on a machine that may be busy does not turn the draft model off for a server's
    life: a second is taken, and the reading that prices a round lower kept."""
    queue = list(readings)
    monkeypatch.setattr(PassCosts, "measure", classmethod(lambda cls, *args: queue.pop(0)))
    assert PassCosts.read(None, None, 4) is kept  # type: ignore[arg-type]
    assert len(readings) - len(queue) == taken


def test_a_lookup_copy_is_cut_to_what_its_verify_pass_pays_on_the_machine():
    """Where each extra verify row costs a third of a step, a 16-token copy is worth verifying whole
    only where copies always land, partly where they often do, not at all where they seldom do;
    where rows are nearly free, the whole copy is worth it at the acceptance that cuts it there."""
    assert AVX2.worth_copying(16, 1.0) == 16
    assert 1 <= AVX2.worth_copying(16, 0.95) < 16 and 1 <= AVX2.worth_copying(16, 0.8) < 16
    assert AVX2.worth_copying(16, 0.3) == 0
    assert AVX512.worth_copying(16, 0.95) == 16 and AVX512.worth_copying(3, 0.8) == 3
    for alpha in (0.5, 0.8, 0.95):  # what it picks promises the most tokens per step's time
        n = AVX2.worth_copying(16, alpha)
        gains = [expected_tokens(alpha, m) / AVX2.ratio(m + 1) for m in range(1, 17)]
        assert n == 0 or gains[n - 1] == max(gains) >= TRY_MARGIN


def test_a_lookup_copy_is_cut_shorter_where_a_rejection_costs_a_long_trim():
    """After a rejected token the target's cache is trimmed, a copy of every state, and the plugin
    regrows its buffers: at 8,000 tokens that costs more than the verify pass, so a copy must land
    more surely to pay."""
    for costs in (AVX2, AVX512):
        short, long = costs.worth_copying(16, 0.8, context=100), costs.worth_copying(16, 0.8, context=8000)
        assert long < short
    assert AVX2.worth_copying(16, 0.99, context=8000) >= 8 and AVX2.worth_copying(16, 1.0, context=8000) == 16


def test_a_priced_lookup_learns_how_often_its_copies_land():
    context = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4])
    lookup = LookupDrafter(16, min_match=4, span=5, price=AVX2.worth_copying)
    first = lookup.draft_free(context, 4, SamplingParams()).tokens
    assert lookup.acceptance == 0.75 and first == [5, 6, 7, 8, 9][: AVX2.worth_copying(5, 0.75)]
    for _ in range(20):
        lookup.observe(5, 5)
    assert lookup.acceptance > 0.95 and lookup.draft_free(context, 4, SamplingParams()).tokens == [5, 6, 7, 8, 9]
    for _ in range(20):
        lookup.observe(5, 0)
    assert lookup.acceptance < 0.5 and lookup.draft_free(context, 4, SamplingParams()).tokens == []
    dropped = 1
    while not lookup.draft_free(context, 4, SamplingParams()).tokens:  # dropped copies drift back to the prior
        dropped += 1
    assert 2 <= dropped <= 30 and lookup.acceptance <= 0.75


def test_where_copies_do_not_pay_at_the_prior_a_dropped_copy_is_probed_now_and_then():
    """A price that takes copies only above 0.8 acceptance never meets a verdict at the prior of
    0.75, so every PROBE_AFTER-th copy dropped in a row is verified anyway, at the length the price
    prefers at any bar; copies that land then raise the average past the bar."""
    context = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4])

    def price(offered: int, acceptance: float, context: int, bar: float) -> int:
        return offered if acceptance > 0.8 else 2 if bar == 0.0 else 0

    lookup = LookupDrafter(16, min_match=4, span=5, price=price)
    offers = [lookup.draft_free(context, 4, SamplingParams()).tokens for _ in range(2 * LookupDrafter.PROBE_AFTER)]
    probes = [i for i, tokens in enumerate(offers) if tokens]
    assert probes == [LookupDrafter.PROBE_AFTER - 1, 2 * LookupDrafter.PROBE_AFTER - 1]
    assert offers[probes[0]] == [5, 6]
    lookup.observe(2, 2)
    lookup.observe(2, 2)
    assert lookup.acceptance > 0.8 and lookup.draft_free(context, 4, SamplingParams()).tokens == [5, 6, 7, 8, 9]


def test_where_the_draft_model_cannot_pay_lookup_copies_still_run_and_the_answer_stays_exact(pair, tok):
    """A paced request on a machine where no draft-model round pays never runs the draft model,
    yet verifies the lookup copies worth verifying, and answers as autoregressive decoding does."""
    target, model = pair
    hybrid = HybridDrafter(LookupDrafter(target.vocab_size, min_match=2, span=8), model)
    passes, drafted = model.runtime.passes, 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=40)
        tokens, stats = run(target, hybrid, prompt, k=4, max_new_tokens=40, pacing=Pacing(HOPELESS))
        assert tokens == expected
        drafted += stats.drafted
    assert drafted > 0 and model.runtime.passes == passes


def test_paced_decoding_gives_the_autoregressive_answer_whichever_rounds_run(pair, tok, monkeypatch):
    target, drafter = pair
    prompt = tok.encode(PROMPTS[3])
    expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=40)
    tokens, stats = run(target, drafter, prompt, k=4, max_new_tokens=40, pacing=Pacing())
    assert tokens == expected and stats.drafted > 0
    slowed(monkeypatch, drafter.runtime, 0.02)  # a draft this slow never pays
    tokens, stats = run(target, drafter, prompt, k=4, max_new_tokens=40, pacing=Pacing())
    assert tokens == expected
    assert stats.plain_rounds >= 30 and stats.rounds - stats.plain_rounds <= 5  # the prompt's step, 1 + probes


def test_a_windowed_draft_sees_a_bounded_view_and_the_answer_stays_exact(pair, tok):
    target, model = pair
    drafter = ModelDrafter(model.runtime, window=16)
    prompt = tok.encode(" ".join(PROMPTS * 8))[:100]  # the tiny model's context is 256
    assert len(prompt) > SINK + 2 * 16
    expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=40)
    cuts = []

    def check(context: list[int]) -> None:
        view = drafter.cut_view(context)
        assert len(view) <= SINK + 3 * 16 and view[:SINK] == context[:SINK] and view[-16:] == context[-16:]
        assert drafter.runtime.tokens == view[: len(drafter.runtime.tokens)]  # what it caches is the view's prefix
        cuts.append(len(context) - len(view) + SINK)

    tokens, _ = run(target, drafter, prompt, k=4, max_new_tokens=40, on_round=check)
    assert tokens == expected
    moves = [i for i in range(1, len(cuts)) if cuts[i] != cuts[i - 1]]
    assert moves and all(cuts[b] - cuts[a] >= 2 * 16 for a, b in zip([0, *moves], moves))  # not every window


def test_one_round_that_keeps_a_single_token_does_not_turn_the_pacer_to_plain_steps():
    """Costs are a ratio of averages (seconds per round over tokens per round): a rejected first
    draft (115 ms for one token) among rounds that keep five does not make plain steps look cheaper."""
    pacer = Pacer()
    paced_kinds(pacer, 20, lambda spec: (0.115, 5) if spec else (0.05, 1))
    pacer.record(DRAFT, 0.115, 1)
    assert pacer.figures[DRAFT].cost < pacer.figures[PLAIN].cost
    unlucky = 1
    # a run of them does, once plain steps are cheaper by the hysteresis
    while pacer.figures[DRAFT].cost <= (1 + Pacer.HYSTERESIS) * pacer.figures[PLAIN].cost:
        pacer.record(DRAFT, 0.115, 1)
        unlucky += 1
    assert not speculates(pacer) and 6 <= unlucky <= 20 and pacer.interval == Pacer.MIN_INTERVAL


def test_the_draft_model_keeps_its_turn_while_plain_steps_are_only_a_little_cheaper():
    """Where the draft model paid, its rounds turning 3% dearer a token than plain steps (noise)
    do not turn the pacer to plain steps; 12% dearer (rounds that no longer pay) do."""
    pacer = Pacer()
    paced_kinds(pacer, 10, lambda spec: (0.09, 2) if spec else (0.05, 1))
    assert sum(paced_kinds(pacer, 40, lambda spec: (0.103, 2) if spec else (0.05, 1))) >= 38  # (and a probe)
    assert sum(paced_kinds(pacer, 60, lambda spec: (0.112, 2) if spec else (0.05, 1))[-24:]) <= 2  # probes


def test_the_pacer_does_not_probe_speculation_that_could_not_pay_even_if_every_draft_landed():
    """At long contexts a verify pass and a trim can cost more than K + 1 plain steps: once a
    round has measured that, no probe of speculation follows; where a full round would pay, probes do."""
    hopeless = paced_kinds(Pacer(most=5), 100, lambda spec: (0.6 if spec else 0.1, 1))  # 0.6 s > 5 plain steps
    assert sum(hopeless) == 1  # the first try only
    dear = paced_kinds(Pacer(most=5), 100, lambda spec: (0.4 if spec else 0.1, 1))  # 5 landed drafts would pay
    assert sum(dear) > 2


@pytest.mark.parametrize("priced", [0, 2])
def test_a_paced_round_runs_the_lookup_once_and_falls_to_the_model(pair, monkeypatch, priced):
    """A paced round asks for a free draft first. Where there is none, or the pacer refuses the
    copy (copies slower than this text's pace), and the draft model runs (a proposal without
    copies), the hybrid neither searches a second time nor verifies the refused copy anyway;
    a proposal with copies searches, whatever was asked before it."""
    target, model = pair
    price = lambda offered, acceptance, context, bar: priced  # noqa: E731
    hybrid = HybridDrafter(LookupDrafter(target.vocab_size, price=price), model)
    calls = []
    monkeypatch.setattr(hybrid.lookup, "lookup", lambda context, k: calls.append(len(context)) or [7, 8])
    context, params = [1, 2, 3, 1, 2], SamplingParams()
    model.runtime.reset()
    assert len(hybrid.draft_free(context, 2, params).tokens) == priced
    proposal = hybrid.propose(context, 2, params, np.random.default_rng(0), copies=False)
    assert proposal.tokens and list(model.runtime.tokens[:5]) == context and calls == [5]  # the model's
    hybrid.rollback(context)
    hybrid.propose(context, 2, params, np.random.default_rng(0))
    assert calls == [5, 5]  # an unpaced proposal searches
    model.runtime.reset()


def test_a_round_needs_surer_drafts_the_longer_the_context():
    """After thousands of tokens a verify pass of K + 1 tokens costs several plain steps (its rows'
    attention over the context) and a rejection's trim a few more: the acceptance a round needs
    rises with the context, past what prose reaches."""
    long = replace(AVX512, long_verify=((1000, 1.6), (4000, 2.6), (8000, 4.1)))
    assert long.ratio(5, 0) == AVX512.ratio(5) and long.ratio(5, 4000) == pytest.approx(2.6)
    assert long.ratio(2, 4000) == pytest.approx(1.05 + (2.6 - 1.4) / 4)
    assert long.ratio(5, 16000) == pytest.approx(1.4 + 5.4)  # past the last context: proportional
    levels = [long.break_even(context) for context in (0, 1000, 2000, 4000, 8000)]
    assert levels == sorted(levels) and levels[0] == AVX512.break_even() < 0.8
    assert levels[2] > 0.85 and levels[-1] == math.inf
    alpha = break_even_acceptance(3.0, 4, rejection=1.0)  # the round's tokens pay for its cost
    assert expected_tokens(alpha, 4) == pytest.approx(3.0 + (1 - alpha**4) * 1.0)
    assert alpha > break_even_acceptance(3.0, 4) and break_even_acceptance(0.5, 4, rejection=0.4) == 0.0


def test_a_paced_request_keeps_one_pacer_for_code_and_one_for_the_text_around_it(pair, tok):
    """Each fence token moves the answer into a code block or out of it, and the pacer with it:
    what speculation did in the prose before a block does not hold it back inside, and back in
    prose the pacer finds what it learned there. The answer stays the autoregressive one."""
    target, drafter = pair
    prompt = tok.encode(PROMPTS[0])
    config = DecodeConfig(k=4, pacing=Pacing(), fence_ids=frozenset({7, 9}))
    decoder = Decoder(target, drafter, prompt, config, Stats("t"))
    prose = decoder.pacer
    decoder._accept(Round([5, 7, 6], [Provenance.AUTOREGRESSIVE] * 3))
    code = decoder.pacer
    assert decoder.in_code and code is not prose and code is not None
    decoder._accept(Round([9, 5, 7], [Provenance.AUTOREGRESSIVE] * 3))  # out and back in within one round
    assert decoder.pacer is code
    decoder._accept(Round([9], [Provenance.AUTOREGRESSIVE]))
    assert not decoder.in_code and decoder.pacer is prose
    assert Decoder(target, None, prompt, DecodeConfig(speculative=False), Stats("t")).pacer is None
    expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=30)
    fences = frozenset(expected[3::4])  # tokens of the answer itself: the regime flips along it
    tokens, _ = run(target, drafter, prompt, k=4, max_new_tokens=30, pacing=Pacing(), fence_ids=fences)
    assert tokens == expected


def test_copies_are_verified_while_they_pay_better_than_the_preferred_kind_and_probed_otherwise():
    """Where the draft model keeps more tokens per second than copied rounds do, a copy is verified
    only once in MIN_INTERVAL offers (to measure copies again); where copies do better, every one."""
    pacer = Pacer()
    paced_kinds(pacer, 20, lambda spec: (0.15, 4) if spec else (0.05, 1))  # the draft model: 0.0375 s a token
    assert pacer.offer_copy()  # copies not measured yet: tried
    pacer.record_copy(0.12, 2)  # 0.06 s a token
    taken = [pacer.offer_copy() for _ in range(4 * Pacer.MIN_INTERVAL)]
    assert sum(taken) == 4
    for _ in range(10):
        pacer.record_copy(0.1, 8)  # copies that land: 0.0125 s a token
    assert all(pacer.offer_copy() for _ in range(20))
