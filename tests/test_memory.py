"""Memory grows with the KV caches, not with a prompt's length times anything else, and stays
inside the engine's budget: long prompts on a tiny model whose context holds thousands of tokens."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from engine.core.budget import ANSWER_BLOCK, HEADROOM, MemoryBudget
from engine.core.cache_manager import OUT_OF_MEMORY
from engine.core.decoding import PREFILL_CHUNK
from engine.core.memory import peak_rss_since, reset_peak_rss
from engine.core.reader import RESIDENT_PER_READ_BYTE
from engine.core.reading import READ_PASS
from engine.core.requests import Event, Request
from engine.core.runtime import EXACT_CONFIG, Runtime
from engine.core.service import Engine
from engine.core.settings import Settings


@pytest.fixture(scope="module")
def long_engine(long_target):
    return Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=1, prompt_reader="f32"))


def _prompt(n: int, vocab: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(10, vocab, n))


@pytest.mark.parametrize("reader", ["off", "f32"])
def test_a_long_prompt_is_read_in_chunks_never_in_one_pass(long_target, reader):
    engine = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=1, prompt_reader=reader))
    widths: list[int] = []
    forward = engine.target.forward

    def spy(new_tokens, rows=1, gemm=False):
        widths.append(len(new_tokens))
        return forward(new_tokens, rows, gemm)

    engine.target.forward = spy
    if engine.reader is not None:
        read = engine.reader.read
        engine.reader.read = lambda runtime, tokens, origin: (  # type: ignore[method-assign]
            widths.append(len(tokens) - len(runtime.tokens)) or read(runtime, tokens, origin)
        )
    event = engine.run(Request(prompt_ids=_prompt(3000, 300), mode="autoregressive", max_new_tokens=2))
    assert event.kind == "done", event.error
    assert sum(widths) >= 3000 and max(widths) <= max(PREFILL_CHUNK, READ_PASS)


def test_budget_keeps_room_for_a_read():
    """A prompt reader's pass holds a copy of the cache it reads into: the longest conversation's
    copy is kept aside, and the input cap follows."""
    plain = MemoryBudget(limit=HEADROOM + 10_000, base=0, per_token=3)
    reading = MemoryBudget(limit=HEADROOM + 10_000, base=0, per_token=3, reading_per_token=2)
    assert (plain.tokens, plain.room) == (3_333, 10_000)
    assert reading.tokens == 2_000 and reading.room == 10_000 - 2_000 * 2
    assert reading.room // reading.per_token >= reading.tokens


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from Linux's /proc")
def test_reading_a_prompt_peaks_at_its_kv_cache_plus_a_constant(long_engine):
    """A pass over the whole prompt would hold its attention scores (heads x length^2 floats:
    about 0.5 GiB here); passes of a chunk hold heads x chunk x length, and the reader's pass what
    the budget keeps aside for it. Measured on a second read as long as the first: in a full test
    run the first one grew the process by 171 and 199 MiB against 119 at times, passing alone
    (the allocator's heap then depends on what ran before)."""
    long_engine.run(Request(prompt_ids=_prompt(6000, 300, seed=1), mode="autoregressive", max_new_tokens=1))
    prompt = _prompt(6000, 300, seed=2)
    reset_peak_rss()
    event = long_engine.run(Request(prompt_ids=prompt, mode="autoregressive", max_new_tokens=2))
    assert event.kind == "done", event.error
    grown = peak_rss_since()
    kv = len(prompt) * long_engine.target.kv_bytes_per_token
    bound = (2 + RESIDENT_PER_READ_BYTE) * kv + 96 * 2**20
    assert grown <= bound, f"reading 6,000 tokens grew the process by {grown / 2**20:.0f} MiB"


ROOM_TOKENS = 2000  # what the small budget below holds of the tiny target's caches


@pytest.fixture
def small_budget_engine(long_target, monkeypatch):
    """An engine whose memory limit leaves room for 2,000 tokens of cache beside its models."""
    from engine.core import service
    from engine.core.budget import HEADROOM, RESIDENT_PER_CACHED_BYTE

    base = 2**30
    monkeypatch.setattr(service, "resident_bytes", lambda: base)
    probe = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=1, prompt_reader="f32"))
    per_token = int(probe.target.kv_bytes_per_token * RESIDENT_PER_CACHED_BYTE)
    return Engine(
        long_target,
        None,
        Settings(
            config=EXACT_CONFIG,
            max_sessions=2,
            memory_limit=base + HEADROOM + ROOM_TOKENS * per_token,
            prompt_reader="off",
        ),  # (with a reader, room is kept aside for its copy: test_budget_keeps_room_for_a_read)
    )


