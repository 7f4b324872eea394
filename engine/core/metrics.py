"""Run metrics, named and defined once (docs/design.md, "Metrics")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


def expected_speedup(alpha: float, gamma: float, c: float) -> float:
    """Leviathan et al. 2023, eq. for the walltime improvement of speculative decoding."""
    if gamma <= 0:
        return 1.0
    mean_tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return mean_tokens / (gamma * c + 1)


class ModeName(StrEnum):
    """A decoding mode's name (a string on the wire: a request's and its metrics' ``mode``);
    :data:`engine.core.modes.MODES` says what each does."""

    BEST = "best"
    SPECULATIVE = "speculative"
    ADAPTIVE = "adaptive"
    HYBRID = "hybrid"
    PLD = "pld"
    AUTOREGRESSIVE = "autoregressive"


class FinishReason(StrEnum):
    """Why an answer ended (a string on the wire: the metrics' ``finish_reason``)."""

    NONE = ""  # not ended yet
    STOP = "stop"  # the model ended its turn, or a stop string came
    LENGTH = "length"  # the answer's token limit
    CONTEXT = "context"  # the model's context is full
    CANCELLED = "cancelled"  # Stop, a closed tab, or a dropped request
    ERROR = "error"


@dataclass
class Stats:
    """Counters of one generation; ``snapshot`` derives the reported figures."""

    mode: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the KV cache (not prefilled again)
    prompt_read: int = 0  # of the prompt, in the target's cache so far (it is read in chunks)
    prefill_seconds: float = 0.0  # reading the prompt's chunks
    prefill_read: int = 0  # prompt tokens those chunks read (not those copied or read by the first round)
    start: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    plain_rounds: int = 0  # rounds a paced request ran as plain steps (speculation did not pay)
    pool_drafted: int = 0  # of the drafted tokens, those the client's n-gram pool proposed
    pool_accepted: int = 0
    target_passes: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_kv_bytes: int = 0
    draft_kv_bytes: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    batch_size: int = 1  # requests in the last round's target pass
    sharing: int = 1  # requests the engine served at the last round (this one included)
    peak_sharing: int = 1  # the most it served at any round of this request
    queue_s: float = 0.0  # from arrival until the engine took the request up
    out_of_view: int = 0  # messages of the conversation left out of the prompt (engine.core.window)

    def add_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.first_token_at is None and n:
            self.first_token_at = now
        self.last_token_at = now
        self.new_tokens += n

    @property
    def prefill_rate(self) -> float | None:
        """Prompt tokens read per second of the prefill passes that read them; None where none
        ran (a short prompt is read by its first round, beside the first token's own work)."""
        return self.prefill_read / self.prefill_seconds if self.prefill_read and self.prefill_seconds else None

    def snapshot(self) -> dict:
        end = self.last_token_at or time.perf_counter()
        wall = end - self.start
        acceptance = self.accepted / self.drafted if self.drafted else 0.0
        per_round = self.drafted / self.rounds if self.rounds else 0.0
        draft_cost = (self.draft_seconds / self.drafted) if self.drafted else 0.0
        target_cost = (self.target_seconds / self.target_passes) if self.target_passes else 0.0
        c = draft_cost / target_cost if target_cost else 0.0
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prompt_read": self.prompt_read,
            "prefill_tokens_per_s": self.prefill_rate,
            "prefill_s": self.prefill_seconds,
            "new_tokens": self.new_tokens,
            "wall_s": wall,
            "ttft_s": (self.first_token_at - self.start) if self.first_token_at else None,
            "tokens_per_s": self.new_tokens / wall if wall > 0 and self.new_tokens else 0.0,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": acceptance,
            "target_passes": self.target_passes,
            "rounds": self.rounds,
            "plain_rounds": self.plain_rounds,
            "pool_drafted": self.pool_drafted,
            "pool_accepted": self.pool_accepted,
            "mean_accepted_length": self.new_tokens / self.target_passes if self.target_passes else 0.0,
            "target_s": self.target_seconds,
            "draft_s": self.draft_seconds,
            "draft_target_cost_ratio": c,
            "expected_speedup": expected_speedup(acceptance, per_round, c) if self.drafted else 1.0,
            "target_kv_bytes": self.target_kv_bytes,
            "draft_kv_bytes": self.draft_kv_bytes,
            "finish_reason": self.finish_reason,
            "batch_size": self.batch_size,
            "sharing": self.sharing,
            "peak_sharing": self.peak_sharing,
            "queue_s": self.queue_s,
            "messages_out_of_view": self.out_of_view,
        }


class Baseline:
    """Plain (autoregressive) decoding speed as measured on this engine, by context length: what
    a speculative answer's speedup is measured against without running it twice.

    An answer of ``n`` tokens decoded plainly would take its own time to first token (the same
    target prefill in every mode) plus ``n - 1`` plain steps at the measured cost per step for
    its context length (steps slow down as the context grows: buckets by powers of two)."""

    MIN_TOKENS = 8  # shorter plain answers measure the step cost too noisily
    SMALLEST = 8  # contexts up to 2**8 tokens share the first bucket

    def __init__(self) -> None:
        self._step_s: dict[int, float] = {}

    def _bucket(self, m: dict) -> int:
        return max(self.SMALLEST, (m["prompt_tokens"] + m["new_tokens"] // 2).bit_length())

    def record(self, m: dict) -> None:
        """Learn from a finished answer: a plain one served alone sets its bucket's step cost."""
        alone = m["peak_sharing"] == 1
        if m["mode"] == ModeName.AUTOREGRESSIVE and alone and m["new_tokens"] >= self.MIN_TOKENS and m["ttft_s"]:
            self._step_s[self._bucket(m)] = (m["wall_s"] - m["ttft_s"]) / (m["new_tokens"] - 1)

    def speedup(self, m: dict) -> float | None:
        """The answer's speedup over plain decoding, where this context length was measured."""
        step = self._step_s.get(self._bucket(m))
        if step is None or not m["ttft_s"] or m["wall_s"] <= 0:
            return None
        return (m["ttft_s"] + (m["new_tokens"] - 1) * step) / m["wall_s"]
