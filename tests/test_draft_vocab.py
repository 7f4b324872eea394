"""The token ranking a draft head is cut by: counted by benchmarks/draft_vocab.py, shipped as
engine/core/draft_vocab.npz, applied only to the vocabulary it was counted over."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import draft_vocab as counting
from engine.core.draft_vocab import RANKING, frequent_ids, write_ranking
from engine.errors import EngineError
from engine.hf import auto_tokenizer
from tests.tiny import SPECIALS


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_dir):
    return auto_tokenizer(tokenizer_dir)


def test_a_counted_ranking_gives_the_control_tokens_first_then_the_most_frequent_ids(
    ir_target, tiny_tokenizer, tmp_path, capsys
):
    out = tmp_path / "ranking.npz"
    assert counting.main(["--target", str(ir_target), "--out", str(out), "--max-mb", "0.05", "--keep", "300"]) == 0
    assert "| code held out    | by count " in capsys.readouterr().out
    ids = frequent_ids(tiny_tokenizer, 300, out)
    controls = tiny_tokenizer.convert_tokens_to_ids(SPECIALS)
    assert sorted(ids[: len(controls)]) == sorted(controls)
    assert len(set(ids.tolist())) == 300 and ids.max() < len(tiny_tokenizer)


def test_ranks_follow_the_counts_with_ties_by_id_after_the_ids_put_first():
    counts = np.array([5, 0, 9, 5, 1])
    np.testing.assert_array_equal(counting.rank(counts, [1]), [1, 2, 0, 3, 4])


def test_a_ranking_counted_over_another_vocabulary_is_refused(tiny_tokenizer, tmp_path):
    out = tmp_path / "ranking.npz"
    write_ranking(out, range(10), tiny_tokenizer)

    class Other:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    with pytest.raises(EngineError, match="another vocabulary"):
        frequent_ids(Other(), 5, out)
    with pytest.raises(EngineError, match="1 to 10 ids"):
        frequent_ids(tiny_tokenizer, 11, out)
    np.testing.assert_array_equal(frequent_ids(tiny_tokenizer, 4, out), [0, 1, 2, 3])


@pytest.mark.real
def test_the_shipped_ranking_fits_the_default_pair_and_keeps_its_chat_tokens_first(real_pair):
    tokenizer = auto_tokenizer(real_pair[0])
    first = frequent_ids(tokenizer, 8).tolist()
    assert set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])) <= set(first)
    assert RANKING.stat().st_size < 300 * 1024
