"""KV caches per conversation: several on one pair of compiled models, found by prefix.

Each session is a target cache and a draft cache (one ``InferRequest`` each on the shared
compiled models: the weights are loaded once) and the drafters built on them. A request goes to
the session it continues whose target cache holds the longest prefix of it, so a follow-up turn
prefills only its new suffix, whoever spoke in between; no session id is needed (an API client
re-sends the conversation, as the UI does). A prompt that continues no session takes an empty
one, else the least recently used one is taken over (its conversation re-prefills on its next
turn, which the request's ``cached_tokens`` shows). A new conversation does not read the chat
template's opening (the system turn and the user's turn up to the message): its entries are copied
from an :class:`Opening` read once, bit for bit what reading them computes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.drafters import Drafter
from engine.core.measured import Measured
from engine.core.reader import PromptReader, read_pass
from engine.core.reading import ReadPass, ReadPath, read_plan
from engine.core.runtime import Runtime, common_prefix

# A prompt continues a session when it repeats at least this share of what the session caches
# (the rest: the last answer's tail, re-tokenized) and more than the chat template's header.
CONTINUES = 0.5
MIN_SHARED = 32
# Conversations kept at most (each an InferRequest on the shared models); the bytes their caches
# take are the memory budget's to bound (engine.core.budget).
MAX_SESSIONS = 32
OPENING = "opening"  # the name its entries are kept under, with the start's measurements


@dataclass
class Session:
    target: Runtime
    draft: Runtime | None
    drafters: dict[str, Drafter]

    def reset(self) -> None:
        for runtime in (self.target, self.draft):
            if runtime is not None:
                runtime.reset()

    def release(self) -> None:
        """Drop the conversation's caches and give their memory back."""
        for runtime in (self.target, self.draft):
            if runtime is not None:
                runtime.release()

    @property
    def kv_cache_bytes(self) -> int:
        return self.target.kv_cache_bytes + (self.draft.kv_cache_bytes if self.draft is not None else 0)


@dataclass(frozen=True)
class Opening:
    """What every conversation starts with (the chat template's system turn and the opening of
    the user's) and each role's cache entries for it, read by the plan every prompt that starts
    with it is read by (engine.core.reading: its end is where a prompt's runs restart; the target
    reads its first token alone, ``Runtime.first_token_alone``, so later entries do not depend on
    the passes): copied in, the opening leaves the answer unchanged, and it
    saves most of a short prompt's reading (docs/benchmarks.md, "Many users").
    The draft's u8 cache comes back requantized (its logits moved by up to 0.5, where reading
    the prompt in other chunks moves them by 1.5): the draft's rounding never changes an answer."""

    tokens: tuple[int, ...]
    entries: tuple[dict[str, np.ndarray] | None, ...]  # per role: the target's, the draft's
    origins: tuple[ReadPass | None, ...] = ()  # what wrote the target's (Runtime.origins)

    @classmethod
    def read(
        cls, tokens: Sequence[int], runtimes: Sequence[Runtime | None], reader: PromptReader | None = None
    ) -> Opening:
        """Read ``tokens`` on each runtime (left empty after): the target's through ``reader`` where
        one reads prompts, in the passes of its plan (every prompt's plan restarts after them)."""
        entries: list[dict[str, np.ndarray] | None] = []
        origins: list[ReadPass | None] = []
        for role, runtime in enumerate(runtimes):
            if runtime is None:
                entries.append(None)
                continue
            runtime.reset()
            if role == 0 and reader is not None:
                for part in read_plan(len(tokens), shortest=reader.shortest):
                    read_pass(runtime, reader, tokens, part, len(tokens))
                origins = list(runtime.origins)
            else:
                runtime.forward(list(tokens))
            entries.append(runtime.entries())
            runtime.release()
        return cls(tuple(tokens), tuple(entries), tuple(origins))

    @classmethod
    def kept(
        cls, measured: Measured, tokens: Sequence[int], runtimes: Sequence[Runtime | None], reader: PromptReader | None
    ) -> Opening:
        """The opening of ``tokens`` as an earlier start on this machine read it, kept with its
        measurements (the same CPU, kernels, models and settings compute the same entries, bit for
        bit), else read here (:meth:`read`) and kept."""
        about, arrays = measured.get(OPENING), measured.arrays(OPENING)
        if about is not None and arrays is not None and about["tokens"] == list(tokens):
            return cls._from_kept(about, arrays)
        opening = cls.read(tokens, runtimes, reader)
        measured.put_arrays(OPENING, {f"{role}/{k}": v for role, e in opening._roles() for k, v in e.items()})
        origins = [None if o is None else [o.start, o.stop, o.path.value] for o in opening.origins]
        measured.put(
            OPENING, {"tokens": list(tokens), "roles": [e is not None for e in opening.entries], "origins": origins}
        )
        return opening

    @classmethod
    def _from_kept(cls, about: dict, arrays: dict[str, np.ndarray]) -> Opening:
        entries = tuple(
            {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(f"{role}/")} if present else None
            for role, present in enumerate(about["roles"])
        )
        origins = tuple(None if o is None else ReadPass(o[0], o[1], ReadPath(o[2])) for o in about["origins"])
        return cls(tuple(about["tokens"]), entries, origins)

    def _roles(self) -> list[tuple[int, dict[str, np.ndarray]]]:
        return [(role, e) for role, e in enumerate(self.entries) if e is not None]

    def seed(self, session: Session, prompt: Sequence[int]) -> None:
        """Load into ``session``'s caches as much of the opening as ``prompt`` starts with, where
        a cache holds less of the prompt (its last token is left for the first round to read)."""
        n = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        for runtime, entries, origins in zip((session.target, session.draft), self.entries, (self.origins, ())):
            if runtime is not None and entries is not None and common_prefix(runtime.tokens, prompt) < n:
                runtime.load(prompt[:n], entries, origins)


