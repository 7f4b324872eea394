"""Where preparing spent its time, phase by phase, summed up in one line at the end (what a new
user waits for on a first start: downloads, graphs, tokenizers, the kernels' build)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

# Seconds spent per phase in this process, in the order the phases first ran.
_SPENT: dict[str, float] = {}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the time of the block toward ``name``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _SPENT[name] = _SPENT.get(name, 0.0) + time.perf_counter() - start


def summary() -> str | None:
    """``download 64 s (31%), graph 40 s (19%), ...``, each phase with its share of the time
    spent in all; None where nothing was prepared here."""
    total = sum(_SPENT.values())
    if total < 1:
        return None
    return ", ".join(f"{name} {seconds:.0f} s ({seconds / total:.0%})" for name, seconds in _SPENT.items())
