"""Where a plain decode step's time goes, ours against llama.cpp's, against the memory bandwidth.

    python -m benchmarks.decode_profile [--steps 64] [--rounds 3] [--json OUT] [--table OUT]

A decode step on a memory-bound CPU reads every weight once, so its floor is the weight bytes over
the machine's read bandwidth. For our target (a raw ``Runtime`` with the engine's settings, on each
kernels it runs: the plugin's; ggml's where it came from a GGUF, with 8-bit activations and, where
the CPU has AVX-512 VNNI, 14-bit ones) and for plain llama.cpp on the GGUF it was made from, both on
every core, this prints the time per token after a chat prompt, the weight bytes a step reads (every
weight but the embedding table, of which a step gathers one row), the bandwidth that makes and its
share of the machine's: numpy sums over 1 GiB on as many threads as cores. Our step is then taken
apart with the plugin's per-node counters (``PERF_COUNT``), summed by node type; what the counters
do not cover is the time outside the graph (the Python loop, the plugin's per-call work); the
counters may overlap, so their sum is printed beside the step's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import openvino as ov

from benchmarks import llamacpp
from benchmarks.bench import load_prompts
from benchmarks.report import add_output_arguments, write_text
from engine import ggml
from engine.cli import CODING_PROMPTS, run_cli
from engine.core import chat, graph
from engine.core.budget import GIB
from engine.core.runtime import TARGET_CONFIG, Runtime
from engine.core.tokenizer import load_tokenizer
from engine.ggml import GGML_XML
from engine.prepare import ggml_ir
from engine.prepare.pipeline import PreparedModel, add_model_arguments, cache_dir_from_args, prepare_from_args
from engine.report import Column, markdown_table

Kernels = tuple[Path | None, int]  # the op's library (None: the plugin's kernels), activation bits
COLUMNS = [
    Column("engine", "engine"),
    Column("ms per token", "ms_per_token", "{:.1f}"),
    Column("tokens/s", "tokens_per_s", "{:.1f}"),
    Column("weight MB per token", "weight_mb", "{:.0f}"),
    Column("GB/s achieved", "gb_per_s", "{:.1f}"),
    Column("share of the machine's read bandwidth", "bandwidth_share", "{:.0%}"),
    Column("speed against llama.cpp (median of rounds)", "vs_llamacpp", "{:.2f}x"),
    Column("range over rounds", "vs_llamacpp_range"),
]
PROFILE_COLUMNS = [
    Column("node type", "node_type"),
    Column("ms per step", "ms", "{:.2f}"),
    Column("share of the counted time", "share", "{:.0%}"),
]


def read_bandwidth(threads: int, size: int = GIB, repeats: int = 5) -> float:
    """Bytes per second read by ``threads`` numpy sums over ``size`` bytes (best of ``repeats``)."""
    parts = [np.ones(size // 4 // threads, dtype=np.float32) for _ in range(threads)]
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]  # numpy sums without the GIL
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return sum(p.nbytes for p in parts) / best


def _constants_under(node: ov.Node) -> dict[str, int]:
    """The constants ``node`` is computed from: their bytes by name (a node's Python wrappers do
    not compare equal, its name does)."""
    found, pending, seen = {}, [node], {node.get_name()}
    while pending:
        current = pending.pop()
        if current.get_type_name() == "Constant":
            found[current.get_name()] = current.get_byte_size()
        for port in current.inputs():
            source = port.get_source_output().get_node()
            if source.get_name() not in seen:
                seen.add(source.get_name())
                pending.append(source)
    return found


def _reads_input_ids(output: ov.Output, depth: int = 4) -> bool:
    node = output.get_node()
    for _ in range(depth):
        if node.get_friendly_name() == "input_ids":
            return True
        if not node.inputs():
            return False
        node = node.input_value(0).get_node()
    return False


def ir_weight_bytes(ir_dir: Path, library: Path | None = None) -> int:
    """Bytes of the IR's constants a decode step reads: all but the embedding table's (unless
    the vocabulary projection shares it); ``library``: of its graph on ggml's kernels."""
    core = ov.Core()
    if library is not None:
        ggml.register(core, library)
    model = core.read_model(ir_dir / (GGML_XML if library is not None else "openvino_model.xml"))
    constants = {op.get_name(): op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant"}
    gathers = [op for op in model.get_ops() if op.get_type_name() == "Gather" and _reads_input_ids(op.input_value(1))]
    embedding = {name for g in gathers for name in _constants_under(g.input_value(0).get_node())}
    embedding -= set(_constants_under(graph.head_weight(model).get_source_output().get_node()))  # its weights
    return sum(size for name, size in constants.items() if name not in embedding)


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: all but the embedding table, which
    llama.cpp reads whole only when it doubles as the output projection."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def timed_steps(runtime: Runtime, prompt: list[int], steps: int, after_step=lambda: None) -> list[float]:
    """Seconds of each of ``steps`` greedy single-token steps after ``prompt``."""
    runtime.warm_up()
    logits = runtime.forward(prompt)[-1]
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = runtime.forward([int(logits.argmax())])[-1]
        seconds.append(time.perf_counter() - start)
        after_step()
    return seconds


def kernel_variants(target: PreparedModel, cache_dir: Path) -> list[Kernels]:
    """Each kernels our target can run on: the plugin's, and ggml's where it came from a GGUF, in
    8-bit activations and in 14 where the CPU can."""
    library = ggml_ir.for_model(target, cache_dir)
    if library is None:
        return [(None, 8)]
    return [(None, 8), (library, 8), *([(library, 14)] if ggml.fine_activations(library) else [])]


def target_runtime(target: Path, kernels: Kernels, config: dict = TARGET_CONFIG) -> Runtime:
    library, bits = kernels
    return Runtime(target, config=config, first_token_alone=True, kernels=library, activations=bits)


def node_profile(target: Path, prompt: list[int], steps: int, kernels: Kernels) -> tuple[list[dict], float]:
    """Our step's time by node type (the plugin's counters; types under 1% of them together as
    "other"; the op on ggml's kernels is a "Reference" node), and the step's wall time, both in
    ms per step."""
    runtime = target_runtime(target, kernels, {**TARGET_CONFIG, "PERF_COUNT": True})
    by_type: dict[str, float] = defaultdict(float)

    def tally() -> None:
        for info in runtime.pass_request(1).profiling_info:
            by_type[info.node_type] += info.real_time.total_seconds()

    wall = sum(timed_steps(runtime, prompt, steps, tally))
    counted = sum(by_type.values())
    rows, other = [], 0.0
    for node_type, seconds in sorted(by_type.items(), key=lambda kv: -kv[1]):
        if seconds >= 0.01 * counted:
            rows.append({"node_type": node_type, "ms": 1000 * seconds / steps, "share": seconds / counted})
        else:
            other += seconds
    rows.append({"node_type": "other", "ms": 1000 * other / steps, "share": other / counted})
    return rows, 1000 * wall / steps


def profile(args: argparse.Namespace) -> None:
    threads = os.cpu_count() or 1
    target, _ = prepare_from_args(args)
    question = load_prompts(CODING_PROMPTS)[0][1]
    prompt = chat.prompt_ids(load_tokenizer(target.path), [{"role": "user", "content": question}])
    limit = read_bandwidth(threads)
    cache_dir = cache_dir_from_args(args)
    # Each kernels our target can run on, timed without the counters (they cost time of their own;
    # the profiled runs come after), in rounds that alternate with llama.cpp's: this VM's speed
    # drifts within minutes, so each round's ratio is taken within the round, and the medians over
    # rounds are reported.
    variants = kernel_variants(target, cache_dir)
    runtimes = {kernels: target_runtime(target.path, kernels) for kernels in variants}
    gguf = llamacpp.gguf_file(args.target, cache_dir)
    peer = llamacpp.LlamaCppPeer(llamacpp.server_binary(cache_dir), gguf, threads=threads)
    ours: dict[Kernels, list[float]] = {kernels: [] for kernels in variants}
    rounds: list[float] = []  # llama.cpp's per round
    try:
        peer.run(prompt, args.steps, None)  # its warm-up
        for _ in range(args.rounds):
            for kernels, runtime in runtimes.items():
                runtime.reset()
                ours[kernels].append(statistics.median(timed_steps(runtime, prompt, args.steps)))
            peer.run(prompt, args.steps, None)
            rounds.append(peer.timings["predicted_per_token_ms"] / 1000)
    finally:
        peer.close()
    labels = {kernels: runtime.label for kernels, runtime in runtimes.items()}
    del runtimes
    rows = []
    graph_bytes = {library: ir_weight_bytes(target.path, library) for library, _ in variants}  # (once per graph)
    measured = [
        (f"ours ({labels[kernels]})", per_round, graph_bytes[kernels[0]]) for kernels, per_round in ours.items()
    ]
    for name, per_round, weights in [*measured, ("llama.cpp (Q4_K_M GGUF)", rounds, gguf_weight_bytes(gguf))]:
        seconds = statistics.median(per_round)
        ratios = [t / s for t, s in zip(rounds, per_round, strict=True)]
        rows.append(
            {
                "engine": name,
                "ms_per_token": 1000 * seconds,
                "tokens_per_s": 1 / seconds,
                "weight_mb": weights / 1e6,
                "gb_per_s": weights / seconds / 1e9,
                "bandwidth_share": weights / seconds / limit,
                "vs_llamacpp": statistics.median(ratios),
                "vs_llamacpp_range": f"{min(ratios):.2f}–{max(ratios):.2f}",
            }
        )
    text = f"Read bandwidth: {limit / 1e9:.1f} GB/s ({threads} threads)\n\n{markdown_table(rows, COLUMNS)}"
    profiles = {}
    for kernels, label in labels.items():
        by_node, step_ms = node_profile(target.path, prompt, args.steps, kernels)
        profiles[label] = {"profile": by_node, "step_ms": step_ms}
        text += (
            f"\n\nOur step ({label}) by node type, the plugin's counters ({args.steps} steps; they add up to "
            f"{sum(r['ms'] for r in by_node):.1f} ms of a {step_ms:.1f} ms step):\n\n"
            + markdown_table(by_node, PROFILE_COLUMNS)
        )
    print(text)
    write_text(args.table, text + "\n")
    figures = {"bandwidth": limit, "rows": rows, "profiles": profiles}
    write_text(args.json, json.dumps(figures, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_profile", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating ours and llama.cpp's")
    add_output_arguments(parser)
    return run_cli(lambda: profile(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
