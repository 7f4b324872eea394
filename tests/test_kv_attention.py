"""The op's attention over the KV caches it keeps (engine/prepare/ggml_op/kv_attention.h,
engine.core.kv_cache): against a reference computed here, a row alike at any pass width, a
rollback that is only a shorter length, rows of several caches in one pass, and a cache read,
written and freed."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from engine import ggml
from engine.core.kv_cache import OwnCache
from engine.prepare import gguf_graph, kernels
from engine.prepare.pipeline import default_cache_dir

# (100 values a head: the op's values are added 64, then 32, then one at a time)
HEADS, KV_HEADS, DIM, LAYER = 6, 2, 100, 0
SCALE = 1 / np.sqrt(DIM)


@pytest.fixture(scope="module")
def library():
    return kernels.library(default_cache_dir(), print)


@pytest.fixture(scope="module")
def attention(library) -> ov.CompiledModel:
    """The op on its own: q, k, v and each row's cache and past as inputs."""
    core = ov.Core()
    ggml.register(core, library)
    q = ops.parameter([-1, HEADS, -1, DIM], ov.Type.f32)
    k, v = (ops.parameter([-1, KV_HEADS, -1, DIM], ov.Type.f32) for _ in range(2))
    caches, pasts = (ops.parameter([-1], ov.Type.i64) for _ in range(2))
    out = ggml.attention(*(p.output(0) for p in (q, k, v, caches, pasts)), LAYER, SCALE, library)
    return core.compile_model(ov.Model([out], [q, k, v, caches, pasts]), "CPU")


def new_cache(library) -> OwnCache:
    return OwnCache(library, LAYER + 1, KV_HEADS, DIM)


def entries(rows: int, width: int, heads: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, heads, width, DIM)).astype(np.float32)


def attend(attention, q, k, v, caches: list[OwnCache], pasts: list[int]) -> np.ndarray:
    ids = np.array([c.id for c in caches], dtype=np.int64)
    return attention([q, k, v, ids, np.array(pasts, dtype=np.int64)])[0]


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, past: int) -> np.ndarray:
    """One row's causal attention in float64: q [HEADS, T, DIM] over keys, values [KV_HEADS, past + T, DIM]."""
    out = np.empty(q.shape)
    for h in range(HEADS):
        g = h // (HEADS // KV_HEADS)
        for t in range(q.shape[1]):
            n = past + t + 1
            scores = keys[g, :n].astype(np.float64) @ q[h, t] * SCALE
            weights = np.exp(scores - scores.max())
            out[h, t] = weights @ values[g, :n] / weights.sum()
    return out


def test_a_pass_attends_causally_over_what_the_cache_held_and_its_own_entries(library, attention):
    cache = new_cache(library)
    k, v = entries(1, 12, KV_HEADS, 1), entries(1, 12, KV_HEADS, 2)
    q = entries(1, 12, HEADS, 3)
    first = attend(attention, q[:, :, :7], k[:, :, :7], v[:, :, :7], [cache], [0])
    then = attend(attention, q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], [cache], [7])
    np.testing.assert_allclose(first[0], reference(q[0, :, :7], k[0], v[0], 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(then[0], reference(q[0, :, 7:], k[0], v[0], 7), rtol=1e-5, atol=1e-6)
    assert cache.read(12)[f"{LAYER}.key"].tobytes() == k.tobytes()
    cache.free()


def test_a_row_is_the_same_bit_for_bit_at_any_pass_width(library, attention):
    """A verify pass's rows are single steps' (so greedy speculative output is autoregressive's)."""
    k, v, q = entries(1, 300, KV_HEADS, 4), entries(1, 300, KV_HEADS, 5), entries(1, 300, HEADS, 6)
    wide, narrow = new_cache(library), new_cache(library)
    attend(attention, q[:, :, :290], k[:, :, :290], v[:, :, :290], [wide], [0])
    attend(attention, q[:, :, :290], k[:, :, :290], v[:, :, :290], [narrow], [0])
    together = attend(attention, q[:, :, 290:], k[:, :, 290:], v[:, :, 290:], [wide], [290])
    alone = [
        attend(attention, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], [narrow], [t])
        for t in range(290, 300)
    ]
    assert np.array_equal(together, np.concatenate(alone, axis=2))
    for cache in (wide, narrow):
        cache.free()


def test_a_rollback_is_a_shorter_past_and_the_entries_after_it_are_written_over(library, attention):
    kept, fresh = new_cache(library), new_cache(library)
    k, v, q = entries(1, 9, KV_HEADS, 7), entries(1, 9, KV_HEADS, 8), entries(1, 9, HEADS, 9)
    attend(attention, q[:, :, :6], k[:, :, :6], v[:, :, :6], [kept], [0])
    rejected = entries(1, 3, KV_HEADS, 10)
    attend(attention, q[:, :, 6:], rejected, rejected, [kept], [6])  # (a draft the target turns down)
    attend(attention, q[:, :, :6], k[:, :, :6], v[:, :, :6], [fresh], [0])
    after = [attend(attention, q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], [c], [6]) for c in (kept, fresh)]
    assert np.array_equal(*after)
    for cache in (kept, fresh):
        cache.free()


