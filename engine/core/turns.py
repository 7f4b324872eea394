"""Fair turns between clients: who waits for the engine, and in what order they start.

Every request names its client (a browser session or a logged-in user, an API key or a caller's
address; "" for a caller inside the process, which no limit applies to). Waiting requests queue in
one line per client, and the engine takes the lines in turn,
one request each (round-robin), so a client with twenty requests waiting delays another client's
first one by one request, not twenty. Per-client limits bound what one client may hold: requests
running at once and requests waiting or running; one over the second is refused at once
(:class:`ClientBusy`, a 429 with ``Retry-After`` on the API).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.errors import EngineError

T = TypeVar("T")
RETRY_AFTER_S = 5
# Requests waiting or running in all past which a client that already has one is refused (a client
# with none is always taken: others' load never refuses its first request).
QUEUE_CAP = 16


class ClientBusy(EngineError):
    """A client asked for more than its share: it may try again after :data:`RETRY_AFTER_S`."""

    retry_after = RETRY_AFTER_S


# How a client is named, by where it asks from. A browser session and a caller's address are
# strangers on a shared server: nothing says who they are. A logged-in user and an API key are known.
PAGE, USER, KEY, ADDRESS = "page:", "user:", "key:", "ip:"


def stranger(client: str) -> bool:
    """Whether ``client`` is anonymous: a browser session without a login, or an API caller
    without a key (known only by their address)."""
    return client.startswith((PAGE, ADDRESS))


@dataclass(frozen=True)
class ClientLimits:
    """What one client may hold (0: no limit): requests running at once, and requests waiting or
    running; and, for a stranger (:func:`stranger`), the longest conversation and the longest
    answer. A local server for one person sets none; a shared link sets them all."""

    running: int = 0
    pending: int = 0
    stranger_input_tokens: int = 0
    stranger_answer_tokens: int = 0

    def input_cap(self, client: str) -> int:
        """The longest conversation ``client`` may send, in tokens (0: the server's own cap)."""
        return self.stranger_input_tokens if stranger(client) else 0

    def answer_cap(self, client: str, asked: int | None, context: int) -> int | None:
        """The answer length ``client`` gets for ``asked`` tokens (None: no cap). A cap of the
        limits' own stays within the model's ``context``: a caller is refused only for what it asked."""
        cap = min(self.stranger_answer_tokens, context) if stranger(client) else 0
        if not cap:
            return asked
        return cap if asked is None else min(asked, cap)

    def describe(self) -> str:
        """The limits, for a page's visitors ("" where there are none)."""
        each = [f"{self.running} answers at once" if self.running else ""]
        each.append(f"{self.pending} waiting or running" if self.pending else "")
        strangers = [f"messages up to {self.stranger_input_tokens:,} tokens" if self.stranger_input_tokens else ""]
        strangers.append(f"answers up to {self.stranger_answer_tokens:,} tokens" if self.stranger_answer_tokens else "")
        said = [" and ".join(s for s in each if s), " and ".join(s for s in strangers if s)]
        if said[1]:
            said[1] = f"without a login, {said[1]}"
        return "; ".join(s for s in said if s)


NO_LIMITS = ClientLimits()
# A shared link's: two requests at once per client (two tabs of one browser), four waiting or
# running; a stranger's conversation up to 4,096 tokens and answers up to 1,024 tokens, so no
# stranger holds the engine for long (docs/design.md, "Hardening").
PUBLIC_LIMITS = ClientLimits(running=2, pending=4, stranger_input_tokens=4096, stranger_answer_tokens=1024)


class ClientLedger:
    """How many requests each client has waiting or running (thread-safe): the callers' threads
    add, the engine's worker removes. ``queue_cap``: requests in all past which a client that
    already has one is refused (:data:`QUEUE_CAP`)."""

    def __init__(self, limits: ClientLimits, queue_cap: int = QUEUE_CAP):
        self.limits = limits
        self.queue_cap = queue_cap
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()

    def admit(self, client: str) -> Callable[[], None]:
        """Count a new request of ``client``, or refuse it where the client holds its limit, or
        holds any while the server holds :attr:`queue_cap` in all; what uncounts it, once,
        whoever calls it first: the engine when it ends, or the stream when its reader goes away
        (the engine ends it at its next round; the client may ask again now, and the count in
        all no longer holds it)."""
        with self._lock:
            held, total = self._pending[client], sum(self._pending.values())
            if client and self.limits.pending and held >= self.limits.pending:
                raise ClientBusy(
                    f"you already have {held} requests waiting or running, the most this server "
                    f"takes from one client; try again when one has finished"
                )
            if client and held and total >= self.queue_cap:
                raise ClientBusy(f"{total} requests are waiting or running on this server; try again shortly")
            self._pending[client] += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
            self.done(client)

        return release

    def done(self, client: str) -> None:
        with self._lock:
            self._pending[client] -= 1
            if self._pending[client] <= 0:
                del self._pending[client]


class FairQueue(Generic[T]):
    """Waiting items in one line per client, taken round-robin (worker thread only)."""

    def __init__(self, client_of: Callable[[T], str]):
        self._client_of = client_of
        self._lines: dict[str, deque[T]] = {}  # in turn order: the next client first
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def put(self, item: T) -> None:
        self._lines.setdefault(self._client_of(item), deque()).append(item)
        self.size += 1

    def put_back(self, item: T) -> None:
        """Return ``item`` to the head of its line, its client first in turn (it could not start)."""
        client = self._client_of(item)
        line = self._lines.pop(client, deque())
        line.appendleft(item)
        self._lines = {client: line, **self._lines}
        self.size += 1

    def drop(self, unwanted: Callable[[T], bool]) -> list[T]:
        """Remove and return every waiting item that is ``unwanted`` (a request cancelled while it
        waited: its client's count must not wait for its turn to fall)."""
        dropped = [item for line in self._lines.values() for item in line if unwanted(item)]
        if dropped:
            lines = {client: deque(i for i in line if not unwanted(i)) for client, line in self._lines.items()}
            self._lines = {client: line for client, line in lines.items() if line}
            self.size -= len(dropped)
        return dropped

    def take(self, eligible: Callable[[str], bool] = lambda client: True) -> T | None:
        """The head of the next eligible client's line; that client goes to the end of the turn."""
        for client in self._lines:
            if eligible(client):
                line = self._lines.pop(client)
                item = line.popleft()
                if line:
                    self._lines[client] = line
                self.size -= 1
                return item
        return None


class TimeShare:
    """The worker's time between the work every generating client shares (one batched step, or
    each one's round when none batch) and side work that serves one client while the others
    wait: a slice of a long prompt's reading, the round of a row too long to batch. With ``n``
    clients in the shared work, side work (all of it) gets ``1 / (n + 1)`` of the time: what one
    more client among equals would get, however many strangers paste at once. Credit is earned
    by shared work and spent by side work; a piece of side work starts while there is credit, and
    may overrun it (the debt is paid by the next shared work)."""

    def __init__(self, most_s: float):
        self.most_s = most_s  # credit saved at most: side work never comes in a burst
        self.credit = 0.0

    def earn(self, seconds: float, sharing: int) -> None:
        """Shared work of ``seconds`` for ``sharing`` clients."""
        if sharing:
            self.credit = min(self.most_s, self.credit + seconds / sharing)

    def settle(self) -> None:
        """No shared work: side work runs freely, and owes nothing later."""
        self.credit = 0.0

    def allows(self) -> bool:
        return self.credit > 0

    def spend(self, seconds: float) -> None:
        self.credit -= seconds
