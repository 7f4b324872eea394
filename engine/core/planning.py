"""What each iteration of the scheduler's worker does, decided before any of it runs (as vLLM's
``SchedulerOutput``): from a snapshot of the requests served (:class:`Seat`), a :class:`Plan`
names one first round, or the shared work (one batched pass, or a round of each request alone)
and the side work that may follow it in its clients' share of the time. A function of the
snapshot alone, so tests check the scheduler's choices without a model; the scheduler runs the
plan (:meth:`engine.core.scheduler.Scheduler._iterate`) and applies each round to its request.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.decoding import PREFILL_CHUNK

# A batched pass's attention runs over its widest row (the others padded): a row joins only while
# the batch stays within twice its shortest row plus this many tokens; a longer one runs alone, in
# its share of the time, so one long conversation does not make everyone's steps as slow as its own.
BATCH_SPREAD = 512


@dataclass(frozen=True)
class Seat:
    """What the planner knows of a request served."""

    key: int
    client: str
    reading: bool  # its prompt's passes are not all run
    unread: int  # prompt tokens not yet in the target's cache
    rounds: int  # rounds generated so far
    context: int  # its conversation's tokens: its batch row's width
    batched: bool = False  # holds a row of the batch
    side_s: float = 0.0  # seconds of the worker it had to itself while others generated

    @property
    def first_due(self) -> bool:
        """Whether its first round is due: what is left of its prompt takes a chunk or less."""
        return self.rounds == 0 and (not self.reading or self.unread <= PREFILL_CHUNK)


@dataclass(frozen=True)
class Plan:
    """One iteration's work, by the requests' keys."""

    first: int | None = None  # a first round (the rest of its prompt, then its round): nothing else runs
    together: tuple[int, ...] = ()  # one batched pass over these rows
    alone: tuple[int, ...] = ()  # shared work where none batch: a round of each on its own caches
    side: tuple[int, ...] = ()  # side work, least served first: a slice of a prompt, or a lone round


def plan(
    seats: Sequence[Seat],
    firsts_in_a_row: int,
    max_batch: int,
    fits: Callable[[Sequence[Seat]], bool],
    batching: bool = True,
) -> Plan:
    """The next iteration. A first round due comes first, so a user has a token as soon as the
    prompt is read, not after every prompt that arrived with it: the next is that of the client
    with the fewest requests already answering (a client with one answering waits for every other
    client's first token), the shortest read among them (a burst's users wait least in all); at
    most ``max_batch`` in a row (``firsts_in_a_row``), so a stream of arrivals does not hold the
    others back. Else the shared work: one batched pass of the requests that generate together
    (from their second round, the shortest first, within :data:`BATCH_SPREAD`, ``max_batch`` and
    what ``fits`` the memory budget padded to the widest), or, where none batch (or not
    ``batching``), a round of each.
    Then side work: the prompts still being read, and the rows that do not batch."""
    due = [s for s in seats if s.first_due]
    if due and firsts_in_a_row < max_batch:
        answering = collections.Counter(s.client for s in seats if s.rounds > 0)
        return Plan(first=min(due, key=lambda s: (answering[s.client], s.unread)).key)
    generating = [s for s in seats if not s.reading]
    going = [s for s in generating if s.rounds > 0]
    together = _batchable(going, max_batch, fits) if batching and len(generating) > 1 else []
    # (while others start beside it, a lone row of the batch stays in it: alone, it would leave
    # and its draft re-read the conversation, only to join again at the next iteration)
    if len(together) == 1 and not (due and together[0].batched):
        together = []
    apart = [s for s in going if s not in together]
    side = (apart if together else []) + [s for s in seats if s.reading]
    return Plan(
        together=tuple(s.key for s in together),
        alone=() if together else tuple(s.key for s in apart),
        side=tuple(s.key for s in sorted(side, key=lambda s: s.side_s)),
    )


def _batchable(going: Sequence[Seat], max_batch: int, fits: Callable[[Sequence[Seat]], bool]) -> list[Seat]:
    """The requests whose rows batch: the shortest first, while the widest stays within twice
    the shortest plus :data:`BATCH_SPREAD`, at most ``max_batch``, while they ``fit`` together. A
    row a thousand times longer than the others would otherwise make each of them that long, in
    memory and in time."""
    chosen: list[Seat] = []
    for seat in sorted(going, key=lambda s: s.context):
        if (chosen and seat.context > 2 * chosen[0].context + BATCH_SPREAD) or len(chosen) == max_batch:
            break
        if not fits([*chosen, seat]):
            break
        chosen.append(seat)
    return chosen
