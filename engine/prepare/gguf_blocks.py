"""A GGUF's own quantized blocks as OpenVINO compressed weights: the model in the file, not a second
quantization of it (docs/benchmarks.md, "Faithful to the file").

An IR exported from the dequantized GGUF holds fp16 weights. Each weight whose GGUF tensor is stored
in a block type below is replaced by the subgraph that NNCF's own compressed weights use, which the
CPU plugin fuses into its fully-connected and gather kernels: integer codes in groups along a row,
converted to f16, minus a zero point, times a scale.

| GGUF type | group | codes | scale | zero point |
|---|---:|---|---|---|
| Q4_K | 32 | u4 | f16 (d x 6-bit scale) | f16: 6-bit min x dmin / scale |
| Q6_K | 16 | i8 (6-bit - 32) | f16 (d x 8-bit scale) | none |
| Q8_0 | 32 | i8 | f16 | none |
| Q4_0 | 32 | i4 (4-bit - 8) | f16 | none |

Other types keep the exact fp16 values the dequantization gave, and are counted in the log. Every
replaced weight is checked against those fp16 values first, so a naming or layout mismatch keeps
the weight rather than changing the model.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import gguf
import numpy as np
import openvino as ov
from openvino import opset13 as ops
from tqdm import tqdm

from engine.prepare.gguf_file import open_gguf

Q = gguf.GGMLQuantizationType
# optimum-intel's module names -> the GGUF's tensor names (llama.cpp's convert_hf_to_gguf).
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Relative difference between a decoded block weight and the fp16 one it replaces; fp16 rounding
# alone stays below 2^-11 of the row's largest weight.
TOLERANCE = 2e-3


@dataclass(frozen=True)
class Blocks:
    """A weight of ``rows`` x ``groups * group`` as codes, per-group scales and zero points."""

    codes: np.ndarray  # [rows, groups, group]
    element: ov.Type
    scale: np.ndarray  # [rows, groups, 1], float32
    zero: np.ndarray | None  # [rows, groups, 1], float32

    def values(self) -> np.ndarray:
        """The weight these blocks stand for, as the plugin computes it (f16 scale and zero point)."""
        q = self.codes.astype(np.float32)
        if self.zero is not None:
            q = q - self.zero.astype(np.float16).astype(np.float32)
        return (q * self.scale.astype(np.float16).astype(np.float32)).reshape(self.codes.shape[0], -1)

    def rows(self, order: np.ndarray | slice) -> Blocks:
        zero = None if self.zero is None else self.zero[order]
        return Blocks(self.codes[order], self.element, self.scale[order], zero)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray, shifts: tuple[int, ...], width: int) -> np.ndarray:
    """Split bytes ``[n, chunks, width]`` into ``len(shifts)`` bit fields each, field-major per chunk."""
    n = raw.shape[0]
    fields = raw.reshape(n, -1, 1, width) >> np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return fields.reshape(n, -1, width)


def q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ov.Type, np.ndarray, np.ndarray | None]:
    """256-weight blocks: d, dmin, 8 packed 6-bit (scale, min) pairs, 128 bytes of 4-bit codes."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale, mins = d * sc.astype(np.float32), dmin * m.astype(np.float32)  # [n, 8]
    codes = (_nibbles(blocks[:, 16:], (0, 4), 32) & 0x0F).reshape(n, 8, 32)
    empty = scale == 0  # an all-min group: code 0, zero point -min
    zero = np.where(empty, mins, mins / np.where(empty, 1, scale))
    codes[empty] = 0
    return codes, ov.Type.u4, np.where(empty, 1, scale), zero


