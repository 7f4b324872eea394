"""The prompt reader (engine.core.reader): its plan is a function of the conversation alone, what
it writes is the target's cache, and an answer is the same whatever the cache held before: kept,
evicted and re-read, after an edit, a retry or a continue, and in every mode."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from engine.core.pacing import Pacing
from engine.core.reader import Reader
from engine.core.reading import ReadPass, ReadPath, read_plan, resume_at, steps_only
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG, Runtime
from engine.core.service import Engine
from engine.core.settings import Settings
from tests.tiny import TOKENS

R, S = ReadPath.READER, ReadPath.STEPS


# -- the plan ---------------------------------------------------------------------------------
def test_a_short_run_is_the_decoding_paths():
    assert read_plan(100, spoken=[(30, 40)], width=32, shortest=20) == (
        ReadPass(0, 30, R),
        ReadPass(30, 40, S),
        ReadPass(40, 72, R),
        ReadPass(72, 100, R),
    )
    assert read_plan(100, spoken=[(30, 40)], width=32, shortest=31)[0] == ReadPass(0, 30, S)


def test_the_plan_reads_in_passes_from_each_runs_start_and_leaves_answers_to_the_decoding_path():
    plan = read_plan(20, spoken=[(8, 12)], breaks=[3], width=4, shortest=1)
    assert plan == (
        ReadPass(0, 3, R),
        ReadPass(3, 7, R),
        ReadPass(7, 8, R),
        ReadPass(8, 12, S),
        ReadPass(12, 16, R),
        ReadPass(16, 20, R),
    )


@pytest.mark.parametrize("length", [0, 1, 5, 9, 40])
def test_the_plan_covers_every_token_but_the_last_once(length):
    plan = read_plan(length, spoken=[(2, 4), (3, 7), (30, 60)], breaks=[5, 100], width=4, shortest=3)
    covered = [i for p in plan for i in range(p.start, p.stop)]
    assert covered == list(range(length))
    assert all(p.stop - p.start <= 4 for p in plan if p.path is R)
    assert steps_only(length) == ((ReadPass(0, length, S),) if length else ())


@dataclass
class Cache:
    """What resume_at reads of a runtime."""

    tokens: list[int]
    origins: list = field(default_factory=list)


def test_a_cache_is_kept_up_to_the_first_entry_another_pass_wrote():
    tokens = list(range(20))
    plan = read_plan(19, spoken=[(8, 12)], width=4, shortest=1)  # 0-4 4-8 R, 8-12 S, 12-16 16-19 R
    written = [p if p.path is R else None for p in plan for _ in range(p.start, p.stop)] + [None]
    assert resume_at(plan, tokens, Cache(tokens, written)) == 20  # all of it, the first round's token too
    assert resume_at(plan, tokens, Cache(tokens[:10], written[:10])) == 10  # into the answer
    assert resume_at(plan, tokens, Cache(tokens[:14], written[:14])) == 12  # a reader pass only whole
    assert resume_at(plan, [*tokens[:6], 99, *tokens[7:]], Cache(tokens, written)) == 4  # an edit mid-pass
    other = read_plan(19, width=4, shortest=1)  # the same tokens read by another plan: the answer as prompt text
    assert resume_at(other, tokens, Cache(tokens, written)) == 8
    decoded = [*written[:8], *[None] * 12]  # what the decoding path wrote where the plan reads
    assert resume_at(plan, tokens, Cache(tokens, decoded)) == 12
    read_last = [*written[:19], ReadPass(19, 20, R)]  # the first round's token must be its own
    assert resume_at(plan, tokens, Cache(tokens, read_last)) == 19


# -- the reader on the tiny target --------------------------------------------------------------
def test_the_reader_writes_the_targets_cache_as_its_own_passes_would(ir_target):
    prompt = TOKENS * 8
    own = Runtime(ir_target, config=EXACT_CONFIG, first_token_alone=True)
    expected = own.forward(prompt, rows=1)
    read = Runtime(ir_target, config=EXACT_CONFIG, first_token_alone=True)
    reader = Reader(ir_target, EXACT_CONFIG, "f32")
    for part in read_plan(len(prompt) - 1, width=16):
        reader.read(read, prompt[: part.stop], part)
    assert read.tokens == prompt[:-1] and read.origins[0] == ReadPass(0, 16, R)
    got = read.forward(prompt[-1:])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    read.trim(40)  # and it rolls back like any cache
    assert read.tokens == prompt[:40] and len(read.origins) == 40
    np.testing.assert_allclose(read.forward(prompt[40:]), expected, atol=1e-4)


# -- the promises, through the engine ------------------------------------------------------------
@pytest.fixture(scope="module")
def read_engine(ir_target, ir_draft) -> Engine:
    return Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), prompt_reader="f32")
    )


def ask(engine: Engine, messages: list[dict], mode: str = "best", reuse: bool = True, **extra) -> list[int]:
    request = Request(tuple(messages), mode=mode, max_new_tokens=12, reuse_cache=reuse, **extra)
    final = engine.run(request)
    assert final.kind == "done", final.error
    return final.token_ids


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def cached(engine: Engine, n: int) -> dict[str, np.ndarray]:
    """The first ``n`` entries of the (one) conversation's target cache."""
    return engine.with_models(
        lambda *_: {k: v[:, :, :n] for k, v in engine.sessions.sessions[0].target.entries().items()}
    )


