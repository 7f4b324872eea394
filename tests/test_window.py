"""A conversation longer than the input cap (engine.core.window): the oldest whole turns leave the
model's view in large steps, the system prompt stays, the start holds turn after turn so that each
prompt continues the caches of the last; an answer after a cut is the kept window's answer; ``stop``
and a last turn too long alone are refused as before."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.api.openai import build_router
from engine.core import chat
from engine.core.chat import Message
from engine.core.requests import Request
from engine.core.tokenizer import load_tokenizer
from engine.core.window import KEPT_SHARE, fit, window_start

SYSTEM: Message = {"role": "system", "content": "Answer with code."}
ANSWER = 12  # tokens of each answer the engine writes here


def laid_out(sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Turns of (question, answer) tokens end to end, the last one just asked: each turn's start and
    where the conversation ended when it was asked (window_start's ``turns``)."""
    starts = np.cumsum([0] + [q + a for q, a in sizes[:-1]])
    return [(int(start), int(start) + q) for start, (q, _) in zip(starts, sizes)]


def test_a_conversation_within_the_cap_keeps_every_turn():
    assert window_start(laid_out([(10, 20)] * 5), fixed=20, cap=200) == 0


def test_the_start_holds_until_the_cap_is_passed_again_then_leaves_half_the_cap_in_view():
    cap, fixed = 400, 20
    rng = np.random.default_rng(0)
    sizes = [(int(rng.integers(5, 30)), int(rng.integers(10, 60))) for _ in range(80)]
    starts = [window_start(laid_out(sizes[: n + 1]), fixed, cap) for n in range(len(sizes))]
    for n in range(1, len(sizes)):
        turns = laid_out(sizes[: n + 1])
        kept = {start: fixed + turns[-1][1] - turns[start][0] for start in (starts[n - 1], starts[n])}
        if starts[n] == starts[n - 1]:
            assert kept[starts[n]] <= cap
        else:  # a cut: only where the window would pass the cap, and down to half of it
            assert starts[n] > starts[n - 1] and kept[starts[n - 1]] > cap and kept[starts[n]] <= cap * KEPT_SHARE
    cuts = len(set(starts)) - 1
    total = sum(q + a for q, a in sizes)
    assert 2 <= cuts <= total / (cap * KEPT_SHARE)  # large steps: far fewer cuts than turns


def test_a_long_last_turn_keeps_only_what_fits_beside_it():
    turns = laid_out([(10, 20)] * 8 + [(300, 0)])
    assert window_start(turns, fixed=20, cap=400) == 6  # the cap, not half of it: two short turns fit
    assert window_start(laid_out([(10, 20)] * 8 + [(500, 0)]), fixed=20, cap=400) == 8  # too long alone


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def question(i: int) -> Message:
    return {"role": "user", "content": f"Question {i}: for i in range({i}): print(i)?"}


def answer(i: int) -> Message:
    return {"role": "assistant", "content": f"def add(a, b):\n    return a + b + {i}\n"}


def conversation(turns: int) -> list[Message]:
    """The system prompt, ``turns`` questions answered, and one more question."""
    return [SYSTEM, *(m for i in range(turns) for m in (question(i), answer(i))), question(turns)]


def test_the_system_prompt_stays_and_whole_turns_leave_the_view(tokenizer):
    messages = conversation(12)
    cap = len(chat.prompt(tokenizer, messages).ids) // 2
    kept = fit(tokenizer, messages, cap)
    assert kept.out_of_view > 0 and kept.out_of_view % 2 == 0  # questions with their answers
    assert kept.ids == chat.prompt(tokenizer, [SYSTEM, *messages[1 + kept.out_of_view :]]).ids
    assert len(kept.ids) <= cap


def test_turn_after_turn_each_prompt_continues_the_last_until_a_cut_and_cuts_are_few(tokenizer):
    cap, cuts, last = 320, 0, None
    for turns in range(30):
        kept = fit(tokenizer, conversation(turns), cap)
        assert len(kept.ids) <= cap
        if last is not None and kept.out_of_view == last.out_of_view:
            assert kept.ids[: len(last.ids)] == last.ids  # the caches of the last turn serve this one
        elif last is not None:
            cuts += 1
            assert kept.out_of_view > last.out_of_view and len(kept.ids) <= cap * KEPT_SHARE
        last = kept
    total = len(chat.prompt(tokenizer, conversation(29)).ids)
    assert 2 <= cuts < total / (cap * KEPT_SHARE)  # each cut leaves out more than half the cap


