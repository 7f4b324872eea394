"""A model's graphs built straight from its GGUF file: no torch, no dequantized copy of the
weights, no fp16 IR on the way (after openvino.genai's ``gguf_modeling.cpp`` and
``building_blocks.cpp``).

The file's metadata gives the shape (layers, heads, RoPE base, norm epsilon) and its tensors the
weights. One builder lays out both graphs of a prepared model; only the factory of its linear
layers and head differs (a llama file's q and k rows put back in the model's order first; the
token embedding's rows as the head where the file has no ``output.weight``):

- on ggml's kernels (:class:`OnGgml`, ``openvino_model_ggml6.xml``): GgmlLinear nodes on the file's
  own rows, grouped and interleaved as :func:`engine.prepare.ggml_ir.rewrite` makes them from an
  exported IR (a layer's q, k and v in one node, its gate and up in another), each node norming
  its input and adding its biases, SwiGLU and residual itself (:class:`engine.ggml.Fused`), and
  each layer's attention a KvAttention node over a KV cache the op keeps (no states: a rollback is
  a shorter length; engine.core.kv_cache);
- on the plugin's (:class:`OnPlugin`, ``openvino_model.xml``): a MatMul per matrix on its blocks'
  codes, converted, minus the zero point, times the scale in f16 (gguf_blocks.subgraph: the
  compressed-weight pattern the plugin fuses into its kernels), named as the export names it.

``four_bit`` (a model prepared in int4): the rows in 4-bit blocks (engine.prepare.four_bit), the
embedding's too, and both graphs read the same ones.

The rest is laid out op for op as optimum-intel's stateful export lays it out
(RMSNorm, RoPE from ``position_ids``; on the plugin's kernels the KV cache in ReadValue/Assign
variables gathered by ``beam_idx``, grouped-query heads expanded before ScaledDotProductAttention),
so that the CPU plugin fuses it as it fuses today's graph and :class:`engine.core.runtime.Runtime`,
the batcher and the prompt reader use it as they use today's: same inputs (the graph on ggml's
kernels two more, each row's cache and the entries it keeps), output and variable names.

What differs from today's graph, on purpose: the norms, biases and RoPE frequencies are the file's
f32 values (the export carried them through fp16, and kept the RoPE frequencies as f16 constants:
the default target's angles drift 1.8e-4 rad per position, 0.1 rad by position 561); the
embedding's scales are f32, not fp16 (the plugin widens them to f32 either way), and a Q5_0
embedding stays in its blocks rather than as fp16 values. The mask is built in fewer ops (same
values). With the export's f16 RoPE frequencies put back, the tiny models' logits are today's bit
for bit (tests/test_gguf_graph.py).

Architectures: llama, qwen2 and qwen3. Any other, or a feature these graphs do not model (RoPE
scaling, partial rotary dimensions, per-layer head counts), raises :class:`UnsupportedModel`, so a
caller can prepare the model through transformers and optimum-intel instead."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import openvino as ov
from openvino import opset6
from openvino import opset13 as ops
from openvino.op.util import Variable, VariableInfo

from engine import ggml
from engine.errors import PrepareError
from engine.ggml import GGML_XML
from engine.prepare import gguf_blocks
from engine.prepare.four_bit import in_four_bits
from engine.prepare.gguf_file import open_gguf

Q = gguf.GGMLQuantizationType
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# The export's masked-out attention score (fp16's lowest, as transformers writes it).
MASKED = -65504.0
# The friendly name of the RoPE frequencies' constant (tests compare against the export's).
INV_FREQ = "rope.inv_freq"
# A layer's q, k and v projections, as the file names them.
PROJECTIONS = ("attn_q", "attn_k", "attn_v")
# The file's names of a layer's matrices -> the modules optimum-intel's export names them by.
MODULES = {short: module for module, short in gguf_blocks.LAYER_NAMES.items()}
# The plugin's graph (the ggml one: GGML_XML).
PLUGIN_XML = "openvino_model.xml"
# What a prepared model's manifest records as its "graph" where it was built here.
FROM_FILE = "gguf_graph"


class UnsupportedModel(PrepareError):
    """The file holds a model these graphs do not build: prepare it through transformers."""


@dataclass(frozen=True)
class Shape:
    """What the graph needs of a GGUF's metadata (llama.cpp's keys, prefixed by the architecture)."""

    architecture: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    eps: float
    rope_base: float
    tied: bool  # no output.weight: the token embedding's rows are the head

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face config.json fields the runtime reads (engine.core.runtime: KV-cache
        bytes per token, the empty state's shape, the context limit) and a reader of the folder
        expects."""
        name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        return {
            "architectures": [name[self.architecture]],
            "model_type": self.architecture,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.context,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_base,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
        }


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def shape_of(reader: gguf.GGUFReader, where: str = "the GGUF") -> Shape:
    """``reader``'s model shape, or :class:`UnsupportedModel` where its architecture or a feature
    of it is not one these graphs build (each refusal says which, so the log tells why the old
    path ran)."""
    architecture = str(_field(reader, "general.architecture", "?"))
    if architecture not in ARCHITECTURES:
        raise UnsupportedModel(
            f"{where}: architecture '{architecture}' has no graph built from the file ({', '.join(ARCHITECTURES)} do)"
        )

    def key(name: str, default: Any = None) -> Any:
        value = _field(reader, f"{architecture}.{name}", default)
        if value is None:
            raise UnsupportedModel(f"{where}: the file has no {architecture}.{name}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    counts = (key("attention.head_count"), key("attention.head_count_kv", key("attention.head_count")))
    if any(isinstance(count, list) for count in counts):
        raise UnsupportedModel(f"{where}: head counts that vary by layer")
    heads, kv_heads = (int(count) for count in counts)
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    unsupported = [
        (int(key("attention.value_length", head_dim)) != head_dim, "values of another head size than keys"),
        (int(key("rope.dimension_count", head_dim)) != head_dim, "RoPE over part of a head"),
        (str(key("rope.scaling.type", "none")) not in ("none", ""), "RoPE scaling"),
        ("rope_freqs.weight" in tensors, "RoPE frequency factors"),
        (_field(reader, f"{architecture}.attention.sliding_window") is not None, "sliding-window attention"),
        (heads % kv_heads != 0, f"{heads} query heads over {kv_heads} KV heads"),
    ]
    for found, what in unsupported:
        if found:
            raise UnsupportedModel(f"{where}: {what} is not built from the file")
    embedding = tensors["token_embd.weight"]
    return Shape(
        architecture=architecture,
        layers=int(key("block_count")),
        hidden=hidden,
        ffn=int(key("feed_forward_length")),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=int(embedding.shape[1]),
        context=int(key("context_length")),
        eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_base=float(key("rope.freq_base", 10000.0)),
        tied="output.weight" not in tensors,
    )


def _constant(values: Any, kind: type = np.float32) -> ov.Output:
    return ops.constant(np.asarray(values, dtype=kind)).output(0)


def _parameter(name: str, dims: list[int], kind: ov.Type) -> ov.Node:
    """A graph input named ``name`` (its tensor too, as the runtime finds it)."""
    parameter = ops.parameter(dims, kind, name=name)
    parameter.output(0).get_tensor().set_names({name})
    return parameter


def _rows(tensor: Any) -> tuple[np.ndarray, int]:
    """A 2-D tensor's rows as the file stores them (u8 [rows, bytes per row]) and its ggml type."""
    return np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1), int(tensor.tensor_type)


