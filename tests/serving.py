"""One request served by the engine's own scheduler on runtimes a test builds: the loop users get
(:mod:`engine.core.scheduler`: its first round, prefill slices and rounds), with the drafter and
decoding settings the test chooses. There is no second decoding loop for tests to drive."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

from engine.core.budget import MemoryBudget
from engine.core.chat import Prompt
from engine.core.drafters import Drafter
from engine.core.metrics import ModeName
from engine.core.modes import BEST_K, MODES
from engine.core.pacing import Pacing
from engine.core.pool import NgramPool
from engine.core.requests import STEP_TIMEOUT, Request, Stream
from engine.core.runtime import Runtime
from engine.core.sampling import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sessions import SessionPool
from engine.core.tokenizer import load_tokenizer
from engine.core.turns import NO_LIMITS, ClientLedger

GREEDY = SamplingParams()


@functools.cache
def _tokenizer(ir_dir: Path):
    return load_tokenizer(ir_dir)


class _OnePool:
    """Every client's n-gram pool is the test's own, which no answer changes (as Pools is used)."""

    def __init__(self, pool: NgramPool | None):
        self.pool = pool

    def of(self, client: str) -> NgramPool | None:
        return self.pool

    def learn(self, client: str, tokens: Sequence[int]) -> None:
        pass


def draft_runtime(drafter: Drafter | None) -> Runtime | None:
    """The draft model's runtime a drafter drafts with, if any."""
    for part in (drafter, getattr(drafter, "model", None)):
        runtime = getattr(part, "runtime", None)
        if runtime is not None:
            return runtime
    return None


def serve(
    target: Runtime,
    drafter: Drafter | None,
    prompt: Sequence[int],
    *,
    speculative: bool = True,
    k: int = 4,
    max_new_tokens: int | None = None,
    sampling: SamplingParams = GREEDY,
    stop_ids: frozenset[int] = frozenset(),
    pacing: Pacing | None = None,
    fence_ids: frozenset[int] = frozenset(),
    pool: NgramPool | None = None,
    on_round: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], SimpleNamespace]:
    """Serve ``prompt`` on empty caches through a scheduler of its own, as the engine serves a
    request: autoregressive where not ``speculative``, paced (mode ``best``, its K) where
    ``pacing`` is given, else drafting K tokens a round with ``drafter``. Returns the answer's
    tokens and its final metrics (as attributes). ``on_round(context)`` is called on the worker
    after every round, the caches as the round left them."""
    if not speculative:
        mode = ModeName.AUTOREGRESSIVE
    elif pacing is not None:
        assert k == BEST_K, f"a paced request drafts {BEST_K} tokens a round"
        mode = ModeName.BEST
    else:
        mode = ModeName.SPECULATIVE
    draft = draft_runtime(drafter)
    sessions = SessionPool(target, draft, lambda _draft: dict.fromkeys(MODES, drafter), capacity=1)
    scheduler = Scheduler(
        target,
        sessions,
        MemoryBudget(limit=2**60, base=0, per_token=target.kv_bytes_per_token),
        _tokenizer(target.ir_dir),
        ClientLedger(NO_LIMITS),
        pacing or Pacing(),
        frozenset(stop_ids),
        frozenset(fence_ids),
        _OnePool(pool),  # type: ignore[arg-type]
    )
    if on_round is not None:
        emit = scheduler._emit
        scheduler._emit = lambda job, round_, batch_size: (on_round(job.decoder.context), emit(job, round_, batch_size))  # type: ignore[method-assign]
    request = Request(
        prompt_ids=tuple(prompt),
        mode=mode,
        k=k,
        max_new_tokens=max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        reuse_cache=False,
    )
    stream = Stream(STEP_TIMEOUT, lambda: True)
    try:
        scheduler.submit(request, Prompt(list(prompt)), stream, lambda: None)
        final = next(event for event in stream if event.final)
    finally:
        scheduler.worker.close()
    assert final.kind == "done", final.error
    return list(final.token_ids), SimpleNamespace(**final.metrics)
