"""The property exact greedy speculative decoding rests on: a verify pass computes each row
bit for bit as single-token steps do, at the target's engine settings."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.drafters import ModelDrafter
from engine.core.runtime import DRAFT_CONFIG, EXACT_CONFIG, MAX_MASKED, TARGET_CONFIG, Runtime
from tests.serving import serve


def _record_widths(runtime: Runtime) -> list[int]:
    """The number of tokens of every pass ``runtime`` runs from now on (``del runtime.forward`` stops it)."""
    widths: list[int] = []
    forward = runtime.forward
    runtime.forward = lambda new, rows=1, gemm=False: widths.append(len(new)) or forward(new, rows, gemm)
    return widths


def _assert_fresh_cache_agrees(fresh: Runtime, context: list[int], logits: np.ndarray) -> None:
    fresh.reset()
    np.testing.assert_allclose(logits, fresh.forward(context)[-1], atol=1e-4)


@pytest.fixture(scope="module")
def target(ir_target):
    return Runtime(ir_target, config=TARGET_CONFIG)


@pytest.mark.parametrize("m", [2, 5, 9, 17])
def test_verify_rows_equal_single_steps_bit_for_bit(target, m):
    prefix, tokens = list(range(3, 40)), list(range(100, 100 + m))
    target.reset()
    target.forward(prefix)
    singles = np.stack([target.forward([t])[-1] for t in tokens])
    target.trim(len(prefix))
    np.testing.assert_array_equal(target.forward(tokens, rows=m), singles)


def test_speculative_prefills_the_prompt_alone_then_verifies_at_most_k_plus_one(target, ir_draft):
    """The prompt goes through the same single pass as in autoregressive decoding."""
    sizes = _record_widths(target)
    try:
        drafter = ModelDrafter(Runtime(ir_draft, config=DRAFT_CONFIG))
        prompt = list(range(5, 60))
        serve(target, drafter, prompt, k=4, max_new_tokens=30)
    finally:
        del target.forward
    assert sizes[0] == len(prompt) and all(1 <= s <= 5 for s in sizes[1:])


def test_masked_rollback_computes_what_a_fresh_cache_computes(ir_draft):
    """The draft drops rejected entries by masking them: later steps attend to the kept tokens
    at their own positions only, and a long run of rollbacks compacts the cache."""
    masked = Runtime(ir_draft, config=EXACT_CONFIG, masked_rollback=True)
    fresh = Runtime(ir_draft, config=EXACT_CONFIG)
    context = list(range(3, 30))
    masked.forward(context)
    for step in range(40):
        masked.forward([7, 8, 9][: 1 + step % 3], rows=1)  # drafted, then rejected
        masked.trim(len(context) - step % 2)  # sometimes a kept token goes too
        del context[len(masked.tokens) :]
        context.append(40 + step)
        _assert_fresh_cache_agrees(fresh, context, masked.forward(context[-1:])[-1])
        assert masked.tokens == context
        assert masked.slots <= len(context) + MAX_MASKED + 3
    assert masked.slots > len(context), "some entries should still be masked rather than copied out"


def test_fixed_pass_width_runs_one_shape_and_computes_what_a_fresh_cache_computes(ir_draft):
    """A draft fed 2 tokens per pass (re-feeding one it holds, rolled back by masking) runs a
    single shape after the prompt, whatever it is asked to sync."""
    draft = Runtime(ir_draft, config=EXACT_CONFIG, masked_rollback=True, pass_width=2)
    fresh = Runtime(ir_draft, config=EXACT_CONFIG)
    sizes = _record_widths(draft)
    context = list(range(3, 30))
    draft.sync(context)
    for step in range(30):
        drafted = [7, 8, 9][: 1 + step % 3]
        for i in range(len(drafted)):
            draft.sync(context + drafted[: i + 1])
        context = context + drafted[: step % 2] + [40 + step]  # some drafts kept, then a correction
        _assert_fresh_cache_agrees(fresh, context, draft.sync(context)[-1])
    assert sizes[0] == 27 and set(sizes[1:]) == {2}


# The real draft's cache is u8 (the CPU plugin's default for int4 models; tiny fp16 ones get f16).
U8_DRAFT_CONFIG = {**DRAFT_CONFIG, "KV_CACHE_PRECISION": "u8"}


@pytest.mark.parametrize("config", [U8_DRAFT_CONFIG, TARGET_CONFIG], ids=["u8-draft", "target"])
@pytest.mark.parametrize("masked", [True, False])
def test_a_long_trim_keeps_the_entries_it_keeps_at_the_engines_kv_precisions(ir_draft, config, masked):
    """A trim of more than MAX_MASKED entries sets the kept prefix back into the plugin. Into a
    u8 cache (the real draft's) the plugin read a view of the prefix as if it were contiguous:
    the kept entries came back scrambled, and the draft drafted from garbage after a new turn or
    a window jump. The next pass must compute what it computes after the kept
    tokens alone (up to the rounding of a longer first pass)."""
    tokens = list(range(5, 5 + 40 + MAX_MASKED + 30))
    trimmed = Runtime(ir_draft, config=config, masked_rollback=masked)
    trimmed.forward(tokens)
    trimmed.trim(40)
    fresh = Runtime(ir_draft, config=config)
    fresh.forward(tokens[:40])
    after_trim, after_fresh = trimmed.forward([7, 8], rows=2), fresh.forward([7, 8], rows=2)
    np.testing.assert_allclose(after_trim, after_fresh, atol=0.05 * float(np.abs(after_fresh).max()))
