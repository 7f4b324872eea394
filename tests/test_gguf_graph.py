"""A GGUF prepared by building its graphs straight from the file (engine.prepare.gguf_graph, through
engine.prepare.pipeline: no torch, no export) against the same file prepared through
transformers and optimum-intel (its graph on ggml's kernels rewritten from the exported IR,
engine.prepare.ggml_ir): the same interface, and the same logits over a prompt, single steps with
the KV cache and a pass after a rollback, on both kernels, for llama, qwen2 and qwen3; a model in
int4 from the file, an engine on such a pair, and the fallback to the export.

The tiny models' norms and biases are random and rounded to fp16 first, so that the export's
fp16 copy of them is exact; its one remaining rounding is the RoPE frequencies the export keeps
as f16 constants, which the graphs built from the file keep in f32."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import openvino as ov
import pytest
import torch
from openvino import opset13 as ops
from openvino._offline_transformations import stateful_to_stateless_transformation

from engine import ggml
from engine.core import graph
from engine.core.pacing import Pacing
from engine.core.requests import Request
from engine.core.runtime import EXACT_CONFIG, Runtime
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.core.tokenizer import load_tokenizer
from engine.ggml import GGML_XML
from engine.hf import auto_tokenizer, tokenizer_tokens
from engine.manifest import read as read_manifest
from engine.prepare import ggml_ir, gguf_graph, kernels
from engine.prepare import pipeline as prepare
from engine.prepare.convert import Compression
from engine.prepare.gguf_graph import PLUGIN_XML, UnsupportedModel
from engine.prepare.pipeline import default_cache_dir, draft_compression, prepare_one
from tests import gguf_writer
from tests.gguf_writer import write_gguf
from tests.test_kernels import random_rows
from tests.tiny import TINY_SHAPE, TOKENS

Q = gguf.GGMLQuantizationType
ARCHITECTURES = ("qwen2", "llama", "qwen3")
STEPS = [7, 8, 9, 10, 11, 12]
# The new graph's logits off today's where only the RoPE frequencies differ (f32 against the
# export's f16), relative to the largest logit; measured at most 2.5e-2, see the test.
ROPE_TOLERANCE = 0.05
# How far the op's own norms and SwiGLU (ggml's) may move the tiny models' logits from the plugin's
# nodes', of the largest: a row's rounding of its activations to 8 bits flipped, at most.
FUSED_TOLERANCE = 1e-2
# The ggml graph's logits off the plugin's, relative to the largest: the op quantizes activations to
# 8 bits per block as llama.cpp does (tests/test_kernels.py); measured up to 6.8e-2 (qwen2), 3.9e-2
# (llama), 3.1e-2 (qwen3).
ACTIVATIONS_TOLERANCE = 0.08


@pytest.fixture(scope="module")
def library() -> Path:
    """The op for this machine (built into the app's cache on first use, as prepare does)."""
    return kernels.library(default_cache_dir(), print)


def varied(source: Path, out: Path, seed: int) -> Path:
    """``source``'s model with random norms and biases (a tiny model's are ones and zeros, which
    the export folds away), every weight rounded to fp16, and a bos id (transformers' llama GGUF
    tokenizer needs one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
            p.copy_(p.half().float())
    model.config.bos_token_id = model.config.bos_token_id or tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# A tiny qwen3's head size: Qwen3Config's default, since transformers' GGUF loader (5.5) does not
# read a file's (it would load a head size of 16 as 128).
QWEN3_HEAD = 128


def qwen3(folder: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Qwen3 (query and key heads RMS-normed) of the shape every tiny model shares,
    but for its heads' size (:data:`QWEN3_HEAD`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    if (folder / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(
        **TINY_SHAPE,
        head_dim=QWEN3_HEAD,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.3,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def copy_gguf(
    source: Path,
    out: Path,
    architecture: str | None = None,
    metadata: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
    tensors: dict[str, str | None] | None = None,
) -> Path:
    """``source`` rewritten: its architecture renamed, ``metadata`` added, and each tensor named in
    ``tensors`` dropped (None) or made a copy of another's bytes."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, architecture or reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name != gguf.Keys.General.ARCHITECTURE and not field.name.startswith("GGUF."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, (value, kind) in (metadata or {}).items():
        writer.add_key_value(key, value, kind)
    by_name = {t.name: t for t in reader.tensors}
    changes = tensors or {}
    kept = [(t.name, by_name[changes.get(t.name) or t.name]) for t in reader.tensors if changes.get(t.name, t.name)]
    for name, tensor in kept:
        writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in kept:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return out


def tiny_gguf(architecture: str, request: pytest.FixtureRequest, tiny_dir: Path) -> Path:
    """A tiny model of ``architecture`` (:func:`varied`) written as a Q4_0 GGUF, as llama.cpp's
    converter would write it (a llama file's q and k rows permuted for ggml's RoPE)."""
    folder = tiny_dir / "gguf-graph"
    folder.mkdir(exist_ok=True)
    file = folder / f"tiny-{architecture}-Q4_0.gguf"
    if file.exists():
        return file
    if architecture == "qwen3":
        source = qwen3(tiny_dir / "hf-qwen3", request.getfixturevalue("tokenizer_dir"))
    else:
        source = request.getfixturevalue({"qwen2": "hf_target", "llama": "hf_llama"}[architecture])
    hf = varied(source, tiny_dir / f"hf-varied-{architecture}", seed=7)
    if architecture != "qwen3":
        return write_gguf(hf, file, Q.Q4_0)
    with pytest.MonkeyPatch.context() as patch:  # (tests.gguf_writer knows qwen2 and llama)
        patch.setitem(gguf_writer.ARCHES, "qwen3", gguf.MODEL_ARCH.QWEN3)
        patch.setitem(gguf_writer.PRE_TOKENIZER, "qwen3", "qwen2")
        written = write_gguf(hf, folder / "qwen3-without-head-size.gguf", Q.Q4_0)
    head_dim = (QWEN3_HEAD, gguf.GGUFValueType.UINT32)
    # (llama.cpp's converter writes a qwen3 file's head size where it is not hidden size / heads)
    return copy_gguf(
        written, file, metadata={"qwen3.attention.key_length": head_dim, "qwen3.attention.value_length": head_dim}
    )


@dataclass(frozen=True)
class Prepared:
    architecture: str
    file: Path
    old: Path  # the file prepared through transformers and optimum-intel, its graph on ggml's kernels beside
    new: Path  # the file prepared from the file, both graphs built by gguf_graph


def without_the_export(patch: pytest.MonkeyPatch) -> None:
    """Make any step of the transformers and optimum-intel path fail, should one run."""

    def refused(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a GGUF the graphs build went through transformers")

    for step in ("dequantize_gguf", "export_ir", "keep_gguf_blocks"):
        patch.setattr(prepare, step, refused)


def from_file(file: Path, compression: Compression, cache: Path, library: Path) -> Path:
    """``file`` prepared as prepare does, the export refused, and its graph on ggml's kernels
    written as startup writes it (engine.prepare.ggml_ir.for_model)."""
    with pytest.MonkeyPatch.context() as patch:
        without_the_export(patch)
        entry = prepare_one(str(file), compression, cache).path
    ggml_ir.write(entry, file, library, print, four_bit=compression.precision == "int4")
    return entry


def exported(file: Path, compression: Compression, cache: Path, library: Path) -> Path:
    """``file`` prepared through transformers and optimum-intel, as any model the graphs do not
    build is, its graph on ggml's kernels rewritten from the IR."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare, "builds_from_file", lambda *_: False)
        entry = prepare_one(str(file), compression, cache).path
    ggml_ir.write(entry, file, library, print, four_bit=compression.precision == "int4")
    return entry


@pytest.fixture(scope="module", params=ARCHITECTURES)
def prepared(request, tiny_dir, library) -> Prepared:
    architecture = request.param
    file = tiny_gguf(architecture, request, tiny_dir)
    old = exported(file, Compression("gguf"), tiny_dir / "gguf-graph" / "exported", library)
    new = from_file(file, Compression("gguf"), tiny_dir / "gguf-graph" / "from-file", library)
    return Prepared(architecture, file, old, new)


def read(folder: Path, library: Path, xml: str = GGML_XML) -> ov.Model:
    core = ov.Core()
    ggml.register(core, library)
    return core.read_model(folder / xml)


def with_rope_in_fp16(folder: Path, out: Path, library: Path, xml: str = GGML_XML) -> Path:
    """``folder``'s graph with its RoPE frequencies rounded to fp16, as the export keeps them."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    model = read(folder, library, xml)
    (frequencies,) = [n for n in model.get_ordered_ops() if n.get_friendly_name() == gguf_graph.INV_FREQ]
    rounded = ops.constant(frequencies.get_data().astype(np.float16).astype(np.float32))
    for target in list(frequencies.output(0).get_target_inputs()):
        target.replace_source_output(rounded.output(0))
    ov.save_model(model, out / xml, compress_to_fp16=False)
    return out


def logits(folder: Path, library: Path | None) -> np.ndarray:
    """Every row of a prompt pass, then single steps with the KV cache, then a rollback of three
    steps and a three-token pass after it: the passes decoding and verifying make (on ggml's
    kernels with a ``library``, else on the plugin's)."""
    runtime = Runtime(folder, config=EXACT_CONFIG, kernels=library)
    rows = [runtime.forward(TOKENS, rows=len(TOKENS))]
    rows += [runtime.forward([token]) for token in STEPS]
    runtime.trim(len(TOKENS) + len(STEPS) - 3)
    rows.append(runtime.forward([33, 34, 35], rows=3))
    return np.concatenate(rows)


def describe(model: ov.Model) -> dict[str, Any]:
    """What Runtime, the batcher and the prompt reader rely on: inputs, output, variables, and the
    op's nodes (their weights' shapes, types and interleaving)."""
    nodes = [n for n in model.get_ordered_ops() if n.get_type_name() == ggml.GGML_LINEAR]
    stateless = model.clone()
    stateful_to_stateless_transformation(stateless)
    return {
        "inputs": [(i.get_any_name(), str(i.get_partial_shape()), i.get_element_type()) for i in model.inputs],
        "outputs": [(o.get_any_name(), str(o.get_partial_shape())) for o in model.outputs],
        "variables": sorted((v.info.variable_id, str(v.info.data_shape)) for v in model.get_variables()),
        "stateless": sorted(p.get_any_name() for p in [*stateless.inputs, *stateless.outputs]),
        "op": sorted(
            sorted(
                (tuple(n.get_input_shape(i)), kind, grouped)
                for i, kind, grouped in zip(
                    range(ggml.FIRST_WEIGHT, n.get_input_size()),
                    n.get_attributes()["ggml_types"],
                    n.get_attributes()["interleaved"],
                )
            )
            for n in nodes
        ),
        "head": tuple(graph.head_weight(model).get_shape()),
    }


def fused(folder: Path, library: Path | None) -> Counter[str]:
    """The nodes the CPU plugin compiled the graph into that the speed depends on: its fused RMS,
    RoPE and attention (with the cache's concat: MemoryInput/Output), the op (Reference), and the
    plugin's own matmuls with their weights' decompression fused in (FullyConnected)."""
    runtime = Runtime(folder, config=EXACT_CONFIG, kernels=library)
    kinds = (n.get_rt_info()["layerType"].astype(str) for n in runtime.compiled.get_runtime_model().get_ordered_ops())
    kept = ("RMS", "RoPE", "ScaledDotProductAttention", "MemoryInput", "Reference", "FullyConnected")
    return Counter(k for k in kinds if k in kept)


# Each graph of a prepared model: on ggml's kernels (the op's library) and on the plugin's (None).
KERNELS = ["ggml", "openvino"]


def on(kernels: str, library: Path) -> Path | None:
    return library if kernels == "ggml" else None


def test_the_graphs_have_todays_inputs_output_states_and_linear_nodes(prepared, library):
    """On ggml's kernels the graph built from the file has today's linear nodes, output and head,
    and its attention is the op's over the caches it keeps: two inputs more (each row's cache and
    the entries it keeps) and no states. On the plugin's kernels it is today's in every way."""
    old, new = (describe(read(folder, library)) for folder in (prepared.old, prepared.new))
    cache = ("inputs", "variables", "stateless")
    assert {k: v for k, v in new.items() if k not in cache} == {k: v for k, v in old.items() if k not in cache}
    assert new["variables"] == [] and len(old["variables"]) == 2 * TINY_SHAPE["num_hidden_layers"]
    assert [name for name, *_ in new["inputs"]] == [name for name, *_ in old["inputs"]] + [
        ggml.KV_CACHES,
        ggml.KV_PASTS,
    ]
    assert [name for name, *_ in old["inputs"]] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "beam_idx",
        ggml.GEMM_INPUT,
    ]
    old, new = (describe(read(folder, library, PLUGIN_XML)) for folder in (prepared.old, prepared.new))
    assert new == old and new["op"] == [] and GGML_XML != PLUGIN_XML
    config = json.loads((prepared.new / "config.json").read_text())
    expected = json.loads((prepared.old / "config.json").read_text())
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        assert config[key] == expected[key], key


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_plugin_fuses_them_as_it_fuses_todays(prepared, library, kernels):
    """On ggml's kernels the op nodes norm their own inputs (ggml.Fused): the plugin's RMS nodes
    are then only qwen3's, of its q and k heads; and the op's attention turns q and k by RoPE
    itself: no RoPE node."""
    layers = TINY_SHAPE["num_hidden_layers"]
    heads = 2 * layers * (prepared.architecture == "qwen3")
    norms = heads + (2 * layers + 1 if kernels == "openvino" else 0)
    counts, today = fused(prepared.new, on(kernels, library)), fused(prepared.old, on(kernels, library))
    apart = (
        "RMS",
        "ScaledDotProductAttention",
        "MemoryInput",
        "Reference",
        "RoPE",
    )  # (on ggml's kernels attention is the op's, RoPE its too)
    assert counts - Counter({k: counts[k] for k in apart}) == today - Counter({k: today[k] for k in apart})
    assert today["RMS"] == heads + 2 * layers + 1
    assert counts["RMS"] == norms and today["RoPE"] == 2 * layers
    assert counts["RoPE"] == (0 if kernels == "ggml" else 2 * layers)
    assert today["ScaledDotProductAttention"] == today["MemoryInput"] // 2 == layers
    if kernels == "ggml":
        assert counts["ScaledDotProductAttention"] == counts["MemoryInput"] == 0
        assert counts["Reference"] == today["Reference"] + layers
    else:
        assert counts["ScaledDotProductAttention"] == counts["MemoryInput"] // 2 == layers
        assert counts["FullyConnected"] == today["FullyConnected"]
    # (each layer's seven matrices and the head; the plugin may join a layer's q, k and v, its gate and up)
    assert counts["FullyConnected" if kernels == "openvino" else "Reference"] >= 4 * layers + 1


@pytest.mark.parametrize("kernels", KERNELS)
def test_with_the_exports_fp16_rope_frequencies_the_logits_are_todays_bit_for_bit(prepared, library, tiny_dir, kernels):
    """Everything else the graphs compute is today's: the file's rows through the same op nodes or
    the same compressed weights, the embedding's values, the same ops for RoPE, the cache and the
    attention. The norms, SwiGLU, biases and residuals too on the plugin's kernels; on ggml's the
    op nodes compute those as llama.cpp does (the norm's squares summed in double, ggml's exp), so
    there within their rounding (which the activations' 8-bit rounding absorbs here)."""
    xml = GGML_XML if kernels == "ggml" else PLUGIN_XML
    like_export = with_rope_in_fp16(
        prepared.new, tiny_dir / "gguf-graph" / f"fp16-rope-{prepared.architecture}-{kernels}", library, xml
    )
    new, old = logits(like_export, on(kernels, library)), logits(prepared.old, on(kernels, library))
    if kernels == "openvino":
        np.testing.assert_array_equal(new, old)
    else:
        np.testing.assert_allclose(new, old, rtol=0, atol=FUSED_TOLERANCE * np.abs(old).max())


@pytest.mark.parametrize("kernels", KERNELS)
def test_with_the_files_rope_frequencies_the_logits_are_todays_within_their_rounding(prepared, library, kernels):
    """The export keeps RoPE's frequencies as f16 constants, the new graphs in f32 as llama.cpp
    computes them: the second pair's frequency is 6.6e-5 off here (1.8e-4 on the default target,
    whose angle drifts 0.1 rad by position 561). Over these 19 positions that moved the tiny random
    models' logits by up to 2.1e-2 of the largest (qwen2), 2.5e-2 (llama, qwen3), and flipped one
    llama argmax, between logits 0.021 apart where they moved by 0.26."""
    new, old = logits(prepared.new, on(kernels, library)), logits(prepared.old, on(kernels, library))
    moved = np.abs(new - old)
    print(f"{prepared.architecture}: logits moved by up to {moved.max() / np.abs(old).max():.2e} of the largest")
    assert 0 < moved.max() <= ROPE_TOLERANCE * np.abs(old).max()
    assert only_close_calls_flipped(new, old)


def only_close_calls_flipped(new: np.ndarray, old: np.ndarray) -> bool:
    """Whether each row's argmax that differs flipped between two logits nearer than the
    rounding moved that row."""
    moved = np.abs(new - old)
    top2 = np.sort(old, axis=-1)[:, -2:]
    flipped = new.argmax(-1) != old.argmax(-1)
    return bool((top2[flipped, 1] - top2[flipped, 0] <= 2 * moved[flipped].max(-1)).all())


def test_the_two_graphs_of_a_model_from_the_file_agree_within_the_ops_activation_rounding(prepared, library):
    """The same weights, the same ops but the linear layers': ggml's round the activations to 8 bits
    per block (llama.cpp's rounding), which flipped 2 of llama's 19 argmaxes, each between two
    logits nearer than it moved them."""
    plugin, ours = logits(prepared.new, None), logits(prepared.new, library)
    moved = np.abs(ours - plugin).max() / np.abs(plugin).max()
    print(f"{prepared.architecture}: ggml's kernels off the plugin's by up to {moved:.2e} of the largest logit")
    assert moved <= ACTIVATIONS_TOLERANCE
    assert only_close_calls_flipped(ours, plugin)


def test_a_model_from_the_file_is_prepared_without_transformers_model_classes_or_the_export(prepared):
    """The preparation ran with every step of the export refused (:func:`from_file`); the folder
    has what a prepared model has, and its tokenizer is the exported one's."""
    manifest, expected = read_manifest(prepared.new), read_manifest(prepared.old)
    assert manifest is not None and expected is not None
    assert manifest["graph"] == gguf_graph.FROM_FILE and expected["graph"] == prepare.EXPORTED
    assert manifest["vocabulary"] == expected["vocabulary"] and manifest["sha256"] == expected["sha256"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", PLUGIN_XML, GGML_XML):
        assert (prepared.new / name).exists(), name
    assert not list(prepared.new.glob("openvino_tokenizer*"))  # (the export's, which nothing reads)
    messages = [{"role": "user", "content": "def f(x): return x"}]
    tokenizers = [auto_tokenizer(folder) for folder in (prepared.new, prepared.old)]
    texts = [t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for t in tokenizers]
    assert texts[0] == texts[1] and tokenizer_tokens(tokenizers[0]) == tokenizer_tokens(tokenizers[1])
    # (transformers reads a llama file's byte-level BPE as CodeLlama's tokenizer, which cannot encode
    # without an unknown token, from either path: the tiny llama's tokenizer is not the point here)
    served = load_tokenizer(prepared.new)  # (read without transformers, as the app serves it)
    assert served.apply_chat_template(messages, add_generation_prompt=True) == texts[0]
    assert served.get_vocab() == tokenizers[0].get_vocab()
    if prepared.architecture != "llama":
        assert tokenizers[0].encode(texts[0]) == tokenizers[1].encode(texts[1])
        assert served.encode(texts[0], add_special_tokens=False) == tokenizers[0].encode(
            texts[0], add_special_tokens=False
        )


@pytest.fixture(scope="module")
def qwen2_file(request, tiny_dir) -> Path:
    return tiny_gguf("qwen2", request, tiny_dir)


def test_a_file_without_a_head_reads_the_token_embedding_as_its_head(qwen2_file, library, tiny_dir):
    """As ggml_ir does for a tied model: the op on the embedding's own rows, so a file whose head is
    a copy of the embedding gives the same logits bit for bit."""
    folder = tiny_dir / "gguf-graph"
    tied = copy_gguf(qwen2_file, folder / "tied.gguf", tensors={"output.weight": None})
    copied = copy_gguf(qwen2_file, folder / "copied-head.gguf", tensors={"output.weight": "token_embd.weight"})
    for file in (tied, copied):
        gguf_graph.write(file, folder / file.stem, library)
    assert json.loads((folder / "tied" / "config.json").read_text())["tie_word_embeddings"]
    np.testing.assert_array_equal(logits(folder / "tied", library), logits(folder / "copied-head", library))


def test_an_architecture_or_feature_it_does_not_build_is_refused_with_a_clear_error(qwen2_file, library, tiny_dir):
    """So that a caller can prepare the file the old way, and say why."""
    other = copy_gguf(qwen2_file, tiny_dir / "gguf-graph" / "gemma2.gguf", architecture="gemma2")
    with pytest.raises(UnsupportedModel, match="architecture 'gemma2' has no graph built from the file"):
        gguf_graph.build(other, library)
    scaled = copy_gguf(
        qwen2_file,
        tiny_dir / "gguf-graph" / "scaled.gguf",
        metadata={"qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)},
    )
    with pytest.raises(UnsupportedModel, match="RoPE scaling is not built from the file"):
        gguf_graph.build(scaled, library)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_0])
def test_the_embedding_gathers_the_files_values_from_its_codes(kind):
    """The plugin's gather reads the codes as they are (u4 for Q4_K, i8 for Q6_K and Q5_0) and f32
    scales: the file's values, Q4_K's to f32 rounding (its min taken as a zero point)."""
    rows, cols = 48, 512
    raw = random_rows(kind, rows, cols, seed=11)
    tensor = type("Tensor", (), {"data": raw, "shape": np.array([cols, rows]), "tensor_type": kind})()
    table, size = gguf_graph.embedding_table(tensor)
    ids = ops.parameter([-1], ov.Type.i32, name="ids")
    compiled = ov.Core().compile_model(ov.Model([ops.gather(table, ids, 0)], [ids]), "CPU", EXACT_CONFIG)
    got = compiled({0: np.arange(rows, dtype=np.int32)})[0]
    expected = gguf.quants.dequantize(raw, kind).reshape(rows, cols)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2**-23 * np.abs(expected).max() if kind == Q.Q4_K else 0)
    bits = {Q.Q4_K: 4 + 2 * 32 / 32, Q.Q6_K: 8 + 32 / 16, Q.Q8_0: 8 + 32 / 32, Q.Q4_0: 4 + 32 / 32, Q.Q5_0: 8 + 32 / 32}
    assert size * 8 == bits[kind] * rows * cols


