"""The engine as its front ends see it: the page (:mod:`ui`), the OpenAI API (:mod:`engine.api`)
and a cluster's ingress (:mod:`engine.cluster`) are written against this and nothing more.

Three classes offer it: :class:`engine.core.service.Engine` (the models in this process),
:class:`engine.loading.Loading` (the same while the models are prepared) and
:class:`engine.cluster.remote.RemoteEngine` (engine replicas on a Ray cluster). The tools that
measure the models themselves (``benchmarks``) use :class:`~engine.core.service.Engine` directly.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.core.requests import Request, Stream


@runtime_checkable
class EngineClient(Protocol):
    @property
    def state(self) -> str:
        """ "ok" when serving; else what is wrong or under way ("loading: ...", "failed: ...")."""

    @property
    def healthy(self) -> bool:
        """Whether requests make progress (what /health and a cluster's health checks report)."""

    @property
    def modes(self) -> tuple[str, ...]:
        """The decoding modes a request may ask for, the default first."""

    @property
    def max_context(self) -> int:
        """The model's context in tokens: prompt and answer together."""

    @property
    def models(self) -> dict[str, str]:
        """Each role's model and precision, for people (empty while unknown)."""

    @property
    def pending(self) -> int:
        """Requests waiting for or using the engine (the API refuses new ones beyond a limit)."""

    @property
    def waiting(self) -> int:
        """Requests queued behind those being served."""

    @property
    def full(self) -> bool:
        """Serving as many requests as it serves together: a new one waits."""

    @property
    def replicas(self) -> int:
        """Engines serving behind this one (one here; a cluster's count)."""

    def check(self, request: Request) -> list[int]:
        """Raise :class:`~engine.errors.EngineError` saying what is wrong with ``request``."""

    def generate(self, request: Request) -> Stream:
        """Stream the request's events; a refused request's stream ends at once with an error."""
