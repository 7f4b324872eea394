"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft, int4), briefly: exactness, and
the app answering on it (answers capped)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client

from engine import ggml, manifest
from engine.core.budget import GIB
from engine.core.memory import resident_bytes
from engine.core.requests import Request
from engine.core.runtime import IN_14_BITS, TARGET_CONFIG, Runtime
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.prepare import ggml_ir
from engine.prepare.pipeline import PreparedModel, default_cache_dir
from tests.ui.served import ask, last_answer, serve

pytestmark = pytest.mark.real
PROMPTS = Path(__file__).parent.parent / "assets" / "prompts" / "coding.jsonl"
ANSWER = 48  # tokens per answer compared: ten rounds of K=4 or more


@pytest.fixture(scope="module")
def real_engine(real_pair):
    with Engine(*real_pair) as engine:  # (closed: the models are freed for the modules after)
        yield engine


@pytest.fixture(scope="module")
def chats() -> list[tuple[dict, ...]]:
    return [({"role": "user", "content": json.loads(line)["prompt"]},) for line in PROMPTS.read_text().splitlines()[:3]]


@pytest.fixture(scope="module")
def autoregressive(real_engine, chats) -> list[list[int]]:
    """Plain greedy answers: what every other mode must give."""
    return [
        real_engine.run(Request(chat, mode="autoregressive", max_new_tokens=ANSWER, reuse_cache=False)).token_ids
        for chat in chats
    ]


@pytest.mark.parametrize("mode", ["speculative", "best"])
def test_greedy_speculative_equals_autoregressive_on_the_real_pair(real_engine, chats, autoregressive, mode):
    """Token for token: the prompt is prefilled alone in every mode, and a verify pass computes
    each row exactly as a single step does at the target's settings (int4 weights, f32 compute)."""
    answers = [
        real_engine.run(Request(chat, mode=mode, k=4, max_new_tokens=ANSWER, reuse_cache=False)).token_ids
        for chat in chats
    ]
    assert answers == autoregressive


def test_the_app_answers_on_the_real_pair_with_its_figures(real_engine, chats):
    demo, url = serve(real_engine)
    try:
        final = ask(Client(url, verbose=False), chats[0][0]["content"], mode="best", max_new_tokens=24).outputs()[-1]
    finally:
        demo.close()
    metrics = final[3]
    assert metrics["mode"] == "best" and metrics["new_tokens"] == 24 and metrics["finish_reason"] == "length"
    assert last_answer(final) and "Could not answer" not in last_answer(final)
    assert final[5].startswith("best · 24 tokens · ")  # the footer's line (the compact line on phones)


def _rows_bit_identical(target) -> bool:
    """Where verify rows equal single steps bit for bit (both measured): the int4 target on
    AVX-512 CPUs, whose int8 kernels quantize each row alone. The `gguf` target's f32 kernels, and
    every kernel on AVX2-only CPUs, round a one-row pass differently from a wider one."""
    cpuinfo = Path("/proc/cpuinfo")
    avx512 = cpuinfo.exists() and " avx512f" in cpuinfo.read_text()
    return avx512 and "gguf" not in target.label


