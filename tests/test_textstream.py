"""Incremental detokenization never shows a broken multi-byte character."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.core.textstream import IncrementalDecoder, StopStrings

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


@pytest.mark.parametrize(
    "deltas, expected",
    [
        (["ab", "cSTOPde"], ["ab", "c"]),
        (["abS", "TO", "P tail"], ["ab", "", ""]),  # a stop string split across deltas
        (["abS", "x"], ["ab", "Sx"]),  # held back, then released: it was not a stop string
    ],
)
def test_stop_strings_cut_the_stream_just_before_the_first_one(deltas, expected):
    stops = StopStrings(("never", "STOP"))
    sent = [stops.push(d)[0] for d in deltas]
    assert sent == expected
