"""How a prompt is read into the target's cache: which path reads each token, in which passes.

The prompt reader (engine.core.reader) rounds differently from the decoding request's own passes,
and with where its passes start and end. So the plan is a function of the conversation alone, and
each cache entry records what wrote it (``Runtime.origins``): a request keeps what its cache holds
only where that is what its plan would write (docs/design.md, "The prompt reader").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

# Tokens per reader pass: a pass's memory grows with its width times the context (its attention
# scores), and a Stop or another user's step waits for one pass at most.
READ_PASS = 256
# A run of prompt text shorter than this is read by the decoding path (the prompt's unread rest
# in the first round, as without a reader): a pass's cost is mostly its width there.
SHORTEST_RUN = 64


class ReadPath(StrEnum):
    """Which model reads a run of prompt tokens into the target's cache."""

    READER = "reader"  # the prompt reader, in passes of the plan
    STEPS = "steps"  # the decoding request's own passes, as answers are decoded


@dataclass(frozen=True)
class ReadPass:
    start: int
    stop: int
    path: ReadPath


def read_plan(
    length: int,
    spoken: Sequence[tuple[int, int]] = (),
    breaks: Sequence[int] = (),
    width: int = READ_PASS,
    shortest: int = SHORTEST_RUN,
) -> tuple[ReadPass, ...]:
    """How the first ``length`` tokens of a prompt are read (the last prompt token is the first
    round's). ``spoken``: spans the decoding path reads, as it did when it decoded them (an
    assistant's answer and the token before it: its entries in a kept cache are the decoder's).
    Everything else comes in runs, between those spans and cut at each of ``breaks`` (the chat
    template's opening, whose entries are copied in): a run of ``shortest`` tokens or more is the
    reader's, in passes of ``width`` from its start; a shorter one is the decoding path's too."""
    passes: list[ReadPass] = []
    cuts = sorted({0, length, *(b for b in breaks if 0 < b < length)})
    steps = sorted((max(0, a), min(b, length)) for a, b in spoken if a < min(b, length))
    at = 0
    for a, b in [*steps, (length, length)]:
        for lo, hi in itertools.pairwise(cuts):
            lo, hi = max(lo, at), min(hi, a)
            if hi - lo >= shortest:
                passes += [ReadPass(s, min(s + width, hi), ReadPath.READER) for s in range(lo, hi, width)]
            elif hi > lo:
                passes.append(ReadPass(lo, hi, ReadPath.STEPS))
        if max(a, at) < b:
            passes.append(ReadPass(max(a, at), b, ReadPath.STEPS))
        at = max(at, b)
    return tuple(passes)


def steps_only(length: int) -> tuple[ReadPass, ...]:
    """The plan without a reader: every token on the decoding path."""
    return (ReadPass(0, length, ReadPath.STEPS),) if length > 0 else ()


def resume_at(plan: Sequence[ReadPass], tokens: Sequence[int], cache: Held) -> int:
    """How much of what ``cache`` holds a read of ``tokens`` by ``plan`` keeps: the tokens it shares
    with them, up to the first entry another path or another pass wrote (a reader pass is kept
    whole or not at all). Past the plan (the prompt's last token) only the decoding path's entries
    are kept."""
    shared = common_prefix(cache.tokens, tokens)
    for p in plan:
        if p.start >= shared:
            return shared
        if p.path is ReadPath.READER:
            if shared < p.stop or any(origin != p for origin in cache.origins[p.start : p.stop]):
                return p.start
        else:
            foreign = next((i for i in range(p.start, min(p.stop, shared)) if cache.origins[i] is not None), None)
            if foreign is not None:
                return foreign
    end = plan[-1].stop if plan else 0
    return next((i for i in range(end, shared) if cache.origins[i] is not None), shared)


class Held(Protocol):
    """A cache as :func:`resume_at` reads it."""

    tokens: list[int]
    origins: list[ReadPass | None]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case on every step, compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
