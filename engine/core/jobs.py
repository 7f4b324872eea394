"""A request as the scheduler serves it (:class:`Job`): what it asked, where its events go, its
caches and decoder once started, its answer's text so far, and the room it holds of the memory
budget (:mod:`engine.core.cache_manager` reads it as a ``Holder``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.core.decoding import DecodeConfig, Decoder, Round
from engine.core.metrics import Stats
from engine.core.planning import Seat
from engine.core.requests import Request, Stream
from engine.core.sessions import Session
from engine.core.textstream import IncrementalDecoder, StopStrings


@dataclass(eq=False)
class Job:
    """A request the scheduler serves: what it asked, where its events go, how far it is."""

    request: Request
    prompt: list[int]
    stream: Stream  # where its events go; its reader may cancel it there
    stats: Stats
    release: Callable[[], None]  # uncounts it for its client (once, whoever is first: see ClientLedger.admit)
    most: int  # the most tokens its caches can hold: its prompt and whole answer, within the context
    session: Session | None = None
    decoder: Decoder | None = None
    prefill: Iterator[int] | None = None  # the prompt's remaining passes (tokens read after each); None once read
    detok: IncrementalDecoder | None = None
    stops: StopStrings | None = None
    out: list[int] = field(default_factory=list)
    side_s: float = 0.0  # seconds of the worker it had to itself while others generated
    spoken: tuple[tuple[int, int], ...] = ()  # the prompt's answers (chat.Prompt.spoken)
    reserved: int = 0  # tokens of cache the memory budget holds for it (engine.core.cache_manager)
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

    @property
    def context(self) -> int:
        """Tokens of its conversation so far: its prompt and what it has answered."""
        return len(self.decoder.context) if self.decoder is not None else len(self.prompt)

    @property
    def answering(self) -> bool:
        return self.stats.new_tokens > 0

    @property
    def generating(self) -> bool:
        """Its prompt read and its first round run."""
        return self.prefill is None and self.stats.rounds > 0

    def seat(self, batched: bool) -> Seat:
        """What the planner is told of it (``batched``: it holds a row of the batch)."""
        reading = self.prefill is not None
        return Seat(self.key, self.client, reading, self.unread, self.stats.rounds, self.context, batched, self.side_s)

    def begin(self, session: Session, config: DecodeConfig, tokenizer: Any) -> None:
        """Decode on ``session``'s caches: its drafter for the request's mode, the prompt's passes
        to read, the answer's text to stream."""
        self.session = session
        drafter = session.drafters.get(self.request.mode)
        self.decoder = Decoder(session.target, drafter, self.prompt, config, self.stats)
        self.prefill = self.decoder.prefill()
        self.detok = IncrementalDecoder(tokenizer, self.request.answer_ids)
        self.stops = StopStrings(self.request.stop_strings)

    def stop_decoding(self) -> None:
        """Free its caches and forget its decoder (it goes back in line, to begin again)."""
        if self.session is not None:
            self.session.release()
        self.session = self.decoder = self.prefill = self.detok = self.stops = None

    def text(self, round_: Round) -> tuple[list[tuple[str, str]], str, bool]:
        """A round's tokens as text: each token's piece with its provenance, the text to stream
        (up to a stop string), and whether a stop string ended the answer."""
        assert self.detok is not None and self.stops is not None
        pieces = [(self.detok.push(t), p.value) for t, p in zip(round_.tokens, round_.provenance)]
        self.out += round_.tokens
        delta, stopped = self.stops.push("".join(piece for piece, _ in pieces))
        return pieces, delta, stopped

    def rest(self, note: str = "") -> tuple[str, bool]:
        """The text still held back once the answer stops (a partial character, a possible stop
        string's start), then ``note``; and whether a stop string ended it."""
        assert self.detok is not None and self.stops is not None
        tail, stopped = self.stops.push(self.detok.flush())
        return tail + ("" if stopped else self.stops.flush() + note), stopped
