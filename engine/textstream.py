"""Incremental detokenization: text deltas that never split a multi-byte character."""
from __future__ import annotations


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks characters whose UTF-8 bytes span several tokens
    (and drops the spaces some tokenizers add between words), so each step decodes a
    short window and holds back output while it ends in an incomplete character.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: context for spacing rules
        self.read = 0  # tokens already turned into text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete character (or nothing printable yet): wait for more bytes
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back when the stream ends (an incomplete character shows as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]
