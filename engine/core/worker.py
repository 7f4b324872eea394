"""The engine's one worker thread, and what reaches it from the callers' threads: requests, and
tool jobs (:meth:`Worker.call`), in one line through a gate that :meth:`Worker.close` shuts. Every
piece of work runs on this thread, so no two requests touch the KV caches at once; the progress
it makes is what the engine's health reads (:meth:`Worker.stuck`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.errors import EngineError

T = TypeVar("T")
R = TypeVar("R")
CLOSED = "the engine is closed"  # what a request or a tool job gets after close()
# Seconds close() waits for the requests it holds to end before it cancels them.
CLOSE_TIMEOUT = 60.0
log = logging.getLogger("specchat.engine")


@dataclass(frozen=True)
class _ToolJob:
    run: Callable[[], None]


class Worker(Generic[T]):
    """A thread that runs ``loop`` (from :meth:`start`), which takes what arrived with
    :meth:`arrived` and ends once :attr:`accepting` is False and what it took has ended."""

    def __init__(self, loop: Callable[[], None], name: str = "engine-worker") -> None:
        self._inbox: queue.Queue[T | _ToolJob] = queue.Queue()  # arrived, not yet taken
        # False once closed: nothing more is taken, and the loop ends when what it took ends.
        # Taking one and closing hold the gate, so none is taken that the loop would never see.
        self.accepting = True
        self._gate = threading.Lock()
        self._abandon = threading.Event()  # set by close() once its timeout has passed
        self._busy = threading.Lock()
        self._progress_at = time.monotonic()
        self._thread = threading.Thread(target=loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item: T) -> bool:
        """Hand ``item`` to the loop; False once closed (the item is not taken)."""
        with self._gate:
            if self.accepting:
                self._inbox.put(item)
            return self.accepting

    def call(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` on the worker thread, after what arrived before, and return its result."""
        future: Future = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed back to the caller's thread
                future.set_exception(exc)

        with self._gate:
            if not self.accepting:
                raise EngineError(CLOSED)
            self._inbox.put(_ToolJob(job))
        return future.result()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Take no more; return once the loop has ended, after what arrived before, or after
        ``timeout`` seconds (logged), when :attr:`abandoned` tells the loop to cancel what it holds.
        Closing a closed worker does nothing."""

        def shut() -> None:
            with self._gate:
                self.accepting = False

        with contextlib.suppress(EngineError):  # (closed already)
            self.call(shut)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("closing: the requests still held after %.0f s are cancelled", timeout)
            self._abandon.set()
            self._thread.join()

    @property
    def abandoned(self) -> bool:
        """Whether :meth:`close` has waited long enough: what the loop holds is to be cancelled."""
        return self._abandon.is_set()

    @property
    def queued(self) -> int:
        """Items arrived, not yet taken by the loop."""
        return self._inbox.qsize()

    def arrived(self, block: bool) -> list[T]:
        """What arrived (waiting for something where ``block``), the tool jobs among it run in turn."""
        items: list[T] = []
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return items
            block = False
            if isinstance(item, _ToolJob):
                with self.busy():
                    item.run()
            else:
                items.append(item)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Work that must make progress (:meth:`progress`) while it runs, or the worker is stuck."""
        with self._busy:
            self.progress()
            yield

    def progress(self) -> None:
        self._progress_at = time.monotonic()

    def stuck(self, timeout: float) -> bool:
        """Whether the thread has stopped, or busy work has made no progress for longer than
        ``timeout`` seconds: a stuck inference call (the worker recovers when the call returns)."""
        stalled = self._busy.locked() and time.monotonic() - self._progress_at > timeout
        return stalled or not self._thread.is_alive()
