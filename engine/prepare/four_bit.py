"""A GGUF's rows in 4-bit blocks, for a model prepared in int4 (the draft's default): the file's
Q4_K and Q4_0 rows as they are, the others requantized to Q4_0 (the draft's rounding never reaches
an answer: the target verifies). Its file's other types have no interleaved kernels, and a draft
step on them cost much more than on Q4_0 rows (docs/design.md, "The draft in 4-bit rows"); on
AVX2, where the plugin's int4 kernels compute in f32, they are the draft's fast kernels. Both of a
model's graphs read the same rows (engine.prepare.gguf_graph)."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# The 4-bit types kept as the file stores them (the rest become Q4_0).
FOUR_BIT = frozenset({Q.Q4_K, Q.Q4_0})
# Rows requantized at a time: a vocabulary-sized matrix is never held in f32 whole.
CHUNK_ROWS = 4096


def in_four_bits(rows: np.ndarray, kind: int) -> tuple[np.ndarray, int]:
    """GGUF rows (u8 [N, bytes per row]) of ``kind`` in 4-bit blocks: as they are where the type is
    one of :data:`FOUR_BIT` (or its rows do not come in Q4_0 blocks), else requantized to Q4_0."""
    block, size = gguf.GGML_QUANT_SIZES[Q(kind)]
    q4_block, q4_size = gguf.GGML_QUANT_SIZES[Q.Q4_0]
    columns = rows.shape[1] // size * block
    if kind in FOUR_BIT or columns % q4_block:
        return rows, kind
    out = np.empty((rows.shape[0], columns // q4_block * q4_size), dtype=np.uint8)
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        part = np.ascontiguousarray(rows[start : start + CHUNK_ROWS])
        weights = gguf.quants.dequantize(part, Q(kind)).astype(np.float32).reshape(part.shape[0], columns)
        out[start : start + part.shape[0]] = gguf.quants.quantize(weights, Q.Q4_0).view(np.uint8)
    return out, int(Q.Q4_0)
