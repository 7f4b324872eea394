"""The engine's stand-in while its models are prepared and loaded (:class:`Loading`), so that a
server listens at once: it offers the :class:`~engine.interface.EngineClient` interface whatever
stands behind it (the models in this process, or a cluster's replicas).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from engine.core.requests import Request, Stream
from engine.errors import EngineError
from engine.interface import EngineClient

log = logging.getLogger("specchat.engine")


class Loading:
    """The engine while its models are prepared and loaded (in a thread), so that a server can
    listen at once. Until the engine is ready every request ends at once with the preparation's
    progress, and health says so; then everything goes to the engine.

    ``load`` builds the engine; ``modes`` are the modes to offer meanwhile. Progress is the last
    message logged under ``progress_logger`` (the preparation's own log)."""

    CONTEXT_WHILE_LOADING = 2048  # what a form may offer before the model's context is known

    def __init__(
        self, load: Callable[[], EngineClient], modes: Sequence[str], progress_logger: str = "specchat.prepare"
    ):
        self.engine: EngineClient | None = None
        self.progress = "starting"
        self.failure: str | None = None
        self._modes = tuple(modes)
        self._load = load
        self._progress_log = logging.getLogger(progress_logger)
        self._listener = _LastMessage(self)
        self._progress_log.addHandler(self._listener)
        threading.Thread(target=self._run, name="engine-loader", daemon=True).start()

    def _run(self) -> None:
        try:
            self.engine = self._load()
        except EngineError as exc:
            self.failure = str(exc)
            log.error("the models could not be prepared: %s", exc)
        except Exception as exc:  # reported on the page and in the log; the server stays up
            self.failure = f"{type(exc).__name__} (the server log has the details)"
            log.exception("the models could not be loaded")
        finally:
            self._progress_log.removeHandler(self._listener)

    @property
    def state(self) -> str:
        if self.engine is not None:
            return self.engine.state
        return f"failed: {self.failure}" if self.failure else f"loading: {self.progress}"

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.healthy

    @property
    def pending(self) -> int:
        return self.engine.pending if self.engine is not None else 0

    @property
    def waiting(self) -> int:
        return self.engine.waiting if self.engine is not None else 0

    @property
    def full(self) -> bool:
        return self.engine is not None and self.engine.full

    @property
    def replicas(self) -> int:
        return self.engine.replicas if self.engine is not None else 0

    @property
    def modes(self) -> tuple[str, ...]:
        return self.engine.modes if self.engine is not None else self._modes

    @property
    def max_context(self) -> int:
        return self.engine.max_context if self.engine is not None else self.CONTEXT_WHILE_LOADING

    @property
    def models(self) -> dict[str, str]:
        return self.engine.models if self.engine is not None else {}

    def check(self, request: Request) -> list[int]:
        if self.engine is None:
            raise EngineError(self._not_ready())
        return self.engine.check(request)

    def generate(self, request: Request) -> Stream:
        if self.engine is None:
            return Stream.refused(self._not_ready(), request.mode)
        return self.engine.generate(request)

    def _not_ready(self) -> str:
        if self.failure:
            return f"the models could not be prepared: {self.failure}"
        return f"the models are still being prepared ({self.progress}); try again in a minute"


class _LastMessage(logging.Handler):
    def __init__(self, loading: Loading):
        super().__init__(logging.INFO)
        self.loading = loading

    def emit(self, record: logging.LogRecord) -> None:
        self.loading.progress = record.getMessage()
