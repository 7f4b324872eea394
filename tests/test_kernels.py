"""The GgmlLinear op: ggml's CPU kernels inside an OpenVINO graph, on weights kept in their GGUF
blocks (the library is built for this machine on first use, a few minutes on 2 cores)."""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import re
import shutil
import subprocess
import time
from pathlib import Path

import gguf
import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from engine import ggml
from engine.core import graph, hugepages, screen
from engine.core.batch import OwnBatch, batch_for
from engine.core.measured import Measured
from engine.core.modes import BEST_K
from engine.core.pacing import Pacing
from engine.core.reader import SHORT_RUN, GemmReader, Reader, fastest_reader
from engine.core.reading import SHORTEST_RUN, ReadPass, ReadPath, read_plan
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG, FIXED_WIDTHS, Runtime
from engine.core.service import Engine, on_kernels
from engine.core.settings import Settings
from engine.errors import EngineError
from engine.ggml import GGML_XML
from engine.prepare import ggml_ir, kernels
from engine.prepare.convert import Compression
from engine.prepare.four_bit import in_four_bits
from engine.prepare.pipeline import default_cache_dir, prepare_one
from tests.gguf_writer import write_gguf
from tests.serving import serve
from tests.test_decoding import PROMPTS
from tests.tiny import TOKENS

Q = gguf.GGMLQuantizationType
K, N = 512, 48


def random_rows(kind: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of ``kind`` blocks: quantized by gguf-py where it can, else random codes with small
    f16 scales (a valid block of any K-quant)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    try:
        return gguf.quants.quantize(weight, kind).view(np.uint8).reshape(rows, -1)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        scales = rng.uniform(1e-4, 2e-3, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
        if kind == Q.Q6_K:  # d is the block's last two bytes
            raw[..., -2:] = scales[..., :2]
        else:  # d and dmin lead the block
            raw[..., :4] = scales
        return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def library() -> Path:
    """The op for this machine (built into the app's cache on first use, as prepare does)."""
    return kernels.library(default_cache_dir(), print)


def compiled(
    library: Path,
    rows: np.ndarray,
    kind: Q,
    threads: int = 0,
    interleave: bool = True,
    gemm: bool = False,
    fine: bool = False,
) -> ov.CompiledModel:
    core = ov.Core()
    ggml.register(core, library)
    x = ops.parameter([-1, K], ov.Type.f32)
    flags = (ggml.GEMM if gemm else 0) | (ggml.FINE if fine else 0)
    flag = ops.constant(np.array([flags], dtype=np.int64)).output(0)
    model = ov.Model(ggml.linears(x.output(0), [(rows, int(kind))], library, interleave, flag), [x])
    return core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads} if threads else {})


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.F16])
def test_the_op_multiplies_by_the_weight_its_blocks_hold(library, kind):
    rows = random_rows(kind, N, K, seed=1)
    weight = gguf.quants.dequantize(rows, kind).reshape(N, K).astype(np.float32)
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    got = compiled(library, rows, kind)({0: x})[0]
    expected = x @ weight.T
    # (the activations are quantized to 8 bits per block, as llama.cpp does)
    assert np.abs(got - expected).max() <= 0.02 * np.abs(expected).max()


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_0, Q.Q6_K, Q.Q8_0])
def test_a_row_is_the_same_bit_for_bit_at_any_pass_width_and_thread_count(library, kind):
    """Rows of one pass share its weight reads (Q4_K and Q4_0 interleaved and Q6_K: the op's own
    multi-row kernels; others: the one-row kernel per row), and each comes out as it does alone."""
    rows = random_rows(kind, N, K, seed=3)
    x = np.random.default_rng(4).standard_normal((70, K)).astype(np.float32) * np.geomspace(1e-3, 1e3, 70)[:, None]
    model = compiled(library, rows, kind)
    alone = np.concatenate([model({0: x[i : i + 1]})[0] for i in range(len(x))])
    for width in (2, 5, 8, 17, 70):
        together = np.concatenate([model({0: x[i : i + width]})[0] for i in range(0, len(x), width)])
        np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(compiled(library, rows, kind, threads=1)({0: x})[0], alone)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_0, Q.Q6_K, Q.Q8_0])
def test_every_candidate_gives_each_row_the_bits_of_the_one_row_result_at_any_width(library, kind):
    """Whichever way a decode or verify pass multiplies (the op's own kernels or ggml's row by row,
    the columns split statically or in chunks that a thread done with its own steals), each row is
    what the 1-row pass gives it, bit for bit: the tuning changes speed only."""
    rows = random_rows(kind, N, K, seed=9)
    x = np.random.default_rng(10).standard_normal((17, K)).astype(np.float32) * np.geomspace(1e-3, 1e3, 17)[:, None]
    models = {threads: compiled(library, rows, kind, threads=threads) for threads in (1, 2)}
    try:
        ggml.force(library, 0)
        alone = np.concatenate([models[2]({0: x[i : i + 1]})[0] for i in range(len(x))])
        for candidate, threads, width in itertools.product(range(len(ggml.CANDIDATES)), (1, 2), (1, 2, 5, 17)):
            ggml.force(library, candidate)
            together = np.concatenate([models[threads]({0: x[i : i + width]})[0] for i in range(0, len(x), width)])
            np.testing.assert_array_equal(together, alone, err_msg=f"{ggml.CANDIDATES[candidate]}, {threads} threads")
    finally:
        ggml.force(library, None)