def test_an_answer_does_not_depend_on_what_the_cache_held(read_engine):
    """Every way to the same conversation leaves its prompt's entries bit for bit alike (a tiny
    model's answers would hide a difference in the last bits), and so the same answer."""
    engine = read_engine
    first = [user("def add(a, b): return a + b. Now subtract, and explain it. " * 2)]  # (runs of 64 and more)
    answer = engine.text(ask(engine, first))
    second = [*first, {"role": "assistant", "content": answer}, user("and multiply, " * 5)]
    n = len(engine.prompt_ids(Request(tuple(second))))
    answers, entries = {}, {}
    answers["fresh"], entries["fresh"] = ask(engine, second, reuse=False), cached(engine, n)
    ask(engine, first, reuse=False)
    answers["kept"], entries["kept"] = ask(engine, second), cached(engine, n)  # only the new message read
    ask(engine, [user("The quick brown fox jumps over the lazy dog.")])  # one session: evicted
    answers["evicted"], entries["evicted"] = ask(engine, second), cached(engine, n)
    ask(engine, [*second[:-1], user("and multiply, " * 3 + "and divide, with a remainder")])
    answers["edited"], entries["edited"] = ask(engine, second), cached(engine, n)
    answers["retried"], entries["retried"] = ask(engine, second), cached(engine, n)
    for way in answers:
        assert answers[way] == answers["fresh"], way
        assert all(np.array_equal(entries[way][k], entries["fresh"][k]) for k in entries[way]), way


def test_entries_another_path_wrote_are_read_again(read_engine):
    """A conversation sent as token ids marks no answers: the reader reads them too, from the
    start of the pass they fall in, and the kept cache then holds what a fresh read writes."""
    engine = read_engine
    first = engine.prompt_ids(Request((user("def add(a, b): return a + b. Now subtract, and explain it. " * 2),)))
    raw = Request(prompt_ids=tuple(first), max_new_tokens=12)
    second = [*first, *engine.run(raw).token_ids, *engine.prompt_ids(Request((user("and multiply, " * 5),)))]
    kept = engine.run(Request(prompt_ids=tuple(second), max_new_tokens=12))
    assert kept.metrics["cached_tokens"] < len(first) - 1  # (read again from the pass the answer falls in)
    entries = cached(engine, len(second) - 1)
    fresh = engine.run(Request(prompt_ids=tuple(second), max_new_tokens=12, reuse_cache=False))
    assert kept.token_ids == fresh.token_ids
    again = cached(engine, len(second) - 1)
    assert all(np.array_equal(entries[k], again[k]) for k in entries)


def test_a_continued_answer_is_the_answer_uncut(read_engine):
    engine = read_engine
    messages = [user("for i in range(10): print(i) -- what does it print?")]
    whole = ask(engine, messages, reuse=False)
    head = engine.run(Request(tuple(messages), max_new_tokens=5, reuse_cache=False)).token_ids
    rest = ask(engine, messages, answer_ids=tuple(head))
    assert [*head, *rest][: len(whole)] == whole


@pytest.mark.parametrize("mode", ["speculative", "adaptive", "hybrid", "pld", "best"])
def test_greedy_output_is_the_same_in_every_mode_with_the_reader(read_engine, mode):
    engine = read_engine
    messages = [user("class Stack: def push(self, x): self.items.append(x) -- add pop.")]
    assert ask(engine, messages, mode=mode, reuse=False) == ask(engine, messages, mode="autoregressive", reuse=False)


def test_a_long_prompt_is_read_in_the_plans_passes(long_target):
    engine = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=2, prompt_reader="f32"))
    text = " ".join(f"line {i}: the quick brown fox" for i in range(120))
    messages = [user(text)]
    final = engine.run(Request(tuple(messages), mode="autoregressive", max_new_tokens=8, reuse_cache=False))
    assert final.kind == "done" and final.metrics["prompt_tokens"] > 600
    own = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=1, prompt_reader="off"))
    plain = own.run(Request(tuple(messages), mode="autoregressive", max_new_tokens=8, reuse_cache=False))
    assert final.token_ids == plain.token_ids  # (a tiny f32 model: rounding far from any tie)
    session = engine.sessions.sessions[-1].target
    passes = {o for o in session.origins if o is not None}
    assert len(passes) >= 3 and all(p.stop - p.start <= 256 for p in passes)
