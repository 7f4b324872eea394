"""ggml's CPU kernels inside OpenVINO graphs: the GgmlLinear op (built by engine.prepare.kernels)
multiplies by a weight kept in its GGUF blocks. Here it is registered with a Core and put into
graphs: one node at a time, or every linear layer of a prepared model whose GGUF is at hand."""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import openvino as ov
from openvino import opset13 as ops
from openvino.utils.node_factory import NodeFactory

from engine import machine

GGML_LINEAR = "GgmlLinear"
# The op's attention over the KV caches it keeps (engine.core.kv_cache).
KV_ATTENTION = "KvAttention"
# Its graph inputs: each row's cache (an id) and the entries the row keeps before the pass.
KV_CACHES, KV_PASTS = "kv_caches", "kv_pasts"
# FIRST_WEIGHT, INTERLEAVE, GEMM_ROWS, AMX_ROWS, TILED_ROWS, GEMM and FINE are the op's too, defined
# here alone: its build reads them from here (engine.prepare.kernels.SHARED, ggml_op/shared.h).
# The op's first weight input (after x and its gemm flag); one input per weight from there.
FIRST_WEIGHT = 2
# Rows ggml's interleaved kernels group together: a weight stored so is cut only at a group's end.
INTERLEAVE = 8
# Activation rows ggml's gemm takes at a time (its interleaved activation blocks hold four rows).
GEMM_ROWS = 4
# From this many rows a prompt pass (GEMM) multiplies through the CPU's AMX tiles in bf16, where it
# has them (:func:`prompt_tiles`).
AMX_ROWS = 32
# From this many rows a prompt pass puts interleaved Q4_K rows back as stored and multiplies them
# by ggml's tiled kernels; below, by the op's own multi-row kernel, which a large layer took less
# time through than through ggml's gemm or tiled kernels up to this width (docs/benchmarks.md,
# "The op's fixed constants").
TILED_ROWS = 256
# A prepared model's graph with the op (engine.prepare.ggml_ir), beside its openvino_model.xml.
# (Its sixth form: weights with interleaved kernels keep their rows interleaved, an int4 model's
# rows are 4-bit blocks, a node norms its input and adds its biases, SwiGLU and residual itself
# (:class:`Fused`), and a graph built from a GGUF attends over the op's own KV caches
# (:data:`KV_ATTENTION`), turning q and k by RoPE's angles itself. A cache holding an earlier form
# writes this one and drops that.)
GGML_XML = "openvino_model_ggml6.xml"
# Its input of a pass's flags (engine.core.runtime sets it on every pass): GEMM turns ggml's batched
# kernels on (its gemm, its tiled mul_mat: a prompt reader's passes); FINE multiplies Q4_K and Q6_K
# rows by activations in 14 bits rather than 8 in the blocks whose largest value stands out, where
# the CPU can (:func:`fine_activations`).
GEMM_INPUT = "ggml_gemm"
GEMM, FINE = 1, 2
# Bits per activation the op's own kernels can multiply Q4_K and Q6_K rows by: 8 (Q8_K, as llama.cpp
# does) or 14 where a block needs them (FINE; the default where the CPU can).
ACTIVATIONS = (8, 14)
# The ways a decode or verify pass may multiply, by index (the op's tuning.h): whose kernels, and
# how the threads share the columns. Each is timed on the machine it runs on, per pass shape.
CANDIDATES = tuple(
    f"{kernel}, {split} split"
    for split in ("static", "stealing")
    for kernel in (
        "own kernels",
        "ggml's kernels",
        "own kernels in 256 bits",
        "own kernels reading nothing ahead",
        "own kernels reading ahead into L1",
    )
)
log = logging.getLogger("specchat.kernels")


def register(core: ov.Core, library: Path) -> None:
    """Let ``core`` read and compile graphs with the op."""
    core.add_extension(str(library))


@functools.cache
def _factory(library: Path) -> NodeFactory:
    factory = NodeFactory()
    factory.add_extension(str(library))
    return factory


@functools.cache
def _native(library: Path) -> ctypes.CDLL:
    native = ctypes.CDLL(str(library))
    native.specchat_choose.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int, ctypes.c_int]
    native.specchat_choices.argtypes = [ctypes.c_char_p, ctypes.c_int]
    native.specchat_set_choice.argtypes = [ctypes.c_char_p, ctypes.c_int]
    native.specchat_force.argtypes = [ctypes.c_int]
    native.specchat_timing_calls.restype = ctypes.c_int64
    native.specchat_interleave.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    return native


