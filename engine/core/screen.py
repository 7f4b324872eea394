"""A cheap first look at which kernels can win a model's plain step: its linear layers timed in
parts (a quarter of the blocks, then the head) on each candidate's kernels
(engine.core.service.on_kernels).

Timing a whole model on the plugin's kernels costs its own copy of the weights: for the default
target, 2.78 GiB resident after its first pass, more than serving on ggml's kernels needs. The
linear layers are most of a step, and both of a model's graphs compute everything else with the
same nodes. So a candidate whose linear layers are slower by a margin cannot win the step, and is
not built whole."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine import ggml
from engine.core.runtime import supported_activations
from engine.errors import PrepareError

# The candidate whose linear layers take this many times the other's is not timed whole. Whole
# steps differ less than their linear layers (the rest is common), never more, but a short timing
# is noisy. The plugin's whole target step took 1.8 to 2.2 times ggml's on every CPU measured, the
# draft's 1.4 on an AVX2 Zen 3 (docs/benchmarks.md).
MARGIN = 1.25


def linear_nodes(model: ov.Model, on_ggml: bool) -> list[ov.Node]:
    """The model's linear layers in graph order: the op's nodes, or the MatMuls by a weight."""
    if on_ggml:
        return [n for n in model.get_ordered_ops() if n.get_type_name() == ggml.GGML_LINEAR]
    return [
        n
        for n in model.get_ordered_ops()
        if n.get_type_name() == "MatMul" and n.get_attributes()["transpose_b"] and not _is_activation(n.input_value(1))
    ]


def _is_activation(value: ov.Output) -> bool:
    """Whether a MatMul's right side depends on a graph input (attention's), not on weights alone."""
    pending, seen = [value.get_node()], set()
    while pending:
        node = pending.pop()
        if node.get_type_name() == "Parameter":
            return True
        if node.get_friendly_name() in seen:
            continue
        seen.add(node.get_friendly_name())
        pending.extend(v.get_node() for v in node.input_values())
    return False


def reading(nodes: list[ov.Node], flags: int | None) -> ov.Model:
    """A model of ``nodes`` (linear layers of another), each reading inputs of its own (the op's
    residual too); the op's ``flags`` a constant (None: on the plugin's kernels, no flags)."""
    inputs = []
    for node in nodes:
        ports = [node.input(0)]
        if flags is not None:
            node.input(1).replace_source_output(ops.constant(np.array([flags], dtype=np.int64)).output(0))
            ports += [p for p in node.inputs()[2:] if p.get_source_output().get_node().get_type_name() != "Constant"]
        for port in ports:
            x = ops.parameter(port.get_partial_shape(), ov.Type.f32)
            port.replace_source_output(x.output(0))
            inputs.append(x)
    return ov.Model([out for node in nodes for out in node.outputs()], inputs)


def parts(model: ov.Model, layers: int, flags: int | None) -> list[tuple[ov.Model, float]]:
    """The first quarter of the blocks' linear layers and the head (:func:`reading`), each with
    how many times a step reads its like; none where the linear layers do not split into
    ``layers`` blocks of as many and a head. (Every later block reads an earlier one's output and
    the head the last's, so graph order puts the first blocks' first and the head last.) A quarter
    of the blocks, not one: a block alone may stay in the CPU's cache between passes, where a
    step reads every weight from memory."""
    nodes = linear_nodes(model, flags is not None)
    per_block, rest = divmod(len(nodes) - 1, layers)
    if per_block < 1 or rest:
        return []
    blocks = max(1, layers // 4)
    return [(reading(nodes[: blocks * per_block], flags), layers / blocks), (reading(nodes[-1:], flags), 1.0)]


def step_seconds(
    ir_dir: Path, library: Path | None, device: str, config: dict, activations: int | None = None, reps: int = 12
) -> float | None:
    """What a plain step's linear layers take in the model in ``ir_dir`` on ggml's kernels
    (``library``: its graph that runs them) or the plugin's (None), from :func:`parts`' median
    1-token passes; None where the graph does not split so."""
    core = ov.Core()
    xml, flags = ir_dir / "openvino_model.xml", None
    if library is not None:
        ggml.register(core, library)
        xml, flags = ir_dir / ggml.GGML_XML, ggml.FINE if supported_activations(activations, library) == 14 else 0
    layers = int(json.loads((ir_dir / "config.json").read_text())["num_hidden_layers"])
    try:
        model = core.read_model(xml)
    except RuntimeError as exc:
        raise PrepareError(f"{ir_dir}: cannot read the OpenVINO model ({exc})") from exc
    pieces = parts(model, layers, flags)
    return sum(times * _pass_seconds(core.compile_model(part, device, config), reps) for part, times in pieces) or None


def _pass_seconds(compiled: ov.CompiledModel, reps: int) -> float:
    """The median time of a 1-token pass of random activations."""
    request = compiled.create_infer_request()
    rng = np.random.default_rng(0)
    shapes = ([1 if d.is_dynamic else d.get_length() for d in p.get_partial_shape()] for p in compiled.inputs)
    feed = {i: rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(shapes)}
    return median_seconds(lambda: request.infer(feed), reps)


def median_seconds(call: Callable[[], object], reps: int) -> float:
    """The median time of ``reps`` calls of ``call``, after two more that set up its shapes."""
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])