def fused_model(library: Path, kind: Q) -> tuple[ov.CompiledModel, ggml.Fused]:
    """Two weights of ``kind`` read by three nodes: plain; RMS-normed with a bias on the first;
    SwiGLU plus a residual (a second input)."""
    core = ov.Core()
    ggml.register(core, library)
    x, residual = ops.parameter([-1, K], ov.Type.f32), ops.parameter([-1, N], ov.Type.f32)
    weights = [(random_rows(kind, N, K, seed=seed), int(kind)) for seed in (11, 12)]
    rng = np.random.default_rng(13)
    normed = ggml.Fused(rng.uniform(0.5, 1.5, K).astype(np.float32), 1e-6, [rng.standard_normal(N), None])
    gated = ggml.Fused(swiglu=True, residual=residual.output(0))
    outputs = [
        *ggml.linears(x.output(0), weights, library),
        *ggml.linears(x.output(0), weights, library, fused=normed),
        *ggml.linears(x.output(0), weights, library, fused=gated),
    ]
    return core.compile_model(ov.Model(outputs, [x, residual]), "CPU"), normed


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_0])
def test_a_node_norms_its_input_adds_biases_gates_and_adds_a_residual_as_llama_cpp_does(library, kind):
    """What a node computes around its products (ggml.Fused) is what the plugin's own nodes
    computed around them, within float rounding, and a row's result is still its 1-row pass's, bit
    for bit, at any width: the op gives each row the same work."""
    model, normed = fused_model(library, kind)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((9, K)).astype(np.float32) * np.geomspace(1e-2, 1e2, 9)[:, None]
    residual = rng.standard_normal((9, N)).astype(np.float32)
    first, second, normed_first, normed_second, gated = (model({0: x, 1: residual})[i] for i in range(5))
    gamma, bias = normed.gamma, normed.biases[0]
    rms = np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + normed.eps)
    products = model({0: (x / rms * gamma).astype(np.float32), 1: residual})
    np.testing.assert_allclose(normed_first, products[0] + bias, rtol=0, atol=1e-4 * np.abs(products[0]).max())
    np.testing.assert_allclose(normed_second, products[1], rtol=0, atol=1e-4 * np.abs(products[1]).max())
    expected = first / (1 + np.exp(-first.astype(np.float64))) * second + residual
    np.testing.assert_allclose(gated, expected, rtol=1e-5, atol=1e-6)
    alone = [np.concatenate([model({0: x[i : i + 1], 1: residual[i : i + 1]})[j] for i in range(9)]) for j in range(5)]
    for width in (2, 5, 9):
        for j in range(5):
            together = np.concatenate(
                [model({0: x[i : i + width], 1: residual[i : i + width]})[j] for i in range(0, 9, width)]
            )
            np.testing.assert_array_equal(together, alone[j], err_msg=f"output {j}, width {width}")


def test_the_choice_keeps_the_candidate_whose_median_time_is_lowest(library):
    """The op's own rule, fed timings: a median, so one slow call (a page fault, the other core
    busy) does not lose a candidate its place."""
    seconds = [[5.0, 5.1, 4.9], [3.0, 9.0, 3.1], [4.0, 4.0, 4.0], [3.5, 3.4, 3.6]]
    assert ggml.choose(library, seconds) == 1
    assert ggml.choose(library, [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]) == 0  # (the first of equals)
    assert ggml.choose(library, [[1.0, 50.0, 60.0], [2.0, 2.0, 2.0]]) == 1


def test_a_pass_shape_is_timed_on_every_candidate_then_keeps_one_which_a_later_start_reads_back(
    library, tmp_path, monkeypatch
):
    """Kept beside the choices other processes kept for other shapes (another model's)."""
    kept = tmp_path / "choices.json"
    monkeypatch.setattr(ggml, "_choices_file", lambda _library: kept)
    kept.write_text(json.dumps({"cpu": "a CPU", "choices": {"another model's shape": 1}}))
    rows = random_rows(Q.Q4_K, N, K, seed=11)
    x = np.random.default_rng(12).standard_normal((3, K)).astype(np.float32)
    model = compiled(library, rows, Q.Q4_K, threads=1)
    ggml.load_choices(library, remeasure=True)  # (every choice of this process forgotten)
    key = f"q4_Kx8:{N} k{K} m3 t1"
    for _ in range(200):
        model({0: x})
        if key in ggml.choices(library):
            break
    chosen = ggml.choices(library)[key]
    assert chosen in range(len(ggml.CANDIDATES))
    assert ggml.save_choices(library)[key] == chosen
    assert json.loads(kept.read_text())["choices"]["another model's shape"] == 1
    ggml.load_choices(library, remeasure=True)
    assert key not in ggml.choices(library)
    assert ggml.load_choices(library) == 2 and ggml.choices(library)[key] == chosen
    assert ggml.CANDIDATES[chosen].split(",")[0] in ggml.describe_choices(ggml.choices(library))


def test_passes_in_14_bits_are_timed_apart_from_the_same_shape_in_8(library):
    """Their kernels differ (ggml's take no 14-bit activations), so one shape's choice in 8 bits
    says nothing of its time in 14."""
    if not ggml.fine_activations(library):
        pytest.skip("14-bit activations take AVX-512 VNNI")
    rows = random_rows(Q.Q4_K, N, K, seed=13)
    x = np.random.default_rng(14).standard_normal((2, K)).astype(np.float32)
    ggml.load_choices(library, remeasure=True)
    key = f"q4_Kx8:{N} k{K} m2 t1"
    for fine, timed in ((False, key), (True, key + " a14")):
        model = compiled(library, rows, Q.Q4_K, threads=1, fine=fine)
        for _ in range(200):
            model({0: x})
            if timed in ggml.choices(library):
                break
        assert timed in ggml.choices(library)
    ggml.load_choices(library, remeasure=True)


def spread_rows(count: int, seed: int) -> np.ndarray:
    """Activation rows from 1e-3 to 1e3 in scale, every other one with a huge channel (60 times the
    rest's spread) as LLMs' have."""
    scales = np.geomspace(1e-3, 1e3, count)[:, None]
    x = (np.random.default_rng(seed).standard_normal((count, K)) * scales).astype(np.float32)
    x[::2, 7] = 60 * scales[::2, 0]
    return x


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K])
def test_activations_in_14_bits_give_blocks_with_a_huge_channel_finer_and_a_row_alike_at_any_width(library, kind):
    """With FINE the op's own Q4_K and Q6_K kernels take a block of activations whose largest
    value stands out in 14 bits, other blocks in 8 as Q8_K: rows with a huge channel come out
    nearer the exact product than with Q8_K (the rest of their block rounds 64 times finer), the
    others as near, and every row the same bit for bit at any pass width and thread count, so
    greedy speculative output stays exact."""
    if not ggml.fine_activations(library):
        pytest.skip("14-bit activations take AVX-512 VNNI")
    rows = random_rows(kind, N, K, seed=3)
    x = spread_rows(70, seed=4)
    exact = x.astype(np.float64) @ gguf.quants.dequantize(rows, kind).reshape(N, K).astype(np.float64).T
    model = compiled(library, rows, kind, fine=True)
    alone = np.concatenate([model({0: x[i : i + 1]})[0] for i in range(len(x))])
    for width in (2, 5, 8, 17, 70):
        together = np.concatenate([model({0: x[i : i + width]})[0] for i in range(0, len(x), width)])
        np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(compiled(library, rows, kind, threads=1, fine=True)({0: x})[0], alone)

    def error(y: np.ndarray) -> np.ndarray:  # per row, against its largest output
        return np.abs(y - exact).max(1) / np.abs(exact).max(1)

    gain = error(compiled(library, rows, kind)({0: x})[0]) / error(alone)
    assert np.median(gain[::2]) > 5 and 0.5 < np.median(gain[1::2]) < 2


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q8_0, Q.Q5_K])
def test_fine_leaves_other_types_and_prompt_passes_as_they_are(library, kind):
    """Types without the op's own 14-bit kernels keep their 8-bit dot type, and a prompt pass
    (GEMM) its batched kernels, FINE or not."""
    rows = random_rows(kind, N, K, seed=5)
    x = spread_rows(40, seed=6)
    for gemm in (False, True):
        np.testing.assert_array_equal(
            compiled(library, rows, kind, gemm=gemm, fine=True)({0: x})[0],
            compiled(library, rows, kind, gemm=gemm)({0: x})[0],
        )


