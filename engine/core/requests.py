"""What a caller sends the engine and what it gets back: a :class:`Request`, with the limits on
its fields and the checks that refuse what the engine must never see, and the :class:`Stream` of
its :class:`Event` objects.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from engine.core.chat import Message, check_messages
from engine.core.metrics import ModeName, Stats
from engine.core.window import Overflow
from engine.errors import EngineError

# Each setting's default, the one the API, the UI and a Request built in code all start from: the
# fastest exact mode, greedy (docs/design.md, "The drafters").
DEFAULT_MODE = ModeName.BEST
DEFAULT_K = 4  # the draft length of a mode that takes one (best has its own)
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS: int | None = None  # no cap: until the model stops, within its context
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256
MAX_K = 16
# Seconds a request may go without progress (a round, a prefill chunk) before its stream fails
# and the engine reports itself unhealthy.
STEP_TIMEOUT = 120.0


@dataclass(frozen=True)
class Request:
    """One generation: a chat (its messages) or raw prompt token ids.

    ``answer_ids``: the token ids of an answer cut short (by its cap, or a Stop) to the last
    message of ``messages``: the request continues that answer from where it stopped, its
    tokens exactly as generated (re-tokenized text could split differently)."""

    messages: tuple[Message, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    answer_ids: tuple[int, ...] = ()
    mode: str = DEFAULT_MODE
    k: int = DEFAULT_K
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    reuse_cache: bool = True  # False: start both KV caches empty (fair benchmarks)
    client: str = ""  # who asks (a browser session, an API key or address): turns and limits are per client
    pooled: bool = True  # False: neither drafts from nor adds to the client's n-gram pool (Compare's runs)
    context_overflow: str | None = None  # past the input cap (engine.core.window.Overflow); None: the server's

    def check(self, modes: Sequence[str], max_context: int) -> None:
        """Refuse what the engine must never see: unknown modes, numbers out of range or not
        finite (NaN passes every range check of a form), malformed messages."""
        if self.mode not in modes:
            raise EngineError(f"unknown mode '{self.mode}': choose one of {', '.join(modes)}")
        _in_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _in_range("top_k", self.top_k, 0, max_context, integer=True)
        _in_range("k", self.k, 1, MAX_K, integer=True)
        if self.max_new_tokens is not None:
            _in_range("max_new_tokens", self.max_new_tokens, 1, max_context, integer=True)
        if self.seed is not None:
            _in_range("seed", self.seed, 0, 2**63 - 1, integer=True)
        if len(self.stop_strings) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and len(s) <= MAX_STOP_LENGTH for s in self.stop_strings
        ):
            raise EngineError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
        if self.context_overflow is not None and self.context_overflow not in tuple(Overflow):
            choices = ", ".join(Overflow)
            raise EngineError(f"context_overflow must be one of {choices}; got {self.context_overflow!r:.40}")
        check_messages(self.messages)
        if self.answer_ids and not self.messages:
            raise EngineError("answer_ids continue an answer to messages: send the messages too")

    def tokens_at_most(self, prompt_tokens: int, max_context: int) -> int:
        """The most tokens this request's caches can hold: its prompt and its whole answer (the
        context bounds an answer without a cap)."""
        if self.max_new_tokens is None:
            return max_context
        return min(prompt_tokens + self.max_new_tokens, max_context)


def _in_range(name: str, value: object, low: float, high: float, integer: bool = False, low_open: bool = False) -> None:
    """A number from ``low`` to ``high`` (``low`` itself excluded when ``low_open``); with
    ``integer`` it must be an int (a float would reach numpy and the sampler as a float)."""
    number = int if integer else int | float
    if isinstance(value, number) and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value)):
        above = value > low if low_open else value >= low
        if above and value <= high:
            return
    kind = "a whole number" if integer else "a number"
    raise EngineError(
        f"{name} must be {kind} from {low:g} to {high:g}{' (not 0)' if low_open else ''}; got {value!r:.40}"
    )


class EventKind(StrEnum):
    """What an :class:`Event` says."""

    PROGRESS = "progress"  # a long prompt is being read: its metrics say how far (prompt_read of prompt_tokens)
    DELTA = "delta"  # a round's text
    DONE = "done"  # the last event: the answer ended (metrics' finish_reason says why)
    ERROR = "error"  # the last event: the request failed or was refused (error says why)
    ACCEPTED = "accepted"  # a cluster replica took the request (engine.cluster), before any work


@dataclass
class Event:
    """One step of a request's stream: its kind, and what that kind carries (a delta its text and
    pieces, every event its metrics so far); a last event ``done`` (or ``error``) carries the final
    metrics and every token of the answer."""

    kind: EventKind
    text: str = ""
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, provenance) per token
    metrics: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # a delta's round; every token of the answer at the end
    error: str = ""

    @property
    def final(self) -> bool:
        return self.kind in (EventKind.DONE, EventKind.ERROR)


class Stream:
    """The events of one request, in order, ending with a ``done`` or ``error`` event.

    ``cancel()`` asks the engine to stop after the current round (or prefill chunk); the stream
    still ends with its final event (finish reason ``cancelled``). ``close()`` cancels and stops
    reading. A stream whose engine is unhealthy (no progress on any request for
    ``step_timeout`` seconds) ends with an error event instead of waiting forever; waiting
    behind other requests that do progress is not a failure."""

    def __init__(
        self, step_timeout: float, healthy: Callable[[], bool], on_close: Callable[[], None] = lambda: None
    ) -> None:
        self._events: queue.Queue[Event] = queue.Queue()
        self._on_close = on_close  # its reader went away: the request no longer counts for its client
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
        stream.put(Event(EventKind.ERROR, error=error, metrics=Stats(mode).snapshot()))
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
            event = Event(
                EventKind.ERROR, error=f"the engine did not answer within {self.step_timeout:g} s; try again later"
            )
        self._ended = event.final
        return event

    @property
    def ended(self) -> bool:
        """Its last event read, or closed."""
        return self._ended

    def cancel(self) -> None:
        self._cancel.set()

    # -- the engine's side ------------------------------------------------------------------
    def put(self, event: Event) -> None:
        """Deliver ``event`` to the reader (the engine's worker calls this)."""
        self._events.put(event)

    @property
    def cancelled(self) -> bool:
        """Whether the reader asked to stop (:meth:`cancel`, :meth:`close`)."""
        return self._cancel.is_set()

    def close(self) -> None:
        self.cancel()
        self._ended = True
        self._on_close()