def compressed(folder: Path) -> Counter[str]:
    """The plugin's graph's integer constants of two or more dimensions (a matrix's codes), by type."""
    nodes = ov.Core().read_model(folder / PLUGIN_XML).get_ordered_ops()
    return Counter(
        n.get_element_type().get_type_name()
        for n in nodes
        if n.get_type_name() == "Constant" and len(n.get_output_shape(0)) >= 2 and not n.get_element_type().is_real()
    )


@pytest.fixture(scope="module")
def draft_file(hf_draft, tiny_dir) -> Path:
    """The tiny draft in Q8_0 (a type the draft's int4 requantizes), as the default draft's file holds
    Q8_0 and Q5_0 rows."""
    return write_gguf(hf_draft, tiny_dir / "gguf-graph" / "tiny-draft-Q8_0.gguf", Q.Q8_0)


@pytest.fixture(scope="module")
def int4_draft(draft_file, tiny_dir, library) -> Path:
    return from_file(draft_file, draft_compression("int4"), tiny_dir / "gguf-graph" / "from-file", library)


def test_an_int4_model_from_the_file_runs_on_the_same_q4_0_rows_on_both_kernels(
    int4_draft, draft_file, tiny_dir, library
):
    """Its Q8_0 rows (the embedding's too) requantized to Q4_0: ggml's op on them, the plugin on their
    codes decoded (i4, a scale per 32); both as close to the file's own model as NNCF's int4 in
    groups of 32 through the export is (0.84 alike on these rows, both; its rounding never reaches
    an answer: the target verifies)."""
    assert read_manifest(int4_draft)["graph"] == gguf_graph.FROM_FILE  # type: ignore[index]
    layers = TINY_SHAPE["num_hidden_layers"]
    assert compressed(int4_draft) == {"i4": 7 * layers + 2}  # (every matrix, the embedding and the head)
    types = {
        Q(kind).name
        for n in read(int4_draft, library).get_ordered_ops()
        if n.get_type_name() == ggml.GGML_LINEAR
        for kind in n.get_attributes()["ggml_types"]
    }
    assert types == {"Q4_0"}
    files = from_file(draft_file, Compression("gguf"), tiny_dir / "gguf-graph" / "from-file", library)
    assert compressed(files) == {"i8": 7 * layers + 2}
    reference = logits(files, None)
    for weights in (None, library):
        four_bit = logits(int4_draft, weights)
        # (4 bits move a tiny random model's flat logits far; rows out of order would leave nothing alike)
        alike = (four_bit * reference).sum(-1) / np.linalg.norm(four_bit, axis=-1) / np.linalg.norm(reference, axis=-1)
        assert alike.mean() >= 0.8
    plugin, ours = logits(int4_draft, None), logits(int4_draft, library)
    assert np.abs(ours - plugin).max() <= ACTIVATIONS_TOLERANCE * np.abs(plugin).max()


