"""Smoke test on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft, int4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.core.service import Engine, Request

pytestmark = pytest.mark.real
PROMPTS = Path(__file__).parent.parent / "assets" / "prompts" / "coding.jsonl"


@pytest.fixture(scope="module")
def real_engine(real_pair):
    return Engine(*real_pair)


@pytest.mark.parametrize("mode", ["speculative", "best"])
def test_greedy_speculative_equals_autoregressive_on_the_real_pair(real_engine, mode):
    """Token for token: the prompt is prefilled alone in every mode, and a verify pass computes
    each row exactly as a single step does at the target's settings (int4 weights, f32 compute)."""
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:3]]
    for prompt in prompts:
        chat = ({"role": "user", "content": prompt},)
        runs = {
            m: real_engine.run(Request(chat, mode=m, k=4, max_new_tokens=64, reuse_cache=False))
            for m in ("autoregressive", mode)
        }
        ar, sd = runs["autoregressive"], runs[mode]
        print(
            f"\n{prompt[:50]!r}: autoregressive {ar.metrics['tokens_per_s']:.1f} tok/s, "
            f"{mode} {sd.metrics['tokens_per_s']:.1f} tok/s (acceptance {sd.metrics['acceptance_rate']:.2f})"
        )
        assert sd.token_ids == ar.token_ids


def _has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


def test_verify_rows_equal_single_steps_on_the_real_target(real_engine):
    """Bit for bit on AVX-512 CPUs (both measured). On an AVX2-only CPU the plugin's int4 and int8
    matmuls round a one-row pass differently from a wider one, by up to 4e-5 in the logits
    (2026-11-24, docs/benchmarks.md, "An AVX2 machine"): greedy speculative output can differ there
    only where the target's top two logits are that close, and `best` runs plain steps there."""
    target = real_engine.target
    prompt = real_engine.prompt_ids(Request(({"role": "user", "content": "Write a haiku about caches."},)))
    target.reset()
    target.forward(prompt)
    tokens = list(range(1000, 1005))
    singles = np.stack([target.forward([t])[-1] for t in tokens])
    target.trim(len(prompt))
    verified = target.forward(tokens, rows=len(tokens))
    target.reset()
    print(f"\nverify rows vs single steps: max |difference| {np.abs(verified - singles).max():.2e}")
    if _has_avx512():
        np.testing.assert_array_equal(verified, singles)
    else:
        np.testing.assert_allclose(verified, singles, rtol=0, atol=1e-4)


def test_an_answer_is_the_same_whatever_the_cache_held_before(real_engine):
    """A cold cache starts with one token, and passes with a past compute every row alike at any
    width: so a turn prefilled after another conversation (sharing only the system prompt) or in
    other chunks gives the answer a cold cache gives."""
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:3]]
    cold = [
        real_engine.run(
            Request(({"role": "user", "content": p},), mode="best", max_new_tokens=48, reuse_cache=False)
        ).token_ids
        for p in prompts
    ]
    warm = [
        real_engine.run(Request(({"role": "user", "content": p},), mode="best", max_new_tokens=48)).token_ids
        for p in prompts[::-1]
    ]
    assert warm[::-1] == cold


def test_the_cold_cache_starts_with_one_token(real_engine):
    target = real_engine.target
    target.reset()
    widths = []
    forward = target.forward
    target.forward = lambda new, rows=1: widths.append(len(new)) or forward(new, rows)
    try:
        target.forward(list(range(1000, 1040)))
    finally:
        del target.forward
    assert widths == [40, 1, 39]  # the call, then its two passes
    target.reset()
