"""ggml's CPU kernels inside OpenVINO graphs: the GgmlLinear op (built by engine.prepare.kernels)
multiplies by a weight kept in its GGUF blocks. Here it is registered with a Core and put into
graphs: one node at a time, or every linear layer of a prepared model whose GGUF is at hand."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops
from openvino.utils.node_factory import NodeFactory

GGML_LINEAR = "GgmlLinear"
# A prepared model's graph with the op (engine.prepare.ggml_ir), beside its openvino_model.xml.
GGML_XML = "openvino_model_ggml.xml"


def register(core: ov.Core, library: Path) -> None:
    """Let ``core`` read and compile graphs with the op."""
    core.add_extension(str(library))


@functools.cache
def _factory(library: Path) -> NodeFactory:
    factory = NodeFactory()
    factory.add_extension(str(library))
    return factory


def linear(x: ov.Output, rows: np.ndarray, ggml_type: int, library: Path) -> ov.Output:
    """``x @ W^T`` for a weight given as its GGUF rows (u8 [N, bytes per row]) of ``ggml_type``."""
    weight = ops.constant(np.ascontiguousarray(rows, dtype=np.uint8))
    node = _factory(library).create(GGML_LINEAR, [x, weight.output(0)], {"ggml_type": ggml_type})
    return node.output(0)
