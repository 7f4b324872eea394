"""The engine's worker thread and the scheduler on it: which requests wait, which are served, and
how each iteration advances them: planned from a snapshot of the requests
(:mod:`engine.core.planning`: a first round, or one batched target pass where every row verifies
its copies or takes a plain step, or each request's round alone, then side work), run, and each
round applied to its request's stream. Every piece of work runs on this one thread, so no two
requests touch the KV caches at once.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.core import decoding, planning
from engine.core.batch import Batch
from engine.core.budget import MemoryBudget
from engine.core.chat import Prompt
from engine.core.decoding import DecodeConfig, Decoder, Provenance, Round
from engine.core.metrics import Baseline, FinishReason, ModeName, Stats
from engine.core.modes import MODES
from engine.core.pacing import BatchPrices, Pacing
from engine.core.pool import Pools
from engine.core.reader import PromptReader
from engine.core.requests import Event, EventKind, Request, Stream
from engine.core.runtime import Runtime
from engine.core.sampling import SamplingParams
from engine.core.sessions import Session, SessionPool
from engine.core.textstream import IncrementalDecoder, StopStrings
from engine.core.turns import ClientLedger, FairQueue, TimeShare
from engine.errors import EngineError

T = TypeVar("T")
# Requests served together; more wait in the queue. Where the weights' reading bounds a pass, a
# batched step over 8 rows costs little more than a single row's (docs/design.md, "Batching").
MAX_BATCH = 8
# While others generate, a long prompt is read in passes of about this long, in its client's share
# of the time (turns.TimeShare): no one's next token waits behind a two-second prefill chunk.
SLICE_S = 0.25
SLICE_ROUND = 32  # a slice's width is a multiple of this many tokens (a prompt's first slice: one, its rate unknown)
# With per-client limits, a client's second request at once starts only while more than this many
# places are free: they are kept for clients with nothing running.
RESERVED = 2
CLOSED = "the engine is closed"  # what a request or a tool job gets after close()
# Seconds close() waits for the requests it holds to end before it cancels them.
CLOSE_TIMEOUT = 60.0
# A request's reservation grows once fewer than this many of its tokens are left: more than any
# round adds (MAX_K + 1, or a lookup copy's span + 1).
ROUND_ROOM = 64
# What an answer that the memory budget could hold no longer ends with.
OUT_OF_MEMORY = (
    "\n\n*(The answer stops here: the server's memory ran out. Ask again when fewer people are chatting, "
    "or start the server with a larger --memory-limit.)*"
)
log = logging.getLogger("specchat.engine")


@dataclass(eq=False)
class _Job:
    """A request the scheduler serves: what it asked, where its events go, how far it is."""

    request: Request
    prompt: list[int]
    stream: Stream  # where its events go; its reader may cancel it there
    stats: Stats
    release: Callable[[], None]  # uncounts it for its client (once, whoever is first: see ClientLedger.admit)
    session: Session | None = None
    decoder: Decoder | None = None
    prefill: Iterator[int] | None = None  # the prompt's remaining passes (tokens read after each); None once read
    detok: IncrementalDecoder | None = None
    stops: StopStrings | None = None
    out: list[int] = field(default_factory=list)
    side_s: float = 0.0  # seconds of the worker it had to itself while others generated
    spoken: tuple[tuple[int, int], ...] = ()  # the prompt's answers (chat.Prompt.spoken)
    reserved: int = 0  # tokens of cache the memory budget holds for it (engine.core.budget)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def key(self) -> int:
        return id(self)

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    @property
    def client(self) -> str:
        return self.request.client

    @property
    def unread(self) -> int:
        """Prompt tokens not yet in the target's cache."""
        return 0 if self.decoder is None else self.decoder.unread