def test_the_input_cap_follows_from_the_memory_budget(small_budget_engine):
    engine = small_budget_engine
    assert engine.budget.tokens == ROOM_TOKENS
    assert engine.max_input_tokens < ROOM_TOKENS
    event = engine.run(Request(prompt_ids=_prompt(ROOM_TOKENS + 100, 300), mode="autoregressive", max_new_tokens=2))
    assert event.kind == "error" and "memory limit" in event.error and f"{engine.max_input_tokens:,}" in event.error


def _answer(stream) -> tuple[Event, str]:
    """A stream's final event and the text it streamed."""
    events = list(stream)
    return events[-1], "".join(e.text for e in events if e.kind == "delta")


def test_a_question_without_a_length_is_admitted_with_room_for_its_prompt_and_a_block(small_budget_engine):
    """Admission reserves the prompt and the next block of its answer, not the whole context
    (8,192 tokens here, four times the room): no request that fits is refused."""
    engine = small_budget_engine
    assert engine.max_context > 4 * ROOM_TOKENS
    stream = engine.generate(Request(prompt_ids=_prompt(50, 300, seed=9), mode="autoregressive"))
    assert not stream.refusal
    first = next(stream)
    assert first.kind == "delta" and first.token_ids
    stream.cancel()
    final = next(e for e in stream if e.final)
    assert final.kind == "done" and final.metrics["finish_reason"] == "cancelled"


def test_an_answer_the_budget_cannot_hold_ends_with_length_and_says_memory_ran_out(small_budget_engine, monkeypatch):
    """Its reservation grows a block at a time; where the room holds no more, the answer ends with
    finish reason length and a line that says why, its caches within the room, and the engine
    keeps serving."""
    engine = small_budget_engine
    monkeypatch.setattr(engine.scheduler, "stop_ids", frozenset())  # (the tiny model would end its turn)
    final, text = _answer(engine.generate(Request(prompt_ids=_prompt(1500, 300, seed=10), mode="autoregressive")))
    assert final.kind == "done" and final.metrics["finish_reason"] == "length", final.error
    assert text.endswith(OUT_OF_MEMORY) and "memory ran out" in OUT_OF_MEMORY
    assert 1500 + ANSWER_BLOCK <= 1500 + len(final.token_ids) <= ROOM_TOKENS
    assert engine.budget.bytes_held(engine.sessions.kv_cache_bytes) <= engine.budget.room
    event = engine.run(Request(prompt_ids=_prompt(1000, 300), mode="autoregressive", max_new_tokens=4))
    assert event.kind == "done" and len(event.token_ids) == 4


def test_a_growing_answer_holds_back_a_newcomer_still_reading_which_then_gets_its_own_answer(
    small_budget_engine, monkeypatch, caplog
):
    """Two requests fit when the second arrives; as the first answer grows, the second, still
    reading its long prompt, is held back (its caches freed), then read again and answered once the
    first has ended: the same answer it gets alone."""
    engine = small_budget_engine
    monkeypatch.setattr(engine.scheduler, "stop_ids", frozenset())
    newcomer = Request(
        prompt_ids=_prompt(1300, 300, seed=11), mode="autoregressive", max_new_tokens=8, reuse_cache=False
    )
    alone = engine.run(newcomer).token_ids
    forward = Runtime.forward

    def slow_reading(self, new_tokens, rows=1, gemm=False):  # a long prompt's passes as a big model's
        if len(new_tokens) > 1:
            time.sleep(0.4)
        return forward(self, new_tokens, rows, gemm)

    monkeypatch.setattr(Runtime, "forward", slow_reading)
    with caplog.at_level(logging.INFO, logger="specchat.engine"):
        growing = engine.generate(Request(prompt_ids=_prompt(100, 300, seed=12), mode="autoregressive"))
        late = engine.generate(newcomer)
        (first, text), (second, _) = _answer(growing), _answer(late)
    assert first.metrics["finish_reason"] == "length" and text.endswith(OUT_OF_MEMORY)
    assert second.kind == "done" and second.token_ids == alone
    assert "held back" in caplog.text


