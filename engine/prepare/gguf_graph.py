"""A model's graph on ggml's kernels built straight from its GGUF file: no torch, no dequantized
copy of the weights, no fp16 IR on the way (issue 73; after openvino.genai's
``gguf_modeling.cpp`` and ``building_blocks.cpp``).

The file's metadata gives the shape (layers, heads, RoPE base, norm epsilon) and its tensors the
weights. Every linear layer and the head are GgmlLinear nodes on the file's own rows, grouped and
interleaved exactly as :func:`engine.prepare.ggml_ir.rewrite` makes them from the exported IR (a
layer's q, k and v in one node, its gate and up in another; a llama file's q and k rows put back
in the model's order; the token embedding's rows as the head where the file has no
``output.weight``). The rest is laid out op for op as optimum-intel's stateful export lays it out
(RMSNorm, RoPE from ``position_ids``, the KV cache in ReadValue/Assign variables gathered by
``beam_idx``, grouped-query heads expanded before ScaledDotProductAttention), so that the CPU
plugin fuses it as it fuses today's graph and :class:`engine.core.runtime.Runtime`, the batcher
and the prompt reader use it as they use today's: same inputs, output and variable names.

What differs from today's graph, on purpose: the norms, biases and RoPE frequencies are the file's
f32 values (the export carried them through fp16, and kept the RoPE frequencies as f16 constants:
the default target's angles drift 1.8e-4 rad per position, 0.1 rad by position 561); the
embedding's scales are f32, not fp16 (the plugin widens them to f32 either way), and a Q5_0
embedding stays in its blocks rather than as fp16 values. The mask is built in fewer ops (same
values). With the export's f16 RoPE frequencies put back, the tiny models' logits are today's bit
for bit (tests/test_gguf_graph.py).

Architectures: llama, qwen2 and qwen3. Any other, or a feature these graphs do not model (RoPE
scaling, partial rotary dimensions, per-layer head counts), raises :class:`UnsupportedModel`, so a
caller can prepare the model the old way instead."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
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

Q = gguf.GGMLQuantizationType
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# The export's masked-out attention score (fp16's lowest, as transformers writes it).
MASKED = -65504.0
# The friendly name of the RoPE frequencies' constant (tests compare against the export's).
INV_FREQ = "rope.inv_freq"
# What a layer's projections are called in the file, and in optimum-intel's export (which
# gguf_blocks.unpermute reads a llama file's permuted heads by).
PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}


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


def _rows(tensor: Any) -> tuple[np.ndarray, int]:
    """A 2-D tensor's rows as the file stores them (u8 [rows, bytes per row]) and its ggml type."""
    return np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1), int(tensor.tensor_type)


def _values(tensor: Any) -> np.ndarray:
    """A norm's weight or a bias in f32 (the file stores them so)."""
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32).reshape(-1)


