"""One layer seven ways (eight where the CPU has AVX-512 VNNI), in one run: the GgmlLinear op
inside an OpenVINO graph (interleaved rows as decoding and verifying run them: ggml's gemv at one
row, the op's own kernel with gemv's bits over several; so with 14-bit activations too, where the
CPU has them), its batched kernels as the prompt reader runs them on interleaved rows
and on rows as stored (the AMX tiles in bf16 from 32 rows where the CPU has them), ggml's vec_dot
row by row on the rows as stored; its weights on huge pages), the plugin's compressed
FullyConnected on the same blocks (the `gguf` form) and ggml's own mul_mat, plain and on repacked
weights as llama.cpp runs it, at 1, 5, 64 and 256 rows.

    python -m benchmarks.ggml_probe [--layers 56] [--reps 20] [--json OUT] [--table OUT]

The weights are the default target's own ffn_up and ffn_gate (1536 -> 8960, Q4_K), cycled through
enough layers that they come from DRAM as in a decode step (their bytes against the L3 cache are
printed). Each way computes all the layers one after another on as many threads as the machine has
cores; the time per layer is that over the layer count, the best of ``--reps``; "in 1-row calls"
is a pass's time over its 1-row time. The op's rows are checked against ggml's bit for bit where
ggml computes a row alone (its gemv, its vec_dot), else within their rounding (ggml's gemm; the
AMX tiles, bf16's), and against the plugin's within its rounding.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import openvino as ov
from openvino import opset13 as ops

from benchmarks import llamacpp
from benchmarks.report import add_output_arguments, write_text
from engine import ggml
from engine.cli import run_cli
from engine.core import hugepages
from engine.core.runtime import TARGET_CONFIG
from engine.prepare import gguf_blocks, kernels
from engine.prepare.embedded import DEFAULT_TARGET
from engine.prepare.pipeline import cache_dir_from_args, log
from engine.report import Column, markdown_table

ROWS = (1, 5, 64, 256)
OP = "GgmlLinear op: interleaved rows, each a one-row gemv's bits (decoding, verifying)"
HUGE_CHANNEL = 7  # an activation channel 60 times the others' spread, as LLMs have a few
GEMM_ROWS = 4  # from this many rows ggml's repacked mul_mat runs its gemm, below its gemv
OP_FINE = "GgmlLinear op: the same, 14-bit activations (--activations 14)"
OP_GEMM = "GgmlLinear op: batched kernels on interleaved rows (prompt reader)"
OP_STORED = "GgmlLinear op: vec_dot on rows as stored"
OP_STORED_BATCHED = "GgmlLinear op: batched kernels on rows as stored (ggml's mul_mat)"
PLUGIN = "plugin compressed FC (gguf form)"
GGML = "ggml mul_mat"
GGML_REPACKED = "ggml mul_mat, repacked (llama.cpp's default)"
COLUMNS = [
    Column("kernel", "kernel"),
    *(Column(f"ms at {m} row{'s' * (m > 1)}", f"ms_{m}", "{:.3f}") for m in ROWS),
    *(Column(f"{m} rows in 1-row calls", f"calls_{m}", "{:.2f}") for m in ROWS[1:]),
    *(Column(f"x ggml repacked at {m}", f"vs_ggml_{m}", "{:.2f}") for m in ROWS),
]


def layer_weights(path: Path, layers: int) -> list[gguf.ReaderTensor]:
    """Up to ``layers`` of the file's ffn_up and ffn_gate weights stored as Q4_K."""
    found = [
        t
        for t in gguf.GGUFReader(path).tensors
        if t.name.endswith(("ffn_up.weight", "ffn_gate.weight")) and t.tensor_type == gguf.GGMLQuantizationType.Q4_K
    ]
    if not found:
        raise SystemExit(f"{path} has no Q4_K ffn_up/ffn_gate weights")
    return [found[i % len(found)] for i in range(layers)]


def blocks(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's rows as the GGUF stores them: u8 [rows, bytes per row]."""
    return np.ascontiguousarray(np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1]), -1))


def timed(compiled: ov.CompiledModel, x: np.ndarray, reps: int) -> tuple[float, np.ndarray]:
    """Seconds per call, best of ``reps``, and the first output."""
    request = compiled.create_infer_request()
    for _ in range(3):
        request.infer({0: x})
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        request.infer({0: x})
        best = min(best, time.perf_counter() - start)
    return best, request.get_output_tensor(0).data.copy()