def test_rows_of_several_caches_in_one_pass_each_compute_what_they_compute_alone(library, attention):
    """Rows of any lengths share a pass (a batch), each reading its own cache only; a row fed fewer
    tokens is padded after them."""
    rows = [new_cache(library) for _ in range(2)]
    alone = [new_cache(library) for _ in range(2)]
    history = [entries(1, n, KV_HEADS, 20 + n) for n in (5, 40)]
    for caches in (rows, alone):
        for cache, h in zip(caches, history):
            attend(attention, entries(1, h.shape[2], HEADS, 0), h, h, [cache], [0])
    q, k, v = entries(2, 3, HEADS, 11), entries(2, 3, KV_HEADS, 12), entries(2, 3, KV_HEADS, 13)
    together = attend(attention, q, k, v, rows, [5, 40])
    for i, cache in enumerate(alone):
        assert np.array_equal(
            together[i : i + 1], attend(attention, q[i : i + 1], k[i : i + 1], v[i : i + 1], [cache], [[5, 40][i]])
        )
    for cache in rows + alone:
        cache.free()


def rope_model(library, turned_by_the_op: bool) -> ov.CompiledModel:
    """The op after RoPE at ``position_ids``: the graph's (engine.prepare.gguf_graph.rope) or its
    own (the graph's cos and sin as its inputs)."""
    core = ov.Core()
    ggml.register(core, library)
    q = ops.parameter([1, HEADS, -1, DIM], ov.Type.f32)
    k, v = (ops.parameter([1, KV_HEADS, -1, DIM], ov.Type.f32) for _ in range(2))
    caches, pasts = (ops.parameter([1], ov.Type.i64) for _ in range(2))
    position_ids = ops.parameter([1, -1], ov.Type.i64)
    frequencies = (1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32)
    cos, sin = gguf_graph.rope_angles(position_ids.output(0), ops.constant(frequencies.reshape(1, -1, 1)))
    inputs = [q, k, v, caches, pasts]
    if turned_by_the_op:
        out = ggml.attention(*(p.output(0) for p in inputs), LAYER, SCALE, library, (cos, sin))
    else:
        turned = [gguf_graph.rope(x.output(0), cos, sin) for x in (q, k)]
        out = ggml.attention(*turned, v.output(0), caches.output(0), pasts.output(0), LAYER, SCALE, library)
    return core.compile_model(ov.Model([out], [*inputs, position_ids]), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def test_the_op_turns_q_and_k_by_rope_as_the_graph_would_before_it(library):
    """A layer's attention takes RoPE's cos and sin and turns q and k itself (one node where the
    plugin ran two more): the same attention, and the same keys in the cache, within rounding."""
    k, v, q = entries(1, 40, KV_HEADS, 30), entries(1, 40, KV_HEADS, 31), entries(1, 40, HEADS, 32)
    results, keys = [], []
    for by_op in (True, False):
        model, cache = rope_model(library, by_op), new_cache(library)
        ids = np.array([cache.id], dtype=np.int64)
        first = model([q[:, :, :33], k[:, :, :33], v[:, :, :33], ids, np.array([0]), np.arange(33)[None]])[0]
        then = model([q[:, :, 33:], k[:, :, 33:], v[:, :, 33:], ids, np.array([33]), np.arange(33, 40)[None]])[0]
        results.append(np.concatenate([first, then], axis=2))
        keys.append(cache.read(40)[f"{LAYER}.key"])
        cache.free()
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(keys[0], keys[1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(keys[0], k)  # (turned, not as given)


def test_a_cache_is_read_written_and_freed_by_its_id(library, attention):
    cache, copy = new_cache(library), new_cache(library)
    k, v, q = entries(1, 300, KV_HEADS, 14), entries(1, 300, KV_HEADS, 15), entries(1, 1, HEADS, 16)
    attend(attention, entries(1, 299, HEADS, 17), k[:, :, :299], v[:, :, :299], [cache], [0])
    assert cache.bytes == 2 * KV_HEADS * 512 * DIM * 4  # (keys and values in blocks of 256 entries)
    copy.write(cache.read(299), 299)
    step = [attend(attention, q, k[:, :, 299:], v[:, :, 299:], [c], [299]) for c in (cache, copy)]
    assert np.array_equal(*step)
    with pytest.raises(ValueError, match="fewer than 301"):
        cache.read(301)
    with pytest.raises(RuntimeError, match="a pass after 400 entries"):
        attend(attention, q, k[:, :, :1], v[:, :, :1], [cache], [400])
    cache.free()
    assert cache.bytes == 0
    copy.zeros(3)
    assert not copy.read(3)[f"{LAYER}.value"].any()
    copy.free()
