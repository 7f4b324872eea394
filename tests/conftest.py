"""Session fixtures: tiny models built once, prepared through the real conversion path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.core.runtime import EXACT_CONFIG
from engine.hf import hide_unloadable_torchvision
from engine.prepare.convert import Compression
from engine.prepare.pipeline import prepare_one
from tests.tiny import build_model, build_tokenizer


def pytest_configure(config):
    hide_unloadable_torchvision()  # before any test imports transformers' model classes
    config.addinivalue_line("markers", "real: needs the prepared default model pair (slow)")
    config.addinivalue_line("markers", "browser: drives a real Chromium")
    config.addinivalue_line("markers", "install: installs the app into a fresh venv (a few minutes)")
    config.addinivalue_line("markers", "cluster: starts a two-node Ray cluster on loopback (a minute or two)")
    config.addinivalue_line("markers", "slow: an opt-in guard that takes minutes (make test-slow)")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_cache(tiny_dir) -> Path:
    return tiny_dir / "cache"


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_dir) -> Path:
    folder = tiny_dir / "tokenizer"
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def hf_target(tiny_dir, tokenizer_dir) -> Path:
    return build_model(tiny_dir / "hf-target", tokenizer_dir, "qwen2", seed=1)


@pytest.fixture(scope="session")
def hf_llama(tiny_dir, tokenizer_dir) -> Path:
    return build_model(tiny_dir / "hf-llama", tokenizer_dir, "llama", seed=3)


@pytest.fixture(scope="session")
def hf_draft(tiny_dir, tokenizer_dir, hf_target) -> Path:
    return build_model(tiny_dir / "hf-draft", tokenizer_dir, base=hf_target, noise=0.15, seed=2)


@pytest.fixture(scope="session")
def ir_target(hf_target, tiny_cache) -> Path:
    return prepare_one(str(hf_target), Compression("fp16"), tiny_cache).path


@pytest.fixture(scope="session")
def ir_draft(hf_draft, tiny_cache) -> Path:
    return prepare_one(str(hf_draft), Compression("fp16"), tiny_cache).path


@pytest.fixture(scope="session")
def long_target(tiny_dir, tokenizer_dir, tiny_cache) -> Path:
    """A tiny target whose context holds 8,192 tokens (long prompts, memory, reading progress)."""
    hf = build_model(tiny_dir / "hf-long", tokenizer_dir, seed=5, max_positions=8192)
    return prepare_one(str(hf), Compression("fp16"), tiny_cache).path


@pytest.fixture(scope="session")
def engine(ir_target, ir_draft):
    """An engine on the tiny pair at f32, where speculative decoding must be exact. Its paced mode
    has no machine figures (``Pacing()``): a tiny model's passes are all overhead, so what they cost
    says nothing of a real pair's, and every round may pay (as in each tiny engine of the tests)."""
    from engine.core.pacing import Pacing
    from engine.core.service import Engine
    from engine.core.settings import Settings

    # One session: the tests that inject faults or slowness patch engine.target, the one the
    # requests must then use (tests/test_sessions.py has its own engine with two).
    return Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, max_sessions=1, pacing=Pacing(), prompt_reader="f32")
    )


@pytest.fixture(scope="module")
def pair(ir_target, ir_draft):
    """The tiny target's runtime and a drafter on the tiny draft's, at f32, as the engine runs them."""
    from engine.core.drafters import ModelDrafter
    from engine.core.runtime import EXACT_CONFIG, Runtime

    draft = Runtime(ir_draft, config=EXACT_CONFIG, masked_rollback=True, pass_width=2)
    return Runtime(ir_target, config=EXACT_CONFIG), ModelDrafter(draft)


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def real_pair():
    """The prepared default pair, or skip where it is not prepared."""
    from engine.prepare.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
    from engine.prepare.pipeline import cached, default_cache_dir, default_compressions, entry_dir
    from engine.prepare.sources import resolve

    cache = default_cache_dir()
    default = default_compressions()
    compressions = {DEFAULT_TARGET: default["target"], DEFAULT_DRAFT: default["draft"]}
    dirs = [cached(entry_dir(cache, resolve(s), c)) for s, c in compressions.items()]
    if not all(dirs) and not os.environ.get("SPECCHAT_PREPARE_REAL"):
        pytest.skip("the default pair is not prepared (python -m engine.prepare)")
    if not all(dirs):
        from engine.prepare.pipeline import prepare_pair

        dirs = prepare_pair(DEFAULT_TARGET, DEFAULT_DRAFT, *compressions.values(), cache)
    return tuple(d.path for d in dirs)