def _columns(rows: np.ndarray, kind: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[Q(kind)]
    return rows.shape[1] // size * block


def _drop(tensor: Any) -> None:
    """Drop ``tensor``'s whole pages of the file's mapping from this process once the graph holds
    its copy: the reader maps the whole file, and pages read stay resident (counted in the
    process's memory, which would grow by the file's size) until dropped; a later read faults
    them in again from the page cache. (As engine.core.hugepages drops a graph's mapped weights.)"""
    view = tensor.data
    if not isinstance(view, np.memmap):  # (rows in memory: nothing to drop, nor to zero)
        return
    start = -(-view.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = (view.ctypes.data + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


def _values(tensor: Any) -> np.ndarray:
    """A norm's weight or a bias in f32 (the file stores them so)."""
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32).reshape(-1)


def dense(rows: np.ndarray, kind: int) -> np.ndarray:
    """Rows of a type kept in no blocks (gguf_blocks.ROW_DECODERS) as values: F32 in f32, the others
    in fp16 as the export carried them, a slice of rows at a time."""
    values = np.empty((rows.shape[0], _columns(rows, kind)), dtype=np.float32 if kind == Q.F32 else np.float16)
    for start in range(0, rows.shape[0], gguf_blocks.CHUNK_ROWS):
        part = np.ascontiguousarray(rows[start : start + gguf_blocks.CHUNK_ROWS])
        values[start : start + part.shape[0]] = gguf.quants.dequantize(part, Q(kind)).reshape(part.shape[0], -1)
    return values


def decoded(blocks: gguf_blocks.Blocks, shape: list[int]) -> ov.Output:
    """``(codes - zero point) * scale`` in f32, reshaped to the weight: the pattern the CPU plugin
    fuses into its gather, which keeps the codes as they are and the scales in f32 (an exported
    graph gives it scales rounded to fp16, gguf_blocks.subgraph, which it widens to f32 all the same)."""
    values = ops.convert(gguf_blocks.codes_constant(blocks.codes, blocks.element), ov.Type.f32)
    if blocks.zero is not None:
        values = ops.subtract(values, _constant(blocks.zero))
    values = ops.multiply(values, _constant(blocks.scale))
    return ops.reshape(values, _constant(shape, np.int64), False).output(0)


def embedding_table(tensor: Any, four_bit: bool = False) -> tuple[ov.Output, int]:
    """The token embedding as the gather reads it (f32 [vocab, hidden]) and the bytes the CPU
    plugin keeps of it. Q4_K, Q6_K, Q8_0, Q4_0 and Q5_0 (gguf_blocks.decode_rows) stay in their
    codes, with f32 scales (and zero points): the file's values (Q4_K's to f32 rounding, its min
    taken as a zero point), at what an exported graph costs (measured: the plugin's gather held u4
    or i8 codes and f32 scales). F32 stays f32, F16 f16; other types (Q5_K, Q3_K, IQ*) are
    dequantized to fp16 values, as the export carried them. ``four_bit``: in 4-bit blocks
    (engine.prepare.four_bit)."""
    rows, kind = _rows(tensor)
    if four_bit:
        rows, kind = in_four_bits(rows, kind)
    shape = [rows.shape[0], _columns(rows, kind)]
    blocks = gguf_blocks.decode_rows(rows, kind)
    if blocks is not None:
        per_group = 4 * (1 if blocks.zero is None else 2)
        size = blocks.codes.size * blocks.element.bitwidth // 8 + per_group * blocks.scale.size
        return decoded(blocks, shape), size
    values = dense(rows, kind) if kind != Q.F16 else rows.view(np.float16).reshape(shape)
    if values.dtype == np.float32:
        return _constant(values), values.nbytes
    return ops.convert(ops.constant(values), ov.Type.f32).output(0), values.nbytes


def rope_angles(position_ids: ov.Output, frequencies: ov.Node) -> tuple[ov.Output, ov.Output]:
    """RoPE's cos and sin [B, 1, T, D] of ``position_ids`` [B, T] at ``frequencies`` [1, D / 2, 1],
    as the export computes them."""
    positions = ops.convert(ops.unsqueeze(position_ids, _constant(1, np.int64)), ov.Type.f32)
    angles = ops.transpose(ops.matmul(frequencies, positions, False, False), _constant([0, 2, 1], np.int32))
    angles = ops.concat([angles, angles], -1)
    cos, sin = (ops.unsqueeze(f(angles), _constant(1, np.int64)).output(0) for f in (ops.cos, ops.sin))
    return cos, sin


def rope(x: ov.Output, cos: ov.Output, sin: ov.Output) -> ov.Output:
    """x [B, H, T, D] * cos + rotate_half(x) * sin, rotate_half as the export writes it (the plugin
    fuses the pattern into its RoPE node)."""
    half, axis = x.get_partial_shape()[3].get_length() // 2, _constant([3], np.int64)
    step = _constant([1], np.int64)
    second = ops.slice(x, _constant([half], np.int64), _constant([np.iinfo(np.int64).max], np.int64), step, axis)
    first = ops.slice(x, _constant([0], np.int64), _constant([half], np.int64), step, axis)
    rotated = ops.concat([ops.multiply(second, _constant(-1.0)), first], -1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin)).output(0)


def inv_freq(shape: Shape) -> np.ndarray:
    """RoPE's frequencies, ``base ** (-2i / head_dim)``, exact to f32."""
    return (1.0 / shape.rope_base ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)).astype(np.float32)


