"""Session affinity: a conversation's turns go to the replica that holds its KV caches.

A Ray Serve request router (it runs in the process that holds the deployment handle, the
ingress). A request's affinity key (:func:`engine.cluster.remote.affinity_key`, the same for
every turn of a conversation) goes first to the replica that served it last; a key seen for the
first time, or whose replica is gone, goes to the replica that rendezvous hashing picks among
the live ones (so that two ingress processes agree without talking). The other replicas follow
in hashing order: Ray takes the next where the first is full, and backs off between attempts
when all are. Requests without a key go to whichever replica Ray finds least loaded.
Remembering where each key went keeps conversations where they are when a replica is added or
replaced; hashing alone would move half of them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

AFFINITY = "affinity"  # the keyword argument of ``generate`` that carries the key
REMEMBERED = 4096  # keys whose replica is remembered, the least recently used dropped first


def rendezvous(key: str, replica: str) -> int:
    """The replica's weight for ``key``: the heaviest live replica takes the key."""
    return int.from_bytes(hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest(), "big")


def affinity_of(request: PendingRequest | None) -> str | None:
    return request.kwargs.get(AFFINITY) if request is not None else None


class AffinityRouter(RequestRouter):
    """(Not FIFO: a replica chosen for one request must go to that request, not to the oldest
    pending one, or a conversation would land on another's replica.)"""

    def initialize_state(self, **kwargs: Any) -> None:
        self._homes: OrderedDict[str, str] = OrderedDict()  # key -> the replica that served it last

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every candidate is ranked already
        key = affinity_of(pending_request)
        if key is None:
            return [candidate_replicas]  # Ray probes their queues and takes the least loaded
        home = self._homes.get(key)
        ranked = sorted(
            candidate_replicas,
            key=lambda r: (r.replica_id.unique_id != home, -rendezvous(key, r.replica_id.unique_id)),
        )
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        if (key := affinity_of(pending_request)) is not None:
            self._homes[key] = replica_id.unique_id
            self._homes.move_to_end(key)
            while len(self._homes) > REMEMBERED:
                self._homes.popitem(last=False)
