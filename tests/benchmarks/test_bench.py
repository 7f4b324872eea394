"""The bench's own measurements on the tiny pair."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench import top2_margin
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
