"""The memory policy (engine.core.cache_manager) as data, without a model: what a newcomer reserves,
how a growing answer finds room (idle caches, then newcomers held back, then its next rounds only,
else it ends), and which rows batch. tests/test_memory.py serves the same cases on a tiny model."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from engine.core.budget import ANSWER_BLOCK, HEADROOM, RESIDENT_PER_CACHED_BYTE, MemoryBudget
from engine.core.cache_manager import ROUND_ROOM, CacheManager
from engine.core.planning import Seat

PER_TOKEN = 100  # bytes of cache entries per token
MOST = 10_000  # what a request's caches could hold at most (no cap on its answer)


def budget(tokens: int) -> MemoryBudget:
    """A budget whose room holds ``tokens`` tokens of caches."""
    per_token = int(PER_TOKEN * RESIDENT_PER_CACHED_BYTE)
    return MemoryBudget(limit=HEADROOM + tokens * per_token, base=0, per_token=per_token)


@dataclass(eq=False)
class Conversation:
    """A session's caches, holding ``conversation``'s tokens (released: none)."""

    conversation: list[int]

    @property
    def target(self) -> SimpleNamespace:
        return SimpleNamespace(tokens=self.conversation)

    @property
    def kv_cache_bytes(self) -> int:
        return len(self.conversation) * PER_TOKEN

    def release(self) -> None:
        self.conversation = []


@dataclass
class Sessions:
    """The pool's answers the manager uses: least recently used first."""

    sessions: list[Conversation]

    def continued(self, prompt: list[int], busy: list) -> Conversation | None:
        return next(
            (s for s in self.sessions if s.conversation and prompt[: len(s.conversation)] == s.conversation), None
        )

    def idle(self, busy: list) -> list[Conversation]:
        return [s for s in self.sessions if s.conversation and not any(s is b for b in busy)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(s.kv_cache_bytes for s in self.sessions)


@dataclass(eq=False)
class Request:
    """A request served, as the manager reads it."""

    prompt: list[int]
    session: Conversation | None = None
    reserved: int = 0
    most: int = MOST
    written: int = 0  # answer tokens so far
    rounds: int = 0

    @property
    def key(self) -> int:
        return id(self)

    @property
    def context(self) -> int:
        return len(self.prompt) + self.written

    @property
    def answering(self) -> bool:
        return self.written > 0

    @property
    def generating(self) -> bool:
        return self.rounds > 0


@dataclass
class Room:
    """A manager over ``sessions`` within a room of ``tokens``, and the requests it serves."""

    tokens: int
    sessions: list[Conversation] = field(default_factory=list)
    serving: list[Request] = field(default_factory=list)
    held_back: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        batch = SimpleNamespace(rows=[], kv_cache_bytes=0)
        self.manager = CacheManager(budget(self.tokens), Sessions(self.sessions), batch, PER_TOKEN)  # type: ignore[arg-type]

    def hold_back(self, request: Request) -> None:
        self.serving.remove(request)
        self.held_back.append(request)

    def grow(self, request: Request) -> bool:
        return self.manager.grow(request, self.serving, self.hold_back)


def test_a_newcomer_reserves_its_prompt_and_a_block_once_idle_caches_go_least_recent_first_but_its_own():
    own, older, newer = (
        Conversation(list(range(start, start + n))) for start, n in ((0, 400), (1000, 200), (2000, 200))
    )
    room = Room(1200, [own, older, newer], [Request(list(range(20)), reserved=40)])
    newcomer = Request(list(range(300 + 400)))  # continues its own conversation, the least recent
    assert room.manager.admit(newcomer, room.serving)  # (800 held, 556 more and the other's 40: 1,396)
    assert newcomer.reserved == 700 + ANSWER_BLOCK
    assert own.conversation and not older.conversation and newer.conversation


def test_a_newcomer_waits_while_others_reservations_fill_the_room_and_alone_it_starts():
    room = Room(1000)
    room.serving.append(Request(list(range(500)), reserved=800))
    newcomer = Request(list(range(300)))
    assert not room.manager.admit(newcomer, room.serving) and newcomer.reserved == 0
    assert room.manager.admit(newcomer, [])  # (the engine refused what could not fit even alone)
    assert newcomer.reserved == 300 + ANSWER_BLOCK


def test_an_answer_nearing_its_reservation_grows_by_a_block_taking_idle_caches_first():
    idle = Conversation(list(range(5000, 5600)))
    room = Room(1000, [idle])
    answering = Request(list(range(300)), reserved=300 + ROUND_ROOM - 1, written=1)
    room.serving.append(answering)
    assert room.grow(answering) and answering.reserved == 301 + ANSWER_BLOCK
    assert not idle.conversation and not room.held_back
    answering.reserved = 400  # far from its end: nothing to do
    assert room.grow(answering) and answering.reserved == 400


def test_then_the_largest_newcomers_are_held_back_then_it_takes_its_next_rounds_then_it_ends():
    answering = Request(list(range(300)), reserved=310, written=10)
    small, large = Request(list(range(100)), reserved=150), Request(list(range(200)), reserved=250)
    room = Room(310 + ANSWER_BLOCK + 150, serving=[answering, small, large])
    assert room.grow(answering) and room.held_back == [large] and large.reserved == 0
    assert answering.reserved == 310 + ANSWER_BLOCK

    tight = Room(310 + ROUND_ROOM)  # no one to hold back: room for its next rounds only
    tight.serving.append(answering := Request(list(range(300)), reserved=310, written=10))
    assert tight.grow(answering) and answering.reserved == 310 + ROUND_ROOM

    full = Room(320)  # not even those: its answer ends, its reservation as it was
    full.serving.append(answering := Request(list(range(300)), reserved=310, written=10))
    assert not full.grow(answering) and answering.reserved == 310


def test_rows_batch_only_where_they_fit_padded_to_the_longest():
    room = Room(1000)
    fits = room.manager.rows_fit([])
    assert fits([Seat(1, "a", False, 0, 1, 450), Seat(2, "b", False, 0, 1, 450)])
    assert not fits([Seat(1, "a", False, 0, 1, 100), Seat(2, "b", False, 0, 1, 600)])  # two rows of 600
    reading = Request(list(range(300)), session=Conversation(list(range(300))), reserved=400)
    assert not room.manager.rows_fit([reading])([Seat(1, "a", False, 0, 1, 450)] * 2)  # beside what it holds
