"""KV caches per conversation (engine.core.sessions) on the tiny f32 pair: a follow-up turn
prefills only its suffix whoever spoke in between, the least recently used conversation is
evicted, a new one starts from the template's opening copied in, and every answer equals the one
the same prompt gets alone."""

from __future__ import annotations

import gc
import logging
import time
import weakref

import numpy as np
import pytest

from engine.core import chat
from engine.core.measured import Measured
from engine.core.pacing import Pacing
from engine.core.requests import Request, Stream
from engine.core.runtime import EXACT_CONFIG, Runtime, common_prefix
from engine.core.service import Engine
from engine.core.sessions import CONTINUES, Opening, Session
from engine.core.settings import Settings
from engine.core.worker import CLOSED
from engine.errors import EngineError

ANSWER = 16


@pytest.fixture(scope="module")
def two_sessions(ir_target, ir_draft) -> Engine:
    return Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, max_sessions=2, pacing=Pacing(), prompt_reader="off")
    )


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


def test_a_conversation_opened_again_continues_in_its_own_session_not_the_longer_one_it_repeats(ir_target, ir_draft):
    """Two users with the same opening (an example prompt, a benchmark's conversation): the
    second one's follow-up shares more with the first one's long conversation than with its own
    session, but only its own session holds what it goes on from."""
    engine = Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, max_sessions=3, pacing=Pacing(), prompt_reader="off")
    )
    first = conversation(engine, "Hash maps?")
    answer, _ = turn(engine, first)
    second = first + answer + conversation(engine, "Resize it.")
    answer, _ = turn(engine, second)
    turn(engine, second + answer + conversation(engine, "Now " + "and then " * 18 + "add deletion."))
    again, _ = turn(engine, first)  # the second user opens the same way: a session of its own
    follow_up = first + again + conversation(engine, "Resize it.")
    longest = max(len(s.target.tokens) for s in engine.sessions.sessions)
    assert follow_up == second and len(follow_up) < CONTINUES * longest  # the case under test
    answer, metrics = turn(engine, follow_up)
    assert metrics["cached_tokens"] >= len(first) + ANSWER - 1
    assert answer == alone(engine, follow_up)


def test_a_failure_to_find_a_session_ends_the_request_with_an_error(two_sessions, monkeypatch):
    def out_of_memory(prompt, busy=()):
        raise RuntimeError("cannot allocate an infer request")

    monkeypatch.setattr(two_sessions.sessions, "take", out_of_memory)
    final = two_sessions.run(Request(({"role": "user", "content": "hi"},), max_new_tokens=4))
    assert final.kind == "error" and "internal error" in final.error  # not a stream left waiting


@pytest.mark.parametrize("mode", ["best", "speculative", "autoregressive"])
def test_continue_extends_a_cut_answer_from_the_caches_as_if_it_was_never_cut(two_sessions, mode):
    """Continue (answer_ids) after a cap or a Stop: the same tokens as one uncut answer, and only
    the last token of the cut answer is read again."""
    engine = two_sessions
    messages = ({"role": "user", "content": "def add(a, b): return a + b. Now subtract."},)
    whole = engine.run(Request(messages, mode=mode, max_new_tokens=2 * ANSWER, reuse_cache=False))
    first = engine.run(Request(messages, mode=mode, max_new_tokens=ANSWER, reuse_cache=False))
    rest = engine.run(Request(messages, answer_ids=tuple(first.token_ids), mode=mode, max_new_tokens=ANSWER))
    assert first.metrics["finish_reason"] == "length"
    assert first.token_ids + rest.token_ids == whole.token_ids
    assert rest.metrics["cached_tokens"] == rest.metrics["prompt_tokens"] - 1
    text = engine.text(first.token_ids) + "".join(
        e.text
        for e in engine.generate(Request(messages, answer_ids=tuple(first.token_ids), mode=mode, max_new_tokens=ANSWER))
    )
    assert text == engine.text(whole.token_ids)  # the continued text joins without a seam


def test_continuing_with_token_ids_outside_the_vocabulary_is_refused(two_sessions):
    messages = ({"role": "user", "content": "hi"},)
    final = two_sessions.run(Request(messages, answer_ids=(two_sessions.target.vocab_size,), max_new_tokens=4))
    assert final.kind == "error" and "answer_ids must be token ids" in final.error
    final = two_sessions.run(Request(answer_ids=(1, 2), prompt_ids=(3, 4), max_new_tokens=4))
    assert final.kind == "error" and "send the messages too" in final.error


def test_a_speculative_answer_is_measured_against_plain_decoding_of_its_context_length(two_sessions):
    engine = two_sessions
    messages = ({"role": "user", "content": "The quick brown fox jumps over the lazy dog, twice."},)
    engine.scheduler.baseline = type(engine.scheduler.baseline)()  # nothing measured yet
    unmeasured = engine.run(Request(messages, mode="best", max_new_tokens=ANSWER, reuse_cache=False))
    assert unmeasured.metrics["speedup_vs_ar"] is None  # the footer then says "expected"
    plain = engine.run(Request(messages, mode="autoregressive", max_new_tokens=ANSWER, reuse_cache=False))
    fast = engine.run(Request(messages, mode="best", max_new_tokens=ANSWER, reuse_cache=False))
    m, p = fast.metrics, plain.metrics
    step = (p["wall_s"] - p["ttft_s"]) / (p["new_tokens"] - 1)
    assert plain.metrics["speedup_vs_ar"] == 1.0
    assert m["speedup_vs_ar"] == pytest.approx((m["ttft_s"] + (m["new_tokens"] - 1) * step) / m["wall_s"])