def row_kernels_without_prefetches(library: Path) -> list[str] | None:
    """The op's row kernels (compiled on their own) whose code has no prefetch, from ``objdump``;
    None where the build has none (no AVX2)."""
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True, text=True, check=True
    ).stdout
    kernels = {}
    for function in re.split(r"\n(?=[0-9a-f]+ <)", listing):  # (each starts "address <name>:")
        head, _, body = function.partition("\n")
        if "_rows_q" in head:
            kernels[head] = body
    return [head for head, body in kernels.items() if "prefetch" not in body] if kernels else None


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_the_row_kernels_prefetch_the_blocks_ahead(library):
    """A plain step reads its weights from memory, and the row kernels prefetch them ahead: a
    compiler once left every prefetch out of them unasked, and a plain step took a fifth longer."""
    missing = row_kernels_without_prefetches(library)
    if missing is None:
        pytest.skip("this build has no row kernels (a CPU without AVX2)")
    assert missing == []


def test_a_row_through_the_ops_own_kernel_is_ggmls_own_bit_for_bit(library):
    """A Q6_K row (as stored) through the op's kernel, and through ggml's own mul_mat (a prompt
    pass's way, its vec_dot for one row)."""
    rows = random_rows(Q.Q6_K, N, K, seed=5)
    x = np.random.default_rng(6).standard_normal((1, K)).astype(np.float32)
    ours, ggmls = (compiled(library, rows, Q.Q6_K, gemm=gemm)({0: x})[0] for gemm in (False, True))
    np.testing.assert_array_equal(ours, ggmls)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_0])
def test_rows_of_a_type_with_interleaved_kernels_are_interleaved_and_multiply_alike(library, kind):
    """ggml's gemv on the rows interleaved computes what its vec_dot computes on them as stored,
    within float rounding; a weight whose rows do not come in eights keeps them as stored."""
    rows = random_rows(kind, N, K, seed=11)
    grouped = ggml.interleaved(rows, int(kind), library)
    assert grouped is not None and grouped.shape == rows.shape and not np.array_equal(grouped, rows)
    assert ggml.interleaved(rows[:44], int(kind), library) is None
    x = np.random.default_rng(12).standard_normal((5, K)).astype(np.float32)
    as_stored = compiled(library, rows, kind, interleave=False)({0: x})[0]
    np.testing.assert_allclose(compiled(library, rows, kind)({0: x})[0], as_stored, atol=1e-5 * np.abs(as_stored).max())


@pytest.mark.parametrize("kind", [Q.Q6_K, Q.Q8_0, Q.Q5_0])
def test_a_type_without_interleaved_kernels_keeps_its_rows(library, kind):
    assert ggml.interleaved(random_rows(kind, N, K, seed=13), int(kind), library) is None


@pytest.mark.parametrize(
    ("kind", "interleave"), [(Q.Q4_K, True), (Q.Q4_K, False), (Q.Q6_K, False), (Q.Q8_0, False), (Q.Q5_0, False)]
)
def test_gemm_reads_many_rows_as_a_row_alone_does_within_rounding(library, kind, interleave):
    """Over more rows than a tile, and a last four left incomplete: every row is computed, and
    without gemm each is the row alone, bit for bit. With gemm, interleaved rows go through ggml's
    gemm, rows as stored through its own mul_mat (its tiled kernels for the K-quants); where the
    CPU has AMX, through the tiles in bf16 (the next test)."""
    rows = random_rows(kind, N, K, seed=14)
    x = np.random.default_rng(15).standard_normal((150, K)).astype(np.float32)
    plain = compiled(library, rows, kind, interleave=interleave)
    alone = plain({0: x})[0]
    for i in (0, 63, 64, 149):
        np.testing.assert_array_equal(alone[i : i + 1], plain({0: x[i : i + 1]})[0])
    batched = compiled(library, rows, kind, interleave=interleave, gemm=True)({0: x})[0]
    rounding = 2e-2 if ggml.prompt_tiles(library) else 1e-5  # (bf16 inputs against 8-bit activations)
    np.testing.assert_allclose(batched, alone, atol=rounding * np.abs(alone).max())


def bf16(values: np.ndarray) -> np.ndarray:
    """f32 values rounded to bf16 (to nearest, ties to even), as f64."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)


@pytest.mark.parametrize(
    ("kind", "interleave"), [(Q.Q4_K, True), (Q.Q4_K, False), (Q.Q6_K, False), (Q.Q8_0, False), (Q.Q5_K, False)]
)
def test_a_prompt_pass_on_the_amx_tiles_is_the_weights_product_in_bf16(library, kind, interleave):
    """Where the CPU has AMX, a prompt pass of 32 rows or more multiplies the weights and the
    activations rounded to bf16, with f32 sums: the product of the rounded values up to the sums'
    rounding, whatever the row and column counts (here neither a whole number of tiles), and
    nearer the exact product than the rows' own kernels with their 8-bit activations. Below 32
    rows a pass keeps ggml's kernels."""
    if not ggml.prompt_tiles(library):
        pytest.skip("no AMX bf16 tiles on this CPU")
    rows = random_rows(kind, N, K, seed=17)
    weights = gguf.quants.dequantize(rows, kind).reshape(N, K)
    batched = compiled(library, rows, kind, interleave=interleave, gemm=True)
    for m in (31, 32, 150):
        x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
        exact = x.astype(np.float64) @ weights.astype(np.float64).T
        ours, rows_alone = batched({0: x})[0], compiled(library, rows, kind, interleave=interleave)({0: x})[0]
        if m < 32:
            assert not np.allclose(ours, bf16(x) @ bf16(weights).T, rtol=0, atol=1e-6 * np.abs(exact).max())
            continue
        np.testing.assert_allclose(ours, bf16(x) @ bf16(weights).T, rtol=0, atol=1e-4 * np.abs(exact).max())
        assert np.sqrt(np.mean((ours - exact) ** 2)) < 0.6 * np.sqrt(np.mean((rows_alone - exact) ** 2))


