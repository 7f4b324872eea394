"""The engine the app and the bench talk to: two models, one worker thread, streamed events.

Every piece of work runs on the single worker thread, so the KV caches are never touched by two
requests at once; callers read their own request's events only. The worker serves up to
``max_batch`` requests together (the scheduler below): each iteration runs one prefill chunk of
a request still reading its prompt, then advances the requests that are generating: one alone
runs speculative rounds on its own caches; several run one batched target pass together
(:mod:`engine.core.batch`), where one pass costs little more than a single row's and
speculation no longer pays (docs/design.md, "Batching"). Further requests wait in the queue.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from engine.core import chat
from engine.core.batch import Batch
from engine.core.budget import MemoryBudget, gigabytes
from engine.core.chat import check_messages
from engine.core.decoding import DecodeConfig, Decoder, Provenance, Round
from engine.core.drafters import Drafter
from engine.core.memory import resident_bytes, return_freed_buffers
from engine.core.metrics import Baseline, Stats
from engine.core.modes import BEST_K, COPY_WIDTHS, MODES, DrafterParts
from engine.core.pacing import Pacing, PassCosts
from engine.core.runtime import DRAFT_CONFIG, TARGET_CONFIG, Runtime
from engine.core.sampling import SamplingParams
from engine.core.sessions import MAX_SESSIONS, Session, SessionPool
from engine.core.textstream import IncrementalDecoder, StopStrings
from engine.core.turns import NO_LIMITS, ClientBusy, ClientLedger, ClientLimits, FairQueue
from engine.errors import EngineError
from engine.hf import auto_tokenizer

T = TypeVar("T")
# The draft head's vocabulary: the first N ids (BPE merge rank ~ frequency). Off by default:
# on this machine the acceptance it costs outweighs the cheaper draft pass (docs/benchmarks.md).
DRAFT_VOCAB: int | None = None
# Tokens per draft pass (see Runtime): one shape for every draft step.
DRAFT_PASS_WIDTH = 2
# The longest prompt accepted, as a share of the context: room is left for the answer.
INPUT_SHARE = 0.75
# A message longer than this many characters per accepted token is refused without tokenizing it
# (no tokenizer here packs more characters into a token).
MAX_CHARS_PER_TOKEN = 16
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256
MAX_K = 16
# Seconds a request may go without progress (a round, a prefill chunk) before its stream fails
# and the engine reports itself unhealthy.
STEP_TIMEOUT = 120.0
# Requests served together; more wait in the queue. On this machine a batched step over 8 rows
# costs 1.4x a single row's (docs/design.md, "Batching").
MAX_BATCH = 8
# Tokens of answer the input cap leaves room for in the memory budget.
MIN_ANSWER_ROOM = 256
log = logging.getLogger("specchat.engine")


@dataclass(frozen=True)
class Request:
    """One generation: a chat (list of {"role", "content"}) or raw prompt token ids.

    ``answer_ids``: the token ids of an answer cut short (by its cap, or a Stop) to the last
    message of ``messages``: the request continues that answer from where it stopped, its
    tokens exactly as generated (re-tokenized text could split differently)."""

    messages: tuple[dict, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    answer_ids: tuple[int, ...] = ()
    mode: str = "speculative"
    k: int = 4
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    reuse_cache: bool = True  # False: start both KV caches empty (fair benchmarks)
    client: str = ""  # who asks (a browser session, an API key or address): turns and limits are per client

    def check(self, modes: Sequence[str], max_context: int) -> None:
        """Refuse what the engine must never see: unknown modes, numbers out of range or not
        finite (NaN passes every range check of a form), malformed messages."""
        if self.mode not in modes:
            raise EngineError(f"unknown mode '{self.mode}': choose one of {', '.join(modes)}")
        _in_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _in_range("top_k", self.top_k, 0, max_context, whole=True)
        _in_range("k", self.k, 1, MAX_K, whole=True)
        _in_range("max_new_tokens", self.max_new_tokens, 1, max_context, whole=True)
        if self.seed is not None:
            _in_range("seed", self.seed, 0, 2**63 - 1, whole=True)
        if len(self.stop_strings) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and len(s) <= MAX_STOP_LENGTH for s in self.stop_strings
        ):
            raise EngineError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
        check_messages(self.messages)
        if self.answer_ids and not self.messages:
            raise EngineError("answer_ids continue an answer to messages: send the messages too")


def _in_range(name: str, value: object, low: float, high: float, whole: bool = False, low_open: bool = False) -> None:
    """A number from ``low`` to ``high`` (``low`` itself excluded when ``low_open``); a whole
    number must be an int (a float would reach numpy and the sampler as a float)."""
    number = int if whole else int | float
    if isinstance(value, number) and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value)):
        above = value > low if low_open else value >= low
        if above and value <= high:
            return
    kind = "a whole number" if whole else "a number"
    raise EngineError(
        f"{name} must be {kind} from {low:g} to {high:g}{' (not 0)' if low_open else ''}; got {value!r:.40}"
    )


@dataclass
class Event:
    """``progress`` while a long prompt is read (its metrics say how far: ``prompt_read`` of
    ``prompt_tokens``), ``delta`` while streaming; a last event ``done`` (or ``error``) carries
    the final metrics."""

    kind: str
    text: str = ""
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, provenance) per token
    metrics: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # a delta's round; every token of the answer at the end
    error: str = ""

    @property
    def final(self) -> bool:
        return self.kind in ("done", "error")


class Stream:
    """The events of one request, in order, ending with a ``done`` or ``error`` event.

    ``cancel()`` asks the engine to stop after the current round (or prefill chunk); the stream
    still ends with its final event (finish reason ``cancelled``). ``close()`` cancels and stops
    reading. A stream whose engine is unhealthy (no progress on any request for
    ``step_timeout`` seconds) ends with an error event instead of waiting forever; waiting
    behind other requests that do progress is not a failure."""

    def __init__(self, step_timeout: float, healthy: Callable[[], bool]) -> None:
        self._events: queue.Queue[Event] = queue.Queue()
        self._cancel = threading.Event()
        self._ended = False
        self.step_timeout = step_timeout
        self._healthy = healthy
        self.refusal = ""  # why the request was refused before it ran (a bad field, too long, not ready)
        self.retry_after: float | None = None  # refused for now only (its client holds its share): seconds

    @classmethod
    def refused(cls, error: str, mode: str, retry_after: float | None = None) -> Stream:
        """A stream that ends at once with ``error``: the request was refused before it ran."""
        stream = cls(STEP_TIMEOUT, lambda: True)
        stream.refusal, stream.retry_after = error, retry_after
        stream._events.put(Event("error", error=error, metrics=Stats(mode).snapshot()))
        return stream

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Event:
        if self._ended:
            raise StopIteration
        while (event := self._poll(self.step_timeout)) is None:
            pass
        return event

    def waiting(self, every: float) -> Iterator[Event | None]:
        """The events, with a None after every ``every`` seconds without one: a caller that must
        stay responsive while the engine serves others or prefills (a web handler, which can only
        be stopped between yields) yields at each None."""
        while not self._ended:
            yield self._poll(every)

    def _poll(self, seconds: float) -> Event | None:
        """The next event, or None after ``seconds`` without one; an error event once the engine
        is unhealthy (no progress on any request for ``step_timeout``)."""
        try:
            event = self._events.get(timeout=seconds)
        except queue.Empty:
            if self._healthy():
                return None
            self.cancel()
            event = Event("error", error=f"the engine did not answer within {self.step_timeout:g} s; try again later")
        self._ended = event.final
        return event

    @property
    def ended(self) -> bool:
        """Its last event read, or closed."""
        return self._ended

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        self.cancel()
        self._ended = True


@dataclass(eq=False)
class _Job:
    """A request the scheduler serves: what it asked, where its events go, how far it is."""

    request: Request
    prompt: list[int]
    events: queue.Queue
    cancel: threading.Event
    stats: Stats
    session: Session | None = None
    decoder: Decoder | None = None
    prefill: Iterator[int] | None = None  # the prompt's remaining passes (tokens read after each); None once read
    detok: IncrementalDecoder | None = None
    stops: StopStrings | None = None
    out: list[int] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def key(self) -> int:
        return id(self)

    @property
    def client(self) -> str:
        return self.request.client


class Engine:
    def __init__(
        self,
        target_dir: Path,
        draft_dir: Path | None = None,
        device: str = "CPU",
        config: dict | None = None,
        draft_config: dict | None = None,
        draft_vocab: int | None = DRAFT_VOCAB,
        max_input_tokens: int | None = None,
        step_timeout: float = STEP_TIMEOUT,
        max_sessions: int | None = None,
        memory_limit: int | None = None,
        pacing: Pacing | None = None,
        client_limits: ClientLimits = NO_LIMITS,
    ):
        """``config`` / ``draft_config``: OpenVINO properties of the target / draft (defaults:
        :data:`TARGET_CONFIG` and :data:`DRAFT_CONFIG`). ``draft_vocab``: the draft head computes
        logits for the first N token ids only (None: all). ``max_input_tokens``: the longest
        prompt accepted (default: :data:`INPUT_SHARE` of the context). ``step_timeout``: seconds
        without progress after which a stream fails and the engine reports itself unhealthy.
        ``max_sessions``: conversations whose KV caches are kept (default:
        :data:`~engine.core.sessions.MAX_SESSIONS`, their bytes bounded by the budget).
        ``memory_limit``: bytes the process may hold (default: a share of the machine's memory,
        :mod:`engine.core.budget`); the input cap follows from it too. ``pacing``: the paced mode's
        policy (default: priced by the passes timed here at start). ``client_limits``: what one
        client may hold (default: no limit; :mod:`engine.core.turns`). The two models must share
        one vocabulary (``engine.prepare`` checks it)."""

        return_freed_buffers()
        self.tokenizer = auto_tokenizer(target_dir)
        self.target = Runtime(
            Path(target_dir), device, TARGET_CONFIG if config is None else config, first_token_alone=True
        )
        self.draft = (
            Runtime(
                Path(draft_dir),
                device,
                DRAFT_CONFIG if draft_config is None else draft_config,
                vocab_limit=draft_vocab,
                masked_rollback=True,
                pass_width=DRAFT_PASS_WIDTH,
            )
            if draft_dir
            else None
        )
        self.modes = tuple(m.name for m in MODES.values() if self.draft is not None or not m.needs_draft_model)
        for runtime in (self.target, self.draft):
            if runtime is not None:
                runtime.warm_up()
        # What a speculative round costs here against a plain step: the paced mode's break-even, and
        # the price of its lookup copies.
        if pacing is None and self.draft is not None:
            pacing = Pacing(PassCosts.measure(self.target, self.draft, BEST_K, COPY_WIDTHS))
            log.info("pass costs: %s", pacing.costs.describe())  # type: ignore[union-attr]
        self.pacing = pacing or Pacing()
        self.stop_ids = frozenset(_stop_ids(Path(target_dir), self.tokenizer))
        self.fence_ids = frozenset(i for token, i in self.tokenizer.get_vocab().items() if "```" in token)
        self.max_context = self.target.max_context
        per_token = self.target.kv_bytes_per_token + (self.draft.kv_bytes_per_token if self.draft else 0)
        self.budget = MemoryBudget.of_machine(memory_limit, resident_bytes(), per_token)
        log.info(self.budget.describe())
        # The longest prompt accepted: a share of the context, and what the budget holds beside an answer.
        self.max_input_tokens = min(
            max_input_tokens or int(self.max_context * INPUT_SHARE), self.budget.tokens - MIN_ANSWER_ROOM
        )
        if self.budget.tokens <= 2 * MIN_ANSWER_ROOM:
            raise EngineError(f"the {self.budget.describe()} is too small to serve a conversation: raise the limit")
        self.sessions = SessionPool(self.target, self.draft, self._drafters, max_sessions or MAX_SESSIONS)
        self.step_timeout = step_timeout
        self.baseline = Baseline()  # plain decoding's measured speed: the answers' speedup (worker thread only)
        self._progress_at = time.monotonic()
        self.max_batch = min(MAX_BATCH, self.sessions.capacity)
        self._batch = Batch(self.target)
        self._serving: list[_Job] = []  # started, not finished (worker thread only)
        self._jobs: queue.Queue[_Job | Callable[[], None]] = queue.Queue()  # arrived, not yet in line
        self._waiting: FairQueue[_Job] = FairQueue(lambda job: job.client)  # in line (worker thread only)
        self._clients = ClientLedger(client_limits)
        self._busy = threading.Lock()
        self._tokenizing = threading.Lock()  # the tokenizer's special-token switch is shared state
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    def _drafters(self, draft: Runtime | None) -> dict[str, Drafter]:
        """Every mode's drafter over one session's draft cache."""
        parts = DrafterParts(self.target.vocab_size, draft, self.pacing.worth_copying)
        return {name: build(parts) for name in self.modes if (build := MODES[name].drafter) is not None}

    # -- the worker -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            try:
                self._admit()
                with self._busy:
                    self._progress_at = time.monotonic()
                    self._advance()
            except BaseException:  # a failure outside any request's handling: log it, keep serving
                log.exception("the scheduler failed outside a request's handling")

    def _admit(self) -> None:
        """Put what arrived in line (waiting for something when idle) and run the queued tool jobs
        (:meth:`with_models`); then start waiting requests while there is room, taking the
        clients' lines in turn (:mod:`engine.core.turns`), each within its client's running limit
        and the memory budget. One that does not fit keeps its turn."""
        self._collect(block=not self._serving and not self._waiting)
        running = collections.Counter(job.client for job in self._serving)
        limit = self._clients.limits.running
        while len(self._serving) < self.max_batch:
            job = self._waiting.take(lambda client: not (limit and client) or running[client] < limit)
            if job is None:
                return
            if not self._room_for(job):
                self._waiting.put_back(job)
                return
            running[job.client] += 1
            self._start(job)

    def _collect(self, block: bool) -> None:
        while True:
            try:
                item = self._jobs.get(block=block)
            except queue.Empty:
                return
            block = False
            if isinstance(item, _Job):
                self._waiting.put(item)
            else:
                with self._busy:
                    self._progress_at = time.monotonic()
                    item()

    def with_models(self, fn: Callable[[Runtime, Runtime | None], T]) -> T:
        """Run ``fn(target, draft)`` on the worker thread, after the queued work, and return its
        result: the one way to use the models' runtimes directly (the tools measure with it)."""
        future: Future = Future()

        def job() -> None:
            try:
                future.set_result(fn(self.target, self.draft))
            except BaseException as exc:  # handed back to the caller's thread
                future.set_exception(exc)

        self._jobs.put(job)
        return future.result()

    @property
    def healthy(self) -> bool:
        """False while a request has made no progress for longer than ``step_timeout``: a stuck
        inference call (the worker recovers, and with it the health, when the call returns)."""
        stuck = self._busy.locked() and time.monotonic() - self._progress_at > self.step_timeout
        return self._worker.is_alive() and not stuck

    @property
    def models(self) -> dict[str, str]:
        """Each role's model name and precision, for people."""
        return {"target": self.target.label} | ({"draft": self.draft.label} if self.draft else {})

    @property
    def replicas(self) -> int:
        """Engines serving (one; a cluster's remote engine says how many run)."""
        return 1

    @property
    def state(self) -> str:
        """One word for ``/health``."""
        return "ok" if self.healthy else "unhealthy"

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
        return len(self._serving) >= self.max_batch

    # -- generation -------------------------------------------------------------------------
    def check(self, request: Request) -> list[int]:
        """The request's prompt ids, or an :class:`EngineError` saying what is wrong with it."""
        request.check(self.modes, self.max_context)
        prompt = self.prompt_ids(request)
        self.budget.check(self._tokens_needed(prompt, request), "this request")
        return prompt

    def _tokens_needed(self, prompt: list[int], request: Request) -> int:
        """The most tokens a request's caches may hold: its prompt and its whole answer."""
        return min(len(prompt) + request.max_new_tokens, self.max_context)

    def prompt_ids(self, request: Request) -> list[int]:
        """The request's prompt, refused above ``max_input_tokens`` (checked on characters first,
        so a multi-megabyte paste is never tokenized)."""
        if request.prompt_ids:
            ids = list(request.prompt_ids)
        else:
            if not request.messages or not str(request.messages[-1].get("content", "")).strip():
                raise EngineError("the message is empty: type something first")
            characters = sum(len(m["content"]) for m in request.messages)
            if characters > self.max_input_tokens * MAX_CHARS_PER_TOKEN:
                raise self._too_long(f"{characters:,} characters")
            with self._tokenizing:
                ids = chat.prompt_ids(self.tokenizer, request.messages)
        if len(ids) > self.max_input_tokens:
            raise self._too_long(f"{len(ids):,} tokens")
        if any(not isinstance(t, int) or not 0 <= t < self.target.vocab_size for t in request.answer_ids):
            raise EngineError(f"answer_ids must be token ids from 0 to {self.target.vocab_size - 1}")
        if len(ids) + len(request.answer_ids) >= self.max_context:  # (an answer may grow past the input cap)
            raise EngineError(f"the answer fills the model's context ({self.max_context:,} tokens): it cannot go on")
        return ids + list(request.answer_ids)

    def _too_long(self, length: str) -> EngineError:
        bound = (
            f"its memory limit of {gigabytes(self.budget.limit)} holds {self.budget.tokens:,} tokens of cache"
            if self.max_input_tokens + MIN_ANSWER_ROOM >= self.budget.tokens
            else f"the model's context holds {self.max_context:,}"
        )
        return EngineError(
            f"the conversation is {length} long; this server takes at most {self.max_input_tokens:,} tokens of "
            f"input ({bound}). Shorten the message or clear the chat."
        )

    def text(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens left out)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def generate(self, request: Request) -> Stream:
        """Stream the events of one request (see :class:`Stream` for how to stop it). A request
        that is not valid ends at once with an error event; nothing of it reaches the worker."""
        try:
            prompt = self.check(request)
            self._clients.admit(request.client)
        except ClientBusy as exc:
            return Stream.refused(str(exc), request.mode, exc.retry_after)
        except EngineError as exc:
            return Stream.refused(str(exc), request.mode)
        stream = Stream(self.step_timeout, lambda: self.healthy)
        self._jobs.put(_Job(request, prompt, stream._events, stream._cancel, Stats(request.mode)))
        return stream

    def run(self, request: Request) -> Event:
        """Generate to the end; return the final event."""
        for event in self.generate(request):
            if event.final:
                return event
        raise EngineError("generation ended without a final event")

    # -- the scheduler (worker thread) ------------------------------------------------------
    def _start(self, job: _Job) -> None:
        def start() -> None:
            job.stats.queue_s = time.perf_counter() - job.stats.start
            busy = [j.session for j in self._serving if j.session is not None]
            # A cold-cache request (a benchmark's) empties the session it gets.
            job.session = self.sessions.take(job.prompt if job.request.reuse_cache else [], busy)
            if not job.request.reuse_cache:
                job.session.reset()
                job.stats.start = time.perf_counter()
            config = self._decode_config(job.request, job.cancel)
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
        if job.cancel.is_set():  # stopped (or its tab closed) while it waited in the queue
            self._finish(job, "cancelled")
            return
        self._guard([job], start)

    def _room_for(self, job: _Job) -> bool:
        """Whether the caches ``job`` may grow to fit in the memory budget beside the others',
        after dropping idle conversations' caches (least recently used first; never the one it
        continues). A cancelled job starts (and ends) at once."""
        if job.cancel.is_set():
            return True
        busy = [j.session for j in self._serving if j.session is not None]
        keep = self.sessions.continued(job.prompt, busy)
        need = self._tokens_needed(job.prompt, job.request) * self.budget.per_token
        need -= self.budget.bytes_held(keep.kv_cache_bytes) if keep is not None else 0  # (already held)
        idle = [s for s in self.sessions.idle(busy) if s is not keep]

        def fits() -> bool:
            return self.budget.bytes_held(self._cache_bytes()) + need <= self.budget.room

        while not fits() and idle:
            idle.pop(0).release()
        return not self._serving or fits()  # (alone it fits: Engine.check refused what does not)

    def _cache_bytes(self) -> int:
        """What every KV cache holds: the conversations' and the batch's rows (padded to the longest)."""
        return self.sessions.kv_cache_bytes + self._batch.kv_cache_bytes

    def _batchable(self, jobs: list[_Job]) -> list[_Job]:
        """The generating requests whose rows fit the budget together, padded to the longest row:
        the shortest first. A row a thousand times longer than the others would otherwise make
        each of them that long."""
        members = [j.session for j in jobs]
        others = sum(s.kv_cache_bytes for s in self.sessions.sessions if not any(s is m for m in members))
        room = self.budget.room - self.budget.bytes_held(others)
        chosen: list[_Job] = []
        for job in sorted(jobs, key=lambda j: len(j.decoder.context)):  # type: ignore[union-attr]
            width = len(job.decoder.context)  # type: ignore[union-attr]
            if (len(chosen) + 1) * self.budget.bytes_held(width * self.target.kv_bytes_per_token) > room:
                break
            chosen.append(job)
        return chosen if len(chosen) > 1 else []

    def _advance(self) -> None:
        """One iteration: the prompts waiting to be read, up to the first that needs a prefill
        chunk of its own (a long one: that chunk is the iteration's prefill), then one round of
        every request that is generating (together when there are several). Short prompts
        arriving together so start together, their prefills in one iteration, instead of one
        iteration each: the last of four no longer waits for three rounds of the others."""
        for job in [j for j in self._serving if j.prefill is not None]:
            self._guard([job], functools.partial(self._read_prompt, job))
            if job.prefill is not None:
                break
        generating = [j for j in self._serving if j.prefill is None]
        together = self._batchable(generating) if len(generating) > 1 else []
        if together:
            self._guard(together, lambda: self._together(together))
        for job in [j for j in generating if j not in together and j in self._serving]:
            self._guard([job], functools.partial(self._alone, job))

    def _read_prompt(self, job: _Job) -> None:
        assert job.prefill is not None and job.decoder is not None
        if next(job.prefill, None) is None:
            job.prefill = None
            job.decoder.room()
        else:  # how far the prompt is read, for a progress bar
            self._put(job, Event("progress", metrics=job.stats.snapshot()))
        self._mark_progress()
        if job.cancel.is_set():
            self._finish(job, "cancelled")
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
            if job.cancel.is_set():
                self._finish(job, "cancelled")
                return
        self._emit(job, job.decoder.round(), batch_size=1)

    def _together(self, jobs: list[_Job]) -> None:
        """One batched target pass over every generating request; each takes its own token."""
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
        logits = self._batch.step([j.decoder.context[-1] for j in jobs])  # type: ignore[union-attr]
        for job, row in zip(jobs, logits):
            assert job.decoder is not None
            self._emit(job, job.decoder.take(row, self._batch.last_seconds), batch_size=len(jobs))

    def _emit(self, job: _Job, round_: Round, batch_size: int) -> None:
        """Stream a round's text; end the request at a stop string, a cancel or the decoder's end."""
        assert job.decoder is not None and job.detok is not None and job.stops is not None
        job.stats.batch_size, job.stats.sharing = batch_size, len(self._serving)
        job.stats.peak_sharing = max(job.stats.peak_sharing, job.stats.sharing)
        pieces = [(job.detok.push(t), p.value) for t, p in zip(round_.tokens, round_.provenance)]
        job.out += round_.tokens
        delta, stopped = job.stops.push("".join(piece for piece, _ in pieces))
        self._put(job, Event("delta", delta, pieces, job.stats.snapshot(), list(round_.tokens)))
        if stopped:
            self._finish(job, "stop")
        elif job.cancel.is_set():
            self._finish(job, "cancelled")
        elif job.decoder.done:
            tail, stopped = job.stops.push(job.detok.flush())
            tail += "" if stopped else job.stops.flush()
            if tail:
                self._put(job, Event("delta", tail, [(tail, Provenance.TARGET.value)], job.stats.snapshot()))
            self._finish(job, "stop" if stopped else job.stats.finish_reason)

    def _finish(self, job: _Job, reason: str, error: str = "") -> None:
        """End a request: its batch row goes back to its own cache, its last event is sent."""
        if job.key in self._batch:
            self._batch.leave(job.key, write_back=not error)
        job.stats.finish_reason = reason
        self._serving.remove(job)
        self._clients.done(job.client)
        metrics = job.stats.snapshot()
        if error:
            self._put(job, Event("error", error=error, metrics=metrics, token_ids=job.out))
            return
        self.baseline.record(metrics)
        metrics["speedup_vs_ar"] = 1.0 if metrics["mode"] == "autoregressive" else self.baseline.speedup(metrics)
        self._put(job, Event("done", metrics=metrics, token_ids=job.out))

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
            self._finish(job, "error", error)

    def _put(self, job: _Job, event: Event) -> None:
        self._mark_progress()
        job.events.put(event)

    def _decode_config(self, request: Request, cancel: threading.Event) -> DecodeConfig:
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p, request.seed)
        mode = MODES[request.mode]
        return DecodeConfig(
            mode.drafter is not None,
            mode.k(request.k),
            request.max_new_tokens,
            sampling,
            self.stop_ids,
            cancelled=cancel.is_set,
            progress=self._mark_progress,
            pacing=self.pacing if mode.paced else None,
            fence_ids=self.fence_ids,
        )

    def _mark_progress(self) -> None:
        self._progress_at = time.monotonic()

    def reset(self) -> None:
        """Empty every session's KV caches (worker thread only)."""
        for session in self.sessions.sessions:
            session.reset()


