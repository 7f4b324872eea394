"""The scheduler on the engine's worker thread (:mod:`engine.core.worker`): which requests wait,
which are served, and how each iteration advances them: planned from a snapshot of the requests
(:mod:`engine.core.planning`: a first round, or one batched target pass where every row verifies
its copies or takes a plain step, or each request's round alone, then side work), run, and each
round applied to its request's stream. What each request may hold of the memory budget is the
cache manager's to decide (:mod:`engine.core.cache_manager`); the scheduler acts on its answers.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.core import decoding, planning
from engine.core.batch import batch_for
from engine.core.budget import MemoryBudget
from engine.core.cache_manager import OUT_OF_MEMORY, CacheManager
from engine.core.chat import Prompt
from engine.core.decoding import DecodeConfig, Provenance, Round
from engine.core.jobs import Job
from engine.core.metrics import Baseline, FinishReason, ModeName, Stats
from engine.core.modes import MODES
from engine.core.pacing import BatchPrices, Pacing
from engine.core.pool import Pools
from engine.core.reader import PromptReader
from engine.core.requests import Event, EventKind, Request, Stream
from engine.core.runtime import Runtime
from engine.core.sampling import SamplingParams
from engine.core.sessions import SessionPool
from engine.core.turns import ClientLedger, FairQueue, TimeShare
from engine.core.worker import CLOSED, Worker
from engine.errors import EngineError

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
log = logging.getLogger("specchat.engine")


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
        batching: bool = True,
    ) -> None:
        """``clients``: the ledger the engine admits requests by (a finished one is returned to
        it here); ``pacing``, ``stop_ids``, ``fence_ids`` and ``reader`` (the prompt reader, if
        one is used) go to every request's decoder; ``pools``: the clients' n-gram pools, which
        paced requests draft from and every finished one adds its conversation to; ``prices``:
        what batched passes cost by rows and width, which prices the copies rows verify in them
        (None: batched passes are plain steps); ``batching``: whether requests share batched passes
        at all (:attr:`~engine.core.settings.Settings.batching`)."""
        self.target = target
        self.sessions = sessions
        self.budget = budget
        self.tokenizer = tokenizer
        self.pacing = pacing
        self.stop_ids = stop_ids
        self.fence_ids = fence_ids
        self.pools = pools
        self.reader = reader
        self.batching = batching
        self.baseline = Baseline()  # plain decoding's measured speed: the answers' speedup (worker thread only)
        self.max_batch = min(MAX_BATCH, self.sessions.capacity)
        self._batch = batch_for(self.target)
        self.memory = CacheManager(budget, sessions, self._batch, target.kv_bytes_per_token)
        self.prices = prices  # (worker thread only)
        self._serving: list[Job] = []  # started, not finished (worker thread only)
        self._waiting: FairQueue[Job] = FairQueue(lambda job: job.client)  # in line (worker thread only)
        self._clients = clients
        self._share = TimeShare(most_s=SLICE_S)
        self._firsts = 0  # first rounds run in a row, since the last shared work (worker thread only)
        self.worker: Worker[Job] = Worker(self._work)  # (what the engine calls, closes and checks the health of)
        self.worker.start()

    def submit(self, request: Request, prompt: Prompt, stream: Stream, release: Callable[[], None]) -> None:
        """Queue a checked request; its events go to ``stream``, and ``release`` uncounts it for
        its client when it ends (at once, with an error event, if the scheduler is closed)."""
        stats = Stats(request.mode, out_of_view=prompt.out_of_view)
        most = request.tokens_at_most(len(prompt.ids), self.target.max_context)
        job = Job(request, prompt.ids, stream, stats, release, most, spoken=prompt.spoken)
        if not self.worker.put(job):
            release()
            stream.put(Event(EventKind.ERROR, error=CLOSED, metrics=job.stats.snapshot()))

    @property
    def pending(self) -> int:
        """Requests waiting for or using the engine."""
        return self.waiting + len(self._serving)

    @property
    def waiting(self) -> int:
        """Requests queued, not yet taken up (they wait while the engine is full, or for memory)."""
        return self.worker.queued + len(self._waiting)

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
        while self.worker.accepting or self._serving or self._waiting:
            try:
                if self.worker.abandoned:
                    self._cancel_held()
                self._grow_reservations()
                self._admit()
                with self.worker.busy():
                    self._iterate()
            except BaseException:  # a failure outside any request's handling: log it, keep serving
                log.exception("the scheduler failed outside a request's handling")

    def _admit(self) -> None:
        """Put what arrived in line (waiting for something when idle; the worker runs the tool jobs
        among it); then start waiting requests while there is room, taking the clients' lines
        in turn (:mod:`engine.core.turns`), each within its client's running limit and the memory
        budget (a client's second request at once only while places are spare). One that does not
        fit keeps its turn; one cancelled while it waited ends at once."""
        for arrived in self.worker.arrived(block=not (self._serving or self._waiting)):
            self._waiting.put(arrived)
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
            if not (job.cancelled or self.memory.admit(job, self._serving)):  # (a cancelled one starts and ends)
                self._waiting.put_back(job)
                return
            running[job.client] += 1
            self._start(job)

    def _cancel_held(self) -> None:
        """Cancel every request served or waiting (each ends with finish reason ``cancelled``)."""
        waiting = [*self._waiting.drop(lambda j: True), *self.worker.arrived(block=False)]
        for job in [*self._serving, *waiting]:
            job.stream.cancel()
            log.warning("request %s cancelled: the engine is closing", job.request_id)
        for job in waiting:
            self._finish(job, FinishReason.CANCELLED)

    # -- the requests served (worker thread) ------------------------------------------------
    def _start(self, job: Job) -> None:
        def start() -> None:
            job.stats.queue_s = time.perf_counter() - job.stats.start
            busy = [j.session for j in self._serving if j.session is not None]
            # A cold-cache request (a benchmark's) empties the session it gets.
            session = self.sessions.take(job.prompt if job.request.reuse_cache else [], busy)
            if not job.request.reuse_cache:
                session.reset()
                job.stats.start = time.perf_counter()
            job.begin(session, self._decode_config(job), self.tokenizer)

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

    def _grow_reservations(self) -> None:
        """Grow the reservation of every request whose answer nears its end, oldest request first;
        an answer the room can no longer hold ends (engine.core.cache_manager)."""
        for job in list(self._serving):
            grows = job in self._serving and job.decoder is not None
            if grows and not self.memory.grow(job, self._serving, self._hold_back):
                self._out_of_memory(job)

    def _hold_back(self, job: Job) -> None:
        """Put a request that has not started answering back in line, its caches freed: it reads
        its prompt again when there is room (its client still counts it as running)."""
        if job.key in self._batch:
            self._batch.leave(job.key, write_back=False)
        self._serving.remove(job)
        job.stop_decoding()
        self._waiting.put_back(job)
        log.info("request %s held back: the memory budget holds a growing answer first", job.request_id)

    def _out_of_memory(self, job: Job) -> None:
        """End an answer the room can no longer hold, with finish reason ``length`` and a line
        that says why."""
        log.warning(
            "request %s ended at %d tokens: the memory budget holds no more (%s)",
            job.request_id,
            job.stats.new_tokens,
            self.budget.describe(),
        )
        self._end_text(job, FinishReason.LENGTH, OUT_OF_MEMORY)

    def _iterate(self) -> None:
        """Plan an iteration (:func:`engine.core.planning.plan`), then run it: a first round alone,
        or the shared work, then side work, each piece serving one client. While others generate,
        side work runs in its clients' share of the time (:class:`TimeShare`), the least served
        first, so one stranger's paste slows everyone else by a client's share, not by its whole
        reading. A request that arrives meanwhile ends the iteration's side work: it starts at
        the next one, its first token not behind a slice (the paste keeps its credit)."""
        seats = [job.seat(job.key in self._batch) for job in self._serving]
        plan = planning.plan(seats, self._firsts, self.max_batch, self.memory.rows_fit(self._serving), self.batching)
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
            if (served and not self._share.allows()) or self.worker.queued:
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

    def _first_round(self, job: Job) -> None:
        """The rest of ``job``'s prompt (a chunk or less), then its first round."""
        while job.prefill is not None and job in self._serving:
            self._read_prompt(job)
        if job in self._serving:
            self._alone(job)

    def _read_prompt(self, job: Job, sliced: bool = False) -> None:
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
        self.worker.progress()
        if job.cancelled:
            self._finish(job, FinishReason.CANCELLED)
        elif job.decoder.done:  # no room left for even one token
            self._finish(job, job.stats.finish_reason)

    def _alone(self, job: Job) -> None:
        """A speculative round (or a plain step, while speculation does not pay) on the
        request's own caches."""
        assert job.decoder is not None
        if job.key in self._batch:
            self._batch.leave(job.key)
        for _ in job.decoder.catch_up():
            self.worker.progress()
            if job.cancelled:
                self._finish(job, FinishReason.CANCELLED)
                return
        self._emit(job, job.decoder.round(), batch_size=1)

    def _together(self, jobs: list[Job]) -> None:
        """One batched target pass over ``jobs``: each row verifies the copy it offers where the
        pass's width pays for all rows together (:class:`BatchPrices`), else takes a plain step;
        then every row is cut back to what its round keeps. A row of the batch not among them
        (grown too wide, or waiting for its share as side work) leaves first."""
        keys = {j.key for j in jobs}
        for row in [row for row in self._batch.rows if row.key not in keys]:
            self._batch.leave(row.key)
        self.memory.make_room_for_rows(jobs, self._serving)
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

    def _emit(self, job: Job, round_: Round, batch_size: int) -> None:
        """Stream a round's text; end the request at a stop string, a cancel or the decoder's end."""
        assert job.decoder is not None
        job.stats.batch_size, job.stats.sharing = batch_size, len(self._serving)
        job.stats.peak_sharing = max(job.stats.peak_sharing, job.stats.sharing)
        pieces, delta, stopped = job.text(round_)
        self._put(job, Event(EventKind.DELTA, delta, pieces, job.stats.snapshot(), list(round_.tokens)))
        if stopped:
            self._finish(job, FinishReason.STOP)
        elif job.cancelled:
            self._finish(job, FinishReason.CANCELLED)
        elif job.decoder.done:
            self._end_text(job, job.stats.finish_reason)

    def _end_text(self, job: Job, reason: FinishReason, note: str = "") -> None:
        """End an answer that stopped between rounds: the text still held back (a partial
        character, a possible stop string's start), then ``note``, then its last event."""
        tail, stopped = job.rest(note)
        if tail:
            self._put(job, Event(EventKind.DELTA, tail, [(tail, Provenance.TARGET.value)], job.stats.snapshot()))
        self._finish(job, FinishReason.STOP if stopped else reason)

    def _finish(self, job: Job, reason: FinishReason, error: str = "") -> None:
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

    def _guard(self, jobs: list[Job], work: Callable[[], None]) -> None:
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

    def _fail(self, job: Job, error: str) -> None:
        if job in self._serving:
            self._finish(job, FinishReason.ERROR, error)

    def _put(self, job: Job, event: Event) -> None:
        self.worker.progress()
        job.stream.put(event)

    def _decode_config(self, job: Job) -> DecodeConfig:
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
            progress=self.worker.progress,
            pacing=self.pacing if mode.paced else None,
            fence_ids=self.fence_ids,
            pool=self.pools.of(request.client) if mode.paced and request.pooled else None,
            reader=self.reader,
            spoken=job.spoken,
            breaks=(len(opening),) if opens else (),
        )
