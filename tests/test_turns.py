"""Fair turns between clients: round-robin lines, per-client limits, identity on the API; on the
tiny pair with the engine's worker held while requests arrive."""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.api.openai import build_router
from engine.core import scheduler as scheduler_module
from engine.core.pacing import Pacing
from engine.core.reading import READ_PASS
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.core.turns import (
    NO_LIMITS,
    PUBLIC_LIMITS,
    RETRY_AFTER_S,
    ClientBusy,
    ClientLedger,
    ClientLimits,
    FairQueue,
    TimeShare,
)


def test_the_lines_are_taken_in_turn_one_request_per_client():
    queue: FairQueue[str] = FairQueue(lambda item: item[0])
    for item in ["a1", "a2", "a3", "b1", "c1", "b2"]:
        queue.put(item)
    assert [queue.take() for _ in range(6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert queue.take() is None and len(queue) == 0


def test_a_request_put_back_keeps_its_turn_and_a_client_at_its_limit_is_passed_over():
    queue: FairQueue[str] = FairQueue(lambda item: item[0])
    for item in ["a1", "a2", "b1"]:
        queue.put(item)
    first = queue.take()
    queue.put_back(first)
    assert queue.take(lambda client: client != "a") == "b1"
    assert [queue.take(), queue.take()] == ["a1", "a2"]


def test_requests_cancelled_while_waiting_leave_the_line_and_the_others_keep_their_turns():
    queue: FairQueue[str] = FairQueue(lambda item: item[0])
    for item in ["a1", "a2", "b1", "a3"]:
        queue.put(item)
    assert queue.drop(lambda item: item in ("a1", "a3")) == ["a1", "a3"] and len(queue) == 2
    assert [queue.take(), queue.take(), queue.take()] == ["a2", "b1", None]


def test_side_work_gets_one_client_s_share_of_the_time_and_never_a_burst():
    """With three clients generating together and a long prompt to read, the reading gets a
    quarter of the time: a slice of 0.3 s after 0.9 s of the others' steps."""
    share = TimeShare(most_s=0.4)
    share.earn(0.3, sharing=3)
    assert share.allows()
    share.spend(0.3)  # a slice overruns what was earned; the others' steps pay it back
    steps = 0
    while not share.allows():
        share.earn(0.3, sharing=3)
        steps += 1
    assert steps == 3  # 0.9 s of shared work, then the next slice
    for _ in range(100):  # a long while with nothing on the side saves no more than one slice
        share.earn(0.1, sharing=3)
    assert share.credit == pytest.approx(0.4)
    share.spend(1.0)
    share.settle()  # nobody generating: side work owes nothing
    assert not share.allows() and share.credit == 0.0


@pytest.fixture(scope="module")
def shared_engine(ir_target, ir_draft):
    """One request at a time (one session); a client may hold two requests waiting or running."""
    return Engine(
        ir_target,
        ir_draft,
        Settings(
            config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), client_limits=ClientLimits(1, 2), prompt_reader="f32"
        ),
    )


@contextmanager
def held(engine: Engine) -> Iterator[None]:
    """The engine's worker held in a tool job while requests arrive, so that they all wait in line."""
    gate, started = threading.Event(), threading.Event()

    def wait(target, draft) -> None:
        started.set()
        gate.wait(30)

    threading.Thread(target=engine.with_models, args=(wait,), daemon=True).start()
    started.wait(30)
    try:
        yield
    finally:
        gate.set()


def ask(client: str, n: int) -> Request:
    return Request(prompt_ids=(5, 6, 7, n), mode="autoregressive", max_new_tokens=2, client=client)


def test_a_client_with_many_requests_waiting_does_not_hold_back_anothers_first(shared_engine):
    with held(shared_engine):
        greedy = [shared_engine.generate(ask("greedy", n)) for n in range(2)]
        polite = shared_engine.generate(ask("polite", 9))
    finals = {name: next(e for e in s if e.final) for name, s in [("g0", greedy[0]), ("g1", greedy[1]), ("p", polite)]}
    started = {name: final.metrics["queue_s"] for name, final in finals.items()}
    assert all(final.kind == "done" for final in finals.values())
    assert started["g0"] < started["p"] < started["g1"]  # the polite client's first goes before the greedy one's second


def test_a_client_over_its_limit_is_refused_for_now_and_nobody_else_is(shared_engine):
    with held(shared_engine):
        kept = [shared_engine.generate(ask("greedy", n)) for n in range(2)]
        third = shared_engine.generate(ask("greedy", 2))
        other = shared_engine.generate(ask("other", 3))
    assert third.retry_after == RETRY_AFTER_S and "try again" in third.refusal
    assert not other.refusal and all(not s.refusal for s in kept)
    assert all(next(e for e in s if e.final).kind == "done" for s in [*kept, other])
    again = shared_engine.generate(ask("greedy", 4))  # its earlier requests have finished
    assert next(e for e in again if e.final).kind == "done"


def test_a_full_server_refuses_clients_that_hold_a_request_never_a_newcomer():
    """Past the queue's cap in all, a client that already has a request waits its turn to ask again
    (429 with Retry-After); one with none is taken, so others' load never refuses its first request
    (a flood of strangers cannot lock a newcomer out). A stream whose reader went away no longer
    counts; neither cap applies to a caller inside the process."""
    ledger = ClientLedger(NO_LIMITS, queue_cap=3)
    held = [ledger.admit(c) for c in ("a", "a", "b")]
    with pytest.raises(ClientBusy, match="3 requests are waiting or running"):
        ledger.admit("a")
    newcomer = ledger.admit("c")
    with pytest.raises(ClientBusy):
        ledger.admit("b")
    held[0]()  # (one of a's streams closed: 3 in all again, still at the cap)
    with pytest.raises(ClientBusy):
        ledger.admit("a")
    newcomer()
    ledger.admit("a")
    ledger.admit("")  # (the bench or a test, in the process)


def test_a_request_cancelled_while_it_waits_ends_at_once_and_frees_its_clients_place(shared_engine, monkeypatch):
    """A client that drops a waiting stream (a closed tab, a dropped connection) may ask again at
    once: the request leaves the line at the worker's next iteration, not when its turn comes."""
    ended: list[int] = []  # the requests' last prompt ids, in the order they ended
    put = shared_engine.scheduler._put
    monkeypatch.setattr(
        shared_engine.scheduler,
        "_put",
        lambda job, e: (e.final and ended.append(job.request.prompt_ids[-1])) or put(job, e),
    )
    with held(shared_engine):
        running = shared_engine.generate(replace(ask("dropper", 0), max_new_tokens=200))
        dropped = shared_engine.generate(ask("dropper", 1))
        dropped.cancel()
    assert next(e for e in dropped if e.final).metrics["finish_reason"] == "cancelled"
    again = shared_engine.generate(ask("dropper", 2))  # (two waiting or running: its limit)
    assert not again.refusal
    assert [next(e for e in s if e.final).kind for s in (running, again)] == ["done", "done"]
    assert ended == [1, 0, 2]  # the dropped one ended while the first was still answering
    with held(shared_engine):  # a stream whose reader goes away frees its place before the worker sees it
        kept = shared_engine.generate(ask("closer", 0))
        shared_engine.generate(ask("closer", 1)).close()
        third = shared_engine.generate(ask("closer", 2))
    assert not third.refusal and [next(e for e in s if e.final).kind for s in (kept, third)] == ["done", "done"]


def test_a_clients_second_request_at_once_takes_only_a_spare_place(ir_target, ir_draft):
    """With per-client limits, places are kept for clients with nothing running: a client's second
    request starts only while more than two of four are free, never beside three other clients."""
    engine = Engine(
        ir_target,
        ir_draft,
        Settings(config=EXACT_CONFIG, max_sessions=4, client_limits=ClientLimits(2, 4), prompt_reader="f32"),
    )
    with held(engine):
        streams = [engine.generate(ask(client, n)) for n, client in enumerate(["a", "a", "b", "c"])]
    peaks = [next(e for e in s if e.final).metrics["peak_sharing"] for s in streams]
    assert peaks[0] == peaks[2] == peaks[3] == 3 and peaks[1] <= 2


def test_the_api_names_its_client_by_key_or_address_and_answers_a_busy_one_with_retry_after(shared_engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    key = "k"
    for server_key, busy_client in ((None, "ip:testclient"), (key, "key:" + hashlib.sha256(b"k").hexdigest()[:12])):
        app = FastAPI()
        app.include_router(build_router(shared_engine, "tiny", {}, server_key))
        with TestClient(app) as http:
            for _ in range(2):  # the client holds its two requests
                shared_engine._clients.admit(busy_client)
            try:
                # (a key the server does not ask for names no one: the caller is its address)
                busy = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            finally:
                for _ in range(2):
                    shared_engine._clients.done(busy_client)
            again = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert busy.status_code == 429 and busy.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert "try again" in busy.json()["error"]["message"]
        assert again.status_code == 200  # the same client, once its requests have finished


def test_a_stranger_gets_the_shared_link_s_caps_and_a_known_user_the_server_s(ir_target, ir_draft):
    """On a shared link a visitor without a login (a page session, an API caller without a key)
    may send shorter conversations and gets shorter answers; a logged-in user or a key does not."""
    limits = ClientLimits(stranger_input_tokens=24, stranger_answer_tokens=5)
    engine = Engine(
        ir_target,
        ir_draft,
        Settings(config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), client_limits=limits, prompt_reader="f32"),
    )
    long = Request(({"role": "user", "content": "def add(a, b): return a + b " * 4},), max_new_tokens=12)
    refused = engine.run(replace(long, client="page:abc"))
    assert refused.kind == "error" and "at most 24 tokens" in refused.error and "not logged in" in refused.error
    known = [engine.run(replace(long, client=client)) for client in ("user:bob", "key:0123")]
    assert all(e.kind == "done" and len(e.token_ids) == 12 for e in known)
    short = Request(({"role": "user", "content": "hi"},), max_new_tokens=12)
    capped = engine.run(replace(short, client="ip:1.2.3.4"))
    assert capped.kind == "done" and len(capped.token_ids) == 5 and capped.metrics["finish_reason"] == "length"
    uncapped = engine.run(replace(short, client="ip:1.2.3.4", max_new_tokens=None))  # no cap asked: the limits'
    assert uncapped.kind == "done" and len(uncapped.token_ids) == 5
    wide = ClientLimits(stranger_answer_tokens=10**6)  # a cap past the context asks only what fits
    assert wide.answer_cap("page:abc", None, engine.max_context) == engine.max_context
    assert wide.answer_cap("user:bob", None, engine.max_context) is None
    assert limits.describe() == "without a login, messages up to 24 tokens and answers up to 5 tokens"
    assert PUBLIC_LIMITS.describe() == (
        "2 answers at once and 4 waiting or running; without a login, messages up to 4,096 tokens and answers "
        "up to 1,024 tokens"
    )


@pytest.mark.parametrize("reader", ["off", "f32"])
def test_a_long_paste_is_read_in_slices_between_another_users_tokens(long_target, monkeypatch, reader):
    """While one user's answer streams, another's 3,000-token paste is read in narrow passes (the
    prompt reader's: its plan's), at most one between two of the answer's tokens (the paste's
    share of the time): the answer ends long before the reading does, and both equal their solo
    runs."""
    monkeypatch.setattr(scheduler_module, "SLICE_S", 1e-4)  # the narrowest slices, and no credit saved
    engine = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=2, prompt_reader=reader))
    rng = np.random.default_rng(3)
    chat = Request(
        prompt_ids=tuple(rng.integers(10, 300, 40).tolist()), mode="autoregressive", max_new_tokens=48, client="chat"
    )
    paste = Request(
        prompt_ids=tuple(rng.integers(10, 300, 3000).tolist()), mode="autoregressive", max_new_tokens=2, client="paste"
    )
    chat, paste = (replace(r, reuse_cache=False) for r in (chat, paste))  # (read from the start each time)
    solo = [engine.run(r).token_ids for r in (chat, paste)]
    seen: list[tuple[str, str, int]] = []  # (client, event, prompt read) in the worker's order
    put = engine.scheduler._put
    monkeypatch.setattr(
        engine.scheduler,
        "_put",
        lambda job, event: (
            seen.append((job.client, event.kind, event.metrics.get("prompt_read", 0))) or put(job, event)
        ),
    )
    with held(engine):
        streams = [engine.generate(r) for r in (chat, paste)]
    assert [next(e for e in s if e.final).token_ids for s in streams] == solo
    chat_done = seen.index(("chat", "done", len(chat.prompt_ids)))
    while_chatting = [e for e in seen[:chat_done] if e[0] == "paste"]
    assert while_chatting and all(kind == "progress" for _, kind, _ in while_chatting)
    read = [r for _, _, r in while_chatting]
    width = scheduler_module.SLICE_ROUND if reader == "off" else READ_PASS
    assert {b - a for a, b in itertools.pairwise(read)} == {width}
    assert read[-1] < len(paste.prompt_ids) - width  # the rest once the answer has ended
    runs = "".join("c" if client == "chat" else "p" for client, _, _ in seen[:chat_done])
    assert "pp" not in runs.lstrip("p")  # after the answer's first token, never two slices in a row


