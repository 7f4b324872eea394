"""Fair turns between clients: round-robin lines, per-client limits, identity on the API; on the
tiny pair with the engine's worker held while requests arrive."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.api.openai import build_router
from engine.core.pacing import Pacing
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine
from engine.core.turns import PUBLIC_LIMITS, RETRY_AFTER_S, ClientLimits, FairQueue


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


@pytest.fixture(scope="module")
def shared_engine(ir_target, ir_draft):
    """One request at a time (one session); a client may hold two requests waiting or running."""
    return Engine(
        ir_target, ir_draft, config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), client_limits=ClientLimits(1, 2)
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
    engine = Engine(ir_target, ir_draft, config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), client_limits=limits)
    long = Request(({"role": "user", "content": "def add(a, b): return a + b " * 4},), max_new_tokens=12)
    refused = engine.run(replace(long, client="page:abc"))
    assert refused.kind == "error" and "at most 24 tokens" in refused.error and "not logged in" in refused.error
    known = [engine.run(replace(long, client=client)) for client in ("user:bob", "key:0123")]
    assert all(e.kind == "done" and len(e.token_ids) == 12 for e in known)
    short = Request(({"role": "user", "content": "hi"},), max_new_tokens=12)
    capped = engine.run(replace(short, client="ip:1.2.3.4"))
    assert capped.kind == "done" and len(capped.token_ids) == 5 and capped.metrics["finish_reason"] == "length"
    assert limits.describe() == "without a login, messages up to 24 tokens and answers up to 5 tokens"
    assert PUBLIC_LIMITS.describe() == (
        "2 answers at once and 4 waiting or running; without a login, messages up to 4,096 tokens and answers "
        "up to 1,024 tokens"
    )
