"""The prompt reader: a second compiled model of the target that reads prompt text in large passes
and hands the resulting cache to the decoding request.

The decoding request is stateful: its KV cache lives in the plugin's states. For a pass of many
rows over such a cache, the CPU plugin fuses the cache's concat into attention and then runs its
one-token attention kernel row by row (``scaled_attn.cpp``: ``use_one_token = L1 == 1 ||
(fuse_concat && L0 > 0)``), which slows a long prompt's reading more the further it gets. The
reader is the same IR made stateless (every state an input and an output): its attention runs the
multi-row kernel (MLAS sgemm in f32, oneDNN brgemm in bf16, AMX where the CPU has it). It reads
from the decoding request's states and writes its output back into them; decoding, verifying and
every answer token stay on the stateful f32 path.

The reader's rows round differently from the stateful path's, and with where its passes start and
end. So where each pass starts and ends, and which path reads which token, is a function of the
conversation alone (:mod:`engine.core.reading`): an answer is the same whatever the cache held before
(docs/design.md, "The prompt reader").
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import openvino as ov
from openvino._offline_transformations import stateful_to_stateless_transformation

from engine import ggml
from engine.core import graph
from engine.core.reading import READ_PASS, ReadPass, ReadPath
from engine.core.runtime import Runtime
from engine.ggml import GGML_XML

# What a reader's pass grows the process by, per byte of the cache it reads into: its output (a
# copy of the cache), the past concatenated in each layer and its scratch; measured reading a
# long paste, with the target's own passes' growth taken off (docs/benchmarks.md, "The prompt reader").
RESIDENT_PER_READ_BYTE = 6
# How an engine reads prompts: timed at start, a reader in one precision, or none.
READERS = ("auto", "f32", "bf16", "off")
# Where the reader's speed is timed at start: one pass of READ_PASS tokens after this many (a
# narrower pass than it reads would favour the target's own: docs/benchmarks.md, "The prompt reader").
PROBE_CONTEXT = 1024
log = logging.getLogger("specchat.reader")


def read_pass(runtime: Runtime, reader: Reader | None, tokens: Sequence[int], part: ReadPass, chunk: int) -> None:
    """One pass of ``part`` of a plan into ``runtime``'s cache (which holds ``tokens`` up to where
    the part starts, or further into a part of the decoding path's, which it reads in chunks)."""
    held = len(runtime.tokens)
    if part.path is ReadPath.READER:
        assert reader is not None and held == part.start
        reader.read(runtime, tokens[: part.stop], part)
    else:
        runtime.forward(tokens[held : min(part.stop, held + chunk)])


class Reader:
    """The target's IR compiled stateless, in ``precision``, last-row logits only."""

    def __init__(
        self, ir_dir: Path, config: dict, precision: str, core: ov.Core | None = None, library: Path | None = None
    ):
        """``library``: the GgmlLinear op's (engine.prepare.kernels), to read on the graph whose
        linear layers run ggml's kernels, with its gemm (engine.ggml.with_gemm); else the plugin's."""
        core = core or ov.Core()
        xml = Path(ir_dir) / "openvino_model.xml"
        if library is not None:
            ggml.register(core, library)
            xml = xml.with_name(GGML_XML)
        model = core.read_model(xml)
        if library is not None:
            ggml.with_gemm(model, library)
        graph.slice_logits(model)
        stateful_to_stateless_transformation(model)
        self.label = precision + (" · ggml kernels" if library is not None else "")
        self.compiled = core.compile_model(model, "CPU", {**config, "INFERENCE_PRECISION_HINT": precision})
        self._inputs = {i.get_any_name() for i in model.inputs}
        self._outputs = [o.get_any_name() for o in model.outputs if o.get_any_name() != "logits"]

    def read(self, runtime: Runtime, tokens: Sequence[int], origin: ReadPass | None = None) -> None:
        """Append ``tokens[len(runtime.tokens):]`` to ``runtime``'s cache in one pass; its entries
        are recorded as written by ``origin`` (None: a pass outside any plan)."""
        past = len(runtime.tokens)
        if runtime.slots != past:
            raise ValueError("the reader needs a cache without masked entries")
        states = runtime.request.query_state()
        feed: dict[str, object] = {
            "input_ids": np.asarray([tokens[past:]], dtype=np.int64),
            "attention_mask": np.ones((1, len(tokens)), dtype=np.int64),
            "position_ids": np.arange(past, len(tokens), dtype=np.int64)[None],
            "logits_to_keep": np.array([1], dtype=np.int64),
        }
        pairs = [(state, *self._names(state.name)) for state in states]
        for state, name, _ in pairs:
            feed[name] = state.state if past else ov.Tensor(runtime.empty_state)
        request = self.compiled.create_infer_request()  # (its outputs, a copy of the cache, go with it)
        request.infer(feed)
        for state, _, output in pairs:
            state.state = request.get_tensor(output)
        runtime.hold_loaded(tokens, [*runtime.origins, *[origin] * (len(tokens) - past)])

    def warm_up(self, runtime: Runtime) -> None:
        """One pass into ``runtime``'s empty cache, left empty after: the plugin sets up the shape
        and lays out its weights for it (a copy of its own: the process grows by about the
        target's size again, which the engine's budget then counts)."""
        self.read(runtime, [0] * READ_PASS)
        runtime.release()

    def _names(self, state: str) -> tuple[str, str]:
        """The input and the output a state became (its variable is named after both)."""
        for output in self._outputs:
            if state.endswith(output) and state[: -len(output)] in self._inputs:
                return state[: -len(output)], output
        raise ValueError(f"state {state} has no input and output in the reader")


def precisions(core: ov.Core) -> list[str]:
    """The compute precisions the reader may run in on this CPU."""
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return ["f32"] + (["bf16"] if "BF16" in capabilities else [])


def fastest_reader(target: Runtime, core: ov.Core | None = None) -> Reader | None:
    """The reader that reads fastest here, or None where the target's own passes read as fast:
    one in each precision on the plugin's kernels and, where the target runs ggml's, on those
    with their gemm. Each is timed at start over one pass of
    :data:`~engine.core.reading.READ_PASS` tokens after :data:`PROBE_CONTEXT` (the gain grows
    with the context), and logged. The target's cache is left empty."""
    core = core or ov.Core()
    context = min(PROBE_CONTEXT, target.max_context - READ_PASS)
    tokens = [0] * (context + READ_PASS)

    def timed(read: Callable[[], object]) -> float:
        target.fill(context)
        start = time.perf_counter()
        read()
        seconds = time.perf_counter() - start
        target.release()
        return seconds

    target.forward(tokens[:READ_PASS])  # (the first pass of a shape sets it up)
    own = timed(lambda: target.forward(tokens[context:]))
    best: tuple[float, Reader | None] = (own, None)
    libraries = [None] if target.library is None else [None, target.library]
    for precision, library in itertools.product(precisions(core), libraries):
        reader = Reader(target.ir_dir, target.config, precision, core, library)
        reader.warm_up(target)
        seconds = timed(functools.partial(reader.read, target, tokens))
        log.info(
            "prompt reader %s: %.2f s for %d tokens after %d, the target's own passes %.2f s",
            reader.label,
            seconds,
            READ_PASS,
            context,
            own,
        )
        if seconds < best[0]:
            best = (seconds, reader)
        del reader  # (a slower one's weights go before the next is laid out)
    log.info("prompt reader: %s", best[1].label if best[1] else "none (no faster here)")
    return best[1]