@pytest.fixture(scope="module")
def gguf_target(hf_target, tiny_dir, library) -> Path:
    file = write_gguf(hf_target, tiny_dir / "gguf-graph" / "tiny-target-Q4_0.gguf", Q.Q4_0)
    return from_file(file, Compression("gguf"), tiny_dir / "gguf-graph" / "from-file", library)


@pytest.mark.parametrize("kernels", KERNELS)
def test_an_engine_on_a_pair_prepared_from_the_files_answers_best_as_autoregressive(
    gguf_target, int4_draft, library, kernels
):
    """The target in its file's blocks, the draft in int4, both from their files, on either kernels:
    greedy ``best`` is the target's own answer token for token."""
    target = gguf_target
    engine = Engine(
        target,
        int4_draft,
        Settings(
            config=EXACT_CONFIG,
            kernels=kernels,
            library=library,
            prompt_reader="gemm" if kernels == "ggml" else "f32",
            pacing=Pacing(),
        ),
    )
    messages = ({"role": "user", "content": " ".join(f"def f{i}(x): return x + {i}" for i in range(6))},)
    answers = {
        mode: engine.run(Request(messages, mode=mode, max_new_tokens=16, reuse_cache=False))
        for mode in ("autoregressive", "best", "speculative")
    }
    engine.close()
    assert all(answer.kind == "done" for answer in answers.values())
    assert answers["best"].token_ids == answers["speculative"].token_ids == answers["autoregressive"].token_ids
    assert answers["speculative"].metrics["drafted"] > 0  # (the draft's proposals were verified)
    assert engine.target.kernels == kernels


def test_a_model_the_graphs_do_not_build_is_prepared_through_the_export_and_says_why(
    qwen2_file, tiny_dir, library, monkeypatch
):
    scaled = copy_gguf(
        qwen2_file,
        tiny_dir / "gguf-graph" / "scaled-rope.gguf",
        metadata={"qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)},
    )
    said: list[str] = []
    monkeypatch.setattr(prepare, "log", said.append)
    entry = prepare_one(str(scaled), Compression("gguf"), tiny_dir / "gguf-graph" / "fallback").path
    assert read_manifest(entry)["graph"] == prepare.EXPORTED  # type: ignore[index]
    assert any("RoPE scaling is not built from the file: prepared through transformers" in line for line in said)
    assert any("dequantizing GGUF" in line for line in said)
    ggml_ir.write(entry, scaled, library, said.append)
    assert (entry / GGML_XML).exists() and any("linear layers on ggml's kernels: " in line for line in said)
