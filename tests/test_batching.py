"""Requests served together (engine.core.batch and engine.core.scheduler), on the
tiny f32 pair: every answer equals the one the same request gets alone, whatever joins, leaves
or is cancelled around it; sampling keeps the target's distribution; a failed batched pass fails
only its own requests."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import pytest
from scipy import stats as scipy_stats

from engine.core import batch as batch_module
from engine.core import planning, service
from engine.core.decoding import DecodeConfig, Decoder
from engine.core.drafters import Draft, LookupDrafter
from engine.core.metrics import Stats
from engine.core.pacing import Pacing
from engine.core.requests import Event, Request, Stream
from engine.core.runtime import EXACT_CONFIG, Runtime, common_prefix
from engine.core.sampling import SamplingParams, logits_to_probs
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.errors import EngineError

ANSWER = 24


@pytest.fixture(scope="module")
def shared(ir_target, ir_draft) -> Engine:
    return Engine(
        ir_target,
        ir_draft,
        Settings(config=EXACT_CONFIG, max_sessions=4, pacing=Pacing(), prompt_reader="f32", batching="on"),
    )


def ask(text: str, mode: str = "best", **fields) -> Request:
    return Request(({"role": "user", "content": text},), mode=mode, **{"max_new_tokens": ANSWER, **fields})


def alone(engine: Engine, request: Request) -> list[int]:
    final = engine.run(Request(**{**request.__dict__, "reuse_cache": False}))
    assert final.kind == "done", final.error
    return final.token_ids


def finish(stream: Stream) -> tuple[Event, int]:
    """The final event and the largest batch any of the stream's rounds ran in."""
    largest = 1
    for event in stream:
        largest = max(largest, event.metrics.get("batch_size", 1))
        if event.final:
            return event, largest
    raise AssertionError("no final event")


@contextmanager
def held(engine: Engine) -> Iterator[None]:
    """The worker held between iterations, so that the requests queued meanwhile start together."""
    release, holding = threading.Event(), threading.Event()
    waiter = threading.Thread(target=engine.with_models, args=(lambda *_: holding.set() or release.wait(10),))
    waiter.start()
    holding.wait(10)
    try:
        yield
    finally:
        release.set()
        waiter.join()


def first_delta(stream: Stream) -> list[Event]:
    seen = []
    for event in stream:
        seen.append(event)
        if event.kind == "delta" or event.final:
            return seen
    return seen


def test_every_answer_equals_its_solo_run_whatever_joins_leaves_or_is_cancelled(shared):
    modes = list(shared.modes)
    requests = [ask(f"Request {i}: tell me about the number {i * 7}.", modes[i % len(modes)]) for i in range(6)]
    solo = [alone(shared, r) for r in requests]
    streams: list[Stream] = []
    for i, request in enumerate(requests):  # staggered: each joins while the others generate
        streams.append(shared.generate(request))
        if i % 2 == 0:
            first_delta(streams[-1])
    cancelled = shared.generate(ask("This one is stopped after its first tokens.", "speculative"))
    first_delta(cancelled)
    cancelled.cancel()
    start = time.monotonic()
    last, _ = finish(cancelled)
    assert last.kind == "done" and last.metrics["finish_reason"] == "cancelled"
    assert time.monotonic() - start < 2.0  # within a step or two, not at the end of the answer
    batched = 1
    for stream, request, expected in zip(streams, requests, solo):
        final, largest = finish(stream)
        batched = max(batched, largest)
        assert final.kind == "done", final.error
        assert final.token_ids == expected, request.mode
    assert batched >= 3  # they were served together


def test_without_batching_requests_served_at_once_each_take_their_own_rounds(ir_target, ir_draft):
    """``batching="off"``: requests generating at once never share a pass, and each answer is its
    solo run's (what a batched row cannot promise on every CPU: docs/design.md, "Batching")."""
    settings = Settings(config=EXACT_CONFIG, max_sessions=4, pacing=Pacing(), prompt_reader="off", batching="off")
    with Engine(ir_target, ir_draft, settings) as engine:
        requests = [ask(f"Request {i}: tell me about the number {i * 5}.") for i in range(3)]
        solo = [alone(engine, r) for r in requests]
        with held(engine):
            streams = [engine.generate(r) for r in requests]
        for stream, expected in zip(streams, solo):
            final, largest = finish(stream)
            assert final.kind == "done" and final.token_ids == expected and largest == 1
        assert engine.scheduler._batch.passes == 0


