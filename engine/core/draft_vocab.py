"""The draft head cut to frequent tokens (FR-Spec, arXiv 2502.14856): token ids ranked by how often
the target's tokenizer gave them over code and chat text (``python -m benchmarks.draft_vocab``
counts them and writes :data:`RANKING`), applied only to the vocabulary they were counted over.

A draft whose head computes the first N ids of the ranking (``Settings(draft_vocab=...)``,
``Runtime(kept_ids=...)``) reads fewer weight rows per step; the ids it leaves out get q = 0, and
the target's verification keeps every answer the target's own (docs/design.md, "A speculative
round").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EngineError
from engine.hf import tokenizer_tokens, vocabulary_digest

# The ranking shipped with the engine: its ids (uint32, most frequent first, the chat template's
# control tokens first of all) and the digest of the vocabulary they were counted over.
RANKING = Path(__file__).with_name("draft_vocab.npz")
# Token ids a head keeps, as a ranking gives them or as a caller lists them.
Ids = Sequence[int] | np.ndarray


def frequent_ids(tokenizer: Any, count: int, ranking: Path = RANKING) -> np.ndarray:
    """The ``count`` most frequent ids of ``tokenizer``'s vocabulary by ``ranking``, most frequent
    first; refused where the ranking was counted over another vocabulary or holds fewer ids."""
    with np.load(ranking) as data:
        ids, digest = data["ids"], str(data["vocabulary"])
    if digest != vocabulary_digest(tokenizer_tokens(tokenizer)):
        raise EngineError(f"{ranking}: its token ranking was counted over another vocabulary than this model's")
    if not 0 < count <= len(ids):
        raise EngineError(f"{ranking}: a draft vocabulary of 1 to {len(ids)} ids, not {count}")
    return ids[:count].astype(np.int64)


def write_ranking(path: Path, ids: Ids, tokenizer: Any) -> None:
    """Keep ``ids`` (most frequent first) as the ranking of ``tokenizer``'s vocabulary."""
    digest = vocabulary_digest(tokenizer_tokens(tokenizer))
    np.savez_compressed(path, ids=np.asarray(ids, dtype=np.uint32), vocabulary=np.array(digest))


def ids_key(ids: Ids | None) -> str | None:
    """A short fingerprint of the ids a head keeps (None: every id), for what depends on them."""
    return None if ids is None else hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]