def test_a_long_prompt_pass_puts_interleaved_rows_back_as_the_file_stores_them(library):
    """From 256 rows a prompt pass multiplies interleaved Q4_K rows by ggml's tiled kernels, after
    putting them back as stored: bit for bit what the rows as stored give (every 6-bit scale and
    min, and every quant, back in its place); below that, the op's own multi-row kernel, each
    row as it is alone. On the AMX tiles (from 32 rows), interleaved rows are read in place, and
    give what the rows as stored give, bit for bit."""
    rows = random_rows(Q.Q4_K, N, K, seed=16)
    alone = compiled(library, rows, Q.Q4_K)
    tiles = ggml.prompt_tiles(library)
    for m in (31, 255, 256, 300):
        x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
        as_stored = compiled(library, rows, Q.Q4_K, interleave=False, gemm=True)({0: x})[0]
        interleaved = compiled(library, rows, Q.Q4_K, gemm=True)({0: x})[0]
        assert np.array_equal(interleaved, as_stored) == (m >= 256 or (tiles and m >= 32))
        assert np.array_equal(interleaved, alone({0: x})[0]) == (m < 256 and not (tiles and m >= 32))
        np.testing.assert_allclose(interleaved, as_stored, atol=1e-5 * np.abs(as_stored).max())


def test_a_graph_with_the_op_is_saved_and_read_back(library, tmp_path):
    rows = random_rows(Q.Q8_0, N, K, seed=5)
    x = ops.parameter([1, -1, K], ov.Type.f32)
    model = ov.Model([ggml.linear(x.output(0), rows, int(Q.Q8_0), library)], [x])
    ov.save_model(model, tmp_path / "op.xml", compress_to_fp16=False)
    core = ov.Core()
    ggml.register(core, library)
    read = core.compile_model(core.read_model(tmp_path / "op.xml"), "CPU")
    inputs = np.random.default_rng(6).standard_normal((1, 3, K)).astype(np.float32)
    assert read({0: inputs})[0].shape == (1, 3, N)
    np.testing.assert_array_equal(read({0: inputs})[0], core.compile_model(model, "CPU")({0: inputs})[0])


def test_a_row_length_that_does_not_match_the_blocks_is_refused_with_a_clear_message(library):
    rows = random_rows(Q.Q8_0, N, K, seed=7)
    x = ops.parameter([-1, K + 32], ov.Type.f32)
    with pytest.raises(RuntimeError, match="bytes of q8_0"):
        ggml.linear(x.output(0), rows, int(Q.Q8_0), library)


def on_ggml(hf_folder: Path, name: str, tiny_dir: Path, tiny_cache: Path, library: Path) -> Path:
    """``hf_folder``'s model written as a Q4_0 GGUF, prepared as prepare does (its blocks kept),
    with its graph on ggml's kernels beside (rows interleaved for ggml's gemv)."""
    folder = tiny_dir / "gguf-ggml"
    folder.mkdir(exist_ok=True)
    file = write_gguf(hf_folder, folder / f"{name}-Q4_0.gguf", Q.Q4_0)
    entry = prepare_one(str(file), Compression("gguf"), tiny_cache).path
    ggml_ir.write(entry, file, library, print)
    return entry


@pytest.fixture(scope="module")
def gguf_target(hf_target, tiny_dir, tiny_cache, library) -> Path:
    return on_ggml(hf_target, "tiny", tiny_dir, tiny_cache, library)


@pytest.fixture(scope="module")
def gguf_draft(hf_draft, tiny_dir, tiny_cache, library) -> Path:
    return on_ggml(hf_draft, "tiny-draft", tiny_dir, tiny_cache, library)


@pytest.fixture(scope="module")
def stateful_on_ggml(gguf_target, tiny_dir, library) -> Path:
    """``gguf_target``'s exported graph rewritten onto the op, as the graph of a model the graphs
    built from a file do not cover is (engine.prepare.ggml_ir.rewrite): its attention the
    plugin's, over states."""
    folder = tiny_dir / "gguf-ggml" / "stateful"
    if not (folder / GGML_XML).exists():
        shutil.copytree(gguf_target, folder, ignore=shutil.ignore_patterns(f"{Path(GGML_XML).stem}.*"))
        model = ov.Core().read_model(folder / "openvino_model.xml")
        ggml_ir.rewrite(model, gguf.GGUFReader(tiny_dir / "gguf-ggml" / "tiny-Q4_0.gguf"), library)
        ov.save_model(model, folder / GGML_XML, compress_to_fp16=False)
    return folder


def test_every_linear_layer_and_the_head_of_a_gguf_model_run_on_the_op(gguf_target):
    model = ov.Core().read_model(gguf_target / "openvino_model.xml")
    layers = sum(n.get_type_name() == "MatMul" and n.get_attributes()["transpose_b"] for n in model.get_ordered_ops())
    core = ov.Core()
    ggml.register(core, kernels.library(default_cache_dir(), print))
    graph = core.read_model(gguf_target / GGML_XML)
    ours = [n for n in graph.get_ordered_ops() if n.get_type_name() == ggml.GGML_LINEAR]
    assert sum(len(n.get_attributes()["ggml_types"]) for n in ours) == layers > 0
    # (a layer's q, k and v are one node, its gate and up another, its o, its down and the head)
    assert len(ours) == 4 * 2 + 1
    # and the nodes norm their inputs, add the biases and residuals, and gate the MLP themselves
    others = {n.get_type_name() for n in graph.get_ordered_ops()}
    assert not others & {"Swish", "Power", "ReduceMean"}
    assert sum(n.get_attributes()["norm"] for n in ours) == 2 * 2 + 1
    assert sum(n.get_attributes()["residual"] for n in ours) == 2 * 2