@dataclass(frozen=True)
class Weight:
    """A matrix as the file stores it, its rows in the model's order: u8 [N, bytes per row] of a
    ggml type; ``module``: what optimum-intel's export names it by (``model.layers.0.mlp.up_proj``,
    ``lm_head``)."""

    module: str
    rows: np.ndarray
    kind: int


class Linears:
    """How a graph multiplies by the file's matrices: ``x @ W^T`` for each of ``weights`` that reads
    ``x``. ``parameters``: the graph inputs it adds; ``done``: what it made, by type, for the log."""

    owns_attention = False  # (each layer's attention is the plugin's, over the graph's states)

    def __init__(self) -> None:
        self.parameters: list[ov.Node] = []
        self.done: Counter[str] = Counter()

    def __call__(self, x: ov.Output, weights: list[Weight], fused: ggml.Fused) -> list[ov.Output]:
        raise NotImplementedError

    def attention(
        self, q: ov.Output, k: ov.Output, v: ov.Output, layer: int, scale: float, rope: tuple[ov.Output, ov.Output]
    ) -> ov.Output:
        """Layer ``layer``'s attention, where it is the graph's own (:attr:`owns_attention`), ``q``
        and ``k`` turned by RoPE's cos and sin first."""
        raise NotImplementedError


def rms_norm(x: ov.Output, gamma: np.ndarray, eps: float, rank: int = 3) -> ov.Output:
    """x / sqrt(mean(x²) + eps) * gamma, in the export's ops (the plugin fuses them into its RMS
    node)."""
    ones = [1] * rank
    square = ops.power(x, _constant(np.full(ones, 2.0)))
    mean = ops.reduce_mean(square, _constant([-1], np.int64), keep_dims=True)
    root = ops.sqrt(ops.add(mean, _constant(np.full(ones, eps))))
    normed = ops.multiply(x, ops.divide(_constant(np.ones(ones)), root))
    return ops.multiply(_constant(gamma.reshape([*ones[:-1], -1])), normed).output(0)