def test_auto_batches_only_where_a_padded_row_keeps_its_lone_logits(ir_target, ir_draft, monkeypatch, caplog):
    """``auto`` probes at start whether a left-padded batched row keeps its lone logits (a row
    not padded always does), and batches only where it does; a restart reads the verdict back."""
    assert batch_module.padded_row_error(Runtime(ir_target, config=EXACT_CONFIG), pads=(0,)) == 0.0
    settings = Settings(config=EXACT_CONFIG, pacing=Pacing(), prompt_reader="off", remeasure=True)
    for moved, verdict in ((0.0, "on"), (0.43, "off")):
        monkeypatch.setattr(service, "padded_row_error", lambda target, moved=moved: moved)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specchat.engine"), Engine(ir_target, ir_draft, settings) as engine:
            assert engine.scheduler.batching == (verdict == "on") and f"batching: {verdict} (" in caplog.text
            assert engine.models["batching"].startswith(f"{verdict}: a batched row")  # (/health says it)
    monkeypatch.setattr(service, "padded_row_error", lambda target: pytest.fail("probed again"))
    with Engine(ir_target, ir_draft, dataclasses.replace(settings, remeasure=False)) as engine:
        assert not engine.scheduler.batching
    with pytest.raises(EngineError, match="unknown batching"):
        Engine(ir_target, ir_draft, dataclasses.replace(settings, batching="maybe"))


def test_a_request_stopped_while_queued_ends_without_running(shared):
    with held(shared):
        stream = shared.generate(ask("Stopped before it starts."))
        stream.cancel()
    final, _ = finish(stream)
    assert final.kind == "done" and final.metrics["finish_reason"] == "cancelled"
    assert final.token_ids == [] and final.metrics["target_passes"] == 0


def test_a_follow_up_turn_after_a_batched_answer_prefills_only_its_suffix(shared):
    requests = [ask(f"Conversation {i}: list three colours.") for i in range(3)]
    with held(shared):
        streams = [shared.generate(r) for r in requests]
    finals = [finish(s) for s in streams]
    assert all(largest == 3 for _, largest in finals)
    answers = [final.token_ids for final, _ in finals]
    first = shared.prompt_ids(requests[0])
    answer = {"role": "assistant", "content": shared.text(answers[0])}
    more = {"role": "user", "content": "And three more."}
    follow = Request((*requests[0].messages, answer, more), mode="best", max_new_tokens=ANSWER)
    reused = common_prefix(shared.prompt_ids(follow), first + answers[0])  # (the answer's text, re-tokenized)
    final = shared.run(follow)
    assert final.kind == "done", final.error
    assert reused > len(first) and final.metrics["cached_tokens"] >= reused - 1
    assert final.token_ids == alone(shared, follow)


def chi_square(counts: Mapping[int, int], p: np.ndarray, n: int) -> float:
    """The chi-square p-value of ``n`` drawn tokens' ``counts`` against the distribution ``p``,
    the tokens expected fewer than 5 times pooled into one cell."""
    frequent = [t for t in range(len(p)) if p[t] * n >= 5]
    observed = [counts.get(t, 0) for t in frequent]
    expected = [p[t] * n for t in frequent]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    return float(scipy_stats.chisquare(observed, expected).pvalue)


def test_sampling_in_a_batch_keeps_the_target_distribution(shared):
    """The first sampled token of many seeded requests, served four at a time and joining as
    others leave, against the target's own distribution at that position (chi-square)."""
    request = ask("Pick a word.", "best", temperature=1.0)
    prompt = shared.prompt_ids(request)

    def target_probs(target, draft):
        target.reset()
        return logits_to_probs(target.forward(prompt)[-1:], SamplingParams(1.0))[0]

    p = shared.with_models(target_probs)
    counts: dict[int, int] = {}
    batched = 0
    n = 240
    for wave in range(0, n, 4):
        with held(shared):
            seeded = [Request(**{**request.__dict__, "seed": wave + j, "max_new_tokens": 2}) for j in range(4)]
            streams = [shared.generate(r) for r in seeded]
        for stream in streams:
            final, largest = finish(stream)
            assert final.kind == "done", final.error
            counts[final.token_ids[0]] = counts.get(final.token_ids[0], 0) + 1
            batched += largest > 1
    assert batched >= n // 2
    assert chi_square(counts, p, n) > 0.001


