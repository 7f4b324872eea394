"""A lean wrapper over one OpenVINO ``InferRequest`` on a stateful causal-LM IR.

The request's states are the KV cache. ``tokens`` mirrors what they hold, so any
call can reuse the longest cached prefix and roll back the rest by trimming the
states: nothing already computed is computed again.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from engine.errors import ContextLimitError, PrepareError

EXACT_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
# Activations are quantized for the int4 matmuls in groups matching the weights' group size:
# on this CPU that cuts a decode step by a quarter against the plugin's default of 32
# (measured: README, Benchmarks).
DYNAMIC_QUANTIZATION = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 128}
# The target's default. With it, a verify pass of up to 32 tokens computes each row bit for
# bit as single-token steps do (tests/test_runtime.py), so greedy speculative decoding equals
# autoregressive decoding exactly. The CPU default u8 KV cache breaks that: its per-block
# quantization depends on how many tokens a pass appends.
TARGET_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "bf16", **DYNAMIC_QUANTIZATION}
# The draft's rounding cannot change the output, so it runs with the plugin's fastest settings.
DRAFT_CONFIG = dict(DYNAMIC_QUANTIZATION)
# A masked rollback compacts the cache once it holds more dropped entries than this; the
# compaction costs one ordinary trim.
MAX_MASKED = 64
_KV_BYTES = {"u8": 1, "i8": 1, "bf16": 2, "f16": 2, "f32": 4}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case on every step, compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _slice_logits(model: ov.Model) -> None:
    """Add a ``logits_to_keep`` input: only the last N rows go through the vocabulary
    projection, so a long prefill does not pay for logits it never reads."""
    node = _lm_head(model)
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


def _lm_head(model: ov.Model) -> ov.Node:
    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        node = node.input_value(0).get_node()
    return node


def _shrink_vocabulary(model: ov.Model, rows: int) -> None:
    """Keep only the first ``rows`` rows of the vocabulary projection (FR-Spec style).

    BPE ids are ordered by merge rank, which follows frequency, so a prefix of the
    vocabulary is a frequency-ranked subset that keeps every id unchanged. The
    compressed weight constants (and their scales / zero points) are sliced in place,
    so the bytes read per token shrink with the rows.
    """
    matmul = _lm_head(model)
    vocab = matmul.input_value(1).get_partial_shape()[0].get_length()
    pending = [matmul.input_value(1).get_node()]
    while pending:
        node = pending.pop()
        for port in node.inputs():
            source = port.get_source_output().get_node()
            if source.get_type_name() != "Constant":
                pending.append(source)
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


class Runtime:
    """One model, one request, one KV cache."""

    def __init__(self, ir_dir: Path, device: str = "CPU", config: dict | None = None, core: ov.Core | None = None,
                 vocab_limit: int | None = None, masked_rollback: bool = False, pass_width: int = 1):
        """``vocab_limit``: compute logits for the first N token ids only (a cheaper draft head).

        ``masked_rollback``: roll back by masking the dropped entries out of attention instead of
        copying the cache. For the draft, copying every state out and back in costs about a third
        of one of its steps, and slows its next step by as much (README, Benchmarks); masking
        costs nothing, but the attention sums then run over other slots and may round
        differently. So it is for the draft, whose rounding cannot change the output.

        ``pass_width``: :meth:`score` feeds at least this many tokens per pass, re-feeding cached
        ones (rolled back for free when masked). The CPU plugin pays a setup cost on every pass
        whose token count differs from the previous pass's, about a quarter of a draft step; a
        draft fed 2 tokens on every step (its catch-up after an accepted round needs 2) never pays
        it, and a 2-token step costs what a 1-token step does (README, "How it works")."""
        if pass_width > 1 and not masked_rollback:
            raise ValueError("pass_width > 1 re-feeds a cached token every step: it needs masked_rollback")
        core = core or ov.Core()
        self.ir_dir = Path(ir_dir)
        xml = self.ir_dir / "openvino_model.xml"
        try:
            model = core.read_model(xml)
        except RuntimeError as exc:
            raise PrepareError(f"{ir_dir}: cannot read the OpenVINO model ({exc})") from exc
        _slice_logits(model)
        if vocab_limit and vocab_limit < _lm_head(model).input_value(1).get_partial_shape()[0].get_length():
            _shrink_vocabulary(model, vocab_limit)
        self.compiled = core.compile_model(model, device, config or {})
        self.request = self.compiled.create_infer_request()
        self.vocab_size: int = self.compiled.output("logits").get_partial_shape()[2].get_length()
        hf_config = json.loads((Path(ir_dir) / "config.json").read_text())
        self.max_context: int = int(hf_config.get("max_position_embeddings", 32768))
        self._kv_bytes_per_token = self._kv_bytes(hf_config)
        self.tokens: list[int] = []  # what the cache holds, in order (dropped entries excluded)
        self.masked_rollback = masked_rollback
        self.pass_width = pass_width
        self._mask = np.ones(0, dtype=np.int64)  # one entry per cache slot: 0 = dropped
        self.passes = 0

    def _kv_bytes(self, cfg: dict) -> int:
        layers = cfg["num_hidden_layers"]
        kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        precision = str(self.compiled.get_property("KV_CACHE_PRECISION"))
        per = next((b for name, b in _KV_BYTES.items() if name in precision), 2)
        return 2 * layers * kv_heads * head_dim * per

    @property
    def slots(self) -> int:
        """Entries the cache holds, masked-out ones included."""
        return len(self._mask)

    @property
    def kv_cache_bytes(self) -> int:
        return self.slots * self._kv_bytes_per_token

    def warm_up(self) -> None:
        """Run the shapes decoding uses once, so the first request does not pay for kernel setup."""
        for n in sorted({8, 1, 5, self.pass_width}):
            self.forward([0] * n, rows=n)
        self.reset()

    def reset(self) -> None:
        self.request.reset_state()
        self.tokens = []
        self._mask = np.ones(0, dtype=np.int64)

    def trim(self, keep: int) -> None:
        """Roll the KV cache back to its first ``keep`` tokens."""
        if keep >= len(self.tokens):
            return
        if keep == 0:
            self.reset()
            return
        slots = np.flatnonzero(self._mask)
        if self.masked_rollback:
            self._mask[slots[keep]:] = 0
            dropped = len(self._mask) - keep
            if dropped > MAX_MASKED:
                self._gather(slots[:keep])
        else:
            self._gather(slots[:keep])
        del self.tokens[keep:]

    def _gather(self, slots: np.ndarray) -> None:
        """Keep only the cache entries at ``slots``: a copy of every state out and back in."""
        for state in self.request.query_state():
            state.state = ov.Tensor(np.take(state.state.data, slots, axis=2))
        self._mask = np.ones(len(slots), dtype=np.int64)

    def forward(self, new_tokens: Sequence[int], rows: int = 1) -> np.ndarray:
        """Append ``new_tokens`` to the cache; return logits of the last ``rows`` of them."""
        past, m = len(self.tokens), len(new_tokens)
        if past + m > self.max_context:
            raise ContextLimitError(f"{past + m} tokens exceed the model's context of {self.max_context}")
        self._mask = np.concatenate([self._mask, np.ones(m, dtype=np.int64)])
        self.request.infer({
            "input_ids": np.asarray([new_tokens], dtype=np.int64),
            "attention_mask": self._mask[None],
            "position_ids": np.arange(past, past + m, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
            "logits_to_keep": np.array([min(rows, m)], dtype=np.int64),
        })
        self.tokens.extend(new_tokens)
        self.passes += 1
        return self.request.get_tensor("logits").data[0].astype(np.float32, copy=True)

    def score(self, tokens: Sequence[int], rows: int = 1) -> np.ndarray:
        """Logits at the last ``rows`` positions of ``tokens``, reusing the cached prefix."""
        start = max(0, min(common_prefix(self.tokens, tokens), len(tokens) - max(rows, self.pass_width)))
        self.trim(start)
        return self.forward(tokens[start:], rows)