def test_a_question_arriving_while_others_generate_starts_before_the_next_slice_of_a_paste(long_target, monkeypatch):
    """A question that arrives during another user's step gets its first token at the worker's next
    iteration, not after one more slice of a paste read on the side (whose share is kept)."""
    monkeypatch.setattr(TimeShare, "allows", lambda self: True)  # a slice after every step, unless something arrived
    engine = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=3, prompt_reader="f32"))
    rng = np.random.default_rng(5)
    chat, paste, late = (
        replace(
            Request(
                prompt_ids=tuple(rng.integers(10, 300, n).tolist()), mode="autoregressive", max_new_tokens=m, client=c
            ),
            reuse_cache=False,
        )
        for n, m, c in ((40, 24, "chat"), (3000, 2, "paste"), (40, 2, "late"))
    )
    seen: list[tuple[str, str]] = []  # (client, event) in the worker's order
    later: list = []
    put = engine.scheduler._put

    def record(job, event) -> None:
        seen.append((job.client, event.kind))
        if not later and ("chat", "delta") in seen:  # (during the chat's round: the worker calls this)
            seen.append(("late", "arrived"))
            later.append(engine.generate(late))
        put(job, event)

    monkeypatch.setattr(engine.scheduler, "_put", record)
    with held(engine):
        streams = [engine.generate(r) for r in (chat, paste)]
    finals = [next(e for e in s if e.final) for s in streams]  # (the question arrives meanwhile)
    finals.append(next(e for e in later[0] if e.final))
    assert [f.kind for f in finals] == ["done"] * 3
    after = seen[seen.index(("late", "arrived")) :]
    assert ("paste", "progress") in after  # (still reading when the question came)
    assert ("paste", "progress") not in after[: after.index(("late", "delta"))]


