"""The accept/reject rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

Given K drafted tokens with the draft's probabilities q and the target's
probabilities p at K+1 positions, the returned tokens are distributed exactly as
tokens sampled from p one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.core.sampling import sample


def accept_draft(draft: Sequence[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """Return (number of drafted tokens accepted, the token that follows them).

    Draft token i is kept with probability min(1, p_i(x) / q_i(x)). At the first
    rejection the next token comes from norm(max(0, p_i - q_i)); if every drafted
    token is kept, the bonus token comes from p_K.
    """
    for i, token in enumerate(draft):
        if rng.random() * q[i, token] < p[i, token]:  # u < p/q without dividing by zero
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        # residual is all zero only when p == q, where no rejection can happen; keep p as a guard.
        return i, sample(residual if residual.sum() > 0 else p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def accept_greedy(draft: Sequence[int], target_logits: np.ndarray) -> tuple[int, int]:
    """:func:`accept_draft` in its temperature -> 0 limit, without building distributions.

    p and q are one-hot there: a drafted token is kept exactly when it is the target's
    argmax, and the correction (or bonus) is the target's argmax at the first miss.
    """
    best = target_logits.argmax(-1)
    n = next((i for i, token in enumerate(draft) if token != best[i]), len(draft))
    return n, int(best[n])