def test_the_reader_on_ggml_kernels_writes_the_cache_as_the_targets_own_passes_would(stateful_on_ggml, library):
    """The prompt reader on the same graph with ggml's batched kernels: its rows round differently (which is
    why where its passes fall is fixed by the conversation), within float rounding."""
    prompt = TOKENS * 8
    own = Runtime(stateful_on_ggml, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    expected = own.forward(prompt, rows=1)
    read = Runtime(stateful_on_ggml, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    reader = Reader(stateful_on_ggml, EXACT_CONFIG, "f32", on=read)
    assert reader.label == "f32 · ggml kernels"
    for part in read_plan(len(prompt) - 1, width=16):
        reader.read(read, prompt[: part.stop], part)
    np.testing.assert_allclose(read.forward(prompt[-1:]), expected, atol=1e-4)


def test_settling_a_width_leaves_every_shape_of_its_passes_chosen(gguf_target, library):
    """Passes timed while the op still takes its candidates in turn would price the slower ones
    too: after settle, a pass of that width takes only chosen shapes, and the cache is as it was."""
    target = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    ggml.load_choices(library, remeasure=True)  # (every choice of this process forgotten)
    target.forward(TOKENS)
    before = ggml.timing_calls(library)
    target.settle(3)
    assert ggml.timing_calls(library) > before  # (it timed them)
    assert target.tokens == list(TOKENS)
    settled = ggml.timing_calls(library)
    target.forward([1, 2, 3], rows=3)
    assert ggml.timing_calls(library) == settled
    target.forward([4, 5], rows=2)  # (another width: its shapes timed yet)
    assert ggml.timing_calls(library) > settled


def test_a_target_whose_cache_the_op_keeps_reads_prompts_with_its_own_passes_only(gguf_target, library, caplog):
    """A stateless reader reads and writes the plugin's states, which such a target has none of."""
    target = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    assert target.own is not None
    with caplog.at_level(logging.INFO, logger="specchat.reader"):
        chosen = fastest_reader(target)
    assert f"prompt reader {GemmReader(library).label}:" in caplog.text
    assert "prompt reader f32" not in caplog.text
    assert chosen is None or isinstance(chosen, GemmReader)
    with pytest.raises(EngineError, match="the prompt reader 'f32' reads into the plugin's states"):
        Engine(gguf_target, None, Settings(config=EXACT_CONFIG, kernels="ggml", library=library, prompt_reader="f32"))


def test_auto_times_readers_on_both_kernels_and_the_short_run_they_read(stateful_on_ggml, library, caplog):
    target = Runtime(stateful_on_ggml, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    with caplog.at_level(logging.INFO, logger="specchat.reader"):
        chosen = fastest_reader(target)
    for label in (GemmReader(library).label, "f32 · ggml kernels", "f32"):
        assert f"prompt reader {label}:" in caplog.text
    on_ggml = isinstance(chosen, GemmReader) or (chosen is not None and "ggml" in chosen.label)
    assert chosen is None or chosen.shortest == (SHORT_RUN if on_ggml else SHORTEST_RUN)
    assert not target.tokens


def test_the_targets_own_passes_with_gemm_read_as_its_plain_passes_would(gguf_target, library):
    prompt = TOKENS * 8
    expected = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library).forward(prompt)
    read = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    for part in read_plan(len(prompt) - 1, width=16):
        GemmReader(library).read(read, prompt[: part.stop], part)
    assert read.tokens == prompt[:-1] and read.origins[16] == ReadPass(16, 32, ReadPath.READER)
    np.testing.assert_allclose(read.forward(prompt[-1:]), expected, atol=1e-4)


@pytest.mark.parametrize("mode", ["speculative", "best"])
def test_greedy_output_is_the_same_in_every_mode_with_the_gemm_reader(gguf_target, gguf_draft, library, mode):
    engine = Engine(
        gguf_target,
        gguf_draft,
        Settings(config=EXACT_CONFIG, kernels="ggml", library=library, prompt_reader="gemm", pacing=Pacing()),
    )
    messages = ({"role": "user", "content": " ".join(f"def f{i}(x): return x + {i}" for i in range(12))},)
    answers = {
        m: engine.run(Request(messages, mode=m, max_new_tokens=12, reuse_cache=False)) for m in ("autoregressive", mode)
    }
    engine.close()
    assert all(a.kind == "done" for a in answers.values()) and answers["autoregressive"].metrics["prompt_tokens"] > 64
    assert answers[mode].token_ids == answers["autoregressive"].token_ids


def graph_types(entry: Path, library: Path) -> set[str]:
    """The ggml types of the op's weights in ``entry``'s graph on ggml's kernels."""
    core = ov.Core()
    ggml.register(core, library)
    nodes = [n for n in core.read_model(entry / GGML_XML).get_ordered_ops() if n.get_type_name() == ggml.GGML_LINEAR]
    return {Q(kind).name for node in nodes for kind in node.get_attributes()["ggml_types"]}


def test_an_int4_model_runs_on_4_bit_rows_and_a_gguf_one_on_the_files_own(hf_draft, tiny_dir, tiny_cache, library):
    """The draft's default, int4: its file's Q8_0 rows are requantized to Q4_0 for ggml's kernels
    (its rounding never reaches an answer), close to the file's own rows; the file's model keeps them."""
    folder = tiny_dir / "gguf-q8"
    folder.mkdir(exist_ok=True)
    file = write_gguf(hf_draft, folder / "tiny-draft-Q8_0.gguf", Q.Q8_0)
    entries = {}
    for precision in ("gguf", "int4"):
        entries[precision] = prepare_one(str(file), Compression(precision, group_size=32), tiny_cache).path
        ggml_ir.write(entries[precision], file, library, print, four_bit=precision == "int4")
    assert graph_types(entries["gguf"], library) == {"Q8_0"}
    assert graph_types(entries["int4"], library) == {"Q4_0"}
    files, four_bit = (
        Runtime(entries[p], config=EXACT_CONFIG, kernels=library).forward(TOKENS, rows=len(TOKENS))
        for p in ("gguf", "int4")
    )
    # (4 bits move a tiny random model's flat logits far; rows out of order would leave nothing alike)
    alike = (four_bit * files).sum(-1) / np.linalg.norm(four_bit, axis=-1) / np.linalg.norm(files, axis=-1)
    assert alike.mean() >= 0.85


def test_rows_in_four_bits_are_within_a_q4_0_step_of_the_files():
    """Half a step, rounded to the nearest code, but where a value lies at the far end of Q4_0's
    codes (8 steps one way, 7 the other)."""
    rows = random_rows(Q.Q8_0, N, K, seed=21)
    four, kind = in_four_bits(rows, int(Q.Q8_0))
    assert kind == Q.Q4_0 and four.shape == (N, K // 32 * 18)
    weights = gguf.quants.dequantize(rows, Q.Q8_0).reshape(N, K // 32, 32)
    step = np.abs(weights).max(-1, keepdims=True) / 8  # (Q4_0's scale: the block's largest value over 8)
    error = np.abs(gguf.quants.dequantize(four, Q.Q4_0).reshape(weights.shape) - weights)
    assert (error <= 1.01 * step).all() and (error <= step / 2 + 1e-6).mean() >= 0.99
    q4_k = random_rows(Q.Q4_K, N, K, seed=22)
    assert in_four_bits(q4_k, int(Q.Q4_K))[0] is q4_k
    f16 = random_rows(Q.F16, N, 48, seed=23)  # (48 values a row: no whole Q4_0 blocks)
    assert in_four_bits(f16, int(Q.F16))[0] is f16


def test_the_model_on_ggml_kernels_computes_the_files_model(gguf_target, library):
    """Within what quantizing the activations to 8 bits per block moves over a tiny random model's
    layers (llama.cpp does the same), the argmax unchanged."""
    plugin = Runtime(gguf_target, config=EXACT_CONFIG).forward(TOKENS, rows=len(TOKENS))
    ours = Runtime(gguf_target, config=EXACT_CONFIG, kernels=library).forward(TOKENS, rows=len(TOKENS))
    assert np.abs(ours - plugin).max() <= 0.08 * np.abs(plugin).max()
    assert (ours.argmax(-1) == plugin.argmax(-1)).mean() >= 0.9


def test_a_draft_head_on_ggml_kernels_cut_to_some_ids_gives_their_logits_bit_for_bit_and_minus_infinity_elsewhere(
    gguf_draft, library
):
    """The head's rows are interleaved 8 at a time: the ids are cut to their first multiple of 8, and
    each id's logit is computed alone, so the ids kept get the full head's, bit for bit."""
    full = Runtime(gguf_draft, config=EXACT_CONFIG, kernels=library)
    kept = np.random.default_rng(0).permutation(full.vocab_size)[:101]
    cut = Runtime(gguf_draft, config=EXACT_CONFIG, kernels=library, kept_ids=kept)
    rows = len(TOKENS)
    logits, expected = cut.forward(TOKENS, rows=rows), full.forward(TOKENS, rows=rows)
    assert cut.vocab_size == full.vocab_size
    np.testing.assert_array_equal(logits[:, kept[:96]], expected[:, kept[:96]])
    assert np.isneginf(logits).sum() == rows * (full.vocab_size - 96)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_0, Q.IQ4_NL])
def test_interleaved_rows_put_back_are_the_rows_as_the_file_stores_them(library, kind):
    rows = random_rows(kind, N, K, seed=14)
    grouped = ggml.interleaved(rows, int(kind), library)
    assert grouped is not None
    np.testing.assert_array_equal(ggml.deinterleaved(grouped, int(kind)), rows)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q4_0, Q.Q6_K])
