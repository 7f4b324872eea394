"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks characters whose UTF-8 bytes span several tokens
    (and drops the spaces some tokenizers add between words), so each step decodes a
    short window and holds back output while it ends in an incomplete character.
    """

    CONTEXT = 4  # earlier tokens kept as the window's start when continuing a text

    def __init__(self, tokenizer: Any, before: Sequence[int] = ()) -> None:
        """``before``: the tokens of the text this stream continues (their text is not repeated)."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(before[-self.CONTEXT :])
        self.prefix = 0  # window start: context for spacing rules
        self.read = len(self.ids)  # tokens already turned into text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete character (or nothing printable yet): wait for more bytes
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back when the stream ends (an incomplete character shows as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class StopStrings:
    """Cuts streamed text just before the first stop string.

    Text that could be the start of a stop string is held back until the next delta
    shows whether it is: what has been sent cannot be taken back."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """The text that is safe to send now, and whether a stop string was found."""
        text = self.held + delta
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """What is still held back when the stream ends without a stop string."""
        held, self.held = self.held, ""
        return held