class Scheduler:
    """The requests one engine serves, on its worker thread (started here): what arrived, what
    waits in line, what is being served, and the batch the generating ones share. The engine
    checks a request and hands it to :meth:`submit`; everything else here runs on the worker."""

    def __init__(
        self,
        target: Runtime,
        sessions: SessionPool,
        budget: MemoryBudget,
        tokenizer: Any,
        clients: ClientLedger,
        pacing: Pacing,
        stop_ids: frozenset[int],
        fence_ids: frozenset[int],
        pools: Pools,
        reader: PromptReader | None = None,
        prices: BatchPrices | None = None,
    ) -> None:
        """``clients``: the ledger the engine admits requests by (a finished one is returned to
        it here); ``pacing``, ``stop_ids``, ``fence_ids`` and ``reader`` (the prompt reader, if
        one is used) go to every request's decoder; ``pools``: the clients' n-gram pools, which
        paced requests draft from and every finished one adds its conversation to; ``prices``:
        what batched passes cost by rows and width, which prices the copies rows verify in them
        (None: batched passes are plain steps)."""
        self.target = target
        self.sessions = sessions
        self.budget = budget
        self.tokenizer = tokenizer
        self.pacing = pacing
        self.stop_ids = stop_ids
        self.fence_ids = fence_ids
        self.pools = pools
        self.reader = reader
        self.baseline = Baseline()  # plain decoding's measured speed: the answers' speedup (worker thread only)
        self._progress_at = time.monotonic()
        self.max_batch = min(MAX_BATCH, self.sessions.capacity)
        self._batch = Batch(self.target)
        self.prices = prices  # (worker thread only)
        self._serving: list[_Job] = []  # started, not finished (worker thread only)
        self._jobs: queue.Queue[_Job | Callable[[], None]] = queue.Queue()  # arrived, not yet in line
        self._waiting: FairQueue[_Job] = FairQueue(lambda job: job.client)  # in line (worker thread only)
        self._clients = clients
        self._share = TimeShare(most_s=SLICE_S)
        self._firsts = 0  # first rounds run in a row, since the last shared work (worker thread only)
        self._busy = threading.Lock()
        # False once closed: no request or tool job is taken, the worker ends when those taken end.
        # Taking one and closing hold the gate, so none is taken that the worker would never see.
        self.accepting = True
        self._gate = threading.Lock()
        self._abandon = threading.Event()  # set by close() once its timeout has passed: cancel what is held
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    def submit(self, request: Request, prompt: Prompt, stream: Stream, release: Callable[[], None]) -> None:
        """Queue a checked request; its events go to ``stream``, and ``release`` uncounts it for
        its client when it ends (at once, with an error event, if the scheduler is closed)."""
        job = _Job(request, prompt.ids, stream, Stats(request.mode), release, spoken=prompt.spoken)
        with self._gate:
            if self.accepting:
                self._jobs.put(job)
                return
        release()
        stream.put(Event(EventKind.ERROR, error=CLOSED, metrics=job.stats.snapshot()))

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker thread, after the queued work, and return its result."""
        future: Future = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed back to the caller's thread
                future.set_exception(exc)

        with self._gate:
            if not self.accepting:
                raise EngineError(CLOSED)
            self._jobs.put(job)
        return future.result()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Take no more requests; return once the worker has ended, after the requests queued
        before, or after ``timeout`` seconds cancels those still held (logged; each ends with
        finish reason ``cancelled``). It holds the models until then (an engine's memory is freed
        only after this). Closing a closed scheduler does nothing."""

        def shut() -> None:
            with self._gate:
                self.accepting = False

        with contextlib.suppress(EngineError):  # (closed already)
            self.call(shut)
        self._worker.join(timeout)
        if self._worker.is_alive():
            log.warning("closing: the requests still held after %.0f s are cancelled", timeout)
            self._abandon.set()
            self._worker.join()

    def stuck(self, timeout: float) -> bool:
        """Whether the worker has stopped, or a request has made no progress for longer than
        ``timeout`` seconds: a stuck inference call (the worker recovers when the call returns)."""
        stalled = self._busy.locked() and time.monotonic() - self._progress_at > timeout
        return stalled or not self._worker.is_alive()

    @property
    def pending(self) -> int:
        """Requests waiting for or using the engine."""
        return self.waiting + len(self._serving)

    @property
    def waiting(self) -> int:
        """Requests queued, not yet taken up (they wait while the engine is full, or for memory)."""
        return self._jobs.qsize() + len(self._waiting)

    @property
    def full(self) -> bool:
        """Serving as many requests as it serves together: new ones wait."""
        return self._places_taken() >= self.max_batch or len(self._serving) >= self.sessions.capacity

    def _places_taken(self) -> int:
        """Requests holding one of the :attr:`max_batch` places: all those served but the ones
        still reading a prompt longer than a chunk. Those are side work, all of them in one
        client's share of the time (:meth:`_iterate`), and their rows do not batch with short
        ones: they would otherwise keep other clients' short questions waiting in line for the
        minutes a paste takes to read (memory and each client's limits bound them still)."""
        return sum(1 for job in self._serving if job.unread <= decoding.PREFILL_CHUNK)

    # -- the worker -------------------------------------------------------------------------
    def _work(self) -> None:
        while self.accepting or self._serving or self._waiting:
            try:
                if self._abandon.is_set():
                    self._cancel_held()
                self._grow_reservations()
                self._admit()
                with self._busy:
                    self._progress_at = time.monotonic()
                    self._iterate()
            except BaseException:  # a failure outside any request's handling: log it, keep serving
                log.exception("the scheduler failed outside a request's handling")

    def _admit(self) -> None:
        """Put what arrived in line (waiting for something when idle) and run the queued tool jobs
        (:meth:`call`); then start waiting requests while there is room, taking the clients' lines
        in turn (:mod:`engine.core.turns`), each within its client's running limit and the memory
        budget (a client's second request at once only while places are spare). One that does not
        fit keeps its turn; one cancelled while it waited ends at once."""
        self._collect(block=not (self._serving or self._waiting))
        for dropped in self._waiting.drop(lambda j: j.cancelled):  # (its client's count falls now)
            self._finish(dropped, FinishReason.CANCELLED)
        running = collections.Counter(job.client for job in self._serving)
        limit = self._clients.limits.running

        def eligible(client: str) -> bool:
            if not (limit and client):
                return True
            spare = self.max_batch - self._places_taken() > RESERVED
            return running[client] < limit and (running[client] == 0 or spare)

        while not self.full:
            job = self._waiting.take(eligible)
            if job is None:
                return
            if not self._make_room_for(job):
                self._waiting.put_back(job)
                return
            job.reserved = self._reservation(job, len(job.prompt))
            running[job.client] += 1
            self._start(job)

    def _cancel_held(self) -> None:
        """Cancel every request served or waiting (each ends with finish reason ``cancelled``)."""
        self._collect(block=False)
        waiting = self._waiting.drop(lambda j: True)
        for job in [*self._serving, *waiting]:
            job.stream.cancel()
            log.warning("request %s cancelled: the engine is closing", job.request_id)
        for job in waiting:
            self._finish(job, FinishReason.CANCELLED)

    def _collect(self, block: bool) -> None:
        """Put the requests that arrived in line, and run the tool jobs among them in turn."""
        while True:
            try:
                item = self._jobs.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, _Job):
                self._waiting.put(item)
            else:
                self._call(item)

    def _call(self, job: Callable[[], None]) -> None:
        with self._busy:
            self._progress_at = time.monotonic()
            job()

    # -- the requests served (worker thread) ------------------------------------------------
    def _start(self, job: _Job) -> None:
        def start() -> None:
            job.stats.queue_s = time.perf_counter() - job.stats.start
            busy = [j.session for j in self._serving if j.session is not None]
            # A cold-cache request (a benchmark's) empties the session it gets.
            job.session = self.sessions.take(job.prompt if job.request.reuse_cache else [], busy)
            if not job.request.reuse_cache:
                job.session.reset()
                job.stats.start = time.perf_counter()
            config = self._decode_config(job)
            drafter = job.session.drafters.get(job.request.mode)
            job.decoder = Decoder(job.session.target, drafter, job.prompt, config, job.stats)
            job.prefill = job.decoder.prefill()
            job.detok = IncrementalDecoder(self.tokenizer, job.request.answer_ids)
            job.stops = StopStrings(job.request.stop_strings)

        self._serving.append(job)
        log.info(
            "request %s from %s: %d prompt tokens, mode %s",
            job.request_id,
            job.client or "a local user",
            len(job.prompt),
            job.request.mode,
        )
        if job.cancelled:  # stopped (or its tab closed) while it waited in the queue
            self._finish(job, FinishReason.CANCELLED)
            return
        self._guard([job], start)

    def _make_room_for(self, job: _Job) -> bool:
        """Whether the room ``job`` is first reserved (its prompt and a block of its answer) fits in
        the memory budget beside what the others hold and have reserved, after dropping idle
        conversations' caches (least recently used first; never the one it continues). A
        cancelled job starts (and ends) at once."""
        if job.cancelled:
            return True
        keep = self.sessions.continued(job.prompt, self._busy_sessions())
        need = self.budget.bytes_for(self._reservation(job, len(job.prompt)))
        need -= self.budget.bytes_held(keep.kv_cache_bytes) if keep is not None else 0  # (already held)
        fits = self._evict_idle_until(lambda: self._committed() + need <= self.budget.room, keep)
        return fits or not self._serving  # (alone it fits: Engine.check refused what does not)

    def _grow_reservations(self) -> None:
        """Grow the reservation of every request whose answer nears its end by a block, oldest
        request first. Where the room cannot hold it: idle conversations' caches are dropped, then
        the longest requests not yet answering are held back, then it takes what its next rounds
        need, and last the answer ends (engine.core.budget)."""
        for job in list(self._serving):
            if job not in self._serving or job.decoder is None:
                continue
            context = len(job.decoder.context)
            least = min(job.request.tokens_at_most(len(job.prompt), self.target.max_context), context + ROUND_ROOM)
            if job.reserved >= least:
                continue
            before, job.reserved = job.reserved, self._reservation(job, context)
            if self._evict_idle_until(self._within_room):
                continue
            for newcomer in sorted(self._newcomers(job), key=lambda j: j.reserved, reverse=True):
                self._hold_back(newcomer)
                if self._within_room():
                    break
            else:
                job.reserved = least
                if not self._within_room():
                    job.reserved = before
                    self._out_of_memory(job)

    def _reservation(self, job: _Job, context: int) -> int:
        most = job.request.tokens_at_most(len(job.prompt), self.target.max_context)
        return self.budget.reservation(context, most)

    def _within_room(self) -> bool:
        return self._committed() <= self.budget.room

    def _committed(self) -> int:
        """Bytes of the room in use or reserved: every cache as held, and what the requests served
        have reserved beyond what their caches hold now."""
        return self.budget.bytes_held(self._cache_bytes()) + self._ahead(self._serving)

    def _ahead(self, jobs: Sequence[_Job]) -> int:
        """Bytes ``jobs`` have reserved beyond what their caches hold now."""
        return self.budget.bytes_for(sum(max(0, job.reserved - self._tokens_held(job)) for job in jobs))

    def _tokens_held(self, job: _Job) -> int:
        """Tokens ``job``'s target cache holds now: its batch row's, or its own cache's."""
        row = next((row for row in self._batch.rows if row.key == job.key), None)
        if row is not None:
            return len(row.tokens)
        return len(job.session.target.tokens) if job.session is not None else 0

    def _busy_sessions(self) -> list[Session]:
        return [j.session for j in self._serving if j.session is not None]

    def _evict_idle_until(self, fits: Callable[[], bool], keep: Session | None = None) -> bool:
        """Drop idle conversations' caches, least recently used first (never ``keep``), until
        ``fits()``; whether it does."""
        idle = [s for s in self.sessions.idle(self._busy_sessions()) if s is not keep]
        while not fits() and idle:
            idle.pop(0).release()
        return fits()

    def _newcomers(self, growing: _Job) -> list[_Job]:
        """Requests served that have written no answer yet and hold room (not ``growing``)."""
        return [j for j in self._serving if j is not growing and j.stats.new_tokens == 0 and j.reserved]

    def _hold_back(self, job: _Job) -> None:
        """Put a request that has not started answering back in line, its caches freed: it reads
        its prompt again when there is room (its client still counts it as running)."""
        if job.key in self._batch:
            self._batch.leave(job.key, write_back=False)
        self._serving.remove(job)
        if job.session is not None:
            job.session.release()
        job.session = job.decoder = job.prefill = job.detok = job.stops = None
        job.reserved = 0
        self._waiting.put_back(job)
        log.info("request %s held back: the memory budget holds a growing answer first", job.request_id)

    def _out_of_memory(self, job: _Job) -> None:
        """End an answer the room can no longer hold, with finish reason ``length`` and a line
        that says why."""
        log.warning(
            "request %s ended at %d tokens: the memory budget holds no more (%s)",
            job.request_id,
            job.stats.new_tokens,
            self.budget.describe(),
        )
        self._end_text(job, FinishReason.LENGTH, OUT_OF_MEMORY)

    def _cache_bytes(self) -> int:
        """What every KV cache holds: the conversations' and the batch's rows (padded to the longest)."""
        return self.sessions.kv_cache_bytes + self._batch.kv_cache_bytes

    def _seats(self) -> list[planning.Seat]:
        """What the planner is told of each request served."""
        return [
            planning.Seat(
                job.key,
                job.client,
                reading=job.prefill is not None,
                unread=job.unread,
                rounds=job.stats.rounds,
                context=len(job.decoder.context) if job.decoder is not None else len(job.prompt),
                batched=job.key in self._batch,
                side_s=job.side_s,
            )
            for job in self._serving
        ]

    def _fits(self) -> Callable[[Sequence[planning.Seat]], bool]:
        """Whether rows fit the memory budget together, each padded to the widest, beside what the
        requests not generating hold and have reserved; idle conversations' caches count as free
        (:meth:`_together` drops them as :meth:`_make_room_for` does)."""
        going = [j for j in self._serving if j.prefill is None and j.stats.rounds > 0]
        others = [j for j in self._serving if j not in going]
        held = sum(j.session.kv_cache_bytes for j in others if j.session is not None)
        room = self.budget.room - self.budget.bytes_held(held) - self._ahead(others)
        per_token = self.target.kv_bytes_per_token
        return lambda rows: len(rows) * self.budget.bytes_held(max(r.context for r in rows) * per_token) <= room

    def _iterate(self) -> None:
        """Plan an iteration (:func:`engine.core.planning.plan`), then run it: a first round alone,
        or the shared work, then side work, each piece serving one client. While others generate,
        side work runs in its clients' share of the time (:class:`TimeShare`), the least served
        first, so one stranger's paste slows everyone else by a client's share, not by its whole
        reading. A request that arrives meanwhile ends the iteration's side work: it starts at
        the next one, its first token not behind a slice (the paste keeps its credit)."""
        plan = planning.plan(self._seats(), self._firsts, self.max_batch, self._fits())
        jobs = {job.key: job for job in self._serving}
        start = time.perf_counter()
        if plan.first is not None:
            self._firsts += 1
            job = jobs[plan.first]
            self._guard([job], functools.partial(self._first_round, job))
            self._share.earn(time.perf_counter() - start, 1)
            return
        self._firsts = 0
        if plan.together:
            together = [jobs[key] for key in plan.together]
            self._guard(together, functools.partial(self._together, together))
        for key in plan.alone:
            self._guard([jobs[key]], functools.partial(self._alone, jobs[key]))
        served = {jobs[key].client for key in (*plan.together, *plan.alone)}
        if served:
            self._share.earn(time.perf_counter() - start, len(served))
        else:
            self._share.settle()
        for job in [jobs[key] for key in plan.side]:
            if (served and not self._share.allows()) or not self._jobs.empty():
                return  # (what arrived meanwhile starts first: its first token does not wait for a slice)
            if job not in self._serving:
                continue
            start = time.perf_counter()
            if job.prefill is not None:
                self._guard([job], functools.partial(self._read_prompt, job, sliced=bool(served)))
            else:
                self._guard([job], functools.partial(self._alone, job))
            took = time.perf_counter() - start
            job.side_s += took
            if served:  # (alone, it owes no one)
                self._share.spend(took)

    def _first_round(self, job: _Job) -> None:
        """The rest of ``job``'s prompt (a chunk or less), then its first round."""
        while job.prefill is not None and job in self._serving:
            self._read_prompt(job)
        if job in self._serving:
            self._alone(job)

    def _read_prompt(self, job: _Job, sliced: bool = False) -> None:
        """A pass of ``job``'s prompt: a whole chunk, or (``sliced``, while others generate) one
        sized to take about :data:`SLICE_S` at the rate its last passes read."""
        assert job.prefill is not None and job.decoder is not None
        if sliced:
            width = int((job.stats.prefill_rate or 0.0) * SLICE_S) // SLICE_ROUND * SLICE_ROUND
            job.decoder.prefill_chunk = min(decoding.PREFILL_CHUNK, max(SLICE_ROUND, width))
        else:
            job.decoder.prefill_chunk = decoding.PREFILL_CHUNK
        if next(job.prefill, None) is None:
            job.prefill = None
            job.decoder.finish_if_full()
        else:  # how far the prompt is read, for a progress bar
            self._put(job, Event(EventKind.PROGRESS, metrics=job.stats.snapshot()))
        self._mark_progress()
        if job.cancelled:
            self._finish(job, FinishReason.CANCELLED)
        elif job.decoder.done:  # no room left for even one token
            self._finish(job, job.stats.finish_reason)

    def _alone(self, job: _Job) -> None:
        """A speculative round (or a plain step, while speculation does not pay) on the
        request's own caches."""
        assert job.decoder is not None
        if job.key in self._batch:
            self._batch.leave(job.key)
        for _ in job.decoder.catch_up():
            self._mark_progress()
            if job.cancelled:
                self._finish(job, FinishReason.CANCELLED)
                return
        self._emit(job, job.decoder.round(), batch_size=1)

    def _together(self, jobs: list[_Job]) -> None:
        """One batched target pass over ``jobs``: each row verifies the copy it offers where the
        pass's width pays for all rows together (:class:`BatchPrices`), else takes a plain step;
        then every row is cut back to what its round keeps. A row of the batch not among them
        (grown too wide, or waiting for its share as side work) leaves first."""
        keys = {j.key for j in jobs}
        for row in [row for row in self._batch.rows if row.key not in keys]:
            self._batch.leave(row.key)
        padded = len(jobs) * max(len(j.decoder.context) for j in jobs if j.decoder is not None)
        rows = self.budget.bytes_held(padded * self.target.kv_bytes_per_token)

        def room_for_rows() -> bool:  # (the rows' own caches are freed as they join)
            homes = [j.session for j in jobs]
            held = sum(s.kv_cache_bytes for s in self.sessions.sessions if not any(s is h for h in homes))
            return self.budget.bytes_held(held) + rows <= self.budget.room

        self._evict_idle_until(room_for_rows)
        joining = [j for j in jobs if j.key not in self._batch]
        for job in joining:
            assert job.decoder is not None and job.session is not None
            job.session.target.hold(job.decoder.context[:-1])
        if joining:
            self._batch.join([(j.key, j.session.target) for j in joining])  # type: ignore[union-attr]
        for job in joining:  # its draft cache idles meanwhile: freed (rebuilt over a bounded window if alone again)
            if job.session is not None and job.session.draft is not None:
                job.session.draft.release()
        order = {row.key: i for i, row in enumerate(self._batch.rows)}
        jobs = sorted(jobs, key=lambda j: order[j.key])
        decoders = [j.decoder for j in jobs if j.decoder is not None]
        copies = [d.copy_for_batch() if self.prices is not None else None for d in decoders]
        offers = [(len(c[0].tokens), c[0].acceptance) if c else (0, 0.0) for c in copies]
        width = self.prices.width(offers) if self.prices is not None else 1
        copies = [(c[0].head(width - 1), c[1]) if c and width > 1 else None for c in copies]
        start = time.perf_counter()
        logits = self._batch.step([[d.context[-1], *(c[0].tokens if c else ())] for d, c in zip(decoders, copies)])
        rounds = [d.take(row, self._batch.last_seconds, c) for d, row, c in zip(decoders, logits, copies)]
        self._batch.keep([len(d.context) - 1 for d in decoders])
        if self.prices is not None:
            self.prices.record(len(jobs), width, time.perf_counter() - start)
        for job, round_ in zip(jobs, rounds):
            self._emit(job, round_, batch_size=len(jobs))

    def _emit(self, job: _Job, round_: Round, batch_size: int) -> None:
        """Stream a round's text; end the request at a stop string, a cancel or the decoder's end."""
        assert job.decoder is not None and job.detok is not None and job.stops is not None
        job.stats.batch_size, job.stats.sharing = batch_size, len(self._serving)
        job.stats.peak_sharing = max(job.stats.peak_sharing, job.stats.sharing)
        pieces = [(job.detok.push(t), p.value) for t, p in zip(round_.tokens, round_.provenance)]
        job.out += round_.tokens
        delta, stopped = job.stops.push("".join(piece for piece, _ in pieces))
        self._put(job, Event(EventKind.DELTA, delta, pieces, job.stats.snapshot(), list(round_.tokens)))
        if stopped:
            self._finish(job, FinishReason.STOP)
        elif job.cancelled:
            self._finish(job, FinishReason.CANCELLED)
        elif job.decoder.done:
            self._end_text(job, job.stats.finish_reason)

    def _end_text(self, job: _Job, reason: FinishReason, note: str = "") -> None:
        """End an answer that stopped between rounds: the text still held back (a partial
        character, a possible stop string's start), then ``note``, then its last event."""
        assert job.detok is not None and job.stops is not None
        tail, stopped = job.stops.push(job.detok.flush())
        tail += "" if stopped else job.stops.flush() + note
        if tail:
            self._put(job, Event(EventKind.DELTA, tail, [(tail, Provenance.TARGET.value)], job.stats.snapshot()))
        self._finish(job, FinishReason.STOP if stopped else reason)

    def _finish(self, job: _Job, reason: FinishReason, error: str = "") -> None:
        """End a request: its batch row goes back to its own cache, its last event is sent."""
        if job.key in self._batch:
            self._batch.leave(job.key, write_back=not error)
        job.stats.finish_reason = reason
        if job in self._serving:  # (else it ended while it waited)
            self._serving.remove(job)
        job.release()
        metrics = job.stats.snapshot()
        if job.decoder is not None and not error and job.request.pooled:
            self.pools.learn(job.client, job.decoder.context)
        if error:
            self._put(job, Event(EventKind.ERROR, error=error, metrics=metrics, token_ids=job.out))
            return
        self.baseline.record(metrics)
        metrics["speedup_vs_ar"] = 1.0 if metrics["mode"] == ModeName.AUTOREGRESSIVE else self.baseline.speedup(metrics)
        self._put(job, Event(EventKind.DONE, metrics=metrics, token_ids=job.out))

    def _guard(self, jobs: list[_Job], work: Callable[[], None]) -> None:
        """Run ``work`` for ``jobs``; a failure ends those requests only, with a clear message
        (an unexpected one with an id to find its traceback in the log, and their caches reset)."""
        try:
            work()
        except EngineError as exc:
            for job in jobs:
                self._fail(job, str(exc))
        except Exception:  # never let a request kill the worker, nor leave its caches half-written
            request_id = uuid.uuid4().hex[:8]
            log.exception(
                "request %s failed (%d request(s) in the step, modes %s, prompts of %s tokens)",
                request_id,
                len(jobs),
                ",".join(sorted({j.request.mode for j in jobs})),
                ",".join(str(len(j.prompt)) for j in jobs),
            )
            if any(j.key in self._batch for j in jobs):
                for job in [j for j in self._serving if j.key in self._batch and j not in jobs]:
                    self._batch.leave(job.key)  # the others' rows were not touched by the failed pass
                self._batch.reset()
            for job in jobs:
                if job.session is not None and job in self._serving:  # (one that finished keeps its caches)
                    job.session.reset()
                self._fail(job, f"internal error (request {request_id}): the server log has the details; try again")

    def _fail(self, job: _Job, error: str) -> None:
        if job in self._serving:
            self._finish(job, FinishReason.ERROR, error)

    def _put(self, job: _Job, event: Event) -> None:
        self._mark_progress()
        job.stream.put(event)

    def _decode_config(self, job: _Job) -> DecodeConfig:
        request, stream = job.request, job.stream
        opening = self.sessions.opening.tokens if self.sessions.opening is not None else ()
        opens = bool(opening) and tuple(job.prompt[: len(opening)]) == opening
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p, request.seed)
        mode = MODES[request.mode]
        return DecodeConfig(
            mode.drafter is not None,
            mode.k(request.k),
            request.max_new_tokens,
            sampling,
            self.stop_ids,
            cancelled=lambda: stream.cancelled,
            progress=self._mark_progress,
            pacing=self.pacing if mode.paced else None,
            fence_ids=self.fence_ids,
            pool=self.pools.of(request.client) if mode.paced and request.pooled else None,
            reader=self.reader,
            spoken=job.spoken,
            breaks=(len(opening),) if opens else (),
        )

    def _mark_progress(self) -> None:
        self._progress_at = time.monotonic()
