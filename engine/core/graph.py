"""Rewrites of a stateful causal-LM IR's graph before it is compiled.

``slice_logits`` adds a ``logits_to_keep`` input, so a long prefill does not pay for logits
it never reads; ``shrink_vocabulary`` keeps only the first rows of the vocabulary projection
(a cheaper draft head).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from engine.ggml import FIRST_WEIGHT, GGML_LINEAR, INTERLEAVE


def slice_logits(model: ov.Model) -> None:
    """Add a ``logits_to_keep`` input: only the last N rows go through the vocabulary
    projection, so a long prefill does not pay for logits it never reads."""
    node = lm_head(model)
    hidden = node.input_value(0)
    keep = ops.parameter([1], ov.Type.i64, name="logits_to_keep")
    keep.output(0).get_tensor().set_names({"logits_to_keep"})
    start = ops.negative(keep)
    stop = ops.constant(np.array([np.iinfo(np.int64).max], dtype=np.int64))
    step = ops.constant(np.array([1], dtype=np.int64))
    axis = ops.constant(np.array([1], dtype=np.int64))
    node.input(0).replace_source_output(ops.slice(hidden, start, stop, step, axis).output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()


def lm_head(model: ov.Model) -> ov.Node:
    """The vocabulary projection: a MatMul, or ggml's GgmlLinear (engine.ggml); its input 0
    is the hidden state (:func:`head_weight`: its weight)."""
    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() not in ("MatMul", GGML_LINEAR):
        node = node.input_value(0).get_node()
    return node


def head_weight(model: ov.Model) -> ov.Input:
    """The vocabulary projection's weight input: a MatMul's second, GgmlLinear's first weight
    (its rows in their GGUF blocks)."""
    head = lm_head(model)
    return head.input(FIRST_WEIGHT if head.get_type_name() == GGML_LINEAR else 1)


def shrink_vocabulary(model: ov.Model, rows: int) -> None:
    """Keep only the first ``rows`` rows of the vocabulary projection (FR-Spec style); on ggml's
    kernels, whole groups of interleaved rows (``rows`` rounded down to a multiple of 8).

    BPE ids are ordered by merge rank, which follows frequency, so a prefix of the
    vocabulary is a frequency-ranked subset that keeps every id unchanged. The
    compressed weight constants (and their scales / zero points) are sliced in place,
    so the bytes read per token shrink with the rows.
    """
    weight = head_weight(model)
    vocab = weight.get_partial_shape()[0].get_length()
    if weight.get_node().get_type_name() == GGML_LINEAR:
        rows -= rows % INTERLEAVE
    pending = [weight]
    while pending:
        port = pending.pop()
        node, source = port.get_node(), port.get_source_output().get_node()
        if source.get_type_name() != "Constant":
            pending.extend(source.inputs())
            continue
        shape, kind = list(source.get_output_shape(0)), source.get_output_element_type(0)
        if node.get_type_name() == "Reshape" and port.get_index() == 1:
            sliced = ops.constant(np.where(source.get_data() == vocab, rows, source.get_data()), kind)
        elif shape and shape[0] == vocab:
            sliced = _first_rows(source, rows)
        else:
            continue
        port.replace_source_output(sliced.output(0))
    model.validate_nodes_and_infer_types()


def _first_rows(constant: ov.Node, rows: int) -> ov.Node:
    """A constant holding the first ``rows`` rows of ``constant``; 4-bit data comes packed two
    values per byte, rows not necessarily byte-aligned, so it is unpacked and repacked."""
    shape, kind = list(constant.get_output_shape(0)), constant.get_output_element_type(0)
    data = constant.get_data()
    if kind.bitwidth != 4:
        return ops.constant(np.ascontiguousarray(data[:rows]), kind)
    count = rows * int(np.prod(shape[1:]))
    values = np.stack([data & 0x0F, data >> 4], axis=1).reshape(-1)[:count]
    values = np.pad(values, (0, count % 2))
    tensor = ov.Tensor(kind, [rows, *shape[1:]])
    tensor.data[:] = (values[0::2] | (values[1::2] << 4)).reshape(tensor.data.shape)
    return ov.op.Constant(tensor)


def vocabulary_rows(model: ov.Model) -> int:
    """Rows of the model's vocabulary projection."""
    return head_weight(model).get_partial_shape()[0].get_length()
