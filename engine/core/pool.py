"""Drafts from what the target wrote before, across requests: an n-gram pool per client.

A conversation's own context often has no earlier match for what comes next (a new question, a
new function), while the answers the target has written before share their idioms: the chat
template's phrases, ``def``/``return`` lines, docstring shapes, the closing explanation. The pool
keeps, for every run of :data:`NGRAM` tokens in earlier answers and prompts, the token that
followed it, in a table of fixed size indexed by a hash of the run (the latest writer wins, as in
llama.cpp's ``ngram-mod``): bounded memory, nothing to evict. A draft chains lookups from the
context's last :data:`NGRAM` tokens. A hash collision can only propose a wrong token, which the
target rejects like any other: every token still follows the target's rule.

Whose text drafts for whom (:class:`Pools`): each client (a browser session, an API key or
address; :mod:`engine.core.turns`) has a pool of its own, so no text one user wrote is ever
proposed in another's conversation. A pool shared by every client would leak nothing into an
answer, since the target decides every token, but the speed of an answer could hint at what
others wrote: the operator may choose sharing (``--shared-pool``) on a server whose users trust
each other, where a team's answers then speed up each other's.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from engine.core.drafters import CopyDrafter, Price

# The run of tokens a pool entry follows: long enough that what follows it in one answer usually
# follows it in another, short enough to recur across answers (docs/design.md, "An n-gram pool
# across requests").
NGRAM = 4
# Entries per pool (int32 each: 1 MiB). A 500-token answer writes 500; past a few hundred answers
# newer ones overwrite older ones where they collide.
ENTRIES = 1 << 18
# Clients whose pools are kept (least recently used dropped first): at most this many MiB.
MAX_POOLS = 64
_MULTIPLIER = 6364136223846793005  # Knuth's MMIX LCG multiplier: mixes each token into the hash
_MASK = (1 << 64) - 1
EMPTY = -1


class NgramPool(CopyDrafter):
    """For each run of ``n`` tokens seen, the token that followed it (:meth:`learn`); proposes the
    chain of lookups after a context (:meth:`lookup`), priced like every copy. Its copies come from
    other conversations, so they are expected to land less often than a conversation's own: half
    of them before any verdict."""

    PRIOR = (1.0, 1.0)

    def __init__(self, vocab_size: int, price: Price | None = None, span: int | None = None, n: int = NGRAM):
        super().__init__(vocab_size, span, price)
        self.n = n
        self.table = np.full(ENTRIES, EMPTY, dtype=np.int32)

    def _index(self, run: Sequence[int]) -> int:
        h = 0
        for token in run:
            h = (h * _MULTIPLIER + int(token)) & _MASK
        return h % len(self.table)

    def learn(self, tokens: Sequence[int]) -> None:
        """Record what followed every run of ``n`` tokens in ``tokens`` (the later of two equal runs wins)."""
        ids = np.asarray(tokens, dtype=np.uint64)
        runs = len(ids) - self.n
        if runs <= 0:
            return
        h = np.zeros(runs, dtype=np.uint64)
        for j in range(self.n):  # the same hash as _index, for every run at once (uint64 wraps around)
            h = h * np.uint64(_MULTIPLIER) + ids[j : j + runs]
        self.table[h % np.uint64(len(self.table))] = ids[self.n :].astype(np.int32)

    def lookup(self, context: np.ndarray, k: int) -> list[int]:
        run = [int(t) for t in context[-self.n :]]
        if len(run) < self.n:
            return []
        out: list[int] = []
        while len(out) < k and (token := int(self.table[self._index(run)])) != EMPTY:
            out.append(token)
            run = [*run[1:], token]
        return out


class Pools:
    """The n-gram pool of each client on one server (``shared``: one pool for all of them)."""

    def __init__(self, vocab_size: int, price: Price | None, span: int, shared: bool = False):
        self.vocab_size, self.price, self.span, self.shared = vocab_size, price, span, shared
        self._pools: collections.OrderedDict[str, NgramPool] = collections.OrderedDict()

    def of(self, client: str) -> NgramPool:
        """``client``'s pool (made empty on first use; the least recently used is dropped past
        :data:`MAX_POOLS`)."""
        key = "" if self.shared else client
        if key in self._pools:
            self._pools.move_to_end(key)
        else:
            self._pools[key] = NgramPool(self.vocab_size, self.price, self.span)
            while len(self._pools) > MAX_POOLS:
                self._pools.popitem(last=False)
        return self._pools[key]

    def learn(self, client: str, tokens: Sequence[int]) -> None:
        """Add a finished request's conversation (prompt and answer) to ``client``'s pool."""
        self.of(client).learn(tokens)