def prompt_tiles(library: Path) -> bool:
    """Whether the op multiplies a prompt pass's rows (:data:`AMX_ROWS` or more) through the CPU's AMX
    tiles in bf16 here, rather than by ggml's batched kernels (docs/design.md, "The GGUF's own kernels")."""
    return bool(_native(library).specchat_prompt_tiles())


def fine_activations(library: Path) -> bool:
    """Whether the op multiplies Q4_K and Q6_K rows by activations in 14 bits here when a pass's
    flags ask for it (FINE: on CPUs with AVX-512 VNNI; docs/design.md, "Activations in 14 bits")."""
    return bool(_native(library).specchat_fine_activations())


def interleaved(rows: np.ndarray, ggml_type: int, library: Path) -> np.ndarray | None:
    """``rows`` (u8 [N, bytes per row]) interleaved as ggml's gemm and gemv read them (its CPU
    "repack" layout), or None where ggml has no such kernels for the type or shape on this CPU."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    out = np.empty_like(rows)
    done = _native(library).specchat_interleave(
        ggml_type, rows.ctypes.data, out.ctypes.data, rows.shape[0], rows.shape[1] // size * block
    )
    return out if done else None


def deinterleaved(grouped: np.ndarray, ggml_type: int) -> np.ndarray:
    """Rows interleaved by :func:`interleaved` (u8 [N, bytes per row]) back as the file stores
    them: the inverse of ggml's repack (its ``make_block_q4_0x8``, ``make_block_iq4_nlx8`` and
    ``make_block_q4_Kx8``, 8 bytes at a time; the op's ``deinterleave_q4_K``). Per group of 8 rows
    and per block, the 8 blocks' scales come first, then their quants 8 bytes from each row in
    turn (Q4_0's nibbles stored signed, their bits 3 flipped); a Q4_K group's scales and mins of
    each sub-block are packed as one Q4_K block packs its 8 sub-blocks'."""
    kind = gguf.GGMLQuantizationType(ggml_type)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    n, row_bytes = grouped.shape
    blocks = row_bytes // size
    x = np.asarray(grouped, dtype=np.uint8).reshape(n // INTERLEAVE, blocks, INTERLEAVE * size)
    rows = np.empty((n // INTERLEAVE, INTERLEAVE, blocks, size), dtype=np.uint8)  # [group, row, block, byte]

    def per_row(chunks: np.ndarray) -> np.ndarray:  # [group, block, row, ...] -> [group, row, block, ...]
        return chunks.swapaxes(1, 2).reshape(*rows.shape[:3], -1)

    if kind in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.IQ4_NL):
        rows[..., :2] = per_row(x[..., :16].reshape(*x.shape[:2], INTERLEAVE, 2))
        quants = x[..., 16:].reshape(*x.shape[:2], -1, INTERLEAVE, 8).swapaxes(2, 3)  # [group, block, row, chunk, 8]
        rows[..., 2:] = per_row(quants ^ (0x88 if kind == gguf.GGMLQuantizationType.Q4_0 else 0))
    elif kind == gguf.GGMLQuantizationType.Q4_K:
        rows[..., 0:2] = per_row(x[..., 0:16].reshape(*x.shape[:2], INTERLEAVE, 2))
        rows[..., 2:4] = per_row(x[..., 16:32].reshape(*x.shape[:2], INTERLEAVE, 2))
        # (each sub-block's 12 bytes: the 8 rows' scales and mins; unpacked, swapped to each row's 8 sub-blocks)
        scales, mins = _unpack_q4_k_scales(x[..., 32:128].reshape(*x.shape[:2], 8, 12))  # [group, block, sub, row]
        rows[..., 4:16] = per_row(_pack_q4_k_scales(scales.swapaxes(2, 3), mins.swapaxes(2, 3)))
        quants = x[..., 128:].reshape(*x.shape[:2], -1, INTERLEAVE, 8).swapaxes(2, 3)
        rows[..., 16:] = per_row(quants)
    else:
        raise ValueError(f"no interleaved layout known for {kind.name} rows")
    return rows.reshape(n, row_bytes)


def _unpack_q4_k_scales(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and mins ([..., 12]) as 8 of each ([..., 8])."""
    scales = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return scales, mins


def _pack_q4_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 scales and 8 mins ([..., 8] each) in Q4_K's 12 bytes."""
    return np.concatenate(
        [
            scales[..., :4] | ((scales[..., 4:] >> 4) << 6),
            mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
            (scales[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)


@dataclass(frozen=True)
class Fused:
    """What a node computes around its products, each as llama.cpp does (the op's fusion.h): the
    plugin runs one node where it ran up to five, and each node it runs costs it some microseconds
    a pass whatever its work. ``gamma``: the input RMS-normed (with ``eps``) and times it first;
    ``biases``: per weight, added to its product (None: none); ``swiglu``: the one output
    silu(first product) * second; ``residual``: added to the (first) output."""

    gamma: np.ndarray | None = None
    eps: float = 0.0
    biases: Sequence[np.ndarray | None] = ()
    swiglu: bool = False
    residual: ov.Output | None = None

    def inputs(self) -> list[ov.Output]:
        """The node's inputs after its weights: gamma, the biases, the residual."""
        values = [v for v in (self.gamma, *self.biases) if v is not None]
        constants = [ops.constant(np.asarray(v, dtype=np.float32)).output(0) for v in values]
        return constants + ([self.residual] if self.residual is not None else [])

    def attributes(self) -> dict:
        """The op's attributes that say so."""
        return {
            "biased": [int(b is not None) for b in self.biases] if any(b is not None for b in self.biases) else [],
            "norm": int(self.gamma is not None),
            "eps": float(self.eps),
            "swiglu": int(self.swiglu),
            "residual": int(self.residual is not None),
        }


def linears(
    x: ov.Output,
    weights: list[tuple[np.ndarray, int]],
    library: Path,
    interleave: bool = True,
    gemm: ov.Output | None = None,
    fused: Fused = Fused(),
) -> list[ov.Output]:
    """``x @ W^T`` for each weight given as its GGUF rows (u8 [N, bytes per row]) and ggml type,
    in one node (the activations quantized once): multiplied by ggml's gemv on the rows
    interleaved where ggml has that for the type (and ``interleave``), else by its vec_dot on the
    rows as stored. ``gemm``: the flags (i64 [1], 0 if not given; :data:`GEMM_INPUT`). GEMM
    multiplies by batched kernels instead, faster over many rows, but a row then rounds with where
    it falls in its pass: for a prompt's passes. Those are the AMX tiles in bf16 from :data:`AMX_ROWS` rows where
    the CPU has them (:func:`prompt_tiles`), else ggml's (its gemm on interleaved rows, its own mul_mat on rows
    as stored, and on interleaved Q4_K rows put back as stored from :data:`TILED_ROWS` rows on).
    ``fused``: what the node computes around the products (:class:`Fused`)."""
    flag = gemm if gemm is not None else ops.constant(np.zeros(1, dtype=np.int64)).output(0)
    inputs, types, interleaved_flags = [x, flag], [], []
    for rows, ggml_type in weights:
        grouped = interleaved(rows, ggml_type, library) if interleave else None
        inputs.append(
            ops.constant(np.ascontiguousarray(rows if grouped is None else grouped, dtype=np.uint8)).output(0)
        )
        types.append(ggml_type)
        interleaved_flags.append(int(grouped is not None))
    attributes = {"ggml_types": types, "interleaved": interleaved_flags, **fused.attributes()}
    return list(_factory(library).create(GGML_LINEAR, [*inputs, *fused.inputs()], attributes).outputs())


def rebuilt(node: ov.Node, rows: np.ndarray, ggml_type: int, interleaved: bool, library: Path) -> ov.Output:
    """A one-weight op ``node`` on other rows (as the op reads them: interleaved where
    ``interleaved``), its input, flags and fused work as they were."""
    attributes = node.get_attributes()
    if len(attributes["ggml_types"]) != 1:
        raise ValueError("the node holds more than one weight")
    rest = [node.input_value(i) for i in range(FIRST_WEIGHT + 1, node.get_input_size())]
    weight = ops.constant(np.ascontiguousarray(rows, dtype=np.uint8)).output(0)
    attributes.update(ggml_types=[int(ggml_type)], interleaved=[int(interleaved)])
    inputs = [node.input_value(0), node.input_value(1), weight, *rest]
    return _factory(library).create(GGML_LINEAR, inputs, attributes).output(0)


def linear(x: ov.Output, rows: np.ndarray, ggml_type: int, library: Path, interleave: bool = True) -> ov.Output:
    """:func:`linears` for one weight."""
    return linears(x, [(rows, ggml_type)], library, interleave)[0]


def attention(
    q: ov.Output,
    k: ov.Output,
    v: ov.Output,
    caches: ov.Output,
    pasts: ov.Output,
    layer: int,
    scale: float,
    library: Path,
    rope: tuple[ov.Output, ov.Output] | None = None,
) -> ov.Output:
    """Layer ``layer``'s attention of ``q`` [B, H, T, D] over the KV caches the op keeps, after
    writing each row's new entries ``k`` and ``v`` [B, Hkv, T, D] into row b's cache ``caches[b]``
    past its first ``pasts[b]`` (:data:`KV_ATTENTION`: engine/prepare/ggml_op/kv_attention.h);
    ``rope``: RoPE's cos and sin [B, 1, T, D], which the node turns q and k by first (else they
    come turned)."""
    inputs = [q, k, v, caches, pasts, *(rope or ())]
    node = _factory(library).create(KV_ATTENTION, inputs, {"layer": layer, "scale": scale})
    return node.output(0)


def gemm_input() -> ov.Node:
    """The graph input of the flags of every op it feeds (:data:`GEMM_INPUT`, :func:`linears`)."""
    flag = ops.parameter([1], ov.Type.i64, name=GEMM_INPUT)
    flag.output(0).get_tensor().set_names({GEMM_INPUT})
    return flag


def choose(library: Path, seconds: Sequence[Sequence[float]]) -> int:
    """The candidate the op keeps for a shape whose candidates took ``seconds`` (as many timings
    each): its own rule, the lowest median."""
    samples = len(seconds[0])
    flat = (ctypes.c_double * (len(seconds) * samples))(*(t for timings in seconds for t in timings))
    return int(_native(library).specchat_choose(flat, len(seconds), samples))


def choices(library: Path) -> dict[str, int]:
    """The candidate (:data:`CANDIDATES`) chosen for each pass shape timed so far in this process."""
    native = _native(library)
    size = native.specchat_choices(None, 0)
    text = ctypes.create_string_buffer(size + 1)
    native.specchat_choices(text, size + 1)
    lines = (line.split("\t") for line in text.value.decode().splitlines())
    return {key: int(candidate) for key, candidate in lines}


def timing_calls(library: Path) -> int:
    """How many of the op's calls so far took a candidate in turn, their pass shape still being
    timed: where a pass leaves it as it was, every shape that pass took was chosen already."""
    return int(_native(library).specchat_timing_calls())


def force(library: Path, candidate: int | None) -> None:
    """Every pass takes ``candidate`` (None: each shape the one chosen for it): tests and probes."""
    _native(library).specchat_force(-1 if candidate is None else candidate)


def _choices_file(library: Path) -> Path:
    """Where the choices are kept: beside the library, which is built per CPU's features, per CPU
    model (two CPUs with the same features may still differ in speed)."""
    return library.parent / f"choices-{machine.cpu_key()}.json"


def _kept_choices(library: Path) -> dict[str, int]:
    """The choices kept for this CPU (none where no file, or no whole one, is kept)."""
    try:
        return {
            key: int(candidate) for key, candidate in json.loads(_choices_file(library).read_text())["choices"].items()
        }
    except (OSError, ValueError, KeyError, AttributeError):
        return {}


def load_choices(library: Path, remeasure: bool = False) -> int:
    """Put the choices kept for this CPU back into the op, so that no shape is timed again (with
    ``remeasure``, forget them all instead); returns how many were put back."""
    native = _native(library)
    if remeasure:
        native.specchat_forget()
        return 0
    kept = _kept_choices(library)
    for key, candidate in kept.items():
        native.specchat_set_choice(key.encode(), candidate)
    return len(kept)


def save_choices(library: Path) -> dict[str, int]:
    """Keep the choices made so far in this process for later starts, beside those kept for other
    shapes (another model's, or a process that forgot its own): a file written whole, then renamed,
    so that two processes never leave half of one. Returns this process's choices."""
    made = choices(library)
    if made:
        path = _choices_file(library)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"cpu": machine.cpu_name(), "choices": _kept_choices(library) | made}, indent=1))
        partial.replace(path)
    return made


def describe_choices(made: Mapping[str, int]) -> str:
    """How many pass shapes took each candidate, for the log and /health."""
    counts = {name: 0 for name in CANDIDATES}
    for candidate in made.values():
        counts[CANDIDATES[candidate]] += 1
    return "; ".join(f"{name}: {count}" for name, count in counts.items() if count) or "none timed yet"
