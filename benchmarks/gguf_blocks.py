"""A probe: the target's fp16 IR with the GGUF's own Q4_K and Q6_K blocks in place of its matmul
weights (docs/benchmarks.md, "Faithful to the file"). Q4_K: u4 weights with an f16 scale and an
f16 zero point per 32; Q6_K: i8 with an f16 scale per 16. The embeddings stay fp16.

    python -m benchmarks.gguf_blocks GGUF FP16_IR_DIR OUT_DIR

then ``python -m benchmarks.fidelity --precisions OUT_DIR`` measures it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import openvino as ov
from openvino import opset13 as ops

NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(ir_name: str) -> str | None:
    """The GGUF tensor behind an IR weight of optimum-intel's export."""
    if ".lm_head." in ir_name:
        return "output.weight"
    if ".embed_tokens." in ir_name:
        return "token_embd.weight"
    parts = ir_name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return f"blk.{parts[i + 1]}.{NAMES.get('.'.join(parts[i + 2 : i + 4]), '?')}.weight"
    return None


def q4_k(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks as u4 values, scales and zero points, each in groups of 32 along a row."""
    rows, cols = int(t.shape[1]), int(t.shape[0])
    blocks = np.asarray(t.data).reshape(-1, 144)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = d * sc.astype(np.float32)  # [n, 8]
    mins = dmin * m.astype(np.float32)
    qs = blocks[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32).astype(np.uint8)
    zero = scale == 0
    zp = np.where(zero, mins, mins / np.where(zero, 1, scale))
    scale = np.where(zero, 1, scale)
    q[zero] = 0
    return q.reshape(rows, cols // 32, 32), scale.reshape(rows, cols // 32, 1), zp.reshape(rows, cols // 32, 1)


def q6_k(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks as i8 values and scales, in groups of 16 along a row."""
    rows, cols = int(t.shape[1]), int(t.shape[0])
    blocks = np.asarray(t.data).reshape(-1, 210)
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    ql = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, -1, 32)
    qh = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, -1, 32)
    q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 16, 16)
    return q.reshape(rows, cols // 16, 16), (d * scales).reshape(rows, cols // 16, 1)


def subgraph(t: Any, shape: list[int], out_type: ov.Type) -> ov.Node:
    if t.tensor_type == gguf.GGMLQuantizationType.Q4_K:
        q, scale, zp = q4_k(t)
        w = ops.convert(ops.constant(q, dtype=ov.Type.u4), ov.Type.f16)
        w = ops.subtract(w, ops.constant(zp.astype(np.float16)))
    else:
        q, scale = q6_k(t)
        w = ops.convert(ops.constant(q, dtype=ov.Type.i8), ov.Type.f16)
    w = ops.multiply(w, ops.constant(scale.astype(np.float16)))
    w = ops.reshape(w, ops.constant(np.array(shape, np.int64)), False)
    return ops.convert(w, out_type)


def main(gguf_path: Path, fp16_ir: Path, out: Path) -> None:
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    model = ov.Core().read_model(fp16_ir / "openvino_model.xml")
    done, kept = 0, []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant" or node.get_element_type() != ov.Type.f16:
            continue
        name, shape = node.get_friendly_name(), list(node.get_output_shape(0))
        key = gguf_name(name)
        if len(shape) != 2 or key is None or key not in tensors or ".embed_tokens." in name:
            kept.append(name)
            continue
        t = tensors[key]
        if t.tensor_type not in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            kept.append(name)
            continue
        for target in node.output(0).get_target_inputs():
            consumer = target.get_node()
            if consumer.get_type_name() == "Convert":  # the f16 -> f32 decompression
                for inner in consumer.output(0).get_target_inputs():
                    inner.replace_source_output(subgraph(t, shape, ov.Type.f32).output(0))
            else:
                target.replace_source_output(subgraph(t, shape, ov.Type.f16).output(0))
        done += 1
    print(f"replaced {done} weights; kept {len(kept)} as they were", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    for f in fp16_ir.iterdir():
        if not f.name.startswith("openvino_model."):
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, out / f.name)
    ov.save_model(model, out / "openvino_model.xml", compress_to_fp16=False)
    print(json.dumps({"ir": str(out), "MB": (out / "openvino_model.bin").stat().st_size / 1e6}))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