def test_a_head_on_the_op_cut_to_some_ids_keeps_their_logits_bit_for_bit_and_gives_the_others_minus_infinity(
    library, kind
):
    """A head's rows gathered as stored (interleaved ones put back first, and interleaved again:
    whole groups of 8, so the first 16 of 21 ids) multiply as the full head's, at any pass width."""
    rows, ids = random_rows(kind, N, K, seed=15), np.random.default_rng(16).permutation(N)[:21]

    def head(kept: np.ndarray | None) -> tuple[ov.CompiledModel, np.ndarray | None]:
        x = ops.parameter([1, -1, K], ov.Type.f32)
        flags = ggml.gemm_input()
        (y,) = ggml.linears(x.output(0), [(rows, int(kind))], library, gemm=flags.output(0))
        y.get_tensor().set_names({"logits"})
        model = ov.Model([y], [x, flags])
        kept = None if kept is None else graph.keep_vocabulary(model, kept, library)
        core = ov.Core()
        ggml.register(core, library)
        return core.compile_model(model, "CPU"), kept

    (full, _), (cut, kept) = head(None), head(ids)
    assert kept is not None and len(kept) == (21 if kind == Q.Q6_K else 16)
    np.testing.assert_array_equal(kept, ids[: len(kept)])
    for width in (1, 5):
        x = np.random.default_rng(width).standard_normal((1, width, K)).astype(np.float32)
        flags = np.zeros(1, dtype=np.int64)
        expected, logits = full({0: x, 1: flags})[0], cut({0: x, 1: flags})[0]
        np.testing.assert_array_equal(logits[..., kept], expected[..., kept])
        assert np.isneginf(np.delete(logits, kept, axis=-1)).all()


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_autoregressive_on_ggml_kernels(gguf_target, library, pair, tok, k):
    """A row's result does not depend on the pass's width, so verifying K drafts computes what K
    plain steps compute: exact, through the scheduler users get."""
    target = Runtime(gguf_target, config=EXACT_CONFIG, kernels=library)
    _, drafter = pair
    for text in PROMPTS:
        prompt = tok.encode(text)
        ar, _ = serve(target, drafter, prompt, speculative=False, max_new_tokens=30)
        sd, stats = serve(target, drafter, prompt, k=k, max_new_tokens=30)
        assert sd == ar and stats.drafted > 0


def test_a_runtime_takes_8_bit_activations_by_default_and_14_where_asked_and_the_cpu_has_them(
    gguf_target, library, monkeypatch, caplog
):
    fine = Runtime(gguf_target, config=EXACT_CONFIG, kernels=library, activations=14)
    assert fine.pass_inputs()[ggml.GEMM_INPUT][0] == (ggml.FINE if ggml.fine_activations(library) else 0)
    assert ("14-bit activations" in fine.label) == ggml.fine_activations(library)
    assert fine.pass_inputs(gemm=True)[ggml.GEMM_INPUT][0] == ggml.GEMM
    default = Runtime(gguf_target, config=EXACT_CONFIG, kernels=library)  # (llama.cpp's 8 bits)
    assert default.pass_inputs()[ggml.GEMM_INPUT][0] == 0 and "14-bit" not in default.label
    monkeypatch.setattr(ggml, "fine_activations", lambda library: False)
    caplog.clear()  # (the 14 asked for above warned already on a CPU without them)
    with caplog.at_level(logging.WARNING, logger="specchat.engine"):
        finest = Runtime(gguf_target, config=EXACT_CONFIG, kernels=library)
    assert finest.pass_inputs()[ggml.GEMM_INPUT][0] == 0 and "VNNI" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="specchat.engine"):
        coarse = Runtime(gguf_target, config=EXACT_CONFIG, kernels=library, activations=14)
    assert coarse.pass_inputs()[ggml.GEMM_INPUT][0] == 0 and "AVX-512 VNNI" in caplog.text
    assert "14-bit" not in coarse.label
    with pytest.raises(EngineError, match="choose one of 8, 14"):
        Runtime(gguf_target, config=EXACT_CONFIG, kernels=library, activations=12)


def test_an_engine_on_a_cpu_without_14_bit_activations_says_so_once(gguf_target, library, monkeypatch, caplog):
    monkeypatch.setattr(ggml, "fine_activations", lambda library: False)
    with caplog.at_level(logging.WARNING, logger="specchat.engine"):
        engine = Engine(
            gguf_target,
            gguf_target,
            Settings(config=EXACT_CONFIG, kernels="ggml", library=library, activations=14, prompt_reader="off"),
        )
    assert caplog.text.count("AVX-512 VNNI") == 1
    assert "14-bit" not in engine.models["target"] + engine.models["draft"]
    engine.close()