class OnGgml(Linears):
    """GgmlLinear nodes on the rows, those that read one input in one node (ggml.linears:
    interleaved where ggml has kernels for that), with the pass's flags as an input; each layer's
    attention the op's too, over KV caches the op keeps (ggml.attention), each row's cache and the
    entries it keeps the graph's inputs :data:`~engine.ggml.KV_CACHES` and ``KV_PASTS``: the graph
    has no states."""

    owns_attention = True

    def __init__(self, library: Path) -> None:
        super().__init__()
        self.library = library
        self.gemm = ggml.gemm_input()
        self.caches, self.pasts = (_parameter(name, [-1], ov.Type.i64) for name in (ggml.KV_CACHES, ggml.KV_PASTS))
        self.parameters = [self.gemm, self.caches, self.pasts]

    def attention(
        self, q: ov.Output, k: ov.Output, v: ov.Output, layer: int, scale: float, rope: tuple[ov.Output, ov.Output]
    ) -> ov.Output:
        """Layer ``layer``'s attention over the op's caches, ``q`` and ``k`` turned by RoPE's cos
        and sin and the new entries ``k`` and ``v`` written first: in the op's one node, where
        the plugin ran a RoPE node each for q and k (each node a step runs costs some
        microseconds whatever its work)."""
        return ggml.attention(q, k, v, self.caches.output(0), self.pasts.output(0), layer, scale, self.library, rope)

    def __call__(self, x: ov.Output, weights: list[Weight], fused: ggml.Fused) -> list[ov.Output]:
        outputs = ggml.linears(
            x, [(w.rows, w.kind) for w in weights], self.library, gemm=self.gemm.output(0), fused=fused
        )
        interleaved = outputs[0].get_node().get_attributes()["interleaved"]
        for weight, grouped in zip(weights, interleaved):
            self.done[Q(weight.kind).name + (" interleaved" if grouped else "")] += 1
        self.done["nodes"] += 1
        return outputs