def _stop_ids(ir_dir: Path, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    gen = ir_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


class Loading:
    """The engine while its models are prepared and loaded (in a thread), so that a server can
    listen at once. Until the engine is ready every request ends at once with the preparation's
    progress, and health says so; then everything goes to the engine.

    ``load`` builds the engine; ``modes`` are the modes to offer meanwhile. Progress is the last
    message logged under ``progress_logger`` (the preparation's own log)."""

    CONTEXT_WHILE_LOADING = 2048  # what a form may offer before the model's context is known

    def __init__(self, load: Callable[[], Engine], modes: Sequence[str], progress_logger: str = "specchat.prepare"):
        self.engine: Engine | None = None
        self.progress = "starting"
        self.failure: str | None = None
        self._modes = tuple(modes)
        self._load = load
        self._progress_log = logging.getLogger(progress_logger)
        self._listener = _LastMessage(self)
        self._progress_log.addHandler(self._listener)
        threading.Thread(target=self._run, name="engine-loader", daemon=True).start()

    def _run(self) -> None:
        try:
            self.engine = self._load()
        except EngineError as exc:
            self.failure = str(exc)
            log.error("the models could not be prepared: %s", exc)
        except Exception as exc:  # reported on the page and in the log; the server stays up
            self.failure = f"{type(exc).__name__} (the server log has the details)"
            log.exception("the models could not be loaded")
        finally:
            self._progress_log.removeHandler(self._listener)

    @property
    def state(self) -> str:
        if self.engine is not None:
            return self.engine.state
        return f"failed: {self.failure}" if self.failure else f"loading: {self.progress}"

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.healthy

    @property
    def pending(self) -> int:
        return self.engine.pending if self.engine is not None else 0

    @property
    def waiting(self) -> int:
        return self.engine.waiting if self.engine is not None else 0

    @property
    def full(self) -> bool:
        return self.engine is not None and self.engine.full

    @property
    def replicas(self) -> int:
        return self.engine.replicas if self.engine is not None else 0

    @property
    def modes(self) -> tuple[str, ...]:
        return self.engine.modes if self.engine is not None else self._modes

    @property
    def max_context(self) -> int:
        return self.engine.max_context if self.engine is not None else self.CONTEXT_WHILE_LOADING

    @property
    def models(self) -> dict[str, str]:
        return self.engine.models if self.engine is not None else {}

    def check(self, request: Request) -> list[int]:
        if self.engine is None:
            raise EngineError(self._not_ready())
        return self.engine.check(request)

    def generate(self, request: Request) -> Stream:
        if self.engine is None:
            return Stream.refused(self._not_ready(), request.mode)
        return self.engine.generate(request)

    def _not_ready(self) -> str:
        if self.failure:
            return f"the models could not be prepared: {self.failure}"
        return f"the models are still being prepared ({self.progress}); try again in a minute"


class _LastMessage(logging.Handler):
    def __init__(self, loading: Loading):
        super().__init__(logging.INFO)
        self.loading = loading

    def emit(self, record: logging.LogRecord) -> None:
        self.loading.progress = record.getMessage()