def test_auto_keeps_the_faster_kernels_per_model_and_says_which(gguf_target, ir_target, library, caplog):
    with caplog.at_level(logging.INFO, logger="specchat.engine"):
        engine = Engine(
            gguf_target, None, Settings(config=EXACT_CONFIG, kernels="auto", library=library, prompt_reader="off")
        )
    assert engine.target.kernels in ("openvino", "ggml") and "kernels for" in caplog.text
    assert engine.target.kernels in caplog.text.split("kernels for")[1].split("(")[0]
    assert ("ggml kernels" in engine.models["target"]) == (engine.target.kernels == "ggml")
    engine.close()
    with pytest.raises(EngineError, match="GGUF"):
        Engine(ir_target, None, Settings(config=EXACT_CONFIG, kernels="ggml", library=library))
    with pytest.raises(EngineError, match="'gemm' reads on ggml's kernels"):
        Engine(ir_target, None, Settings(config=EXACT_CONFIG, prompt_reader="gemm"))


@pytest.mark.parametrize("on_ggml", [True, False])
def test_the_screen_times_a_quarter_of_the_blocks_linear_layers_and_the_head_each_on_its_own_input(
    gguf_target, library, on_ggml
):
    core = ov.Core()
    ggml.register(core, library)
    xml = gguf_target / (GGML_XML if on_ggml else "openvino_model.xml")
    flags = 0 if on_ggml else None
    whole = screen.linear_nodes(core.read_model(xml), on_ggml)
    assert len(whole) == (4 if on_ggml else 7) * 2 + 1  # (2 blocks: the tiny model's)
    (block, reads), (head, once) = screen.parts(core.read_model(xml), 2, flags)
    assert (reads, once) == (2.0, 1.0)  # (a quarter of 2 blocks is 1)
    residuals = 2 if on_ggml else 0  # (on the op, a block's o and down nodes add their residual input)
    assert len(block.inputs) == len(whole) // 2 + residuals and len(head.inputs) == 1
    # (on the op, the gate and up node gives one output: their SwiGLU)
    assert sum(len(n.outputs()) for n in whole[: len(whole) // 2]) == len(block.outputs) == (6 if on_ggml else 7)
    for part in (block, head):
        x = {i: np.ones([1, 1, p.get_partial_shape()[-1].get_length()], np.float32) for i, p in enumerate(part.inputs)}
        out = core.compile_model(part, "CPU", EXACT_CONFIG)(x)
        assert all(np.isfinite(out[i]).all() for i in range(len(part.outputs)))
    assert out[0].shape[-1] == json.loads((gguf_target / "config.json").read_text())["vocab_size"]
    assert screen.parts(core.read_model(xml), 3, flags) == []  # (15 or 9 layers are not 3 blocks and a head)
    assert screen.step_seconds(gguf_target, library if on_ggml else None, "CPU", EXACT_CONFIG) > 0


@pytest.mark.parametrize("plugin_over_ggml, built", [(2.0, ["ggml"]), (1 / 2.0, ["openvino"]), (1.1, None)])
def test_kernels_whose_linear_layers_are_slower_by_the_margin_are_not_built_whole(
    gguf_target, library, tmp_path, caplog, plugin_over_ggml, built
):
    """Injected screen timings: a candidate slower by the margin is never built; within it, both
    are timed whole, one at a time, and the faster kept."""
    made = []

    def build(kernels):
        made.append("ggml" if kernels else "openvino")
        return Runtime(gguf_target, config=EXACT_CONFIG, kernels=kernels)

    def linears_seconds(kernels):
        return 0.01 * (1.0 if kernels else plugin_over_ggml)

    measured = Measured(tmp_path / "m.json", {}, "", reused=False)
    with caplog.at_level(logging.INFO, logger="specchat.engine"):
        runtime = on_kernels(build, gguf_target, "auto", library, measured, linears_seconds)
    if built is None:
        assert made[:2] == ["openvino", "ggml"] and "a plain step:" in caplog.text
    else:
        assert made == built and "not built whole" in caplog.text and "a plain step:" not in caplog.text
    assert runtime.kernels == measured.get(f"kernels for {gguf_target.name}") == made[-1]


def test_a_second_start_reads_back_what_the_first_measured_and_says_so(gguf_target, gguf_draft, library, caplog):
    """Kernels per model, the prompt reader and the pass costs are timed once per machine, build,
    models and settings (and the opening's cache entries computed once); a restart reads them
    (the log, the page's header and /health say when they were measured) and answers as the
    first start did."""
    settings = dict(config=EXACT_CONFIG, draft_config=EXACT_CONFIG, kernels="auto", library=library)
    request = Request(({"role": "user", "content": PROMPTS[0]},), max_new_tokens=12, mode="best", reuse_cache=False)
    with caplog.at_level(logging.INFO):
        first = Engine(gguf_target, gguf_draft, Settings(remeasure=True, **settings))
    assert "timing at start" in caplog.text and "prompt reader" in caplog.text
    answer = first.run(request).token_ids
    opening = first.sessions.opening
    first.close()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = Engine(gguf_target, gguf_draft, Settings(**settings))
    assert "measurements: read back" in caplog.text and "timing at start" not in caplog.text
    assert "a plain step:" not in caplog.text and "prompt reader f32:" not in caplog.text
    assert second.pacing.costs == first.pacing.costs
    assert (second.target.kernels, second.draft.kernels) == (first.target.kernels, first.draft.kernels)
    assert getattr(second.reader, "name", None) == getattr(first.reader, "name", None)
    assert second.models["measured"] == first.models["measured"] + ", kept from an earlier start"
    for read, kept in zip(opening.entries, second.sessions.opening.entries):  # (kept, not read again)
        assert all(np.array_equal(kept[name], entries) for name, entries in read.items())
    assert second.run(request).token_ids == answer
    second.close()
    with caplog.at_level(logging.INFO):
        Engine(gguf_target, gguf_draft, Settings(remeasure=True, **settings)).close()
    assert "timing at start" in caplog.text


def q4k_model(library, weights: list[np.ndarray]) -> ov.Model:
    x = ops.parameter([-1, K], ov.Type.f32)
    flag = ops.constant(np.array([0], dtype=np.int64)).output(0)
    outputs = ggml.linears(x.output(0), [(w, int(Q.Q4_K)) for w in weights], library, True, flag)
    return ov.Model(outputs, [x])


def outputs_of(library, model: ov.Model, x: np.ndarray) -> list[np.ndarray]:
    core = ov.Core()
    ggml.register(core, library)
    result = core.compile_model(model, "CPU")({0: x})
    return [result[i] for i in range(len(model.outputs))]


def weight_addresses(model: ov.Model) -> list[int]:
    return [
        port.get_source_output().get_node().get_data().ctypes.data
        for node in model.get_ordered_ops()
        if node.get_type_name() == hugepages.OP
        for port in list(node.inputs())[ggml.FIRST_WEIGHT :]
    ]


@pytest.mark.skipif(not hugepages.available(), reason="this kernel gives no transparent huge pages")
def test_moved_weights_lie_in_one_region_on_huge_pages_and_compute_the_same(library):
    weights = [random_rows(Q.Q4_K, N, K, seed=seed) for seed in (1, 2, 3)]
    x = np.random.default_rng(4).standard_normal((5, K)).astype(np.float32)
    model = q4k_model(library, weights)
    before = outputs_of(library, model, x)
    region = hugepages.move_weights(model)
    assert region is not None
    base = np.frombuffer(region, dtype=np.uint8).ctypes.data
    addresses = weight_addresses(model)
    assert len(addresses) == len(weights)
    assert all(base <= a < base + len(region) for a in addresses)
    assert min(addresses) % hugepages.HUGE_PAGE == 0  # (the region starts on a huge page)
    for got, expected in zip(outputs_of(library, model, x), before, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("refused", ["setting", "advice"])
def test_without_transparent_huge_pages_the_weights_stay_where_they_are(library, tmp_path, monkeypatch, refused):
    """Transparent huge pages off (``never``), or the advice refused by the kernel."""
    if refused == "setting":
        setting = tmp_path / "enabled"
        setting.write_text("always madvise [never]\n")
        monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    else:
        monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)  # (no such advice: EINVAL)
    model = q4k_model(library, [random_rows(Q.Q4_K, N, K, seed=5)])
    addresses = weight_addresses(model)
    assert hugepages.move_weights(model) is None
    assert weight_addresses(model) == addresses


def test_rows_of_a_target_whose_cache_the_op_keeps_batch_without_copies_and_as_they_run_alone(gguf_target, library):
    """OwnBatch: rows of different lengths and widths in one pass, each its lone logits bit for bit;
    a cut is a shorter row; a leaving row's own cache holds what the row held."""
    template = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    homes, alone = [template.fork() for _ in range(2)], [template.fork() for _ in range(2)]
    prompts = [TOKENS[:5], TOKENS * 2]
    for runtimes in (homes, alone):
        for runtime, prompt in zip(runtimes, prompts):
            runtime.forward(prompt)
    batch = batch_for(template)
    assert isinstance(batch, OwnBatch)
    batch.join(list(enumerate(homes)))
    feeds = [[3, 4, 5], [6]]
    together = batch.step(feeds)
    for runtime, feed, logits in zip(alone, feeds, together):
        assert np.array_equal(runtime.forward(feed, rows=len(feed)), logits)
    batch.keep([len(prompts[0]) + 1, len(prompts[1]) + 1])  # (the first row's last two tokens rejected)
    alone[0].trim(len(prompts[0]) + 1)
    again = batch.step([[7], [8]])
    for runtime, feed, logits in zip(alone, [[7], [8]], again):
        assert np.array_equal(runtime.forward(feed), logits)
    batch.leave(0)
    assert homes[0].tokens == alone[0].tokens
    assert np.array_equal(homes[0].forward([9]), alone[0].forward([9]))
    assert batch.kv_cache_bytes == 0 and len(batch) == 1


def test_passes_on_the_copies_compiled_for_their_width_compute_what_the_dynamic_graph_does(gguf_target, library):
    """FixedShapes: a cache's passes at the fixed widths, between passes at others, and a fork's
    passes on the same copies, give the logits of the graph of dynamic shapes bit for bit."""
    fixed = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library, fixed_widths=(1, 2))
    dynamic = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library, fixed_widths=())
    twin = fixed.fork()
    feeds = [TOKENS, [3], [4, 5], [6, 7, 8], [9], [10, 11]]
    for feed in feeds:
        expected = dynamic.forward(feed, rows=len(feed))
        assert np.array_equal(fixed.forward(feed, rows=len(feed)), expected)
        assert np.array_equal(twin.forward(feed, rows=len(feed)), expected)
    assert fixed.fixed is twin.fixed and fixed.fixed is not None and dynamic.fixed is not None
    assert fixed.pass_request(1) is not fixed.request and fixed.pass_request(3) is fixed.request
    assert twin.pass_request(2) is not fixed.pass_request(2)  # (each cache its own requests)
    assert dynamic.pass_request(1) is dynamic.request