def q5_0(tensor: Any) -> gguf_blocks.Blocks:
    """A Q5_0 tensor's blocks as i8 codes (the 5-bit value minus 16) times each block's f16 scale:
    exactly the file's values, at a byte a weight where fp16 takes two."""
    block, size = gguf.GGML_QUANT_SIZES[Q.Q5_0]
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, size)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32)
    high = raw[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
    low = (raw[:, 6:, None] >> np.array([0, 4], dtype=np.uint8)).swapaxes(1, 2).reshape(-1, block) & 0x0F
    codes = (low | ((high & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    groups = cols // block
    return gguf_blocks.Blocks(codes.reshape(rows, groups, block), ov.Type.i8, scale.reshape(rows, groups, 1), None)


def decoded(blocks: gguf_blocks.Blocks, shape: list[int]) -> ov.Output:
    """``(codes - zero point) * scale`` in f32, reshaped to the weight: the pattern the CPU plugin
    fuses into its gather, which keeps the codes as they are and the scales in f32 (today's graph
    gives it scales rounded to fp16, gguf_blocks.subgraph, which it widens to f32 all the same)."""
    values = ops.convert(ops.constant(blocks.codes, dtype=blocks.element), ov.Type.f32)
    if blocks.zero is not None:
        values = ops.subtract(values, _constant(blocks.zero))
    values = ops.multiply(values, _constant(blocks.scale))
    return ops.reshape(values, _constant(shape, np.int64), False).output(0)


def embedding_table(tensor: Any) -> tuple[ov.Output, int]:
    """The token embedding as the gather reads it (f32 [vocab, hidden]) and the bytes the CPU
    plugin keeps of it. Q4_K, Q6_K, Q8_0, Q4_0 (gguf_blocks.decode) and Q5_0 (:func:`q5_0`) stay
    in their codes, with f32 scales (and zero points): the file's values (Q4_K's to f32 rounding,
    its min taken as a zero point), at what today's graph costs (measured: the plugin's gather
    held u4 or i8 codes and f32 scales). F32 stays f32, F16 f16; other types (Q5_K, Q3_K, IQ*) are
    dequantized to fp16 values, as the export carried them."""
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    kind = Q(tensor.tensor_type)
    blocks = q5_0(tensor) if kind == Q.Q5_0 else gguf_blocks.decode(tensor)
    if blocks is not None:
        per_group = 4 * (1 if blocks.zero is None else 2)
        size = blocks.codes.size * blocks.element.bitwidth // 8 + per_group * blocks.scale.size
        return decoded(blocks, [rows, cols]), size
    values = gguf.quants.dequantize(np.asarray(tensor.data), kind).reshape(rows, cols)
    if kind == Q.F32:
        return _constant(values), values.nbytes
    table = ops.constant(values.astype(np.float16))
    return ops.convert(table, ov.Type.f32).output(0), rows * cols * 2


def inv_freq(shape: Shape) -> np.ndarray:
    """RoPE's frequencies, ``base ** (-2i / head_dim)``, exact to f32."""
    return (1.0 / shape.rope_base ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)).astype(np.float32)


class _Builder:
    """The graph, block by block (one instance per build: it holds the graph's shared inputs)."""

    def __init__(self, reader: gguf.GGUFReader, library: Path, where: str):
        self.shape = shape_of(reader, where)
        self.tensors = {t.name: t for t in reader.tensors}
        self.permuted = gguf_blocks.permuted_heads(reader)
        self.library = library
        self.where = where
        self.parameters = {
            name: ops.parameter(dims, kind, name=name)
            for name, dims, kind in (
                ("input_ids", [-1, -1], ov.Type.i64),
                ("attention_mask", [-1, -1], ov.Type.i64),
                ("position_ids", [-1, -1], ov.Type.i64),
                ("beam_idx", [-1], ov.Type.i32),
            )
        }
        for name, parameter in self.parameters.items():
            parameter.output(0).get_tensor().set_names({name})
        self.gemm = ggml.gemm_input()
        self.variables: list[Variable] = []
        self.sinks: list[ov.Node] = []

    def tensor(self, name: str) -> Any:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise UnsupportedModel(f"{self.where}: the file has no tensor {name}")
        return tensor

    # -- blocks

    def rms_norm(self, x: ov.Output, weight: str, rank: int = 3) -> ov.Output:
        """x / sqrt(mean(x²) + eps) * weight, in the export's ops (the plugin fuses them into its RMS
        node)."""
        ones = [1] * rank
        square = ops.power(x, _constant(np.full(ones, 2.0)))
        mean = ops.reduce_mean(square, _constant([-1], np.int64), keep_dims=True)
        root = ops.sqrt(ops.add(mean, _constant(np.full(ones, self.shape.eps))))
        normed = ops.multiply(x, ops.divide(_constant(np.ones(ones)), root))
        gamma = _values(self.tensor(weight))
        return ops.multiply(_constant(gamma.reshape([*ones[:-1], -1])), normed).output(0)

    def linears(self, x: ov.Output, names: list[str]) -> list[ov.Output]:
        """``x`` times each named weight, in one GgmlLinear node on the file's rows (ggml.linears:
        interleaved where ggml has kernels for that), each output plus its bias where the file has
        one. A llama file's q and k rows (and biases) are put back in the model's order first."""
        weights, orders = [], []
        for name in names:
            rows, kind = _rows(self.tensor(f"{name}.weight"))
            projection = PROJECTIONS.get(name.split(".")[-1], "")
            order = gguf_blocks.unpermute(f".{projection}.", rows.shape[0], self.permuted) if projection else None
            weights.append((rows if order is None else rows[order], kind))
            orders.append(order)
        outputs = ggml.linears(x, weights, self.library, gemm=self.gemm.output(0))
        for i, (name, order) in enumerate(zip(names, orders)):
            if f"{name}.bias" in self.tensors:
                bias = _values(self.tensors[f"{name}.bias"])
                outputs[i] = ops.add(outputs[i], _constant(bias if order is None else bias[order])).output(0)
        return outputs

    def heads(self, x: ov.Output, count: int, norm: str | None) -> ov.Output:
        """[batch, seq, count * head_dim] -> [batch, count, seq, head_dim] (qwen3: each head
        RMS-normed first)."""
        split = ops.reshape(x, _constant([0, 0, count, self.shape.head_dim], np.int64), special_zero=True).output(0)
        if norm is not None and f"{norm}.weight" in self.tensors:
            split = self.rms_norm(split, f"{norm}.weight", rank=4)
        return ops.transpose(split, _constant([0, 2, 1, 3], np.int32)).output(0)

    def rope(self, x: ov.Output, cos: ov.Output, sin: ov.Output) -> ov.Output:
        """x * cos + rotate_half(x) * sin, rotate_half as the export writes it (the plugin fuses
        the pattern into its RoPE node)."""
        half, axis = self.shape.head_dim // 2, _constant([3], np.int64)
        step = _constant([1], np.int64)
        second = ops.slice(x, _constant([half], np.int64), _constant([np.iinfo(np.int64).max], np.int64), step, axis)
        first = ops.slice(x, _constant([0], np.int64), _constant([half], np.int64), step, axis)
        rotated = ops.concat([ops.multiply(second, _constant(-1.0)), first], -1)
        return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin)).output(0)

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
        table, _ = embedding_table(self.tensor("token_embd.weight"))
        ids = ops.convert(p["input_ids"], ov.Type.i32)
        x = ops.gather(table, ids, _constant(0, np.int32)).output(0)
        batch = ops.gather(ops.shape_of(p["input_ids"], ov.Type.i64), _constant([0], np.int64), _constant(0, np.int64))

        frequencies = ops.constant(inv_freq(shape).reshape(1, -1, 1))
        frequencies.set_friendly_name(INV_FREQ)
        positions = ops.convert(ops.unsqueeze(p["position_ids"], _constant(1, np.int64)), ov.Type.f32)
        angles = ops.transpose(ops.matmul(frequencies, positions, False, False), _constant([0, 2, 1], np.int32))
        angles = ops.concat([angles, angles], -1)
        cos = ops.unsqueeze(ops.cos(angles), _constant(1, np.int64)).output(0)
        sin = ops.unsqueeze(ops.sin(angles), _constant(1, np.int64)).output(0)
        scale = _constant(1.0 / np.sqrt(shape.head_dim))

        # (the export's variable ids: its past input's name and its present output's, which the
        # prompt reader's stateless copy splits back into an input and an output: engine.core.reader)
        names = [(f"past_key_values.{i}.key", f"present.{i}.key") for i in range(shape.layers)]
        names += [(f"past_key_values.{i}.value", f"present.{i}.value") for i in range(shape.layers)]
        states = [self.cache(past + present, batch.output(0)) for past, present in names]
        caches = list(zip(states[: shape.layers], states[shape.layers :]))
        bias = self.mask(caches[0][0][0])
        for i, ((past_k, key_variable), (past_v, value_variable)) in enumerate(caches):
            block = f"blk.{i}"
            q, k, v = self.linears(self.rms_norm(x, f"{block}.attn_norm.weight"), [f"{block}.{n}" for n in PROJECTIONS])
            q = self.rope(self.heads(q, shape.heads, f"{block}.attn_q_norm"), cos, sin)
            k = self.rope(self.heads(k, shape.kv_heads, f"{block}.attn_k_norm"), cos, sin)
            keys = self.extend(past_k, k, key_variable)
            values = self.extend(past_v, self.heads(v, shape.kv_heads, None), value_variable)
            attended = ops.scaled_dot_product_attention(q, keys, values, bias, scale, causal=False)
            attended = ops.transpose(attended, _constant([0, 2, 1, 3], np.int32))
            merged = ops.reshape(attended, _constant([0, 0, shape.heads * shape.head_dim], np.int64), True)
            (out,) = self.linears(merged.output(0), [f"{block}.attn_output"])
            x = ops.add(x, out).output(0)
            gate, up = self.linears(
                self.rms_norm(x, f"{block}.ffn_norm.weight"), [f"{block}.ffn_gate", f"{block}.ffn_up"]
            )
            (down,) = self.linears(ops.multiply(ops.swish(gate), up).output(0), [f"{block}.ffn_down"])
            x = ops.add(x, down).output(0)

        hidden = self.rms_norm(x, "output_norm.weight")
        head = "token_embd" if shape.tied else "output"
        (logits,) = ggml.linears(hidden, [_rows(self.tensor(f"{head}.weight"))], self.library, gemm=self.gemm.output(0))
        result = ops.result(logits)
        result.output(0).get_tensor().set_names({"logits"})
        parameters = [*p.values(), self.gemm]
        model = ov.Model([result], self.sinks, parameters, self.variables, "gguf_graph")
        model.validate_nodes_and_infer_types()
        return model


def build(gguf_path: Path, library: Path) -> ov.Model:
    """The stateful model in ``gguf_path`` with its linear layers and head on ggml's kernels
    (``library``: the op's, engine.prepare.kernels), as Runtime(kernels=library) reads it; raises
    :class:`UnsupportedModel` where the file holds a model these graphs do not build."""
    return _Builder(gguf.GGUFReader(gguf_path), library, str(gguf_path)).model()


def write(gguf_path: Path, out_dir: Path, library: Path) -> Path:
    """:func:`build`'s graph saved as ``out_dir / GGML_XML``, with the config.json the runtime
    reads beside it (and generation_config.json where the file names its end-of-text token); the
    graph's xml is renamed into place last, so a folder holding it holds the rest. Returns the
    xml's path. The folder still needs a tokenizer (and a manifest) to be a prepared model."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    builder = _Builder(reader, library, str(gguf_path))
    model = builder.model()
    config = {**builder.shape.hf_config(), "_name_or_path": gguf_path.name}
    special = {
        name: int(value)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        if (value := _field(reader, f"tokenizer.ggml.{name}")) is not None
    }
    (out_dir / "config.json").write_text(json.dumps({**config, **special}, indent=2))
    if "eos_token_id" in special:
        generation = {k: v for k, v in special.items() if k != "pad_token_id"}
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    xml = out_dir / GGML_XML
    partial = out_dir / f".{os.getpid()}.{GGML_XML}"
    ov.save_model(model, partial, compress_to_fp16=False)
    del model
    partial.with_suffix(".bin").replace(xml.with_suffix(".bin"))
    partial.replace(xml)
    return xml
