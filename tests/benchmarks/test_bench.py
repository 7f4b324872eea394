"""The bench's own measurements on the tiny pair."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench import Run, best_trails, same_text, summarize, top2_margin
from engine.core.runtime import EXACT_CONFIG, Runtime
from tests.test_decoding import PROMPTS


def test_top2_margin_is_measured_as_autoregressive_decoding_computes_it(engine, ir_target):
    prompt, prefix = engine.tokenizer.encode(PROMPTS[0]), engine.tokenizer.encode(" return a")
    steps = Runtime(ir_target, config=EXACT_CONFIG, first_token_alone=True)  # as the engine's target
    logits = steps.forward(prompt)[-1]
    for token in prefix:
        logits = steps.forward([token])[-1]
    top = np.sort(logits)[-2:]
    margin = engine.with_models(lambda target, _: top2_margin(target, prompt, prefix))
    assert margin == pytest.approx(float(top[1] - top[0]), abs=0)


def test_the_check_fails_where_best_trails_the_fastest_fixed_mode_by_more_than_three_percent():
    rows = [{"mode": "ar", "tokens_per_s": 16.0}, {"mode": "hybrid", "tokens_per_s": 25.0}]
    assert best_trails([*rows, {"mode": "best", "tokens_per_s": 24.5}]) is None
    assert "trails hybrid" in str(best_trails([*rows, {"mode": "best", "tokens_per_s": 24.0}]))
    peer = {"mode": "llamacpp", "tokens_per_s": 40.0}  # only our own modes count
    assert best_trails([*rows, peer, {"mode": "best", "tokens_per_s": 25.0}]) is None


def _run(prompt_id: str, mode: str, text: str, wall_s: float) -> Run:
    return Run(prompt_id, mode, [], text, wall_s, 0.1, 10)


def test_peers_compare_on_the_prompts_where_both_wrote_the_same_text_and_against_their_own_plain():
    runs = [
        _run("a", "ar", "x = 1", 1.0),
        _run("a", "best", "x = 1", 0.5),
        _run("a", "llamacpp", "x = 1 ", 0.8),
        _run("a", "llamacpp-best", "x = 1", 0.4),
        _run("b", "ar", "short", 1.0),
        _run("b", "best", "short", 0.5),
        _run("b", "llamacpp", "a much longer answer", 4.0),
        _run("b", "llamacpp-best", "a much longer answer", 1.0),
    ]
    assert {r.prompt_id for r in same_text(runs)} == {"a"}
    rows = {row["mode"]: row for row in summarize(runs)}
    assert rows["best"]["speedup_vs_own_plain"] == pytest.approx(2.0)
    assert rows["llamacpp-best"]["speedup_vs_own_plain"] == pytest.approx(4.8 / 1.4)  # its seconds against plain's
    assert rows["llamacpp"]["speedup_vs_own_plain"] == pytest.approx(1.0)
