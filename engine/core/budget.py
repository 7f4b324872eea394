"""The memory the engine may use, and what each conversation's KV caches take of it.

A server's memory goes to the models (fixed once loaded), to the KV caches of the conversations it
keeps (they grow with their length) and to what a pass holds while it runs (its attention scores
grow with its width times the context). The budget is a limit for the whole process
(``--memory-limit``; by default :data:`DEFAULT_SHARE` of the machine's memory); what the loaded
models leave of it, less :data:`HEADROOM`, is the room for caches.

Room is reserved as an answer grows, the way vLLM allocates KV blocks on demand: a request is
admitted with room for its prompt and the next :data:`ANSWER_BLOCK` tokens of its answer (no more
than its cap allows), and its reservation grows by a block at a time as it writes. Where the room
cannot hold a growing answer, idle conversations' caches are dropped first (least recently used),
then the longest request not yet answering is held back (its caches freed, read again when it
resumes), and last the answer ends with finish reason ``length`` and a line saying that memory ran
out. A newcomer waits while the reservations leave no room for it; only a prompt that could not
fit even alone is refused, at once, its message naming the limit. A batch's rows are padded to the
longest, so a row joins only while the padded batch fits (docs/design.md, "Memory"). A prompt
reader's pass grows the process with the cache it reads into (its output, a copy, and its
scratch): room for reading the longest conversation is kept aside.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

DEFAULT_SHARE = 0.3
# Bytes the process may grow by beside the caches: the web server's handlers, a tokenizer's
# buffers, a pass's activations.
HEADROOM = 768 * 2**20
# What the process holds per byte of a cache's entries: a chunk's attention scratch grows with the
# context beside them, as a long prompt read into the default target shows (docs/benchmarks.md,
# "Memory").
RESIDENT_PER_CACHED_BYTE = 1.5
# Tokens of answer a request's reservation grows by: room for a few seconds of rounds, reserved at
# once (a round adds at most MAX_K + 1 tokens).
ANSWER_BLOCK = 256
GIB = 2**30  # memory is counted and shown in GiB
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": GIB, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``"8G"``, ``"7.5GB"``, ``"6000M"`` or a plain number of bytes (powers of 1,024)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise ValueError(f"not a size: {text!r} (write it as 8G, 7.5GB or 6000M)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def machine_memory() -> int:
    """The memory this process may use: the machine's, or its control group's limit if lower
    (0 where neither can be read)."""
    total = 0
    try:
        meminfo = Path("/proc/meminfo").read_text()
        total = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryBudget:
    """``limit``: bytes the process may hold; ``base``: what it holds with the models loaded;
    ``per_token``: cache bytes per token of a conversation, as held (both models' caches)."""

    limit: int
    base: int
    per_token: int
    reading_per_token: int = 0  # what a prompt reader's pass holds per token of the cache it reads into

    @classmethod
    def of_machine(cls, limit: int | None, base: int, per_token: int, reading_per_token: int = 0) -> MemoryBudget:
        """The budget for ``limit`` bytes (None: :data:`DEFAULT_SHARE` of the machine's memory)."""
        if limit is None:
            limit = int(machine_memory() * DEFAULT_SHARE) or base + 4 * GIB
        return cls(limit, base, int(per_token * RESIDENT_PER_CACHED_BYTE), reading_per_token)

    def bytes_held(self, cache_bytes: int) -> int:
        """What caches of ``cache_bytes`` entries hold of the process's memory."""
        return int(cache_bytes * RESIDENT_PER_CACHED_BYTE)

    @property
    def _free(self) -> int:
        return max(0, self.limit - self.base - HEADROOM)

    @property
    def room(self) -> int:
        """Bytes for KV caches (every conversation's and the batch's), beside a prompt read into the
        longest conversation."""
        return max(0, self._free - self.tokens * self.reading_per_token)

    @staticmethod
    def reservation(context: int, most: int) -> int:
        """The tokens reserved for a request whose context is ``context`` tokens: those and the
        next :data:`ANSWER_BLOCK`, within the ``most`` its caches can hold."""
        return min(most, context + ANSWER_BLOCK)

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.per_token

    @property
    def tokens(self) -> int:
        """The most tokens of caches the room holds (one conversation's, read into)."""
        return self._free // max(1, self.per_token + self.reading_per_token)

    def check(self, tokens: int, what: str) -> None:
        """Refuse a request whose first reservation, ``tokens``, the room cannot hold even with
        nothing else cached."""
        if tokens > self.tokens:
            raise EngineError(
                f"{what} needs room for {tokens:,} tokens of KV cache (about {gib(self.bytes_for(tokens))}); "
                f"this server's memory limit of {gib(self.limit)} leaves room for {self.tokens:,} "
                f"beside its models ({gib(self.base)}). Shorten the conversation."
            )

    def describe(self) -> str:
        reading = f", {gib(self._free - self.room)} for reading prompts" if self.reading_per_token else ""
        return (
            f"memory budget {gib(self.limit)}: models and runtime {gib(self.base)}, "
            f"{gib(self.room)} for KV caches ({self.tokens:,} tokens at {self.per_token / 1e3:.0f} KB each)"
            f"{reading}"
        )
