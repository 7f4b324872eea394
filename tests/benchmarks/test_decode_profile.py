"""The decode profile's arithmetic on the tiny models: weight bytes a step reads, the per-node
split of a step, the bandwidth probe."""

from __future__ import annotations

import json

import openvino as ov
import pytest

from benchmarks import decode_profile
from tests.gguf_writer import write_gguf


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_a_step_reads_every_weight_but_the_embedding_table(ir_target):
    """The IR's constants, less the table a step gathers one row of (unless the vocabulary
    projection reads it whole)."""
    cfg = _config(ir_target)
    model = ov.Core().read_model(ir_target / "openvino_model.xml")
    total = sum(op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant")
    table = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"] * 2  # fp16
    assert decode_profile.ir_weight_bytes(ir_target) == total - table


def test_a_gguf_step_reads_every_tensor_but_the_embedding_table(hf_target, tiny_dir):
    import gguf

    (tiny_dir / "gguf").mkdir(exist_ok=True)
    path = write_gguf(hf_target, tiny_dir / "gguf" / "tiny-qwen2.gguf")
    cfg = _config(hf_target)
    total = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert decode_profile.gguf_weight_bytes(path) == total - cfg["vocab_size"] * cfg["hidden_size"] * 4  # f32


def test_the_node_profile_splits_the_counted_time_by_node_type(ir_target):
    rows, step_ms = decode_profile.node_profile(ir_target, [5, 17, 42, 99], steps=4, kernels=(None, 8))
    assert rows[-1]["node_type"] == "other" and len(rows) >= 2 and step_ms > 0
    # (how many types pass the 1% mark depends on the machine's timing: 2 to 4 here)
    assert all(r["share"] >= 0.01 for r in rows[:-1]) and rows[0]["ms"] == max(r["ms"] for r in rows[:-1])
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert all(r["ms"] >= 0 for r in rows)


def test_the_bandwidth_probe_measures_something():
    assert decode_profile.read_bandwidth(threads=2, size=1 << 26, repeats=1) > 1e8