def test_a_failed_batched_pass_fails_only_its_requests_and_the_next_is_served(shared, monkeypatch, caplog):
    requests = [ask(f"Doomed {i}: count to ten.") for i in range(2)]
    step = shared.scheduler._batch.step

    def broken(tokens):
        raise RuntimeError("injected inference failure")

    monkeypatch.setattr(shared.scheduler._batch, "step", broken)
    with held(shared):
        streams = [shared.generate(r) for r in requests]
    finals = [finish(s)[0] for s in streams]
    monkeypatch.setattr(shared.scheduler._batch, "step", step)
    assert all(f.kind == "error" and "internal error" in f.error for f in finals)
    assert "injected inference failure" in caplog.text
    after = ask("A normal request afterwards.")
    final = shared.run(after)
    assert final.kind == "done" and final.token_ids == alone(shared, after)


def test_a_request_failing_while_others_generate_together_leaves_their_answers_intact(shared, monkeypatch):
    requests = [ask(f"Healthy {i}: name two rivers.") for i in range(2)]
    solo = [alone(shared, r) for r in requests]
    doomed = Request(prompt_ids=(7, 7, 7, 7, 7, 7, 7, 7), mode="best", max_new_tokens=ANSWER)
    prefill = Decoder.prefill

    def failing(self):
        if self.context[:8] == list(doomed.prompt_ids):
            raise RuntimeError("injected failure in one request's prefill")
        yield from prefill(self)

    monkeypatch.setattr(Decoder, "prefill", failing)
    with held(shared):
        streams = [shared.generate(r) for r in requests]
    first_delta(streams[0])
    failed = shared.run(doomed)
    assert failed.kind == "error" and "internal error" in failed.error
    finals = [finish(s) for s in streams]
    assert [f.token_ids for f, _ in finals] == solo
    assert all(largest == 2 for _, largest in finals)


def test_rows_of_any_length_join_and_a_long_row_leaving_cuts_the_padding(shared, monkeypatch):
    """A one-token prompt on a fresh session, and the longest row leaving first: the batch
    drops the padding no row needs any more (a copy), and every answer still equals its solo run."""
    monkeypatch.setattr(batch_module, "MAX_SLACK", 8)
    long = ask("Summarize: " + "the fox runs and the dog sleeps. " * 5, max_new_tokens=3)
    others = [ask("Name a fruit."), Request(prompt_ids=(5,), mode="best", max_new_tokens=ANSWER)]
    requests = [long, *others]
    solo = [alone(shared, r) for r in requests]
    cuts = []
    cut = batch_module.Batch._cut
    monkeypatch.setattr(batch_module.Batch, "_cut", lambda self, width: cuts.append(width) or cut(self, width))
    with held(shared):
        streams = [shared.generate(r) for r in requests]
    finals = [finish(s) for s in streams]
    assert [f.token_ids for f, _ in finals] == solo
    assert all(largest == 3 for _, largest in finals) and cuts


def test_short_prompts_that_arrive_together_each_get_a_first_token_when_read_then_batch(shared, monkeypatch):
    """Each first token comes as soon as its own prompt is read (not after every prompt that
    arrived with it), then the requests go on in one batched step; each the answer it gets alone."""
    requests = [ask(f"Arriving together {i}: name a fruit.") for i in range(3)]
    solo = [alone(shared, r) for r in requests]
    order: list[tuple[str, int]] = []  # (what the worker did, for which decoder), in turn
    first_round, put = Decoder.round, shared.scheduler._put

    def round_(self: Decoder):
        order.append(("round", id(self)))
        return first_round(self)

    def record(job, event: Event) -> None:
        if event.kind == "delta" and ("first token", id(job.decoder)) not in order:
            order.append(("first token", id(job.decoder)))
        put(job, event)

    monkeypatch.setattr(Decoder, "round", round_)
    monkeypatch.setattr(shared.scheduler, "_put", record)
    with held(shared):
        streams = [shared.generate(r) for r in requests]
    firsts = [first_delta(s)[-1] for s in streams]
    assert [e.metrics["batch_size"] for e in firsts] == [1, 1, 1]
    opened = [d for what, d in order if what == "first token"]
    reads = [order.index(("round", d)) for d in opened]  # each one's first round reads its prompt
    assert all(order.index(("first token", d)) < read for d, read in zip(opened, reads[1:]))
    assert [first_delta(s)[-1].metrics["batch_size"] for s in streams] == [3, 3, 3]
    for stream, expected in zip(streams, solo):
        final, _ = finish(stream)
        assert final.kind == "done", final.error
        assert final.token_ids == expected


