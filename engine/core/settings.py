"""How an engine serves its two models: one frozen object that the command line
(:mod:`engine.startup`), the cluster's replicas, the benchmarks and the tests build, and
:class:`~engine.core.service.Engine` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.core.draft_vocab import Ids
from engine.core.pacing import Pacing
from engine.core.requests import STEP_TIMEOUT
from engine.core.turns import NO_LIMITS, ClientLimits
from engine.core.window import Overflow

# What computes the models' linear layers: the OpenVINO plugin's kernels, ggml's on the GGUF's
# own blocks (engine.ggml), or the faster of the two on this machine, per model.
KERNELS = ("auto", "openvino", "ggml")
# Whether requests generating at once share batched passes: on, off, or where exact here.
BATCHING = ("auto", "on", "off")


@dataclass(frozen=True)
class Settings:
    """Everything but the models themselves; each field's default is the library's (the command
    line's defaults are :mod:`engine.startup`'s)."""

    device: str = "CPU"
    config: dict | None = None
    """OpenVINO properties of the target (default: :data:`~engine.core.runtime.TARGET_CONFIG`)."""
    draft_config: dict | None = None
    """The draft's (default: :data:`~engine.core.runtime.DRAFT_CONFIG`)."""
    draft_vocab: Ids | None = None
    """The token ids the draft head computes logits for, most frequent first
    (:func:`engine.core.draft_vocab.frequent_ids`; the others get q = 0); None: all, as by default,
    since a cut head has cost more acceptance than its cheaper pass gained (docs/benchmarks.md,
    "Tried and dropped")."""
    max_input_tokens: int | None = None
    """The longest prompt accepted (default: a share of the context, as the memory budget holds)."""
    context_overflow: str = Overflow.WINDOW
    """What becomes of a longer conversation where its request does not say (:class:`Overflow`)."""
    step_timeout: float = STEP_TIMEOUT
    """Seconds without progress after which a stream fails and the engine reports itself unhealthy."""
    max_sessions: int | None = None
    """Conversations whose KV caches are kept (default: :data:`~engine.core.sessions.MAX_SESSIONS`,
    their bytes bounded by the budget)."""
    memory_limit: int | None = None
    """Bytes the process may hold (default: a share of the machine's memory,
    :mod:`engine.core.budget`); the input cap follows from it too."""
    pacing: Pacing | None = None
    """The paced mode's policy (default: priced by the passes timed at start)."""
    client_limits: ClientLimits = NO_LIMITS
    """What one client may hold (:mod:`engine.core.turns`)."""
    shared_pool: bool = False
    """One n-gram pool for every client, instead of one each (:mod:`engine.core.pool`)."""
    prompt_reader: str = "auto"
    """How prompts are read (:data:`~engine.core.reader.READERS`): ``auto`` times the readers at
    start and uses one where it reads faster and the budget holds its weights beside the full input
    cap; ``off``: the target's own passes."""
    batching: str = "auto"
    """``on``: requests that generate at once share batched target passes (engine.core.batch);
    ``off``: each takes its own rounds, so every answer is its solo run's bit for bit; ``auto``:
    on where a batched row gives its lone logits on this machine, measured at start (a row's
    logits may move with its padding: docs/design.md, "Batching"), else off."""
    batch_speculation: bool = True
    """Requests served together verify their copies in the batched pass (else plain batched steps)."""
    kernels: str = "openvino"
    """What computes the linear layers (:data:`KERNELS`): the plugin's, or ggml's on the GGUF's own
    blocks through the op in ``library`` where a model has a graph on it; ``auto`` keeps the faster
    per model, as measured on this machine."""
    library: Path | None = None
    """The GgmlLinear op's library (:mod:`engine.ggml`)."""
    activations: int | None = None
    """On ggml's kernels, the bits the op's own Q4_K and Q6_K kernels multiply by (8 or 14;
    :class:`~engine.core.runtime.Runtime`)."""
    remeasure: bool = False
    """Time what start times (kernels, reader, pass costs, the op's candidates) even where figures
    are kept for this machine (:mod:`engine.core.measured`)."""


DEFAULTS = Settings()
