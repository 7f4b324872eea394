"""The paged-attention probe on the tiny models: the paged form computes what the stateful IR
does, its rollback is a length, and the side-by-side timing runs."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import paged_probe
from engine.core.runtime import EXACT_CONFIG, Runtime


def _pair(ir_target):
    stateful = Runtime(ir_target, config=EXACT_CONFIG, first_token_alone=True)
    return stateful, paged_probe.PagedCache.compile(ir_target, capacity=200, config=EXACT_CONFIG)


def test_the_paged_form_computes_the_stateful_rows_and_rolls_back_by_its_length(ir_target):
    stateful, paged = _pair(ir_target)
    rng = np.random.default_rng(3)
    prompt, added = [int(t) for t in rng.integers(5, 300, 40)], [int(t) for t in rng.integers(5, 300, 5)]
    exact = paged_probe.exactness(stateful, paged, prompt, added)
    assert exact["paged_steps_after_rollback"] == 0.0  # a smaller length, then the same passes: the same rows
    assert exact["paged_vs_stateful"] < 1e-4 and exact["same_argmax"]
    assert exact["paged_pass_vs_steps"] < 1e-4 and exact["stateful_pass_vs_steps"] == 0.0
    assert paged.length == len(prompt) + len(added)


def test_a_paged_rollback_forgets_what_was_written_after_it(ir_target):
    """Entries past the kept length are overwritten by the next pass, never read."""
    _, paged = _pair(ir_target)
    paged.forward([7, 8, 9, 10])
    paged.trim(2)
    first = paged.forward([9, 10])  # (the same width as below: rows of other widths may round differently)
    paged.trim(2)
    paged.forward([11, 12, 13])  # written over entries 2 to 4
    paged.trim(2)
    np.testing.assert_array_equal(paged.forward([9, 10]), first)


def test_the_probe_times_both_forms_at_each_context(ir_target):
    stateful, paged = _pair(ir_target)
    rows = paged_probe.costs_at(stateful, paged, context=64, k=3, repeats=2)
    assert [r["form"] for r in rows] == ["stateful", "paged"]
    assert all(r["context"] == 64 and r["step_ms"] > 0 and r["pass_ms"] > 0 and r["rejection_ms"] > 0 for r in rows)
    assert len(stateful.tokens) == paged.length  # both forms ran the same passes


def test_a_pass_past_the_allocated_blocks_is_refused(ir_target):
    _, paged = _pair(ir_target)
    paged.fill(paged.capacity - 1)
    with pytest.raises(ValueError, match="exceed"):
        paged.forward([5, 6])
    assert paged.length == paged.capacity - 1  # nothing was written
