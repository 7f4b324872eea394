"""One sampling rule for every mode: logits -> (warped) probabilities -> token.

Greedy decoding is the temperature -> 0 limit: the distribution becomes one-hot on
the argmax, so the speculative accept/reject rule needs no special case for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

BLOCK = 1024  # token ids per block when a token is drawn (sample)
# Top-p sorts the tokens at least this share of the likeliest one first (_nucleus): the rest of a
# 152k vocabulary holds at most 0.15 of the mass, in practice far less.
NUCLEUS_FLOOR = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def top_probability(logits: np.ndarray) -> float:
    """The largest probability of a row of logits at temperature 1 (how sure the model is)."""
    z = logits - logits.max()
    return float(1.0 / np.exp(z).sum())


def logits_to_probs(logits: np.ndarray, params: SamplingParams, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of logits [..., V] -> rows of probabilities after temperature, top-k and top-p.
    ``out`` (float64, the logits' shape), where given, is warped in place of a new copy."""
    if params.greedy:
        probs = np.zeros(np.shape(logits), dtype=np.float64)
        np.put_along_axis(probs, np.argmax(logits, -1)[..., None], 1.0, axis=-1)
        return probs
    # In place on one copy: a row of a 152k vocabulary is 1.2 MB in float64, and every temporary
    # of that size is mapped and faulted in afresh (engine.core.memory), a cost a batched step
    # pays per sampled row (docs/benchmarks.md, "Top-p").
    if out is None:
        z = np.array(logits, dtype=np.float64)
    else:
        z = out
        np.copyto(z, logits)
    z -= z.max(-1, keepdims=True)
    z /= params.temperature  # (after the shift: no inf - inf at a tiny temperature)
    if 0 < params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z[z < kth] = -np.inf
        z -= z.max(-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        _top_p(z.reshape(-1, z.shape[-1]), params.top_p)  # (a view: z is contiguous, made here)
    return z


def _top_p(rows: np.ndarray, top_p: float) -> None:
    """Keep, in each row in place, the smallest set of most likely tokens whose mass reaches
    ``top_p``, renormalized (no new array of the vocabulary's size)."""
    for row in rows:
        ids = _nucleus(row, top_p)
        kept = row[ids]
        row.fill(0.0)
        row[ids] = kept
        row /= row.sum()


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids of the smallest set of most likely tokens in a row whose mass reaches ``top_p``
    (a token is kept while the mass of those before it is below ``top_p``). Only the tokens
    above :data:`NUCLEUS_FLOOR` of the likeliest one's probability are sorted where they hold
    that mass (every token left out then has at least as much before it): a fraction of the
    cost of sorting a 152k vocabulary (docs/benchmarks.md, "Top-p")."""
    for floor in (NUCLEUS_FLOOR, 0.0):
        ids = np.flatnonzero(probs >= floor * probs.max()) if floor else np.arange(len(probs))
        order = ids[np.argsort(-probs[ids], kind="stable")]  # (ties: the lower id first)
        ordered = probs[order]
        cumulative = np.cumsum(ordered)
        if not floor or cumulative[-1] >= top_p:
            break
    return order[cumulative - ordered < top_p]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability row: the block of :data:`BLOCK` ids the draw falls
    in, by the blocks' sums, then the id within it, by the draw's place in that block. The same
    distribution as a search of the whole row's running sum, without building it (1.2 MB for a
    152k vocabulary); a token of probability 0 is never drawn."""
    sums = np.add.reduceat(probs, np.arange(0, len(probs), BLOCK))
    cdf = np.cumsum(sums)
    draw = rng.random() * cdf[-1]
    block = min(int(np.searchsorted(cdf, draw, side="right")), len(sums) - 1)
    place = min(max((draw - (cdf[block] - sums[block])) / sums[block], 0.0), np.nextafter(1.0, 0.0))
    within = np.cumsum(probs[block * BLOCK : (block + 1) * BLOCK])
    return block * BLOCK + int(np.searchsorted(within, place * within[-1], side="right"))


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one row of logits: the argmax when greedy (no distribution is built). The
    distribution is built in a buffer the thread keeps: a new one is 1.2 MB, mapped and faulted in
    afresh under the engine's allocator settings (engine.core.memory), which more than doubled a
    sampled token's cost (docs/benchmarks.md, "Top-p")."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(logits_to_probs(logits, params, out=_scratch(np.shape(logits))), rng)


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """This thread's float64 buffer of ``shape`` (its contents are overwritten by each use)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.shape != shape:
        buffer = _SCRATCH.buffer = np.empty(shape, dtype=np.float64)
    return buffer
