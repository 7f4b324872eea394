"""The memory budget applied to the requests served, beside the scheduler as vLLM's KVCacheManager
is beside its: what each request reserves of the room for KV caches, growing as its answer does,
and which caches go when the room runs short (docs/design.md, "Memory").

A request is admitted with room for its prompt and the next block of its answer
(:meth:`MemoryBudget.reservation`) where that fits beside what the others hold and have reserved,
once idle conversations' caches are dropped, least recently used first. As an answer nears the end
of its reservation, the reservation grows by a block; where the room cannot hold it, idle caches
go first, then the requests not yet answering are held back (largest first: the scheduler puts
them back in line, their caches freed), then the answer takes only what its next rounds need, and
last it ends (with :data:`OUT_OF_MEMORY`). A batch's rows are padded to the longest, so rows batch
only where the padded rows fit. The scheduler asks and acts on the requests; this module decides,
and drops idle caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from engine.core.batch import Batch, OwnBatch
from engine.core.budget import MemoryBudget
from engine.core.planning import Seat
from engine.core.sessions import Session, SessionPool

# A request's reservation grows once fewer than this many of its tokens are left: more than any
# round adds (MAX_K + 1, or a lookup copy's span + 1).
ROUND_ROOM = 64
# What an answer that the memory budget could hold no longer ends with.
OUT_OF_MEMORY = (
    "\n\n*(The answer stops here: the server's memory ran out. Ask again when fewer people are chatting, "
    "or start the server with a larger --memory-limit.)*"
)


class Holder(Protocol):
    """A request served, as the cache manager reads it (the scheduler's jobs)."""

    prompt: list[int]
    session: Session | None  # its conversation's caches, once started
    reserved: int  # tokens of cache the room holds for it
    most: int  # the most tokens its caches can hold: its prompt and whole answer, within the context

    @property
    def key(self) -> int:
        """What names it (its batch row's key)."""

    @property
    def context(self) -> int:
        """Tokens of its conversation so far: its prompt and what it has answered."""

    @property
    def answering(self) -> bool:
        """Whether it has written any of its answer."""

    @property
    def generating(self) -> bool:
        """Whether it has read its prompt and run its first round."""


H = TypeVar("H", bound=Holder)


class CacheManager:
    """Reservations of the requests served within ``budget``; ``sessions`` and ``batch`` hold the
    caches (the conversations' and the batched rows'), ``per_token``: the target's cache bytes per
    token (what a batched row holds)."""

    def __init__(self, budget: MemoryBudget, sessions: SessionPool, batch: Batch | OwnBatch, per_token: int) -> None:
        self.budget = budget
        self.sessions = sessions
        self.batch = batch
        self.per_token = per_token

    def admit(self, job: Holder, serving: Sequence[Holder]) -> bool:
        """Reserve ``job``'s prompt and a block of its answer, where that fits beside what
        ``serving`` hold and have reserved once idle conversations' caches are dropped (never the
        one it continues), or where it would be served alone; whether it is admitted."""
        first = self.budget.reservation(len(job.prompt), job.most)
        keep = self.sessions.continued(job.prompt, self._busy(serving))
        need = self.budget.bytes_for(first) - (self.budget.bytes_held(keep.kv_cache_bytes) if keep else 0)
        fits = self._evict_idle_until(lambda: self._committed(serving) + need <= self.budget.room, serving, keep)
        admitted = fits or not serving  # (alone it fits: the engine refused what does not)
        if admitted:
            job.reserved = first
        return admitted

    def grow(self, job: H, serving: Sequence[H], hold_back: Callable[[H], None]) -> bool:
        """Grow ``job``'s reservation by a block where its answer nears its end; where the room
        cannot hold it, drop idle caches, then ``hold_back`` (which takes a request out of
        ``serving``, its caches freed) the requests not yet answering, largest first, then reserve
        what its next rounds need. Whether the room holds it (False: its answer must end)."""
        least = min(job.most, job.context + ROUND_ROOM)
        if job.reserved >= least:
            return True
        before, job.reserved = job.reserved, self.budget.reservation(job.context, job.most)
        if self._evict_idle_until(lambda: self._within_room(serving), serving):
            return True
        newcomers = [j for j in serving if j is not job and not j.answering and j.reserved]
        for newcomer in sorted(newcomers, key=lambda j: j.reserved, reverse=True):
            hold_back(newcomer)
            newcomer.reserved = 0
            if self._within_room(serving):
                return True
        job.reserved = least
        if self._within_room(serving):
            return True
        job.reserved = before
        return False

    def rows_fit(self, serving: Sequence[Holder]) -> Callable[[Sequence[Seat]], bool]:
        """Whether rows fit the budget together, each padded to the widest, beside what the
        requests not generating hold and have reserved; idle conversations' caches count as free
        (:meth:`make_room_for_rows` drops them)."""
        others = [j for j in serving if not j.generating]
        held = sum(j.session.kv_cache_bytes for j in others if j.session is not None)
        room = self.budget.room - self.budget.bytes_held(held) - self._ahead(others)
        return lambda rows: len(rows) * self.budget.bytes_held(max(r.context for r in rows) * self.per_token) <= room

    def make_room_for_rows(self, jobs: Sequence[Holder], serving: Sequence[Holder]) -> None:
        """Drop idle conversations' caches until ``jobs``' rows, padded to the longest, fit beside
        the other caches (the rows' own caches are freed as they join the batch)."""
        rows = self.budget.bytes_held(len(jobs) * max(j.context for j in jobs) * self.per_token)

        def room_for_rows() -> bool:
            homes = [j.session for j in jobs]
            held = sum(s.kv_cache_bytes for s in self.sessions.sessions if not any(s is h for h in homes))
            return self.budget.bytes_held(held) + rows <= self.budget.room

        self._evict_idle_until(room_for_rows, serving)

    def _within_room(self, serving: Sequence[Holder]) -> bool:
        return self._committed(serving) <= self.budget.room

    def _committed(self, serving: Sequence[Holder]) -> int:
        """Bytes of the room in use or reserved: every cache as held (the conversations' and the
        batch's rows, padded to the longest), and what ``serving`` have reserved beyond it."""
        cached = self.sessions.kv_cache_bytes + self.batch.kv_cache_bytes
        return self.budget.bytes_held(cached) + self._ahead(serving)

    def _ahead(self, jobs: Sequence[Holder]) -> int:
        """Bytes ``jobs`` have reserved beyond what their caches hold now."""
        return self.budget.bytes_for(sum(max(0, job.reserved - self._tokens_held(job)) for job in jobs))

    def _tokens_held(self, job: Holder) -> int:
        """Tokens ``job``'s target cache holds now: its batch row's, or its own cache's."""
        row = next((row for row in self.batch.rows if row.key == job.key), None)
        if row is not None:
            return len(row.tokens)
        return len(job.session.target.tokens) if job.session is not None else 0

    @staticmethod
    def _busy(serving: Sequence[Holder]) -> list[Session]:
        return [j.session for j in serving if j.session is not None]

    def _evict_idle_until(
        self, fits: Callable[[], bool], serving: Sequence[Holder], keep: Session | None = None
    ) -> bool:
        """Drop idle conversations' caches, least recently used first (never ``keep``), until
        ``fits()``; whether it does."""
        idle = [s for s in self.sessions.idle(self._busy(serving)) if s is not keep]
        while not fits() and idle:
            idle.pop(0).release()
        return fits()