def op_model(weights: list[gguf.ReaderTensor], k: int, library: Path, interleave: bool, flags: int) -> ov.Model:
    """The op on each weight with a pass's ``flags`` (engine.ggml.GEMM, FINE), its weights on
    huge pages as the engine keeps them."""
    x = ops.parameter([-1, k], ov.Type.f32)
    flag = ops.constant(np.array([flags], dtype=np.int64)).output(0)
    outs = [ggml.linears(x.output(0), [(blocks(t), int(t.tensor_type))], library, interleave, flag)[0] for t in weights]
    model = ov.Model(outs, [x])
    hugepages.move_weights(model)
    return model


def rows_of(model: ov.Model, m: int) -> ov.Model:
    """``model`` for inputs of ``m`` rows alone (its weights shared, not copied)."""
    fixed = model.clone()
    fixed.reshape({0: ov.PartialShape([m, fixed.input(0).get_partial_shape()[1]])})
    return fixed


def plugin_model(weights: list[gguf.ReaderTensor], k: int) -> ov.Model:
    """Today's `gguf` form: u4 codes with f16 scales and zero points per 32, a MatMul the plugin
    fuses into its compressed FullyConnected."""
    x = ops.parameter([-1, k], ov.Type.f32)
    outs = []
    for t in weights:
        decoded = gguf_blocks.decode(t)
        assert decoded is not None
        w = gguf_blocks.subgraph(decoded, [int(t.shape[1]), k], ov.Type.f32)
        outs.append(ops.matmul(x, w, False, True))
    return ov.Model(outs, [x])


def ggml_library(ops_library: Path) -> ctypes.CDLL:
    """benchmarks/ggml_probe.cpp against the kernels' own ggml (built next to them, once)."""
    out = ops_library.parent / "libggml_probe.so"
    source = Path(__file__).with_suffix(".cpp")
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        command = ["c++", "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", str(source)]
        command += [f"-I{ops_library.parent / 'include'}", "-o", str(out)]
        command += [str(ops_library.parent / "libggml-cpu.a"), str(ops_library.parent / "libggml-base.a"), "-lpthread"]
        subprocess.run(command, check=True)
    library = ctypes.CDLL(str(out))
    library.ggml_mul_mat_ms.restype = ctypes.c_double
    return library


def ggml_mul_mat(
    library: ctypes.CDLL, weights: list[np.ndarray], kind: int, x: np.ndarray, reps: int, repacked: bool
) -> tuple[float, np.ndarray]:
    """ggml's own mul_mat over ``weights``: seconds per layer and the first layer's output."""
    m, k = x.shape
    n = weights[0].shape[0]
    pointers = (ctypes.c_void_p * len(weights))(*[w.ctypes.data for w in weights])
    y = np.empty((m, n), np.float32)
    ms = library.ggml_mul_mat_ms(
        pointers,
        len(weights),
        ctypes.c_int64(k),
        ctypes.c_int64(n),
        kind,
        np.ascontiguousarray(x, np.float32).ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        ctypes.c_int64(m),
        os.cpu_count() or 1,
        reps,
        int(repacked),
        y.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
    )
    if ms < 0:
        raise SystemExit("ggml has no repacked kernels for these weights on this CPU")
    return ms / 1000, y


def l3_bytes() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    return int(size[:-1]) * 1024 if size.endswith("K") else int(size)


