"""The engine as the app and the API see it (``generate``, ``check``, ``modes``, health...), served
by the replicas of a Ray Serve deployment: what the ingress holds instead of an engine.

Every request carries its conversation's affinity key, so that its turns reach the replica
holding their KV caches (:mod:`engine.cluster.router`). A replica that dies before a request's
first token is shown is replaced by another, unseen; one that dies mid-answer ends that answer
with :data:`REPLICA_LOST`, and the conversation's next turn is prefilled on a live replica.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import weakref
from typing import cast

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from engine.cluster import REPLICA_LOST
from engine.cluster.router import AFFINITY
from engine.core.service import STEP_TIMEOUT, Event, Request, Stream
from engine.errors import EngineError

# A request whose replica is gone before its first event is sent again, this many times at most.
ATTEMPTS = 3
RETRY_S = 1.0
# The replicas are asked how they are this often; none answering for HEALTHY_WITHIN_S is unhealthy.
PROBE_S, HEALTHY_WITHIN_S = 2.0, 15.0
GONE = (RayActorError, ReplicaUnavailableError)
log = logging.getLogger("specchat.cluster")


def affinity_key(request: Request) -> str | None:
    """The same for every turn of one conversation: its opening (the system prompt and the first
    user message), or its first prompt tokens. None for a request that wants fresh caches."""
    if not request.reuse_cache:
        return None
    if request.prompt_ids:
        opening = json.dumps(request.prompt_ids[:64])
    else:
        first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), 0)
        opening = json.dumps(request.messages[: first_user + 1], sort_keys=True)
    return hashlib.blake2b(opening.encode(), digest_size=12).hexdigest()


class RemoteStream(Stream):
    """A request's events as a replica streams them, in :class:`Stream`'s form. The replica's
    first event is its verdict (sent before any work), so a refusal is known when this returns."""

    def __init__(self, replicas: DeploymentHandle, request: Request, step_timeout: float) -> None:
        super().__init__(step_timeout, lambda: True)  # a stuck replica's own stream times out
        self._replicas = replicas.options(stream=True)
        self._request = request
        self._affinity = affinity_key(request)
        self._responses: DeploymentResponseGenerator | None = None
        self._last: dict = {}  # the metrics of the latest event
        verdict = self._open()
        if verdict.kind == "error":
            self.refusal = verdict.error if verdict.error != REPLICA_LOST else ""
            self._events.put(verdict)
        else:
            threading.Thread(target=self._pump, name="remote-stream", daemon=True).start()

    def _open(self) -> Event:
        """Send the request to a replica and return its verdict (an ``accepted`` event or the
        refusal), trying another replica where the chosen one is gone."""
        for attempt in range(1, ATTEMPTS + 1):
            responses = self._replicas.generate.remote(self._request, **{AFFINITY: self._affinity})
            self._responses = cast(DeploymentResponseGenerator, responses)
            try:
                return next(self._responses)
            except GONE as exc:
                log.warning(f"a replica was gone before answering (attempt {attempt} of {ATTEMPTS}): {exc}")
                time.sleep(RETRY_S)
        return Event("error", error=REPLICA_LOST)

    def _pump(self) -> None:
        """Move the replica's events into the stream until the last; a replica lost before the
        first token is replaced, one lost later ends the answer with :data:`REPLICA_LOST`."""
        delivered = False
        while self._responses is not None:
            try:
                for event in self._responses:
                    self._last = event.metrics
                    delivered = delivered or event.kind == "delta"
                    self._events.put(event)
                    if event.final:
                        return
                self._events.put(Event("error", error="the replica ended the answer early", metrics=self._last))
                return
            except RequestCancelledError:
                self._events.put(Event("done", metrics=self._last | {"finish_reason": "cancelled"}))
                return
            except GONE as exc:
                log.warning(f"the replica serving a request stopped: {exc}")
                verdict = Event("error", error=REPLICA_LOST, metrics=self._last) if delivered else self._open()
                if verdict.kind == "error":
                    self._events.put(verdict)
                    return
            except Exception as exc:  # reported on this request only
                log.exception("a replica's stream failed")
                self._events.put(Event("error", error=f"the server failed ({type(exc).__name__})", metrics=self._last))
                return

    def cancel(self) -> None:
        super().cancel()
        if self._responses is not None:
            self._responses.cancel()


class RemoteEngine:
    """The engine interface over the replicas. Creating it waits for one replica to be ready."""

    def __init__(self, replicas: DeploymentHandle, step_timeout: float = STEP_TIMEOUT) -> None:
        self._replicas = replicas
        self.step_timeout = step_timeout
        self.described = replicas.describe.remote().result()
        self._seen_at = time.monotonic()
        self._streams: weakref.WeakSet[RemoteStream] = weakref.WeakSet()  # opened through this ingress
        threading.Thread(target=self._probe, name="replica-probe", daemon=True).start()

    def _probe(self) -> None:
        while True:
            time.sleep(PROBE_S)
            try:
                self.described = self._replicas.describe.remote().result(timeout_s=HEALTHY_WITHIN_S)
                self._seen_at = time.monotonic()
            except Exception as exc:  # health says so
                log.warning(f"no replica answered: {type(exc).__name__}: {exc}")

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self._seen_at < HEALTHY_WITHIN_S

    @property
    def state(self) -> str:
        return "ok" if self.healthy else f"unhealthy: no replica answered for {HEALTHY_WITHIN_S:g} s"

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.described["modes"])

    @property
    def max_context(self) -> int:
        return int(self.described["max_context"])

    @property
    def models(self) -> dict[str, str]:
        return dict(self.described["models"])

    @property
    def pending(self) -> int:
        """Requests open through this ingress, on every replica."""
        return sum(not stream.ended for stream in self._streams)

    waiting = 0  # requests wait in the replicas' queues, not here
    full = False

    def check(self, request: Request) -> list[int]:
        if refusal := self._replicas.check.remote(request).result(timeout_s=self.step_timeout):
            raise EngineError(refusal)
        return []

    def generate(self, request: Request) -> Stream:
        stream = RemoteStream(self._replicas, request, self.step_timeout)
        self._streams.add(stream)
        return stream
