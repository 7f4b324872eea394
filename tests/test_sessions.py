"""KV caches per conversation (engine.core.sessions) on the tiny f32 pair: a follow-up turn
prefills only its suffix whoever spoke in between, the least recently used conversation is
evicted, and every answer equals the one the same prompt gets alone."""

from __future__ import annotations

import pytest

from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine, Request
from engine.core.sessions import MAX_SESSIONS, default_capacity

ANSWER = 16


@pytest.fixture(scope="module")
def two_sessions(ir_target, ir_draft) -> Engine:
    return Engine(ir_target, ir_draft, config=EXACT_CONFIG, max_sessions=2)


def turn(engine: Engine, prompt: list[int], reuse: bool = True) -> tuple[list[int], dict]:
    final = engine.run(Request(prompt_ids=tuple(prompt), mode="best", max_new_tokens=ANSWER, reuse_cache=reuse))
    assert final.kind == "done", final.error
    return final.token_ids, final.metrics


def conversation(engine: Engine, text: str) -> list[int]:
    return engine.prompt_ids(Request(({"role": "user", "content": text},)))


def alone(engine: Engine, prompt: list[int]) -> list[int]:
    return turn(engine, prompt, reuse=False)[0]


def test_a_follow_up_turn_prefills_only_its_suffix_whoever_spoke_in_between(two_sessions):
    engine = two_sessions
    engine.with_models(lambda *_: engine.reset())
    a1 = conversation(engine, "def add(a, b): return a + b. Now subtract.")
    b1 = conversation(engine, "The quick brown fox jumps over the lazy dog, twice.")
    a_answer, _ = turn(engine, a1)
    turn(engine, b1)
    a2 = a1 + a_answer + conversation(engine, "and multiply")
    answer, metrics = turn(engine, a2)
    assert metrics["cached_tokens"] >= len(a1) + ANSWER - 1  # B's turn did not evict A's caches
    assert answer == alone(engine, a2)


def test_the_least_recently_used_conversation_is_evicted_and_re_prefilled(two_sessions):
    engine = two_sessions
    engine.with_models(lambda *_: engine.reset())
    a1, b1, c1 = (conversation(engine, f"Conversation {name}: write a long answer about {name}.") for name in "ABC")
    a_answer, _ = turn(engine, a1)
    turn(engine, b1)
    turn(engine, c1)  # a third conversation in a pool of two: A's caches go
    a2 = a1 + a_answer + conversation(engine, "go on")
    answer, metrics = turn(engine, a2)
    assert metrics["cached_tokens"] < len(a1)  # re-prefilled, and the metrics say so
    assert answer == alone(engine, a2)
    assert len(engine.sessions.sessions) == 2


def test_the_default_pool_fits_the_memory_available(monkeypatch):
    assert 1 <= default_capacity(28 * 1024, 32768) <= MAX_SESSIONS
    assert default_capacity(1 << 40, 32768) == 1  # never less than one conversation
    assert default_capacity(1, 1) == MAX_SESSIONS


def test_a_failure_to_find_a_session_ends_the_request_with_an_error(two_sessions, monkeypatch):
    def out_of_memory(prompt, busy=()):
        raise RuntimeError("cannot allocate an infer request")

    monkeypatch.setattr(two_sessions.sessions, "take", out_of_memory)
    final = two_sessions.run(Request(({"role": "user", "content": "hi"},), max_new_tokens=4))
    assert final.kind == "error" and "internal error" in final.error  # not a stream left waiting