def first_tokens_in_order(engine: Engine, monkeypatch, requests: dict[str, Request], then=None) -> list[str]:
    """Start ``requests`` together (by name) and return the names in the order the worker gave
    each its first token; each answer must equal its solo run. ``then(name)`` is called on the
    worker as each first token is put."""
    solo = {name: alone(engine, r) for name, r in requests.items()}
    firsts: list[str] = []
    streams: dict[str, Stream] = {}
    put = engine.scheduler._put

    def record(job, event: Event) -> None:
        name = next(n for n, r in requests.items() if r.messages == job.request.messages)
        if event.kind == "delta" and name not in firsts:
            firsts.append(name)
            if then is not None:
                then(name, streams)
        put(job, event)

    monkeypatch.setattr(engine.scheduler, "_put", record)
    with held(engine):
        streams.update({name: engine.generate(r) for name, r in requests.items() if name != "later"})
    deadline = time.monotonic() + 30
    while len(streams) < len(requests) and time.monotonic() < deadline:  # (one ``then`` starts)
        time.sleep(0.01)
    for name, stream in list(streams.items()):
        final, _ = finish(stream)
        assert final.kind == "done", final.error
        assert final.token_ids == solo[name], name
    return firsts


def fruit(n: int, client: str) -> Request:
    return ask("Name a fruit. " + "Really, " * n, reuse_cache=False, client=client)


def test_first_rounds_that_start_together_read_the_shortest_prompt_first(shared, monkeypatch):
    """A burst's first rounds run shortest read first (its users wait least in all), whatever the
    order they arrived in; each answer is the one it gets alone."""
    requests = {name: fruit(n, name) for name, n in {"long": 20, "short": 1, "medium": 10}.items()}
    assert first_tokens_in_order(shared, monkeypatch, requests) == ["short", "medium", "long"]


def test_a_question_arriving_during_a_burst_of_first_rounds_waits_for_one_not_all(shared, monkeypatch):
    """A question asked while a burst's first rounds run starts after the one under way (and, the
    shortest, goes next), not after every first round of the burst."""
    requests = {name: fruit(n, name) for name, n in {"long": 20, "short": 1, "medium": 10, "later": 0}.items()}

    def ask_later(name: str, streams: dict[str, Stream]) -> None:
        if name == "short":
            streams["later"] = shared.generate(requests["later"])

    assert first_tokens_in_order(shared, monkeypatch, requests, ask_later) == ["short", "later", "medium", "long"]


def test_a_client_already_answering_waits_for_every_other_clients_first_round(shared, monkeypatch):
    """Two requests of one client and one of another start together: once one of the first
    client's has its first token, the other client's comes before its second, shorter or not."""
    requests = {"a1": fruit(1, "a"), "a2": fruit(5, "a"), "b": fruit(15, "b")}
    assert first_tokens_in_order(shared, monkeypatch, requests) == ["a1", "b", "a2"]


def test_a_row_that_no_longer_batches_leaves_the_batch_for_its_own_cache_unharmed(shared, monkeypatch):
    """Rows batch while the widest is at most twice the shortest (no spread here): a shorter
    conversation joining mid-answer sends the widest row out of the batch, to its own cache, in
    its share of the time; every answer equals its solo run."""
    monkeypatch.setattr(planning, "BATCH_SPREAD", 0)
    rng = np.random.default_rng(5)
    a, r, c = (tuple(rng.integers(10, 300, n).tolist()) for n in (30, 50, 26))
    requests = [
        Request(prompt_ids=ids, mode="autoregressive", max_new_tokens=n) for ids, n in ((a, 40), (r, 40), (c, 8))
    ]
    solo = [alone(shared, request) for request in requests]
    with held(shared):
        streams = [shared.generate(request) for request in requests[:2]]
    for _ in range(6):  # both rows in one batch, the wider one now more than twice the newcomer
        next(e for e in streams[1] if e.kind == "delta")
    streams.append(shared.generate(requests[2]))
    finals = [finish(stream)[0] for stream in streams]
    assert [f.error for f in finals] == ["", "", ""]
    assert [f.token_ids for f in finals] == solo