def test_warm_up_compiles_the_copy_for_every_fixed_width(gguf_target, library):
    """A first request's pass at a fixed width waits on no compile (half a second a copy)."""
    runtime = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library, fixed_widths=(1, 3))
    runtime.warm_up()
    assert runtime.fixed is not None and {(1, 1), (1, 3)} <= set(runtime.fixed._compiled)
    assert not runtime.tokens


def test_the_paced_modes_verify_width_runs_on_a_copy_compiled_for_it():
    assert {1, 2, BEST_K + 1} <= set(FIXED_WIDTHS)


def test_batched_plain_steps_move_onto_a_copy_of_fixed_shapes_once_compiled_and_compute_alike(gguf_target, library):
    """A batched plain step's shape is compiled in the background on its first pass; passes until
    then run on the dynamic graph, those after on the copy, each row its lone logits bit for bit."""
    template = Runtime(gguf_target, config=EXACT_CONFIG, first_token_alone=True, kernels=library)
    homes, alone = [template.fork() for _ in range(2)], [template.fork() for _ in range(2)]
    for runtimes in (homes, alone):
        for runtime, prompt in zip(runtimes, [TOKENS[:5], TOKENS]):
            runtime.forward(prompt)
    batch = batch_for(template)
    batch.join(list(enumerate(homes)))
    deadline = time.monotonic() + 120
    for token in itertools.count(3):
        on_copy = template.fixed.compiled(1, rows=2) is not None
        together = batch.step([[token], [token + 1]])
        for runtime, feed, logits in zip(alone, [[token], [token + 1]], together):
            assert np.array_equal(runtime.forward(feed), logits)
        if on_copy:
            break
        assert time.monotonic() < deadline, "the batched step's copy was never compiled"
        time.sleep(0.2)
    assert batch._request(2, 1) is not batch.request and batch._request(2, 3) is batch.request
