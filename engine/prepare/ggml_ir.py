"""A prepared model's graph with ggml's kernels: every linear layer and the head whose weight the
GGUF holds become GgmlLinear nodes on the file's own rows (engine.ggml), stored once in the
graph's weights. The rest of the graph (attention over the stateful KV cache, RoPE, norms, the
embedding gather) stays OpenVINO's. Written beside the model's graph on the plugin's kernels, once
per model: built from the file (engine.prepare.gguf_graph) where that graph was, else rewritten
from the IR optimum-intel exported.

A model prepared in int4 (the draft's default) is given 4-bit rows (engine.prepare.four_bit)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import openvino as ov

from engine import ggml, manifest
from engine.errors import EngineError
from engine.ggml import GGML_XML
from engine.prepare import disk, gguf_blocks, gguf_graph, kernels, sources
from engine.prepare.four_bit import in_four_bits
from engine.prepare.gguf_file import open_gguf
from engine.prepare.phases import phase
from engine.prepare.pipeline import PreparedModel, local_source, log
from engine.prepare.sources import Kind


def rewrite(model: ov.Model, reader: gguf.GGUFReader, library: Path, four_bit: bool = False) -> Counter[str]:
    """Replace ``model``'s linear layers by the op on ``reader``'s rows in place, those that read
    the same input (a layer's q, k and v; its gate and up) in one node; count what was done by
    type. A layer whose rows the file does not hold in that shape keeps its weight. ``four_bit``:
    rows in 4-bit blocks (engine.prepare.four_bit)."""
    tensors = {t.name: t for t in reader.tensors}
    heads = gguf_blocks.permuted_heads(reader)
    done: Counter[str] = Counter()
    by_input: dict[tuple[str, int], list[tuple[ov.Node, np.ndarray, int]]] = {}
    for node in [n for n in model.get_ordered_ops() if n.get_type_name() == "MatMul"]:
        attributes = node.get_attributes()
        weight = node.get_friendly_name().split("/")[0] + ".weight"  # (the export names it by module)
        name = gguf_blocks.gguf_name(weight)
        if name is None or attributes["transpose_a"] or not attributes["transpose_b"]:
            continue
        tensor = tensors.get(name) or (tensors.get("token_embd.weight") if name == "output.weight" else None)
        shape = node.get_input_partial_shape(1)
        if tensor is None or shape.is_dynamic or [d.get_length() for d in shape] != [tensor.shape[1], tensor.shape[0]]:
            done["kept (not in the file)"] += 1
            continue
        rows, kind = np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1), int(tensor.tensor_type)
        if four_bit:
            rows, requantized = in_four_bits(rows, kind)
            if requantized != kind:
                done[f"{gguf.GGMLQuantizationType(kind).name} requantized"] += 1
                kind = requantized
        order = gguf_blocks.unpermute(weight, rows.shape[0], heads)
        if order is not None:
            rows = rows[order]
        source = node.input_value(0)
        by_input.setdefault((source.get_node().get_name(), source.get_index()), []).append((node, rows, kind))
    gemm = ggml.gemm_input()
    model.add_parameters([gemm])
    for group in by_input.values():
        weights = [(rows, kind) for _, rows, kind in group]
        outputs = ggml.linears(group[0][0].input_value(0), weights, library, gemm=gemm.output(0))
        interleaved = outputs[0].get_node().get_attributes()["interleaved"]
        for (node, _, kind), output, grouped in zip(group, outputs, interleaved):
            node.output(0).replace(output)
            done[gguf.GGMLQuantizationType(kind).name + (" interleaved" if grouped else "")] += 1
    done["nodes"] = len(by_input)
    model.validate_nodes_and_infer_types()
    return done


def built_from_file(ir: Path) -> bool:
    """Whether the model in ``ir`` was prepared by building its graph from the file."""
    return (manifest.read(ir) or {}).get("graph") == gguf_graph.FROM_FILE


def write(ir: Path, gguf_path: Path, library: Path, log: Callable[[str], None], four_bit: bool = False) -> Path:
    """``ir``'s graph with ggml's kernels, written beside it once (under the entry's lock): built
    from ``gguf_path`` as the plugin's graph was, else rewritten from the exported IR;
    ``four_bit``: in 4-bit rows (:func:`rewrite`)."""
    xml = ir / GGML_XML
    if xml.exists():
        return xml
    with disk.exclusive(ir, "ggml", log) as scratch, phase("graph"):
        if xml.exists():
            return xml
        if built_from_file(ir):
            model = gguf_graph.build(gguf_path, library, four_bit, log)
        else:
            model = ov.Core().read_model(ir / "openvino_model.xml")
            done = rewrite(model, open_gguf(gguf_path), library, four_bit)
            counts = ", ".join(f"{n} {k}" for k, n in sorted(done.items()))
            log(f"{ir.name}: linear layers on ggml's kernels: {counts}")
        ov.save_model(model, scratch / GGML_XML, compress_to_fp16=False)
        del model
        (scratch / GGML_XML).with_suffix(".bin").replace(xml.with_suffix(".bin"))
        (scratch / GGML_XML).replace(xml)
        for stale in ir.glob("openvino_model_ggml*.*"):  # (the graph's earlier forms)
            if stale.stem != xml.stem:
                stale.unlink()
    return xml


def for_model(model: PreparedModel, cache_dir: Path) -> Path | None:
    """The op's library where ``model`` came from a GGUF and its ggml graph is written (building
    both on first use), else None: a model from a Hugging Face folder or an IR has no blocks of
    its own to run."""
    source = sources.resolve(model.source)
    if source.kind not in (Kind.GGUF, Kind.EMBEDDED):
        return None
    library = kernels.library(cache_dir, log)
    if (model.path / GGML_XML).exists():  # (written already: the file need not be at hand)
        return library
    write(model.path, local_source(source, cache_dir).local, library, log, four_bit=model.precision == "int4")
    return library


@contextmanager
def built_meanwhile(specs: Iterable[str], cache_dir: Path) -> Iterator[None]:
    """The op's library built on a thread while the block runs (the models' downloads leave the
    cores idle), where one of the models named by ``specs`` comes from a GGUF; a build that fails
    says so where the library is asked for (:func:`for_models`)."""
    try:
        from_gguf = any(sources.resolve(spec).kind in (Kind.GGUF, Kind.EMBEDDED) for spec in specs)
    except EngineError:  # (the preparation says what is wrong with the spec)
        from_gguf = False
    if not from_gguf:
        yield
        return
    with ThreadPoolExecutor(1, thread_name_prefix="kernels") as pool:
        pool.submit(kernels.library, cache_dir, log)
        yield


def for_models(models: tuple[PreparedModel, ...], cache_dir: Path, required: bool = False) -> Path | None:
    """The op's library, with each of ``models`` from a GGUF given its graph on it (:func:`for_model`);
    None where none came from a GGUF. Where it cannot be built: an error if ``required``, else a
    warning, and the plugin's kernels run."""
    try:
        found = [for_model(model, cache_dir) for model in models]
    except EngineError as exc:
        if required:
            raise
        logging.getLogger("specchat.prepare").warning(f"ggml's kernels are not available ({exc}): the plugin's run")
        return None
    return next((library for library in found if library is not None), None)