def test_a_pass_of_mixed_widths_gives_each_row_its_lone_logits(ir_target):
    """Rows fed 1, 3 and 5 tokens in one pass (the narrower padded after theirs), then cut back
    (rejected drafts) to the same or to different lengths, then fed again: every row's logits
    equal those of the same passes on its own cache, trimmed alike: bit for bit while the rows are
    as long (padding after a row's tokens changes nothing), within rounding once they are not (on
    an AVX2 CPU, left padding moved a tiny model's logits by up to 5e-6; docs/design.md, "Batching")."""
    template = Runtime(ir_target, config=EXACT_CONFIG)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(10, 200, 17)] for _ in range(3)]
    homes, lone = [template.fork() for _ in prompts], [template.fork() for _ in prompts]
    for home, own, prompt in zip(homes, lone, prompts):
        home.forward(prompt)
        own.forward(prompt)
    batch = batch_module.Batch(template)
    batch.join(list(enumerate(homes)))
    rounds = [((1, 3, 5), (1, 1, 1)), ((5, 2, 1), (1, 2, 1)), ((3, 3, 3), (3, 1, 2)), ((1, 2, 4), (1, 2, 3))]
    for widths, kept in rounds:  # (tokens fed, kept of them)
        even = len({len(own.tokens) for own in lone}) == 1
        feeds = [[int(t) for t in rng.integers(10, 200, w)] for w in widths]
        got = batch.step(feeds)
        for row, own, feed in zip(got, lone, feeds):
            expected = own.forward(feed, rows=len(feed))
            assert np.array_equal(row, expected) if even else np.allclose(row, expected, rtol=0, atol=1e-4)
        lengths = [len(own.tokens) - len(feed) + k for own, feed, k in zip(lone, feeds, kept)]
        batch.keep(lengths)
        for own, n in zip(lone, lengths):
            own.trim(n)
        assert [row.tokens for row in batch.rows] == [own.tokens for own in lone]
        assert batch.slots == max(lengths)


def test_a_copy_verified_in_a_batched_pass_keeps_the_target_distribution(ir_target):
    """Sampling: a row verifies a copied token (the target's second likeliest) beside a plain row
    in one batched pass, many times over with different seeds; the token each round starts with
    follows the target's own distribution after the prompt (chi-square)."""
    template = Runtime(ir_target, config=EXACT_CONFIG)
    prompt, other = [11, 42, 7, 99, 23, 5], [13, 8, 77]
    p = logits_to_probs(template.fork().forward(prompt)[-1:], SamplingParams(1.0))[0]
    copied = int(np.argsort(p)[-2])
    homes = [template.fork(), template.fork()]
    homes[0].forward(prompt[:-1])
    homes[1].forward(other[:-1])
    batch = batch_module.Batch(template)
    batch.join(list(enumerate(homes)))
    copier = LookupDrafter(len(p))
    n, counts = 600, collections.Counter()
    for seed in range(n):
        logits = batch.step([[prompt[-1], copied], [other[-1]]])
        config = DecodeConfig(sampling=SamplingParams(1.0, seed=seed))
        decoder = Decoder(template.fork(), None, prompt, config, Stats("best"))
        draft = Draft([copied], np.eye(len(p))[[copied]], 0.0)
        counts[decoder.take(logits[0], 0.0, (draft, copier)).tokens[0]] += 1
        batch.keep([len(prompt) - 1, len(other) - 1])
    assert counts[copied] > 0 and len(counts) > 1  # both the rule's ways were taken
    assert chi_square(counts, p, n) > 0.001


def test_rows_verify_their_copies_in_the_batched_pass_and_each_answer_equals_its_solo_run(shared, monkeypatch):
    """Conversations that repeat themselves, served together in `best` and `pld` (prompt lookup): the batched
    passes verify the rows' copies (wider than one token, rejected tokens cut back), and each
    answer is the one its request gets alone."""
    text = "one two three four five six seven eight nine ten " * 4
    requests = [ask(f"{i}: continue {text}", mode, max_new_tokens=40) for i, mode in enumerate(["best", "pld"] * 2)]
    solo = [alone(shared, r) for r in requests]
    widths: list[int] = []
    record = shared.scheduler.prices.record
    monkeypatch.setattr(shared.scheduler.prices, "record", lambda r, w, s: widths.append(w) or record(r, w, s))
    with held(shared):
        streams = [shared.generate(r) for r in requests]
    finals = [finish(s) for s in streams]
    assert [f.token_ids for f, _ in finals] == solo
    assert all(largest == len(requests) for _, largest in finals)
    assert sum(w > 1 for w in widths) >= 3, widths