def q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ov.Type, np.ndarray, np.ndarray | None]:
    """256-weight blocks: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], (0, 4), 64) & 0x0F
    high = _nibbles(blocks[:, 128:192], (0, 2, 4, 6), 32) & 0x03
    codes = ((low.reshape(n, -1) | (high.reshape(n, -1) << 4)).astype(np.int16) - 32).astype(np.int8)
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return codes.reshape(n, 16, 16), ov.Type.i8, _f16(blocks[:, 208:210]) * scales, None


def q8_0(blocks: np.ndarray) -> tuple[np.ndarray, ov.Type, np.ndarray, np.ndarray | None]:
    """32-weight blocks: d, 32 int8 codes."""
    return blocks[:, None, 2:].copy().view(np.int8), ov.Type.i8, _f16(blocks[:, 0:2]), None


def q4_0(blocks: np.ndarray) -> tuple[np.ndarray, ov.Type, np.ndarray, np.ndarray | None]:
    """32-weight blocks: d, 16 bytes of 4-bit codes (low nibbles first), each minus 8."""
    codes = (_nibbles(blocks[:, 2:], (0, 4), 16) & 0x0F).reshape(-1, 1, 32).astype(np.int8) - 8
    return codes, ov.Type.i4, _f16(blocks[:, 0:2]), None


def q5_0(blocks: np.ndarray) -> tuple[np.ndarray, ov.Type, np.ndarray, np.ndarray | None]:
    """32-weight blocks: d, 4 bytes of fifth bits, 16 bytes of low 4 bits (low nibbles first): i8
    codes, the 5-bit value minus 16. Exactly the file's values, at a byte a weight where fp16 takes
    two (a graph built from the file: :data:`DECODERS` is what an exported IR's weights become)."""
    high = blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
    low = _nibbles(blocks[:, 6:], (0, 4), 16).reshape(-1, 32) & 0x0F
    codes = (low | ((high & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    return codes.reshape(-1, 1, 32), ov.Type.i8, _f16(blocks[:, 0:2]), None


Decoder = Callable[[np.ndarray], tuple[np.ndarray, ov.Type, np.ndarray, np.ndarray | None]]
DECODERS: dict[Q, Decoder] = {
    Q.Q4_K: q4_k,
    Q.Q6_K: q6_k,
    Q.Q8_0: q8_0,
    Q.Q4_0: q4_0,
}
# What a graph built from the file keeps in blocks (engine.prepare.gguf_graph).
ROW_DECODERS: dict[Q, Decoder] = {**DECODERS, Q.Q5_0: q5_0}
# Rows decoded at a time: a decoder's intermediates take a few bytes a weight, so a
# vocabulary-sized matrix is decoded a slice at a time into its codes.
CHUNK_ROWS = 4096


def decode(tensor: Any) -> Blocks | None:
    """A GGUF tensor's blocks, or None where its type is not one of :data:`DECODERS`."""
    if tensor.tensor_type not in DECODERS:
        return None
    return decode_rows(np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1), tensor.tensor_type)


def decode_rows(rows: np.ndarray, kind: int) -> Blocks | None:
    """GGUF rows (u8 [N, bytes per row]) of ``kind`` as blocks, :data:`CHUNK_ROWS` at a time;
    None where the type is not one of :data:`ROW_DECODERS`."""
    decoder = ROW_DECODERS.get(Q(kind))
    if decoder is None:
        return None
    block, size = gguf.GGML_QUANT_SIZES[Q(kind)]
    n, cols = rows.shape[0], rows.shape[1] // size * block
    codes, element, scale, zero = np.empty(0), ov.Type.dynamic, np.empty(0), None
    for start in range(0, n, CHUNK_ROWS):
        part = np.ascontiguousarray(rows[start : start + CHUNK_ROWS])
        c, element, s, z = decoder(part.reshape(-1, size))
        group, done = c.shape[-1], slice(start, start + part.shape[0])
        if start == 0:
            codes = np.empty((n, cols // group, group), dtype=c.dtype)
            scale = np.empty((n, cols // group, 1), dtype=np.float32)
            zero = None if z is None else np.empty_like(scale)
        codes[done] = c.reshape(part.shape[0], -1, group)
        scale[done] = s.reshape(part.shape[0], -1, 1)
        if zero is not None and z is not None:
            zero[done] = z.reshape(part.shape[0], -1, 1)
    return Blocks(codes, element, scale, zero)


def gguf_name(ir_name: str) -> str | None:
    """The GGUF tensor behind an IR weight of optimum-intel's export."""
    if ".lm_head." in ir_name:
        return "output.weight"
    if ".embed_tokens." in ir_name:
        return "token_embd.weight"
    parts = ir_name.split(".")
    if "layers" not in parts:
        return None
    i = parts.index("layers")
    short = LAYER_NAMES.get(".".join(parts[i + 2 : i + 4]))
    return f"blk.{parts[i + 1]}.{short}.weight" if short else None


def permuted_heads(reader: gguf.GGUFReader) -> dict[str, int]:
    """The heads of each projection whose rows llama.cpp's converter permuted (a llama file's
    query and key), for :func:`unpermute`; none for other architectures."""
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    if architecture != "llama":
        return {}
    return {
        "q_proj": int(reader.fields["llama.attention.head_count"].parts[-1][0]),
        "k_proj": int(reader.fields["llama.attention.head_count_kv"].parts[-1][0]),
    }


def unpermute(name: str, rows: int, heads: dict[str, int]) -> np.ndarray | None:
    """The row order that undoes llama.cpp's Q/K permutation for a llama GGUF (transformers' GGUF
    loader undoes it the same way), or None where the file keeps the model's order."""
    kind = next((k for k in heads if f".{k}." in name), None)
    if kind is None:
        return None
    n_head = heads[kind]
    permuted = np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(permuted)


def codes_constant(codes: np.ndarray, element: ov.Type) -> ov.Node:
    """``codes`` as a constant of ``element``; 4-bit ones packed here, two a byte, the first in the
    low nibble, a slice at a time (OpenVINO's own packing from an array goes through a copy of 8
    bytes a code: 1.9 GB for a vocabulary of 152k rows of 1536)."""
    if element.bitwidth != 4:
        return ops.constant(codes, dtype=element)
    tensor = ov.Tensor(element, ov.Shape(list(codes.shape)))
    packed, pairs = tensor.data.reshape(-1).view(np.uint8), codes.reshape(-1, 2)
    step = CHUNK_ROWS * 4096
    for start in range(0, len(pairs), step):
        pair = pairs[start : start + step].view(np.uint8) & 0x0F
        packed[start : start + len(pair)] = pair[:, 0] | (pair[:, 1] << 4)
    return ov.op.Constant(tensor)


def subgraph(blocks: Blocks, shape: list[int], out: ov.Type) -> ov.Output:
    """codes -> f16, minus zero point, times scale, reshaped to the weight, converted to ``out``."""
    w = ops.convert(codes_constant(blocks.codes, blocks.element), ov.Type.f16)
    if blocks.zero is not None:
        w = ops.subtract(w, ops.constant(blocks.zero.astype(np.float16)))
    w = ops.multiply(w, ops.constant(blocks.scale.astype(np.float16)))
    w = ops.reshape(w, ops.constant(np.array(shape, np.int64)), False)
    return ops.convert(w, out).output(0) if out != ov.Type.f16 else w.output(0)


def matches(blocks: Blocks, weight: np.ndarray, chunk: int = 4096) -> bool:
    """Whether ``blocks`` stand for ``weight`` up to fp16 rounding; a few thousand rows at a time,
    so that a vocabulary-sized matrix is never held in f32 whole."""
    if blocks.codes.shape[0] != weight.shape[0] or blocks.codes[0].size != weight.shape[1]:
        return False
    for start in range(0, weight.shape[0], chunk):
        rows = slice(start, start + chunk)
        expected = weight[rows].astype(np.float32)
        scale = np.maximum(np.abs(expected).max(axis=1, keepdims=True), 1e-6)
        if (np.abs(blocks.rows(rows).values() - expected) / scale).max() > TOLERANCE:
            return False
    return True


def rewrite(
    model: ov.Model, reader: gguf.GGUFReader, log: Callable[[str], None], progress: TextIO | None = None
) -> Counter[str]:
    """Replace ``model``'s fp16 weights by the file's blocks in place; count what was done by type.
    A progress bar goes to ``progress`` where given."""
    tensors = {t.name: t for t in reader.tensors}
    heads = permuted_heads(reader)
    done: Counter[str] = Counter()
    weights = [
        (node, tensors[key])
        for node in model.get_ordered_ops()
        if node.get_type_name() == "Constant"
        and node.get_element_type() == ov.Type.f16
        and len(node.get_output_shape(0)) == 2
        and (key := gguf_name(node.get_friendly_name())) in tensors
    ]
    bar = tqdm(weights, desc="keeping the file's blocks", unit="weight", file=progress, disable=progress is None)
    for node, tensor in bar:
        name, shape = node.get_friendly_name(), list(node.get_output_shape(0))
        blocks = decode(tensor)
        order = unpermute(name, shape[0], heads)
        if blocks is not None and order is not None:
            blocks = blocks.rows(order)
        if blocks is None or not matches(blocks, node.get_data()):
            done[f"kept fp16 ({tensor.tensor_type.name})"] += 1
            continue
        built: dict[str, ov.Output] = {}  # one subgraph per output type, whoever consumes it
        for target in list(node.output(0).get_target_inputs()):
            consumer = target.get_node()
            if consumer.get_type_name() == "Convert":  # the export's f16 -> f32 step
                out, inputs = consumer.get_output_element_type(0), list(consumer.output(0).get_target_inputs())
            else:
                out, inputs = ov.Type.f16, [target]
            if out.get_type_name() not in built:
                built[out.get_type_name()] = subgraph(blocks, shape, out)
            for consumed in inputs:
                consumed.replace_source_output(built[out.get_type_name()])
        done[tensor.tensor_type.name] += 1
    log("weights from the file's blocks: " + ", ".join(f"{n} {k}" for k, n in sorted(done.items())))
    return done


def rewrite_ir(ir: Path, gguf_path: Path) -> None:
    """Rewrite ``ir``'s openvino_model in place with ``gguf_path``'s blocks."""
    xml = ir / "openvino_model.xml"
    model = ov.Core().read_model(xml)
    # stdout: the preparation shows a child's stdout as it goes (engine.prepare.convert.run_child)
    rewrite(model, open_gguf(gguf_path), lambda m: print(m, flush=True), progress=sys.stdout)
    temporary = ir / "blocks.xml"
    ov.save_model(model, temporary, compress_to_fp16=False)
    del model
    temporary.replace(xml)
    temporary.with_suffix(".bin").replace(xml.with_suffix(".bin"))