class OnPlugin(Linears):
    """A MatMul per matrix on its blocks' codes (gguf_blocks.subgraph: f16 scales and zero points,
    the compressed weights the plugin fuses into its kernels), or on fp16 values where the type has
    no blocks here (f32 for F32 rows). Each is named as the export names it, so
    :func:`engine.prepare.ggml_ir.rewrite` reads this graph as it reads an exported one."""

    def __call__(self, x: ov.Output, weights: list[Weight], fused: ggml.Fused) -> list[ov.Output]:
        """The products with what ``fused`` asks around them, in the plugin's own nodes."""
        if fused.gamma is not None:
            x = rms_norm(x, fused.gamma, fused.eps)
        outputs = [self.matmul(x, weight) for weight in weights]
        for i, bias in enumerate(fused.biases):
            if bias is not None:
                outputs[i] = ops.add(outputs[i], _constant(bias)).output(0)
        if fused.swiglu:
            outputs = [ops.multiply(ops.swish(outputs[0]), outputs[1]).output(0)]
        if fused.residual is not None:
            outputs[0] = ops.add(fused.residual, outputs[0]).output(0)
        return outputs

    def matmul(self, x: ov.Output, weight: Weight) -> ov.Output:
        shape = [weight.rows.shape[0], _columns(weight.rows, weight.kind)]
        blocks = gguf_blocks.decode_rows(weight.rows, weight.kind)
        if blocks is not None:
            matrix = gguf_blocks.subgraph(blocks, shape, ov.Type.f32)
            self.done[Q(weight.kind).name] += 1
        else:
            values = dense(weight.rows, weight.kind)
            constant = ops.constant(values)
            matrix = constant.output(0) if values.dtype == np.float32 else ops.convert(constant, ov.Type.f32).output(0)
            self.done[f"{Q(weight.kind).name} as {values.dtype.name} values"] += 1
        product = ops.matmul(x, matrix, transpose_a=False, transpose_b=True)
        product.set_friendly_name(f"__module.{weight.module}/ov_ext::linear/MatMul")
        return product.output(0)


def _module(name: str) -> str:
    """The export's module of the file's matrix ``name`` (``blk.0.attn_q``; the head's: lm_head)."""
    if not name.startswith("blk."):
        return "lm_head"
    _, layer, short = name.split(".")
    return f"model.layers.{layer}.{MODULES[short]}"