def test_a_paste_being_read_holds_no_place_that_another_users_question_waits_for(long_target, monkeypatch):
    """With one place to serve in, a 3,000-token paste being read (side work, in its share of the
    time) does not keep another client's short question in line: the question is answered while
    the paste is still read, and both answers equal their solo runs."""
    engine = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=2, prompt_reader="f32"))
    engine.scheduler.max_batch = 1
    rng = np.random.default_rng(4)
    paste = Request(
        prompt_ids=tuple(rng.integers(10, 300, 3000).tolist()), mode="autoregressive", max_new_tokens=2, client="paste"
    )
    chat = Request(
        prompt_ids=tuple(rng.integers(10, 300, 40).tolist()), mode="autoregressive", max_new_tokens=8, client="chat"
    )
    paste, chat = (replace(r, reuse_cache=False) for r in (paste, chat))
    solo = [engine.run(r).token_ids for r in (paste, chat)]
    seen: list[tuple[str, str]] = []  # (client, event) in the worker's order
    put = engine.scheduler._put
    monkeypatch.setattr(
        engine.scheduler, "_put", lambda job, event: seen.append((job.client, event.kind)) or put(job, event)
    )
    with held(engine):
        streams = [engine.generate(r) for r in (paste, chat)]
    assert [next(e for e in s if e.final).token_ids for s in streams] == solo
    assert seen.index(("chat", "done")) < seen.index(("paste", "delta"))  # answered before the paste's first token
