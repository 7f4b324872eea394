"""The fidelity benchmark's measures: perplexity as llama-perplexity scores it, and the functional
check's verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.fidelity import CHUNK, kept_log_probs, log_softmax, passes, problems, program, text_scores
from engine.core.runtime import EXACT_CONFIG, Runtime


def test_perplexity_scores_the_second_half_of_each_chunk_read_fresh(long_target):
    model = Runtime(long_target, config=EXACT_CONFIG)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.vocab_size, 2 * CHUNK + 100).tolist()  # two whole chunks; the rest is left out
    nll, count, top = 0.0, 0, []
    for chunk in (ids[:CHUNK], ids[CHUNK : 2 * CHUNK]):
        model.reset()
        for position, token in enumerate(chunk[:-1]):  # one token at a time, predicting the next
            logp = log_softmax(model.forward([token]))[-1]
            if position >= CHUNK // 2:
                nll, count = nll - logp[chunk[position + 1]], count + 1
                top.append(int(logp.argmax()))
    assert count == 2 * (CHUNK // 2 - 1)
    perplexity, tops = text_scores(model, ids)
    assert perplexity == pytest.approx(float(np.exp(nll / count)), rel=1e-4)
    assert np.mean(np.asarray(tops) == top) > 0.99  # (a near-tie may round to another top)


def test_the_base_file_is_laid_out_as_llama_perplexity_reads_it(long_target, tmp_path):
    """``--kl-divergence-base``: "_logits_", the context, the vocabulary, the chunks, every token
    of the chunks, then per scored row a scale and the lowest log-probability (f32) and a uint16
    per token (an even count), from which each log-probability comes back within half a step."""
    model = Runtime(long_target, config=EXACT_CONFIG)
    ids = np.random.default_rng(1).integers(0, model.vocab_size, 2 * CHUNK + 7).tolist()
    path = tmp_path / "base.kld"
    with path.open("wb") as file:
        _, top = text_scores(model, ids, file)
    data = path.read_bytes()
    assert data[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(data, np.int32, 3, 8)
    assert (n_ctx, n_vocab, n_chunk) == (CHUNK, model.vocab_size, 2)
    assert np.frombuffer(data, np.int32, 2 * CHUNK, 20).tolist() == ids[: 2 * CHUNK]
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(data, np.uint16, offset=20 + 8 * CHUNK).reshape(-1, nv)
    assert len(rows) == 2 * (CHUNK // 2 - 1) and rows[:, 4:].argmax(-1).tolist() == top
    model.reset()
    logp = log_softmax(model.forward(ids[:CHUNK], CHUNK // 2))[:-1]
    scale, low = rows[: len(logp), :4].copy().view(np.float32).T
    back = scale[:, None] * rows[: len(logp), 4 : 4 + n_vocab] + low[:, None]
    kept = logp >= low[:, None]
    assert np.abs(back - logp)[kept].max() <= scale.max() / 2 + 1e-5
    assert np.array_equal(kept_log_probs(logp), rows[: len(logp)])


SOLUTION = """def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])
"""


@pytest.mark.parametrize(
    "answer, expected",
    [
        (f"Here it is:\n\n```python\n{SOLUTION}```\n\nIt compares every pair.", True),
        ("    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n", True),
        ("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```", False),
        ("```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```", False),
        ("I cannot help with that.", False),
    ],
    ids=["code block", "body only", "wrong", "never ends", "no code"],
)
def test_an_answer_passes_only_where_its_code_passes_the_problems_tests(answer, expected):
    problem = problems(164)[0]
    assert problem.entry_point == "has_close_elements"
    assert passes(problem, answer) is expected


def test_an_answer_with_the_whole_function_gets_the_prompts_imports():
    problem = problems(164)[0]
    code = program(problem, f"```python\n{SOLUTION}```")
    assert code.startswith("from typing import List\n") and code.count("def has_close_elements") == 1


def test_problems_are_spread_over_the_set():
    chosen = problems(41)
    assert len(chosen) == 41 and chosen[1].task_id == "HumanEval/4"


def test_the_files_side_is_computed_once_and_read_back(long_target, tmp_path, monkeypatch):
    """The file model's answers, positions and perplexity are kept in the cache: a second run
    reads them and builds no model; its agreement with itself is exact."""
    import argparse

    from benchmarks import fidelity
    from engine.hf import auto_tokenizer

    args = argparse.Namespace(measures=["agreement", "perplexity"], cache_dir=tmp_path)
    tokenizer = auto_tokenizer(long_target)
    text_ids = [5 + i % 300 for i in range(CHUNK + 40)]  # (within the tiny vocabulary)
    first = fidelity.the_files_side(args, long_target, tokenizer, text_ids)
    monkeypatch.setattr(fidelity, "Runtime", lambda *a, **k: pytest.fail("the file's side was computed again"))
    again = fidelity.the_files_side(args, long_target, tokenizer, text_ids)
    assert json.dumps(again) == json.dumps(first) and set(again) == {"sequences", "positions", "perplexity", "text_top"}
    model = Runtime(long_target, config=EXACT_CONFIG)
    top1, deltas = fidelity.agreement(again["positions"]["coding"], model, again["sequences"]["coding"])
    assert top1 == 1.0 and max(deltas) < 1e-4


def test_the_functional_check_alone_prepares_no_file_model(tmp_path, monkeypatch):
    """The file model (the GGUF dequantized through torch) is prepared only to be compared against."""
    import argparse

    from benchmarks import fidelity

    (tmp_path / "openvino_model.bin").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(fidelity, "prepare_one", lambda *a, **k: pytest.fail("the file model was prepared"))
    monkeypatch.setattr(fidelity, "target_ir", lambda args, precision, cache: tmp_path)
    monkeypatch.setattr(fidelity, "problems", lambda count: problems(1))
    monkeypatch.setattr(fidelity, "_functional", lambda args, precisions, rows, items: {"int4": ["an answer"]})
    args = argparse.Namespace(precisions="int4", measures=["functional"], problems=1, llamacpp=True, cache_dir=tmp_path)
    figures = fidelity.run_fidelity(args)
    assert [row["weights"] for row in figures["rows"]] == ["int4"] and figures["answers"] == {"int4": ["an answer"]}
    assert figures["task_ids"] == [problems(1)[0].task_id]
