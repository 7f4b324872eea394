"""Smoke test on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft, int4)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import NEAR_TIE
from engine.service import Engine, Request

pytestmark = pytest.mark.real
PROMPTS = Path(__file__).parent.parent / "assets" / "prompts" / "coding.jsonl"


@pytest.fixture(scope="module")
def real_engine(real_pair):
    return Engine(*real_pair)


def test_greedy_speculative_matches_autoregressive_on_the_real_pair(real_engine):
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:3]]
    for prompt in prompts:
        chat = ({"role": "user", "content": prompt},)
        runs = {mode: real_engine.run(Request(chat, mode=mode, k=4, max_new_tokens=64, reuse_cache=False))
                for mode in ("autoregressive", "speculative")}
        ar, sd = runs["autoregressive"], runs["speculative"]
        print(f"\n{prompt[:50]!r}: autoregressive {ar.metrics['tokens_per_s']:.1f} tok/s, "
              f"speculative {sd.metrics['tokens_per_s']:.1f} tok/s "
              f"(acceptance {sd.metrics['acceptance_rate']:.2f})")
        if sd.token_ids != ar.token_ids:
            i = next(i for i, (a, b) in enumerate(zip(ar.token_ids, sd.token_ids + [-1])) if a != b)
            margin = real_engine.top2_margin(real_engine.prompt_ids(Request(chat)), ar.token_ids[:i])
            assert margin < NEAR_TIE, f"divergence at token {i} with top-2 margin {margin:.3f}"