class _Builder:
    """The graph, block by block (one instance per build: it holds the graph's shared inputs)."""

    def __init__(self, reader: gguf.GGUFReader, linears: Linears, where: str, four_bit: bool = False):
        self.shape = shape_of(reader, where)
        self.tensors = {t.name: t for t in reader.tensors}
        self.permuted = gguf_blocks.permuted_heads(reader)
        self.multiply = linears
        self.four_bit = four_bit
        self.where = where
        self.parameters = {
            name: _parameter(name, dims, kind)
            for name, dims, kind in (
                ("input_ids", [-1, -1], ov.Type.i64),
                ("attention_mask", [-1, -1], ov.Type.i64),
                ("position_ids", [-1, -1], ov.Type.i64),
                ("beam_idx", [-1], ov.Type.i32),
            )
        }
        self.variables: list[Variable] = []
        self.sinks: list[ov.Node] = []

    def tensor(self, name: str) -> Any:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise UnsupportedModel(f"{self.where}: the file has no tensor {name}")
        return tensor

    def weight(self, name: str) -> tuple[Weight, np.ndarray | None]:
        """The file's matrix ``name`` in the model's row order (and that order, where a llama file
        permuted it), in 4-bit blocks where the graph is."""
        rows, kind = _rows(self.tensor(f"{name}.weight"))
        module = _module(name)
        order = gguf_blocks.unpermute(f"{module}.weight", rows.shape[0], self.permuted)
        if order is not None:
            rows = rows[order]
        if self.four_bit:
            rows, four = in_four_bits(rows, kind)
            if four != kind:
                self.multiply.done[f"{Q(kind).name} requantized"] += 1
                kind = four
        return Weight(module, rows, kind), order

    # -- blocks

    def linears(
        self,
        x: ov.Output,
        names: list[str],
        norm: str | None = None,
        swiglu: bool = False,
        residual: ov.Output | None = None,
    ) -> list[ov.Output]:
        """``x`` (RMS-normed by the ``norm`` weight first) times each named matrix, by the graph's
        factory: each product plus its bias where the file has one (a llama file's q and k biases
        put back in the model's order too); with ``swiglu``, the one output silu(first) * second;
        plus ``residual``."""
        weights, orders = zip(*(self.weight(name) for name in names))
        biases = [
            None if f"{name}.bias" not in self.tensors else _values(self.tensors[f"{name}.bias"]) for name in names
        ]
        biases = [b if b is None or order is None else b[order] for b, order in zip(biases, orders)]
        gamma = _values(self.tensor(norm)) if norm is not None else None
        fused = ggml.Fused(gamma, self.shape.eps if norm is not None else 0.0, biases, swiglu, residual)
        outputs = self.multiply(x, list(weights), fused)
        for name in names:
            _drop(self.tensor(f"{name}.weight"))
        return outputs

    def heads(self, x: ov.Output, count: int, norm: str | None) -> ov.Output:
        """[batch, seq, count * head_dim] -> [batch, count, seq, head_dim] (qwen3: each head
        RMS-normed first)."""
        split = ops.reshape(x, _constant([0, 0, count, self.shape.head_dim], np.int64), special_zero=True).output(0)
        if norm is not None and f"{norm}.weight" in self.tensors:
            split = rms_norm(split, _values(self.tensors[f"{norm}.weight"]), self.shape.eps, rank=4)
        return ops.transpose(split, _constant([0, 2, 1, 3], np.int32)).output(0)

    def cache(self, name: str, batch: ov.Output) -> tuple[ov.Output, Variable]:
        """A layer's keys or values so far: the variable (zero entries until a pass assigns it),
        its rows reordered by ``beam_idx``, as the export's stateful model reads it."""
        shape = self.shape
        info = VariableInfo()
        info.data_shape = ov.PartialShape([-1, shape.kv_heads, -1, shape.head_dim])
        info.data_type = ov.Type.f32
        info.variable_id = name
        variable = Variable(info)
        dims = [batch, _constant([shape.kv_heads], np.int64), _constant([0], np.int64)]
        empty = ops.broadcast(_constant(0.0), ops.concat([*dims, _constant([shape.head_dim], np.int64)], 0))
        read = opset6.read_value(empty, variable)
        past = ops.gather(read, self.parameters["beam_idx"], _constant(0, np.int64)).output(0)
        self.variables.append(variable)
        return past, variable

    def extend(self, past: ov.Output, new: ov.Output, variable: Variable) -> ov.Output:
        """The cache with this pass's entries appended (assigned back to its variable), its KV heads
        repeated for the query heads they serve."""
        shape = self.shape
        joined = ops.concat([past, new], -2)
        self.sinks.append(opset6.assign(joined, variable))
        whole = joined.output(0)
        groups = shape.heads // shape.kv_heads
        if groups == 1:
            return whole
        dims = ops.shape_of(whole, ov.Type.i64)
        target = ops.concat(
            [
                ops.gather(dims, _constant([0, 1], np.int64), _constant(0, np.int64)),
                _constant([groups], np.int64),
                ops.gather(dims, _constant([2], np.int64), _constant(0, np.int64)),
                _constant([shape.head_dim], np.int64),
            ],
            0,
        )
        spread = ops.broadcast(ops.unsqueeze(whole, _constant(2, np.int64)), target, broadcast_spec="bidirectional")
        return ops.reshape(spread, _constant([0, shape.heads, -1, shape.head_dim], np.int64), True).output(0)

    def mask(self, past: ov.Output) -> ov.Output:
        """The attention bias [batch, 1, seq, entries]: 0 where a query may look (an entry at or
        before its own slot in the cache and not masked out by ``attention_mask``), else MASKED.
        Causality counts cache slots, not positions, as the export's does: a masked rollback leaves
        slots that positions skip."""
        i64 = ov.Type.i64
        zero, one = _constant(0, np.int64), _constant(1, np.int64)
        done = ops.gather(ops.shape_of(past, i64), _constant(2, np.int64), zero)
        seq = ops.gather(ops.shape_of(self.parameters["input_ids"], i64), one, zero)
        total = ops.add(done, seq)
        slots = ops.range(zero, total, one, i64)
        queries = ops.reshape(ops.range(done, total, one, i64), _constant([1, 1, -1, 1], np.int64), False)
        causal = ops.less_equal(ops.reshape(slots, _constant([1, 1, 1, -1], np.int64), False), queries)
        kept = ops.gather(ops.convert(self.parameters["attention_mask"], ov.Type.boolean), slots, one)
        kept = ops.unsqueeze(kept, _constant([1, 2], np.int64))
        return ops.select(ops.logical_and(causal, kept), _constant(0.0), _constant(MASKED)).output(0)

    # -- the model

    def model(self) -> ov.Model:
        shape, p = self.shape, self.parameters
        table, _ = embedding_table(self.tensor("token_embd.weight"), self.four_bit)
        _drop(self.tensor("token_embd.weight"))
        ids = ops.convert(p["input_ids"], ov.Type.i32)
        x = ops.gather(table, ids, _constant(0, np.int32)).output(0)
        batch = ops.gather(ops.shape_of(p["input_ids"], ov.Type.i64), _constant([0], np.int64), _constant(0, np.int64))

        frequencies = ops.constant(inv_freq(shape).reshape(1, -1, 1))
        frequencies.set_friendly_name(INV_FREQ)
        cos, sin = rope_angles(p["position_ids"], frequencies)
        root = 1.0 / np.sqrt(shape.head_dim)  # (what q . k is scaled by)
        scale = _constant(root)

        # (the export's variable ids: its past input's name and its present output's, which the
        # prompt reader's stateless copy splits back into an input and an output: engine.core.reader)
        names = [(f"past_key_values.{i}.key", f"present.{i}.key") for i in range(shape.layers)]
        names += [(f"past_key_values.{i}.value", f"present.{i}.value") for i in range(shape.layers)]
        own = self.multiply.owns_attention
        if not own:
            states = [self.cache(past + present, batch.output(0)) for past, present in names]
            caches = list(zip(states[: shape.layers], states[shape.layers :]))
            bias = self.mask(caches[0][0][0])
        for i in range(shape.layers):
            block = f"blk.{i}"
            q, k, v = self.linears(x, [f"{block}.{n}" for n in PROJECTIONS], norm=f"{block}.attn_norm.weight")
            q = self.heads(q, shape.heads, f"{block}.attn_q_norm")
            k = self.heads(k, shape.kv_heads, f"{block}.attn_k_norm")
            v = self.heads(v, shape.kv_heads, None)
            if own:
                attended = self.multiply.attention(q, k, v, i, float(root), (cos, sin))
            else:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
                (past_k, key_variable), (past_v, value_variable) = caches[i]
                keys, values = self.extend(past_k, k, key_variable), self.extend(past_v, v, value_variable)
                attended = ops.scaled_dot_product_attention(q, keys, values, bias, scale, causal=False).output(0)
            attended = ops.transpose(attended, _constant([0, 2, 1, 3], np.int32))
            merged = ops.reshape(attended, _constant([0, 0, shape.heads * shape.head_dim], np.int64), True)
            (x,) = self.linears(merged.output(0), [f"{block}.attn_output"], residual=x)
            mlp = [f"{block}.ffn_gate", f"{block}.ffn_up"]
            (gated,) = self.linears(x, mlp, norm=f"{block}.ffn_norm.weight", swiglu=True)
            (x,) = self.linears(gated, [f"{block}.ffn_down"], residual=x)

        (logits,) = self.linears(x, ["token_embd" if shape.tied else "output"], norm="output_norm.weight")
        result = ops.result(logits)
        result.output(0).get_tensor().set_names({"logits"})
        parameters = [*p.values(), *self.multiply.parameters]
        model = ov.Model([result], self.sinks, parameters, self.variables, FROM_FILE)
        model.validate_nodes_and_infer_types()
        return model


