"""One engine replica of the cluster: the models prepared (or found) in its node's cache and
loaded once, its own sessions, and the engine's events streamed to the ingress.

Ray Serve runs it as a deployment (:mod:`engine.cluster.deploy`); its health check is the
engine's, so Ray replaces a replica whose engine is stuck."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ray import serve

from engine.core.requests import Event, EventKind, Request
from engine.errors import EngineError
from engine.startup import start_engine

# Answers one replica takes at once (those beyond the engine's batch wait in its queue); the
# router sends more to another replica.
MAX_ONGOING = 16
# Calls it takes at once: room beside a full load of answers for health probes and checks, so that
# a busy replica still says how it is.
MAX_CALLS = MAX_ONGOING + 4


class EngineReplica:
    def __init__(self, args: argparse.Namespace, threads: int) -> None:
        self.engine = start_engine(args, threads)
        self.replica = serve.get_replica_context().replica_id.unique_id
        # A stream is read by a thread blocked on its next event: one thread per call at most.
        self._readers = ThreadPoolExecutor(MAX_CALLS, thread_name_prefix="stream-reader")

    async def generate(self, request: Request, affinity: str | None = None) -> AsyncIterator[Event]:
        """The request's events, each tagged with this replica's id. ``affinity`` is the router's
        (:mod:`engine.cluster.router`). The first event is the verdict, sent before any work: the
        refusal, or ``accepted``. Cancelled by the caller: the engine request is cancelled."""
        stream = self.engine.generate(request)
        loop = asyncio.get_running_loop()
        try:
            if not stream.refusal:
                yield Event(EventKind.ACCEPTED, metrics={"replica": self.replica})
            while (event := await loop.run_in_executor(self._readers, next, stream, None)) is not None:
                event.metrics["replica"] = self.replica
                yield event
                if event.final:
                    return
        finally:
            stream.close()

    def describe(self) -> dict:
        """What the ingress shows and checks against, and where this replica runs."""
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state": self.engine.state,
            "modes": self.engine.modes,
            "max_context": self.engine.max_context,
            "models": self.engine.models,
            "pending": self.engine.pending,
        }

    def check(self, request: Request) -> str:
        """Why the engine would refuse ``request`` ("" if it would not)."""
        try:
            self.engine.check(request)
        except EngineError as exc:
            return str(exc)
        return ""

    def check_health(self) -> None:
        """Ray's health check: a stuck engine fails it, and Ray replaces the replica."""
        if not self.engine.healthy:
            raise RuntimeError(f"the engine is {self.engine.state}")