def test_two_questions_without_a_length_are_served_together_within_a_small_budget(small_budget_engine):
    engine = small_budget_engine
    streams = [engine.generate(Request(prompt_ids=_prompt(60, 300, seed=s), mode="autoregressive")) for s in (13, 14)]
    assert not any(stream.refusal for stream in streams)
    firsts = [next(stream) for stream in streams]
    assert all(event.kind == "delta" for event in firsts)
    for stream in streams:
        stream.cancel()
    finals = [next(e for e in stream if e.final) for stream in streams]
    assert all(final.metrics["peak_sharing"] == 2 for final in finals)


def test_an_idle_conversations_cache_is_dropped_to_admit_a_request_that_needs_its_memory(small_budget_engine):
    engine = small_budget_engine
    first, second = _prompt(1200, 300, seed=3), _prompt(1200, 300, seed=4)
    engine.run(Request(prompt_ids=first, mode="autoregressive", max_new_tokens=4))
    assert engine.sessions.kv_cache_bytes >= 1200 * engine.target.kv_bytes_per_token  # kept for a next turn
    event = engine.run(Request(prompt_ids=second, mode="autoregressive", max_new_tokens=4))
    assert event.kind == "done"
    held = engine.budget.bytes_held(engine.sessions.kv_cache_bytes)
    assert held <= engine.budget.room, "the first conversation's cache should have been dropped"


def test_rows_that_would_not_fit_padded_to_the_longest_are_not_batched(small_budget_engine, monkeypatch):
    """A 1,500-token conversation and a 200-token one fit the budget side by side, not as two
    1,500-token rows: they take turns on their own caches, each answer as it is alone."""
    engine = small_budget_engine
    long, short = _prompt(1500, 300, seed=5), _prompt(200, 300, seed=6)
    requests = [Request(prompt_ids=p, mode="autoregressive", max_new_tokens=8) for p in (long, short)]
    alone = [engine.run(request).token_ids for request in requests]
    joined: list[int] = []
    join = engine.scheduler._batch.join
    monkeypatch.setattr(engine.scheduler._batch, "join", lambda members: (joined.append(len(members)), join(members)))
    streams = [engine.generate(request) for request in requests]
    answers = [next(e for e in stream if e.final).token_ids for stream in streams]
    assert answers == alone and not joined


def test_a_long_prompt_reports_how_far_it_is_read_and_stops_between_chunks(long_engine):
    prompt = _prompt(2000, 300, seed=7)
    events = list(long_engine.generate(Request(prompt_ids=prompt, mode="autoregressive", max_new_tokens=2)))
    read = [e.metrics["prompt_read"] for e in events if e.kind == "progress"]
    assert len(read) >= 2000 // PREFILL_CHUNK - 1 and read == sorted(read) and read[-1] < len(prompt)
    assert all(e.metrics["prefill_tokens_per_s"] > 0 for e in events if e.kind == "progress")
    done = events[-1].metrics
    assert events[-1].kind == "done" and done["prompt_read"] == len(prompt)
    # the rate is over the reading passes alone: what they read over what they took, not the
    # prompt over them (the first round reads the rest; the opening is copied, not read)
    assert done["prefill_tokens_per_s"] == pytest.approx(read[-1] / done["prefill_s"])
    short = long_engine.run(Request(prompt_ids=prompt[:40], mode="autoregressive", max_new_tokens=2))
    assert short.metrics["prefill_tokens_per_s"] is None
    stream = long_engine.generate(Request(prompt_ids=_prompt(3000, 300, seed=8), mode="autoregressive"))
    first = next(stream)
    assert first.kind == "progress"
    stream.cancel()
    final = next(e for e in stream if e.final)
    assert final.metrics["finish_reason"] == "cancelled" and final.metrics["new_tokens"] == 0
    assert final.metrics["prompt_read"] < 3000