def build(
    gguf_path: Path, library: Path | None = None, four_bit: bool = False, log: Callable[[str], None] | None = None
) -> ov.Model:
    """The stateful model in ``gguf_path`` with its linear layers and head on ggml's kernels
    (``library``: the op's, engine.prepare.kernels), as Runtime(kernels=library) reads it, or
    without a library on the plugin's, as Runtime reads it; ``four_bit``: in 4-bit rows; ``log``:
    told what the linear layers became. Raises :class:`UnsupportedModel` where the file holds a
    model these graphs do not build."""
    return _build(open_gguf(gguf_path), Path(gguf_path), library, four_bit, log)[0]


def _build(
    reader: gguf.GGUFReader,
    gguf_path: Path,
    library: Path | None,
    four_bit: bool,
    log: Callable[[str], None] | None,
) -> tuple[ov.Model, Shape]:
    linears = OnPlugin() if library is None else OnGgml(library)
    builder = _Builder(reader, linears, str(gguf_path), four_bit)
    model = builder.model()
    if log is not None:
        kernels = "the plugin's" if library is None else "ggml's"
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(linears.done.items()))
        log(f"{gguf_path.name}: linear layers on {kernels} kernels, from the file: {counts}")
    return model, builder.shape


def write(
    gguf_path: Path,
    out_dir: Path,
    library: Path | None = None,
    four_bit: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """:func:`build`'s graph saved in ``out_dir`` (as ``GGML_XML`` with a ``library``, else as
    :data:`PLUGIN_XML`), with the config.json the runtime reads beside it (and
    generation_config.json where the file names its end-of-text token); the graph's xml is
    renamed into place last, so a folder holding it holds the rest. Returns the xml's path. The
    folder still needs a tokenizer (and a manifest) to be a prepared model."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, shape = _build(reader, gguf_path, library, four_bit, log)
    # (transformers_version as save_pretrained writes it: without one, transformers takes the
    # tokenizer beside it for an old Mistral export and warns of a wrong regex)
    config = {**shape.hf_config(), "_name_or_path": gguf_path.name, "transformers_version": version("transformers")}
    special = {
        name: int(value)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        if (value := _field(reader, f"tokenizer.ggml.{name}")) is not None
    }
    (out_dir / "config.json").write_text(json.dumps({**config, **special}, indent=2))
    if "eos_token_id" in special:
        generation = {k: v for k, v in special.items() if k != "pad_token_id"}
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    xml = out_dir / (PLUGIN_XML if library is None else GGML_XML)
    partial = out_dir / f".{os.getpid()}.{xml.name}"
    ov.save_model(model, partial, compress_to_fp16=False)
    del model
    partial.with_suffix(".bin").replace(xml.with_suffix(".bin"))
    partial.replace(xml)
    return xml