class SessionPool:
    """At most ``capacity`` sessions, most recently used last. ``build(target, draft)`` makes the
    drafters of a session's runtimes; ``opening``: what most conversations start with, copied into
    each new one (:class:`Opening`)."""

    def __init__(
        self,
        target: Runtime,
        draft: Runtime | None,
        build: Callable[[Runtime | None], dict[str, Drafter]],
        capacity: int,
        opening: Opening | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"at least one session is needed, got {capacity}")
        self.capacity = capacity
        self._build = build
        self.sessions = [Session(target, draft, build(draft))]
        self.opening = opening

    def take(self, prompt: list[int], busy: Collection[Session] = ()) -> Session:
        """The session for ``prompt``, moved to most recently used, its caches holding the opening
        where the prompt starts with it; never one of ``busy`` (those serving other requests: the
        caller keeps fewer requests going than :attr:`capacity`)."""
        free = self._free_indices(busy)
        best = self._continued(prompt, free)
        if best is None:
            best = self._free(free)
        session = self.sessions.pop(best)
        self.sessions.append(session)
        if self.opening is not None:
            self.opening.seed(session, prompt)
        return session

    def continued(self, prompt: list[int], busy: Collection[Session] = ()) -> Session | None:
        """The session whose cache ``prompt`` continues, if any (:meth:`take` would give it)."""
        best = self._continued(prompt, self._free_indices(busy))
        return None if best is None else self.sessions[best]

    def idle(self, busy: Collection[Session] = ()) -> list[Session]:
        """The sessions holding a cache that no request uses, least recently used first."""
        return [self.sessions[i] for i in self._free_indices(busy) if self.sessions[i].kv_cache_bytes]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(session.kv_cache_bytes for session in self.sessions)

    def _free_indices(self, busy: Collection[Session]) -> list[int]:
        return [i for i, s in enumerate(self.sessions) if not any(s is b for b in busy)]

    def _continued(self, prompt: list[int], free: list[int]) -> int | None:
        shared = {i: common_prefix(self.sessions[i].target.tokens, prompt) for i in free}
        # Among the sessions the prompt continues: a session holding a longer conversation that
        # this prompt repeats the start of (the same opening, asked again) is not this one's.
        continued = [i for i in free if shared[i] and self._continues(self.sessions[i], shared[i])]
        return max(continued, key=lambda i: (shared[i], i), default=None)  # the latest on a tie

    @staticmethod
    def _continues(session: Session, shared: int) -> bool:
        cached = len(session.target.tokens)
        return cached == 0 or (shared >= MIN_SHARED and shared >= CONTINUES * cached)

    def _free(self, free: list[int]) -> int:
        """A session to overwrite: an unused one, a new one while there is room, else the least
        recently used one (its cache is trimmed to what it shares with the prompt when used)."""
        empty = next((i for i in free if not self.sessions[i].target.tokens), None)
        if empty is not None:
            return empty
        if len(self.sessions) < self.capacity:
            base = self.sessions[0]
            draft = base.draft.fork() if base.draft is not None else None
            self.sessions.append(Session(base.target.fork(), draft, self._build(draft)))
            return len(self.sessions) - 1
        if not free:
            raise RuntimeError("every session is serving a request")
        return free[0]