def run_turns(engine, mode: str) -> tuple[list[Message], list]:
    """Questions answered by the engine until one's answer comes after a cut; the messages sent
    for it and every turn's final event."""
    messages: list[Message] = [SYSTEM]
    finals = []
    for i in range(40):
        messages.append(question(i))
        finals.append(engine.run(Request(tuple(messages), mode=mode, max_new_tokens=ANSWER)))
        assert finals[-1].kind == "done", finals[-1].error
        if finals[-1].metrics["messages_out_of_view"]:
            return messages, finals
        messages.append({"role": "assistant", "content": engine.text(finals[-1].token_ids)})
    raise AssertionError("no cut in 40 turns")


@pytest.mark.parametrize("mode", ["autoregressive", "speculative", "best"])
def test_an_answer_after_a_cut_is_the_kept_windows_and_the_next_turn_reuses_its_caches(engine, mode):
    """The cut's window is read into the caches once, both models' (the draft drafts on), and the
    next turn, kept from the same start, reads only what it adds; each answer is the one the
    window gets as a fresh conversation."""
    messages, finals = run_turns(engine, mode)
    cut = finals[-1]
    hidden = cut.metrics["messages_out_of_view"]
    after = [*messages, {"role": "assistant", "content": engine.text(cut.token_ids)}, question(99)]
    later = engine.run(Request(tuple(after), mode=mode, max_new_tokens=ANSWER))
    assert later.metrics["messages_out_of_view"] == hidden
    assert later.metrics["cached_tokens"] >= cut.metrics["prompt_tokens"]
    assert cut.metrics["cached_tokens"] < cut.metrics["prompt_tokens"] // 2  # (the window was read anew)
    if mode == "speculative":
        assert cut.metrics["drafted"] > 0 and later.metrics["drafted"] > 0
    for sent, final in ((messages, cut), (after, later)):
        kept = (SYSTEM, *sent[1 + hidden :])
        fresh = engine.run(Request(kept, mode=mode, max_new_tokens=ANSWER, reuse_cache=False))
        assert fresh.metrics["messages_out_of_view"] == 0 and fresh.token_ids == final.token_ids


def test_stop_refuses_a_long_conversation_and_a_last_turn_too_long_alone_is_refused_either_way(engine):
    messages = tuple(conversation(12))
    cap = f"at most {engine.max_input_tokens:,} tokens"
    windowed = engine.run(Request(messages, max_new_tokens=4))
    assert windowed.kind == "done" and windowed.metrics["messages_out_of_view"] > 0
    stopped = engine.run(Request(messages, max_new_tokens=4, context_overflow="stop"))
    assert stopped.kind == "error" and "tokens long" in stopped.error and cap in stopped.error
    paste = (*messages[:-1], {"role": "user", "content": "speculative " * 150})
    refused = engine.run(Request(paste, max_new_tokens=4))
    assert refused.kind == "error" and "the last turn is" in refused.error and "tokens long" in refused.error
    assert cap in refused.error
    unknown = engine.run(Request(messages, context_overflow="truncate-middle"))
    assert unknown.kind == "error" and "context_overflow" in unknown.error


def test_the_api_says_how_many_messages_are_out_of_view_in_usage(engine):
    app = FastAPI()
    app.include_router(build_router(engine, "tiny", {}, None))
    body = {"model": "tiny", "messages": conversation(12), "max_tokens": 4}
    with TestClient(app) as http:
        windowed, stopped, unknown = (
            http.post("/v1/chat/completions", json={**body, **extra})
            for extra in ({}, {"context_overflow": "stop"}, {"context_overflow": "middle"})
        )
    expected = engine.run(Request(tuple(conversation(12)), max_new_tokens=4)).metrics["messages_out_of_view"]
    assert windowed.status_code == 200 and windowed.json()["usage"]["messages_out_of_view"] == expected > 0
    assert stopped.status_code == 400 and "tokens long" in stopped.json()["error"]["message"]
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "context_overflow"
