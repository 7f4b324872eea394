"""Memory grows with the KV caches, not with a prompt's length times anything else, and stays
inside the engine's budget: long prompts on a tiny model whose context holds thousands of tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.core.decoding import PREFILL_CHUNK
from engine.core.memory import peak_rss_since, reset_peak_rss
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine, Request
from engine.prepare.convert import Compression
from engine.prepare.pipeline import prepare_one
from tests.tiny import build_model

LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def long_target(tiny_dir, tokenizer_dir, tiny_cache) -> Path:
    """A tiny target whose context holds 8,192 tokens."""
    hf = build_model(tiny_dir / "hf-long", tokenizer_dir, seed=5, max_positions=LONG_CONTEXT)
    return prepare_one(str(hf), Compression("fp16"), tiny_cache).path


@pytest.fixture(scope="module")
def long_engine(long_target):
    return Engine(long_target, None, config=EXACT_CONFIG, max_sessions=1)


def _prompt(n: int, vocab: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(10, vocab, n))


def test_a_long_prompt_is_read_in_chunks_never_in_one_pass(long_engine):
    widths: list[int] = []
    forward = long_engine.target.forward

    def spy(new_tokens, rows=1):
        widths.append(len(new_tokens))
        return forward(new_tokens, rows)

    long_engine.target.forward = spy
    try:
        event = long_engine.run(Request(prompt_ids=_prompt(3000, 300), mode="autoregressive", max_new_tokens=2))
    finally:
        del long_engine.target.forward
    assert event.kind == "done", event.error
    assert sum(widths) >= 3000 and max(widths) <= PREFILL_CHUNK


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from Linux's /proc")
def test_reading_a_prompt_peaks_at_its_kv_cache_plus_a_constant(long_engine):
    """A pass over the whole prompt would hold its attention scores (heads x length^2 floats:
    about 0.5 GB here); passes of a chunk hold heads x chunk x length."""
    long_engine.run(Request(prompt_ids=_prompt(64, 300, seed=1), mode="autoregressive", max_new_tokens=1))
    prompt = _prompt(6000, 300, seed=2)
    reset_peak_rss()
    event = long_engine.run(Request(prompt_ids=prompt, mode="autoregressive", max_new_tokens=2))
    assert event.kind == "done", event.error
    grown = peak_rss_since()
    kv = len(prompt) * long_engine.target.kv_bytes_per_token
    assert grown <= 2 * kv + 96 * 2**20, f"reading 6,000 tokens grew the process by {grown / 2**20:.0f} MiB"
