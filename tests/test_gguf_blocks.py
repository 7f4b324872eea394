"""A GGUF's own quantized blocks kept as OpenVINO compressed weights: each block type decodes to what
gguf-py's reference dequantization gives, and a GGUF target prepared with ``gguf`` weights computes
what the file's model computes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import openvino as ov
import pytest

from engine.prepare import gguf_blocks
from engine.prepare.convert import Compression
from engine.prepare.pipeline import prepare_one
from tests.gguf_writer import permute_qk, write_gguf
from tests.tiny import TOKENS, ov_logits

Q = gguf.GGMLQuantizationType
# Where each type keeps its f16 super-block scales (d, and dmin for Q4_K), by byte offset.
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,), Q.Q4_0: (0,)}


def random_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes as ``rows`` x ``cols`` weights of ``kind``, with finite f16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        raw[:, offset : offset + 2] = rng.uniform(1e-3, 2e-2, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


class Tensor:
    """What ``gguf.GGUFReader`` gives for a tensor: type, ggml's shape (columns first), raw bytes."""

    def __init__(self, kind: Q, raw: np.ndarray, cols: int):
        self.tensor_type, self.data, self.shape = kind, raw, (cols, raw.shape[0])


@pytest.mark.parametrize("kind", list(gguf_blocks.DECODERS))
def test_each_block_type_decodes_to_the_reference_dequantization(kind):
    rows, cols = 6, 512
    raw = random_blocks(kind, rows, cols)
    blocks = gguf_blocks.decode(Tensor(kind, raw, cols))
    assert blocks is not None and blocks.codes.shape[:2] == blocks.scale.shape[:2]
    expected = gguf.quants.dequantize(raw, kind).reshape(rows, cols)
    got = blocks.values()
    # the plugin's f16 scales and zero points are the only rounding
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3 * np.abs(expected).max())
    assert gguf_blocks.matches(blocks, expected)
    assert not gguf_blocks.matches(blocks, expected[::-1].copy())


def test_a_type_without_a_mapping_is_not_decoded():
    assert gguf_blocks.decode(Tensor(Q.Q5_0, random_blocks(Q.Q8_0, 2, 64), 64)) is None


def compressed_weights(ir: Path) -> dict[str, int]:
    """Integer constants of the IR by element type, and the 2-D float ones that remain."""
    counts: dict[str, int] = {}
    for node in ov.Core().read_model(ir / "openvino_model.xml").get_ordered_ops():
        if node.get_type_name() == "Constant" and len(node.get_output_shape(0)) >= 2:
            kind = node.get_element_type()
            name = kind.get_type_name() if not kind.is_real() else f"float {len(node.get_output_shape(0))}-D"
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize(("kind", "element"), [(Q.Q8_0, "i8"), (Q.Q4_0, "i4")])
def test_a_gguf_target_keeps_its_blocks_and_computes_the_files_model(kind, element, hf_target, tiny_dir, tiny_cache):
    hf = hf_target
    folder = tiny_dir / f"gguf-{kind.name}"
    folder.mkdir(exist_ok=True)
    file = write_gguf(hf, folder / f"tiny-{kind.name}.gguf", kind)
    kept = prepare_one(str(file), Compression("gguf"), tiny_cache).path
    dequantized = prepare_one(str(file), Compression("fp16"), tiny_cache).path
    assert json.loads((kept / "manifest.json").read_text())["precision"] == "gguf"
    weights = compressed_weights(kept)
    # every layer's seven matrices, the embeddings and the head
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    assert weights.get(element) == 7 * layers + 2
    assert "float 2-D" not in weights
    got, expected = ov_logits(kept, TOKENS), ov_logits(dequantized, TOKENS)
    np.testing.assert_allclose(got, expected, atol=0.05)  # as the fp16 IR against torch
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("heads", [2, 4])
def test_a_llama_files_query_and_key_rows_go_back_to_the_models_order(heads):
    rows = 64
    weight = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    in_file = permute_qk(weight, heads)  # as llama.cpp's converter writes them
    order = gguf_blocks.unpermute("model.layers.0.self_attn.k_proj.weight", rows, {"k_proj": heads})
    assert order is not None
    np.testing.assert_array_equal(in_file[order], weight)
    assert gguf_blocks.unpermute("model.layers.0.self_attn.v_proj.weight", rows, {"k_proj": heads}) is None


def test_weights_that_do_not_match_the_file_are_kept(hf_target, hf_draft, tiny_dir, tiny_cache):
    """A file of another model under the same names: nothing is replaced, the model is unchanged."""
    other = write_gguf(hf_draft, tiny_dir / "gguf-Q8_0" / "draft-Q8_0.gguf", Q.Q8_0)
    ir = prepare_one(str(hf_target), Compression("fp16"), tiny_cache).path
    model = ov.Core().read_model(ir / "openvino_model.xml")
    done = gguf_blocks.rewrite(model, gguf.GGUFReader(other), lambda _: None)
    assert set(done) == {"kept fp16 (Q8_0)"}


def test_gguf_weights_for_a_source_without_blocks_are_int8(hf_target, tiny_cache):
    prepared = prepare_one(str(hf_target), Compression("gguf"), tiny_cache)
    assert prepared.precision == "int8"
    assert prepared.path == prepare_one(str(hf_target), Compression("int8"), tiny_cache).path