def probe(args: argparse.Namespace) -> None:
    cache = cache_dir_from_args(args)
    library = kernels.library(cache, log)
    weights = layer_weights(llamacpp.gguf_file(DEFAULT_TARGET, cache), args.layers)
    k = int(weights[0].shape[0])
    raw = [blocks(t) for t in weights]
    megabytes = sum(w.nbytes for w in raw) / 1e6
    print(f"{len(raw)} layers of {raw[0].shape[0]}x{k} Q4_K: {megabytes:.0f} MB, L3 {l3_bytes() / 1e6:.0f} MB")
    core = ov.Core()
    ggml.register(core, library)
    ways = {OP: (True, 0), OP_GEMM: (True, ggml.GEMM), OP_STORED: (False, 0), OP_STORED_BATCHED: (False, ggml.GEMM)}
    if ggml.fine_activations(library):
        ways[OP_FINE] = (True, ggml.FINE)
    models = {name: op_model(weights, k, library, interleave, flags) for name, (interleave, flags) in ways.items()}
    models[PLUGIN] = plugin_model(weights, k)
    probe_library = ggml_library(library)
    tiles = ggml.prompt_tiles(library)
    rng = np.random.default_rng(0)
    rows: dict[str, dict] = {name: {"kernel": name} for name in [*models, GGML, GGML_REPACKED]}
    checks: dict[str, bool | float] = {}
    kind = int(weights[0].tensor_type)
    one_row: dict[str, ov.CompiledModel] = {}  # (each way compiled for 1 row, the first of ROWS)
    for m in ROWS:
        # (each graph compiled for m rows, as the engine runs the widths it decodes at: FixedShapes)
        compiled = {name: core.compile_model(rows_of(model, m), "CPU", TARGET_CONFIG) for name, model in models.items()}
        one_row = one_row or compiled
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, HUGE_CHANNEL] = 60  # (one block of six fine in 14 bits, as 11% of the model's are)
        out = {}
        for name, model in compiled.items():
            seconds, out[name] = timed(model, x, args.reps)
            rows[name][f"ms_{m}"] = 1000 * seconds / len(raw)
        for name, repacked in ((GGML, False), (GGML_REPACKED, True)):
            seconds, out[name] = ggml_mul_mat(probe_library, raw, kind, x, args.reps, repacked)
            rows[name][f"ms_{m}"] = 1000 * seconds
        if m < GEMM_ROWS:  # (from there its gemm, whose rows round with where they fall in a pass)
            checks[f"{m} rows: op == ggml repacked (its gemv), bit for bit"] = bool(
                np.array_equal(out[OP], out[GGML_REPACKED])
            )
        else:
            difference = np.abs(out[OP] - out[GGML_REPACKED]).max() / np.abs(out[GGML_REPACKED]).max()
            checks[f"{m} rows: op against ggml repacked (its gemm), relative to the largest output"] = float(difference)
        checks[f"{m} rows: op on rows as stored == ggml, bit for bit"] = bool(np.array_equal(out[OP_STORED], out[GGML]))
        if tiles and m >= ggml.AMX_ROWS:  # (bf16 inputs: within their rounding, not ggml's bits)
            for name in (OP_GEMM, OP_STORED_BATCHED):
                checks[
                    f"{m} rows: {name} on the AMX tiles against ggml, largest difference relative to the largest output"
                ] = float(np.abs(out[name] - out[GGML]).max() / np.abs(out[GGML]).max())
        else:
            # (below ggml.TILED_ROWS the op's batched kernel on interleaved rows is its own, one row's
            # bits; from there ggml's tiled mul_mat)
            gemm_peer = OP if m < ggml.TILED_ROWS else GGML
            checks[f"{m} rows: op's batched kernels on interleaved rows == {gemm_peer}, bit for bit"] = bool(
                np.array_equal(out[OP_GEMM], out[gemm_peer])
            )
            checks[f"{m} rows: op's batched kernels on rows as stored == ggml, bit for bit"] = bool(
                np.array_equal(out[OP_STORED_BATCHED], out[GGML])
            )
        for name in [way for way in (OP, OP_FINE) if way in out]:
            checks[f"{m} rows: {name} against the plugin, largest difference relative to the largest output"] = float(
                np.abs(out[name] - out[PLUGIN]).max() / np.abs(out[PLUGIN]).max()
            )
            if m > 1:
                single = timed(one_row[name], x[:1], 1)[1]
                checks[f"{m} rows: {name}, first row == at 1 row, bit for bit"] = bool(
                    np.array_equal(out[name][:1], single)
                )
    for row in rows.values():
        for m in ROWS:
            row[f"vs_ggml_{m}"] = row[f"ms_{m}"] / rows[GGML_REPACKED][f"ms_{m}"]
            if m > 1:
                row[f"calls_{m}"] = row[f"ms_{m}"] / row[f"ms_{ROWS[0]}"]
    text = markdown_table(list(rows.values()), COLUMNS) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in checks.items())
    print(text)
    write_text(args.table, text + "\n")
    write_text(args.json, json.dumps({"rows": list(rows.values()), "checks": checks, "layers": len(raw)}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ggml_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=56, help="weights cycled through (56: every ffn_up and ffn_gate)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per way and width (the best is kept)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the models' cache (default: the app's)")
    add_output_arguments(parser)
    return run_cli(lambda: probe(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
