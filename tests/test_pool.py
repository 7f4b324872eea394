"""The n-gram pool across requests (engine.core.pool): what it proposes, its bounded memory, whose
text drafts for whom, and exactness where it drafts (greedy equality here; chi-square in
tests/test_decoding.py)."""

from __future__ import annotations

import numpy as np

from engine.core.drafters import HybridDrafter, LookupDrafter
from engine.core.pacing import Pacing, PassCosts
from engine.core.pool import EMPTY, ENTRIES, MAX_POOLS, NgramPool, Pools
from engine.core.requests import Request
from engine.core.sampling import SamplingParams
from tests.test_decoding import PROMPTS, run

# A machine where verify rows cost nothing and a draft step two plain steps: copies pay, the draft
# model never does (a paced request never runs it).
COPIES_ONLY = PassCosts(1.0, ((2, 1.0), (5, 1.0), (17, 1.0)), 2.0, 4)


def test_a_pool_proposes_the_chain_of_what_followed_each_run_in_earlier_text():
    pool = NgramPool(100, n=2)
    pool.learn([1, 2, 3, 4, 5, 6])
    assert pool.lookup(np.array([9, 1, 2]), 8) == [3, 4, 5, 6]  # chained until no run is known
    assert pool.lookup(np.array([9, 1, 2]), 2) == [3, 4]
    assert pool.lookup(np.array([2, 1]), 8) == [] and pool.lookup(np.array([2]), 8) == []
    pool.learn([7, 1, 2, 8])  # the later text wins
    assert pool.lookup(np.array([1, 2]), 3) == [8]


def test_a_pool_holds_a_fixed_number_of_entries_whatever_it_learns():
    pool = NgramPool(50_000)
    size = pool.table.nbytes
    rng = np.random.default_rng(0)
    for _ in range(20):
        pool.learn(rng.integers(0, 50_000, 20_000).tolist())
    assert pool.table.nbytes == size == 4 * ENTRIES and (pool.table != EMPTY).sum() <= ENTRIES


def test_each_client_drafts_from_its_own_pool_unless_the_operator_shares_one():
    pools = Pools(100, None, 16)
    pools.learn("alice", [1, 2, 3, 4, 5, 6, 7])
    assert pools.of("alice").lookup(np.array([1, 2, 3, 4]), 4) == [5, 6, 7]
    assert pools.of("bob").lookup(np.array([1, 2, 3, 4]), 4) == []
    shared = Pools(100, None, 16, shared=True)
    shared.learn("alice", [1, 2, 3, 4, 5, 6, 7])
    assert shared.of("bob").lookup(np.array([1, 2, 3, 4]), 4) == [5, 6, 7]


def test_a_server_keeps_the_pools_of_its_most_recent_clients_only():
    pools = Pools(100, None, 16)
    first = pools.of("client 0")
    for i in range(1, MAX_POOLS + 1):
        pools.of(f"client {i}")
    assert pools.of("client 0") is not first and pools.of(f"client {MAX_POOLS}") is pools.of(f"client {MAX_POOLS}")


def test_pool_drafts_land_and_the_answer_stays_the_autoregressive_one(pair, tok):
    """Where the conversation has no match and the draft model cannot pay, a paced request drafts
    from its pool only: what it learned from an earlier answer to the same question is accepted,
    and a pool of wrong continuations changes the passes, never the answer."""
    target, model = pair
    never_matches = HybridDrafter(LookupDrafter(target.vocab_size, min_match=10**6), model)
    passes = model.runtime.passes
    for text in PROMPTS:
        prompt = tok.encode(text)
        expected, _ = run(target, None, prompt, speculative=False, max_new_tokens=40)
        taught, wrong = NgramPool(target.vocab_size), NgramPool(target.vocab_size)
        full = prompt + expected
        taught.learn(full)
        for i in range(len(prompt), len(full)):  # after every run of the answer, a token it does not have
            wrong.learn([*full[i - wrong.n : i], (full[i] + 1) % target.vocab_size])
        found = {}
        for name, pool in (("taught", taught), ("wrong", wrong)):
            tokens, found[name] = run(
                target, never_matches, prompt, k=4, max_new_tokens=40, pacing=Pacing(COPIES_ONLY), pool=pool
            )
            assert tokens == expected
        assert found["taught"].accepted >= 0.8 * found["taught"].drafted > 0
        assert found["wrong"].drafted > 0 and found["wrong"].accepted < found["wrong"].drafted
    assert model.runtime.passes == passes


def test_an_answer_teaches_its_own_client_s_pool_and_no_one_else_s(engine):
    prompt = tuple(engine.tokenizer.encode(PROMPTS[0]))
    final = engine.run(Request(prompt_ids=prompt, mode="best", max_new_tokens=24, client="alice"))
    assert final.kind == "done"
    pools = engine.scheduler.pools
    assert pools.of("alice").lookup(np.asarray(prompt[-4:]), 4) == final.token_ids[:4]
    assert (pools.of("bob").table == EMPTY).all()
    again = engine.run(Request(prompt_ids=prompt, mode="best", max_new_tokens=24, client="alice", reuse_cache=False))
    assert again.token_ids == final.token_ids and again.metrics["accepted"] > 0


def test_a_sampled_pool_draft_carries_its_one_hot_distribution():
    pool = NgramPool(10, n=1)
    pool.learn([1, 2, 3])
    draft = pool.draft_free([5, 1], 2, SamplingParams(1.0))
    assert draft.tokens == [2, 3] and draft.probs is not None and (draft.probs.argmax(axis=1) == [2, 3]).all()
