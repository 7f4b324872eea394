"""Rewrites of a stateful causal-LM IR's graph before it is compiled.

``slice_logits`` adds a ``logits_to_keep`` input, so a long prefill does not pay for logits
it never reads; ``keep_vocabulary`` computes the vocabulary projection for a set of token ids only
(a cheaper draft head) and gives the others -inf.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from engine import ggml
from engine.core.draft_vocab import Ids
from engine.errors import EngineError
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


def keep_vocabulary(model: ov.Model, ids: Ids, library: Path | None = None) -> np.ndarray:
    """Compute the vocabulary projection's rows for ``ids`` only (FR-Spec: the draft's head cut to
    frequent tokens, arXiv 2502.14856), and give every other id a logit of -inf: the logits keep
    the whole vocabulary, so whatever reads them (the drafters, sampling) is unchanged, and softmax
    gives those ids q = 0 exactly (-inf is what top-k gives the tokens it cuts already; a finite
    floor could overflow to it at a tiny temperature anyway). Returns the ids kept.

    The head's rows are gathered in the order of ``ids``. On the plugin's kernels the compressed
    weight's constants (codes, 4-bit packed or not, and their scales and zero points) are gathered
    in place, so the bytes read per token shrink with the rows. On ggml's kernels (``library``: the
    op's) the head is a new node on the rows gathered as the file stores them (interleaved rows
    put back first: :func:`engine.ggml.deinterleaved`), interleaved again where they were, which
    takes whole groups of 8: then only the first multiple of 8 of ``ids`` is kept, so ``ids``
    comes most wanted first."""
    weight = head_weight(model)
    vocab = weight.get_partial_shape()[0].get_length()
    kept = np.asarray(ids, dtype=np.int64)
    if kept.ndim != 1 or len(np.unique(kept)) != len(kept) or not ((kept >= 0) & (kept < vocab)).all():
        raise EngineError(f"the ids kept must be distinct ids of the {vocab}-row vocabulary")
    head = lm_head(model)
    if head.get_type_name() == GGML_LINEAR:
        if library is None:
            raise EngineError("a head on ggml's kernels is rebuilt by the op: give its library")
        head, kept = _ggml_head_rows(head, kept, library)
    else:
        _gather_weight_rows(weight, vocab, kept)
    consumers = list(head.output(0).get_target_inputs())
    # One more column, of -inf, and every id's column picked from it or from the rows kept.
    floor = np.array(-np.inf, dtype=np.float32)
    padded = ops.pad(head.output(0), [0, 0, 0], [0, 0, 1], "constant", ops.constant(floor))
    column = np.full(vocab, len(kept), dtype=np.int64)
    column[kept] = np.arange(len(kept))
    full = ops.gather(padded, ops.constant(column), ops.constant(np.array(2, dtype=np.int64)))
    for port in consumers:
        port.replace_source_output(full.output(0))
    model.validate_nodes_and_infer_types()
    return kept


def _gather_weight_rows(weight: ov.Input, vocab: int, ids: np.ndarray) -> None:
    """The plugin's head: each constant behind its weight with a row per id (codes, scales, zero
    points) gathered at ``ids``, and a reshape's target shape told the new row count. The nodes
    between are changed in place, so they must feed the head alone (not a tied embedding too)."""
    pending = [weight]
    while pending:
        port = pending.pop()
        node, source = port.get_node(), port.get_source_output().get_node()
        if source.get_type_name() != "Constant":
            if len(source.output(0).get_target_inputs()) > 1:
                raise EngineError("the head's weight feeds other nodes too (a tied embedding): not cut in place")
            pending.extend(source.inputs())
            continue
        shape, kind = list(source.get_output_shape(0)), source.get_output_element_type(0)
        if node.get_type_name() == "Reshape" and port.get_index() == 1:
            gathered = ops.constant(np.where(source.get_data() == vocab, len(ids), source.get_data()), kind)
        elif shape and shape[0] == vocab:
            gathered = _rows(source, ids)
        else:
            continue
        port.replace_source_output(gathered.output(0))


def _rows(constant: ov.Node, ids: np.ndarray) -> ov.Node:
    """A constant holding the rows of ``constant`` at ``ids``; 4-bit data comes packed two values
    per byte, rows not necessarily byte-aligned, so it is unpacked and repacked."""
    shape, kind = list(constant.get_output_shape(0)), constant.get_output_element_type(0)
    data = constant.get_data()
    if kind.bitwidth != 4:
        return ops.constant(np.ascontiguousarray(data[ids]), kind)
    per_row = int(np.prod(shape[1:]))
    values = np.stack([data & 0x0F, data >> 4], axis=1).reshape(-1)[: shape[0] * per_row]
    values = np.pad(values.reshape(shape[0], per_row)[ids].reshape(-1), (0, len(ids) * per_row % 2))
    tensor = ov.Tensor(kind, [len(ids), *shape[1:]])
    tensor.data[:] = (values[0::2] | (values[1::2] << 4)).reshape(tensor.data.shape)
    return ov.op.Constant(tensor)


def _ggml_head_rows(head: ov.Node, ids: np.ndarray, library: Path) -> tuple[ov.Node, np.ndarray]:
    """A GgmlLinear head of one weight rebuilt on its rows at ``ids`` (its first multiple of 8
    where the rows were interleaved), on the same input and flags; returns it and the ids kept."""
    attributes = head.get_attributes()
    if len(attributes["ggml_types"]) != 1:
        raise EngineError("the head's op holds more than one weight")
    kind, grouped = int(attributes["ggml_types"][0]), bool(attributes["interleaved"][0])
    rows = head.input_value(FIRST_WEIGHT).get_node().get_data()
    if grouped:
        rows = ggml.deinterleaved(rows, kind)
        ids = ids[: len(ids) - len(ids) % INTERLEAVE]
    kept = rows[ids]
    if grouped:
        kept = ggml.interleaved(kept, kind, library)
    output = ggml.rebuilt(head, kept, kind, grouped, library)
    head.output(0).replace(output)
    return output.get_node(), ids
