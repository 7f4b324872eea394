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
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import cast

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from engine.cluster import APP_NAME, ENGINE, REPLICA_LOST
from engine.cluster.router import AFFINITY
from engine.core.metrics import FinishReason
from engine.core.requests import STEP_TIMEOUT, Event, EventKind, Request, Stream
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
    user message), or for a raw token prompt its first 64 ids (a conversation whose first prompt
    is shorter may move once). Conversations that open alike share a key, and so a replica: the
    one whose caches hold that opening. None for a request that wants fresh caches."""
    if not request.reuse_cache:
        return None
    if request.prompt_ids:
        opening = json.dumps(request.prompt_ids[:64])
    else:
        first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), 0)
        opening = json.dumps(request.messages[: first_user + 1], sort_keys=True)
    return hashlib.blake2b(opening.encode(), digest_size=12).hexdigest()


class RemoteStream(Stream):
    """A request's events as a replica streams them, in :class:`Stream`'s form, read by a thread
    of its own. The replica's first event is its verdict (the refusal, or ``accepted``, sent
    before any work): ``refusal`` waits for it."""

    def __init__(
        self, replicas: DeploymentHandle, request: Request, step_timeout: float, healthy: Callable[[], bool]
    ) -> None:
        super().__init__(step_timeout, healthy)
        self._replicas = replicas.options(stream=True)
        self._request = request
        self._affinity = affinity_key(request)
        self._responses: DeploymentResponseGenerator | None = None
        self._last: dict = {}  # the metrics of the latest event
        self._verdict = threading.Event()
        threading.Thread(target=self._pump, name="remote-stream", daemon=True).start()

    @property
    def refusal(self) -> str:
        """Why the replica refused the request ("" if it did not), once it has said."""
        self._verdict.wait(self.step_timeout)
        return self._refused

    @refusal.setter
    def refusal(self, value: str) -> None:
        self._refused = value

    def _pump(self) -> None:
        try:
            self._relay()
        except Exception as exc:  # whatever failed, the stream ends with its last event
            log.exception("a replica's stream failed")
            self._end(Event(EventKind.ERROR, error=f"the server failed ({type(exc).__name__})", metrics=self._last))

    def _relay(self) -> None:
        """Send the request to a replica and move its events into the stream until the last; a
        replica lost before the first token is replaced (the request sent again), one lost later
        ends the answer with :data:`REPLICA_LOST`."""
        delivered = False
        for attempt in range(1, ATTEMPTS + 1):
            if self._cancel.is_set():
                self._end(Event(EventKind.DONE, metrics=self._last | {"finish_reason": FinishReason.CANCELLED}))
                return
            responses = self._replicas.generate.remote(self._request, **{AFFINITY: self._affinity})
            self._responses = cast(DeploymentResponseGenerator, responses)
            if self._cancel.is_set():  # (a cancel that came while it was being sent)
                self._responses.cancel()
            try:
                for event in self._responses:
                    self._last = event.metrics
                    if event.kind == EventKind.ACCEPTED:
                        self._verdict.set()
                        continue
                    if not self._verdict.is_set() and event.kind == EventKind.ERROR:
                        self.refusal = event.error
                    delivered = delivered or event.kind == EventKind.DELTA
                    if event.final:
                        self._end(event)
                        return
                    self._events.put(event)
                self._end(Event(EventKind.ERROR, error="the replica ended the answer early", metrics=self._last))
                return
            except RequestCancelledError as exc:
                if self._cancel.is_set():  # (this stream's own cancel)
                    self._end(Event(EventKind.DONE, metrics=self._last | {"finish_reason": FinishReason.CANCELLED}))
                    return
                # Not asked for here: the replica went away mid-answer (Ray says so either way).
                log.warning(f"the replica serving a request cancelled it (attempt {attempt} of {ATTEMPTS}): {exc}")
                if delivered:
                    break
                time.sleep(RETRY_S)
            except GONE as exc:
                log.warning(f"the replica serving a request stopped (attempt {attempt} of {ATTEMPTS}): {exc}")
                if delivered:
                    break
                time.sleep(RETRY_S)
        self._end(Event(EventKind.ERROR, error=REPLICA_LOST, metrics=self._last))

    def _end(self, event: Event) -> None:
        self._events.put(event)
        self._verdict.set()

    def cancel(self) -> None:
        super().cancel()
        if self._responses is not None:
            self._responses.cancel()


class RemoteEngine:
    """The engine interface over the replicas. Creating it waits for one replica to be ready;
    ``close()`` stops its health probe."""

    def __init__(self, replicas: DeploymentHandle, step_timeout: float = STEP_TIMEOUT) -> None:
        self._replicas = replicas
        self.step_timeout = step_timeout
        self.described = replicas.describe.remote().result()
        self.replicas = 1  # replicas running, as Ray last said
        self._seen_at = time.monotonic()
        self._streams: weakref.WeakSet[RemoteStream] = weakref.WeakSet()  # opened through this ingress
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._probe, name="replica-probe", daemon=True).start()

    def _probe(self) -> None:
        from ray import serve

        while not self._closed.wait(PROBE_S):
            try:
                self.described = self._replicas.describe.remote().result(timeout_s=HEALTHY_WITHIN_S)
                self._seen_at = time.monotonic()
                states = serve.status().applications[APP_NAME].deployments[ENGINE].replica_states
                self.replicas = max(1, sum(n for state, n in states.items() if state == "RUNNING"))
            except Exception as exc:  # health says so
                log.warning(f"no replica answered: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._closed.set()

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
        """Requests open through this ingress per running replica: what each engine has to do
        (so the API's queue limit holds per replica)."""
        with self._lock:
            open_ = sum(not stream.ended for stream in self._streams)
        return math.ceil(open_ / self.replicas)

    waiting = 0  # requests wait in the replicas' queues, not here
    full = False

    def check(self, request: Request) -> list[int]:
        try:
            refusal = self._replicas.check.remote(request).result(timeout_s=self.step_timeout)
        except Exception as exc:  # a replica gone or too slow: said as such, not as a traceback
            raise EngineError(f"no engine replica could check the request ({type(exc).__name__}); try again") from exc
        if refusal:
            raise EngineError(refusal)
        return []

    def generate(self, request: Request) -> Stream:
        stream = RemoteStream(self._replicas, request, self.step_timeout, lambda: self.healthy)
        with self._lock:
            self._streams.add(stream)
        return stream