def test_a_new_conversation_copies_the_template_opening_and_answers_as_if_it_had_read_it(two_sessions):
    engine = two_sessions
    engine.with_models(lambda *_: engine.reset())
    opening = engine.sessions.opening
    assert opening is not None and opening.tokens == tuple(chat.opening_ids(engine.tokenizer))
    for text in ("Sort a list.", "The quick brown fox jumps over the lazy dog."):
        prompt = conversation(engine, text)
        answer, metrics = turn(engine, prompt)
        assert metrics["cached_tokens"] == len(opening.tokens) > 0  # copied, not read
        assert answer == alone(engine, prompt)  # (a cold request reads everything)
    system = engine.prompt_ids(Request(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})))
    shared = common_prefix(opening.tokens, system)
    assert 0 < shared < len(opening.tokens)  # a conversation of its own system turn takes what it shares
    answer, metrics = turn(engine, system)
    assert metrics["cached_tokens"] == shared and answer == alone(engine, system)


def test_a_cache_loaded_with_copied_entries_computes_the_same_logits_as_one_that_read_them(ir_target):
    target = Runtime(ir_target, config=EXACT_CONFIG, first_token_alone=True)
    read = target.fork()
    prompt = list(range(5, 45))
    expected = read.sync(prompt, rows=8)
    opening = Opening.read(prompt[:20], (target.fork(), None))
    for shared in (1, 12, 20):  # a prompt that leaves the opening after `shared` tokens takes those
        target.reset()
        opening.seed(Session(target, None, {}), prompt[:shared] + [3] * 5)
        assert target.tokens == prompt[:shared]
    target.sync(prompt[:30])
    opening.seed(Session(target, None, {}), prompt)  # a cache holding more of the prompt is kept
    assert target.tokens == prompt[:30]
    target.reset()
    opening.seed(Session(target, None, {}), prompt)
    assert np.array_equal(target.sync(prompt, rows=8), expected)


def test_the_opening_read_at_one_start_is_kept_and_a_restart_loads_it_without_computing(
    ir_target, tmp_path, monkeypatch
):
    target = Runtime(ir_target, config=EXACT_CONFIG, first_token_alone=True)
    tokens = list(range(5, 25))
    read = Opening.kept(Measured.open(tmp_path, {}), tokens, (target, None), None)

    def computes(*_args):
        raise AssertionError("a restart computed the opening again")

    monkeypatch.setattr(Opening, "read", computes)
    kept = Opening.kept(Measured.open(tmp_path, {}), tokens, (target, None), None)
    assert kept.tokens == read.tokens and kept.origins == read.origins and kept.entries[1] is None
    assert kept.entries[0].keys() == read.entries[0].keys()
    assert all(np.array_equal(kept.entries[0][name], e) for name, e in read.entries[0].items())
    monkeypatch.undo()
    other = Opening.kept(Measured.open(tmp_path, {}), tokens[:10], (target, None), None)  # another template
    assert other.tokens == tuple(tokens[:10])
    remeasured = Opening.kept(Measured.open(tmp_path, {}, remeasure=True), tokens, (target, None), None)
    assert all(np.array_equal(remeasured.entries[0][name], e) for name, e in read.entries[0].items())


def test_a_closed_engine_answers_what_it_took_refuses_more_and_frees_its_models(ir_target, ir_draft):
    """A benchmark loads one engine after another in one process: the one closed must not hold its
    models (each engine's budget counts what the process holds)."""
    engine = Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), prompt_reader="off")
    )
    prompt = conversation(engine, "Sort a list.")
    taken = engine.generate(Request(prompt_ids=tuple(prompt), mode="best", max_new_tokens=ANSWER))
    engine.close()
    answered = next(event for event in taken if event.final)
    assert answered.kind == "done" and len(answered.token_ids) == ANSWER
    refused = engine.run(Request(prompt_ids=tuple(prompt)))
    assert refused.kind == "error" and "closed" in refused.error
    late, released = Stream(1.0, lambda: True), []  # a request that passed the engine's check as it closed
    engine.scheduler.submit(
        Request(), engine.prompt(Request(prompt_ids=tuple(prompt))), late, lambda: released.append(1)
    )
    assert [event.error for event in late] == [CLOSED] and released
    with pytest.raises(EngineError, match="closed"):
        engine.with_models(lambda target, draft: None)
    engine.close()  # (closed already: nothing to wait for)
    models = [weakref.ref(engine.target), weakref.ref(engine.draft)]
    gc.disable()  # freed at once, not at the collector's next cycle
    try:
        del engine, taken
        assert [model() for model in models] == [None, None]
    finally:
        gc.enable()


def test_closing_cancels_what_the_engine_still_holds_after_its_timeout_and_says_so(ir_target, ir_draft, caplog):
    """One request running at a big model's pace, one waiting behind it (one session)."""
    engine = Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), prompt_reader="off")
    )
    forward = engine.target.forward
    engine.target.forward = lambda *a, **kw: (time.sleep(0.05), forward(*a, **kw))[1]  # (a big model's pace)
    prompt = conversation(engine, "Sort a list.")
    running = engine.generate(Request(prompt_ids=tuple(prompt), mode="autoregressive", max_new_tokens=200))
    waiting = engine.generate(Request(prompt_ids=tuple(prompt), mode="autoregressive", max_new_tokens=200))
    first = next(running)
    assert first.kind == "delta", first.error
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="specchat.engine"):
        engine.close(timeout=0.5)
    assert time.monotonic() - start < 5.0
    finals = [next(event for event in stream if event.final) for stream in (running, waiting)]
    assert [final.metrics["finish_reason"] for final in finals] == ["cancelled", "cancelled"]
    assert "cancelled" in caplog.text and "closing" in caplog.text
