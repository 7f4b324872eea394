"""Incremental detokenization never shows a broken multi-byte character."""
from __future__ import annotations

from transformers import AutoTokenizer

from engine.textstream import IncrementalDecoder

TEXT = "héllo 日本語のテキスト 🙂🚀 naïve café, 한국어"


def test_streamed_deltas_rebuild_the_text_without_broken_characters(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode(TEXT)
    split = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert split, "the test needs tokens that carry only part of a character"
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode("🙂")
    decoder = IncrementalDecoder(tokenizer)
    held = [decoder.push(i) for i in ids[:-1]]
    assert "".join(held) == ""
    assert decoder.flush() != ""
