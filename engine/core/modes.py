"""Every decoding mode in one registry: its name, where its drafts come from, its K and help.

The engine builds each mode's drafter from here, the app lists the modes and their help
from here, and the bench names and repeats them from here. A new drafting mode is one
entry below plus its drafter in :mod:`engine.core.drafters`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from engine.core.drafters import Drafter, HybridDrafter, LookupDrafter, ModelDrafter, Price
from engine.core.metrics import ModeName
from engine.core.runtime import Runtime

# "adaptive": its draft model stops a round once its confidence in the token it drafted falls
# below this (0.3 stopped almost no round; docs/benchmarks.md, "How best was chosen").
ADAPTIVE_P_MIN = 0.7
# "best": the fastest exact configuration measured on this machine (docs/benchmarks.md, "How best
# was chosen"): hybrid drafting at K=4 (with the draft's next-token guess it beat a confidence stop).
BEST_K = 4
# hybrid: prompt lookup only where at least this many tokens match, else the draft model.
HYBRID_MIN_MATCH = 4
# The draft model sees a long conversation's first tokens and its last DRAFT_WINDOW to
# 3 * DRAFT_WINDOW tokens (ModelDrafter.cut_view): a bounded prefill and bounded steps at any length.
DRAFT_WINDOW = 256
# Prompt lookup copies up to this many tokens per round, whatever the draft model's K: a copied
# run costs only verify rows (docs/benchmarks.md, "What a pass costs as the context grows").
LOOKUP_SPAN = 16
# Pass widths the engine times at start besides 2 and K + 1, to price lookup copies up to LOOKUP_SPAN
# (PassCosts.worth_copying; between them a pass's cost is interpolated, nearly linear past 2).
COPY_WIDTHS = (LOOKUP_SPAN + 1,)


class DrafterParts:
    """What the modes' drafters are made of, built once per engine and shared: every mode that
    drafts with the draft model uses the one draft runtime (one KV cache). ``price``: how many
    of the tokens prompt lookup offers are worth verifying on this machine, at an acceptance, a
    context length and a bar (``PassCosts.worth_copying``), for the mode that paces itself."""

    def __init__(self, vocab_size: int, draft: Runtime | None, price: Price | None = None):
        self.vocab_size = vocab_size
        self.draft = draft
        self.price = price

    @cached_property
    def model(self) -> ModelDrafter:
        assert self.draft is not None
        return ModelDrafter(self.draft, vocab_size=self.vocab_size, window=DRAFT_WINDOW)

    @cached_property
    def hybrid(self) -> HybridDrafter:
        return HybridDrafter(LookupDrafter(self.vocab_size, min_match=HYBRID_MIN_MATCH, span=LOOKUP_SPAN), self.model)

    def best(self) -> HybridDrafter:
        """Hybrid drafting with each lookup copy cut to what pays here."""
        lookup = LookupDrafter(self.vocab_size, min_match=HYBRID_MIN_MATCH, span=LOOKUP_SPAN, price=self.price)
        return HybridDrafter(lookup, self.model)

    def adaptive(self) -> ModelDrafter:
        assert self.draft is not None
        return ModelDrafter(
            self.draft, p_min=ADAPTIVE_P_MIN, adaptive=True, vocab_size=self.vocab_size, window=DRAFT_WINDOW
        )

    def lookup(self) -> LookupDrafter:
        return LookupDrafter(self.vocab_size, span=LOOKUP_SPAN)


@dataclass(frozen=True)
class Mode:
    name: ModeName
    short: str  # the bench's name for it
    help: str  # where the drafts come from, in a few words
    drafter: Callable[[DrafterParts], Drafter] | None  # None: autoregressive
    needs_draft_model: bool = True
    fixed_k: int | None = None  # a K of its own, whatever the request asks
    takes_k: bool = True  # a request's K changes its drafts (the bench runs it once per K it is given)
    paced: bool = False  # speculates only while it pays (decoding.Pacer)

    def k(self, requested: int) -> int:
        return self.fixed_k or requested


MODES: dict[str, Mode] = {  # by name (a ModeName, or the same string)
    m.name: m
    for m in (
        Mode(
            ModeName.BEST,
            "best",
            f"fastest measured here: prompt lookup, else the draft model, at K={BEST_K}, only while it pays",
            DrafterParts.best,
            fixed_k=BEST_K,
            takes_k=False,
            paced=True,
        ),
        Mode(ModeName.SPECULATIVE, "sd", "draft model", lambda parts: parts.model),
        Mode(ModeName.ADAPTIVE, "adaptive", "draft model, stops when unsure, adaptive K", DrafterParts.adaptive),
        Mode(ModeName.HYBRID, "hybrid", "prompt lookup, else the draft model", lambda parts: parts.hybrid),
        Mode(
            ModeName.PLD,
            "pld",
            f"prompt lookup (copies up to {LOOKUP_SPAN} tokens)",
            DrafterParts.lookup,
            needs_draft_model=False,
            takes_k=False,
        ),
        Mode(
            ModeName.AUTOREGRESSIVE,
            "ar",
            "the target alone, one pass per token",
            None,
            needs_draft_model=False,
            takes_k=False,
        ),
    )
}
BY_SHORT_NAME = {m.short: m for m in MODES.values()}
