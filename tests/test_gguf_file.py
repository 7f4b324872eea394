"""The GGUF reader that parses metadata in bulk gives gguf-py's fields and tensors exactly; a file
is opened once per process; preparing sums its time up by phase."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.prepare import gguf_file, phases


def write_file(path: Path, tokens: int = 300) -> Path:
    """A GGUF with fields of every kind a model's file has (arrays of strings and of numbers, an
    empty array, scalars, a string) and two tensors."""
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_token_list([f"tok{i}é" * (i % 5) for i in range(tokens)])  # (empty strings too)
    writer.add_token_types([i % 3 for i in range(tokens)])
    writer.add_token_merges([f"a{i} b{i}" for i in range(tokens // 2)])
    writer.add_array("test.floats", [0.5 * i for i in range(7)])
    writer.add_array("test.empty", [])
    writer.add_uint32("test.u32", 7)
    writer.add_float32("test.f32", 1.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.name", "ünïcode")
    rows = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    writer.add_tensor("a.weight", rows)
    writer.add_tensor(
        "b.weight", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_its_fields_and_tensors_are_gguf_pys(tmp_path):
    path = write_file(tmp_path / "f.gguf")
    ours, theirs = gguf_file.Reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in ours.fields.items():
        other = theirs.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        assert len(field.parts) == len(other.parts), name
        for part, expected in zip(field.parts, other.parts):
            assert part.dtype == expected.dtype and np.array_equal(part, expected), name
        assert field.contents() == other.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in theirs.tensors
    ]
    assert all(
        isinstance(t.data, np.memmap) and np.array_equal(t.data, u.data) for t, u in zip(ours.tensors, theirs.tensors)
    )


def test_a_file_is_opened_once_and_again_once_rewritten(tmp_path):
    path = write_file(tmp_path / "f.gguf")
    first = gguf_file.open_gguf(path)
    assert gguf_file.open_gguf(str(path)) is first
    write_file(path, tokens=12)
    os.utime(path, ns=(1, 1))  # (a new modification time, however coarse the file system's clock)
    again = gguf_file.open_gguf(path)
    assert again is not first and len(again.fields["tokenizer.ggml.tokens"].data) == 12


def test_transformers_opens_files_through_it_where_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "GGUFReader", gguf.GGUFReader)  # (put back after the test)
    path = write_file(tmp_path / "f.gguf")
    gguf_file.everywhere()
    assert gguf.GGUFReader(path) is gguf_file.open_gguf(path)


def test_preparing_sums_its_time_up_by_phase(monkeypatch):
    monkeypatch.setattr(phases, "_SPENT", {})
    assert phases.summary() is None
    clock = iter([0.0, 30.0, 30.0, 40.0, 40.0, 50.0, 50.0, 60.0])
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(clock))
    for name in ("download", "graph", "download"):
        with phases.phase(name):
            pass
    assert phases.summary() == "download 40 s (80%), graph 10 s (20%)"
    with pytest.raises(RuntimeError), phases.phase("graph"):
        raise RuntimeError("a failed phase counts too")
    assert phases.summary() == "download 40 s (67%), graph 20 s (33%)"