def verify_rows_and_single_steps(engine: Engine, target: Runtime | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The logits of the engine's target (or ``target``) for 5 tokens after a prompt: from one
    verify pass, and from 5 steps."""
    target = target or engine.target
    prompt = engine.prompt_ids(Request(({"role": "user", "content": "Write a haiku about caches."},)))
    target.reset()
    target.forward(prompt)
    tokens = list(range(1000, 1005))
    singles = np.stack([target.forward([t])[-1] for t in tokens])
    target.trim(len(prompt))
    verified = target.forward(tokens, rows=len(tokens))
    target.reset()
    return verified, singles


def test_verify_rows_equal_single_steps_on_the_real_target(real_engine):
    """Bit for bit where the kernels allow it; elsewhere within 1e-4 in the logits
    (docs/benchmarks.md, "An AVX2 machine"): greedy speculative output can differ there only where
    the target's top two logits are that close."""
    verified, singles = verify_rows_and_single_steps(real_engine)
    if _rows_bit_identical(real_engine.target):
        np.testing.assert_array_equal(verified, singles)
    else:
        np.testing.assert_allclose(verified, singles, rtol=0, atol=1e-4)


def test_an_answer_is_the_same_whatever_the_cache_held_before(real_engine, chats, autoregressive):
    """A cold cache starts with one token, and passes with a past compute every row alike at any
    width: so a turn prefilled after another conversation (sharing only the system prompt), from
    the template's opening copied in, or in other chunks gives the answer a cold cache gives (the
    plain one, which every mode gives)."""
    warm = [real_engine.run(Request(chat, mode="best", max_new_tokens=ANSWER)) for chat in chats[::-1]]
    assert [final.token_ids for final in warm[::-1]] == autoregressive
    assert all(final.metrics["cached_tokens"] >= len(real_engine.sessions.opening.tokens) > 0 for final in warm)


def test_the_cold_cache_starts_with_one_token(real_engine):
    target = real_engine.target
    target.reset()
    widths = []
    forward = target.forward
    target.forward = lambda new, rows=1, gemm=False: widths.append(len(new)) or forward(new, rows, gemm)
    try:
        target.forward(list(range(1000, 1040)))
    finally:
        del target.forward
    assert widths == [40, 1, 39]  # the call, then its two passes
    target.reset()


@pytest.mark.slow
def test_the_longest_prompt_the_default_cap_accepts_is_answered_within_the_memory_budget(real_engine):
    """A paste at the input cap (about 24,000 tokens; minutes of prefill on 2 cores) is answered,
    and the process never holds more than its budget; after the answer, no more than the caches
    it keeps plus 4 GiB, what the pair loaded holds (README, "Requirements"; docs/design.md,
    "Memory")."""
    words = real_engine.max_input_tokens - 64  # "word " is one token; the chat template adds a few
    request = Request(({"role": "user", "content": "word " * words},), mode="best", max_new_tokens=8)
    assert len(real_engine.check(request)) <= real_engine.max_input_tokens
    event = real_engine.run(request)
    assert event.kind == "done", event.error
    peak = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    print(f"peak RSS {peak / 2**30:.1f} GiB within a budget of {real_engine.budget.limit / 2**30:.1f} GiB")
    assert peak <= real_engine.budget.limit
    held = real_engine.budget.bytes_held(real_engine.sessions.kv_cache_bytes)
    assert resident_bytes() <= held + 4 * GIB


@pytest.fixture(scope="module")
def library(real_pair) -> Path:
    """The op's library, the real pair's graphs on it written (built and written on first use,
    as prepare does)."""
    models = []
    for path in real_pair:
        recorded = manifest.read(path) or {}
        models.append(PreparedModel(path, recorded.get("precision", ""), recorded.get("source", ""), ""))
    return ggml_ir.for_models(tuple(models), default_cache_dir(), required=True)


@pytest.fixture(scope="module")
def ggml_engine(real_pair, library):
    """The real pair with every linear layer on ggml's kernels."""
    # (its own budget: the default one counts the other engine this module holds as its models;
    # in whole GiB, so that the next run finds what this one measured at start kept)
    limit = (resident_bytes() // GIB + 7) * GIB
    with Engine(*real_pair, Settings(kernels="ggml", library=library, memory_limit=limit)) as engine:
        yield engine


def test_on_ggml_kernels_verify_rows_equal_single_steps_bit_for_bit(ggml_engine):
    """ggml's vec_dot computes a row alone whatever the pass's width, on every CPU."""
    assert ggml_engine.target.kernels == "ggml"
    np.testing.assert_array_equal(*verify_rows_and_single_steps(ggml_engine))


def test_with_14_bit_activations_too_verify_rows_equal_single_steps_bit_for_bit(ggml_engine, real_pair, library):
    """So the op's own kernels in either width of activations: the engine runs the default, 8 bits
    as llama.cpp's, a raw runtime here 14 where the CPU has AVX-512 VNNI, so greedy speculative
    output is exact in both for the same reason."""
    if not ggml.fine_activations(library):
        pytest.skip("14-bit activations take AVX-512 VNNI")
    assert IN_14_BITS not in ggml_engine.models["target"]
    fine = Runtime(real_pair[0], config=TARGET_CONFIG, first_token_alone=True, kernels=library, activations=14)
    assert fine.label.endswith(IN_14_BITS)
    np.testing.assert_array_equal(*verify_rows_and_single_steps(ggml_engine, fine))


def test_on_ggml_kernels_greedy_speculative_equals_autoregressive(ggml_engine, chats):
    def answers(mode: str) -> list[list[int]]:
        return [
            ggml_engine.run(Request(chat, mode=mode, k=4, max_new_tokens=ANSWER, reuse_cache=False)).token_ids
            for chat in chats
        ]

    assert answers("best") == answers("speculative") == answers("autoregressive")
