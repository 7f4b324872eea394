"""Prompt readers: what reads runs of prompt text into the target's cache in large passes, other
than the decoding request's own plain passes.

The decoding request is stateful: its KV cache lives in the plugin's states. For a pass of many
rows over such a cache, the CPU plugin fuses the cache's concat into attention and then runs its
one-token attention kernel row by row (``scaled_attn.cpp``: ``use_one_token = L1 == 1 ||
(fuse_concat && L0 > 0)``), which slows a long prompt's reading more the further it gets. The
reader is the same IR made stateless (every state an input and an output): its attention runs the
multi-row kernel (MLAS sgemm in f32, oneDNN brgemm in bf16, AMX where the CPU has it). It reads
from the decoding request's states and writes its output back into them; decoding, verifying and
every answer token stay on the stateful f32 path. On ggml's kernels the target's own passes with
ggml's batched kernels switched on read prompts too (:class:`GemmReader`): no second model and no
copies.

The reader's rows round differently from the stateful path's, and with where its passes start and
end. So where each pass starts and ends, and which path reads which token, is a function of the
conversation alone (:mod:`engine.core.reading`): an answer is the same whatever the cache held before
(docs/design.md, "The prompt reader").
"""

from __future__ import annotations

import abc
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import openvino as ov
from openvino._offline_transformations import stateful_to_stateless_transformation

from engine import ggml
from engine.core import graph
from engine.core.reading import READ_PASS, SHORTEST_RUN, ReadPass, ReadPath
from engine.core.runtime import ON_GGML, Runtime
from engine.ggml import GEMM, GEMM_INPUT

# What a reader's pass grows the process by, per byte of the cache it reads into: its output (a
# copy of the cache), the past concatenated in each layer and its scratch; measured reading a
# long paste, with the target's own passes' growth taken off (docs/benchmarks.md, "The prompt reader").
RESIDENT_PER_READ_BYTE = 6
# How an engine reads prompts: timed at start, a stateless reader on the plugin's kernels in one
# precision, the target's own passes with ggml's batched kernels, or none.
READERS = ("auto", "f32", "bf16", "gemm", "off")
# Where the reader's speed is timed at start: one pass of READ_PASS tokens after this many (a
# narrower pass than it reads would favour the target's own: docs/benchmarks.md, "The prompt reader").
PROBE_CONTEXT = 1024
# The shortest run a reader on ggml's kernels reads: from 16 tokens it read faster than the
# target's own passes, into an empty cache and after 1,024 tokens (docs/benchmarks.md, "The GGUF's
# own kernels"); elsewhere a reader reads runs of SHORTEST_RUN or more.
SHORT_RUN = 16
# Reader names (PromptReader.name): the target's own passes with ggml's batched kernels, and what a
# stateless reader on the target's graph with ggml's kernels adds to its precision.
GEMM_READER, SHARED = "gemm", " on the target's graph"
log = logging.getLogger("specchat.reader")


def read_pass(runtime: Runtime, reader: PromptReader | None, tokens: Sequence[int], part: ReadPass, chunk: int) -> None:
    """One pass of ``part`` of a plan into ``runtime``'s cache (which holds ``tokens`` up to where
    the part starts, or further into a part of the decoding path's, which it reads in chunks)."""
    held = len(runtime.tokens)
    if part.path is ReadPath.READER:
        assert reader is not None and held == part.start
        reader.read(runtime, tokens[: part.stop], part)
    else:
        runtime.forward(tokens[held : min(part.stop, held + chunk)])


class PromptReader(abc.ABC):
    """Reads runs of prompt text into the target's cache, in the passes of a plan."""

    label: str
    # What :func:`named_reader` makes it again from (a start keeps the reader it timed fastest).
    name: str
    # What a pass grows the process by, per byte of the cache it reads into.
    resident_per_read_byte: int

    def __init__(self, on_ggml: bool) -> None:
        # The shortest run of prompt text it reads (engine.core.reading.read_plan); a shorter one
        # is the target's own plain passes'. On ggml's kernels those cost more per row the wider
        # they are, so a reader there reads short runs too. (A rule, not a timing: replicas that
        # take over each other's conversations must read them alike.)
        self.shortest = SHORT_RUN if on_ggml else SHORTEST_RUN

    @abc.abstractmethod
    def read(self, runtime: Runtime, tokens: Sequence[int], origin: ReadPass | None = None) -> None:
        """Append ``tokens[len(runtime.tokens):]`` to ``runtime``'s cache in one pass; its entries
        are recorded as written by ``origin`` (None: a pass outside any plan)."""

    def warm_up(self, runtime: Runtime) -> None:
        """One pass into ``runtime``'s empty cache, left empty after: the plugin sets up the shape
        (and, for a :class:`Reader` on its kernels, lays out a copy of the weights, which the
        engine's budget then counts)."""
        self.read(runtime, [0] * READ_PASS)
        runtime.release()


class GemmReader(PromptReader):
    """Reads with the target's own passes on ggml's kernels, their batched kernels on (engine.ggml.GEMM_INPUT):
    no second model, no copy of the weights or of the cache. Its attention is the target's
    (row by row over a past, slower the longer the context than a stateless reader's)."""

    resident_per_read_byte = 0  # (its passes grow the process as the target's own do)

    def __init__(self, library: Path) -> None:
        """``library``: the op's, which multiplies a prompt pass through the AMX tiles where the CPU has them."""
        super().__init__(on_ggml=True)
        kernels = "the AMX tiles in bf16" if ggml.prompt_tiles(library) else "ggml's batched kernels"
        self.label = f"the target's own passes, {kernels}"
        self.name = GEMM_READER

    def warm_up(self, runtime: Runtime) -> None:
        """Nothing to lay out: its first pass costs what later ones do (a 256-token pass on the
        default target, AVX2 EPYC: 5.2 s first, 5.1 s after), and what a pass grows the process
        by is a pass's activations (engine.core.budget.HEADROOM). A start skips the pass it would
        cost (docs/operations.md, "Start")."""

    def read(self, runtime: Runtime, tokens: Sequence[int], origin: ReadPass | None = None) -> None:
        past = len(runtime.tokens)
        runtime.forward(tokens[past:], gemm=True)
        runtime.origins[past:] = [origin] * (len(tokens) - past)


class Reader(PromptReader):
    """The target's IR compiled stateless, in ``precision``, last-row logits only."""

    resident_per_read_byte = RESIDENT_PER_READ_BYTE

    def __init__(
        self, ir_dir: Path, config: dict, precision: str, core: ov.Core | None = None, on: Runtime | None = None
    ):
        """``on``: a target on ggml's kernels, whose graph the reader reads on with ggml's batched kernels
        (engine.ggml.GEMM_INPUT), its weights shared, in memory once; else the IR on the plugin's
        kernels (which lay out a copy of them)."""
        core = core or ov.Core()
        shared = on.model if on is not None else None
        if shared is not None:
            model = shared.clone()  # (its passes set GEMM_INPUT)
            self.label = precision + ON_GGML
            self.name = precision + SHARED
        else:
            model = core.read_model(Path(ir_dir) / "openvino_model.xml")
            graph.slice_logits(model)
            self.label = self.name = precision
        stateful_to_stateless_transformation(model)
        super().__init__(on_ggml=shared is not None)
        self.compiled = core.compile_model(model, "CPU", {**config, "INFERENCE_PRECISION_HINT": precision})
        self._inputs = {i.get_any_name() for i in model.inputs}
        self._outputs = [o.get_any_name() for o in model.outputs if o.get_any_name() != "logits"]

    def read(self, runtime: Runtime, tokens: Sequence[int], origin: ReadPass | None = None) -> None:
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
        if GEMM_INPUT in self._inputs:
            feed[GEMM_INPUT] = np.array([GEMM], dtype=np.int64)
        pairs = [(state, *self._names(state.name)) for state in states]
        for state, name, _ in pairs:
            feed[name] = state.state if past else ov.Tensor(runtime.empty_state)
        request = self.compiled.create_infer_request()  # (its outputs, a copy of the cache, go with it)
        request.infer(feed)
        for state, _, output in pairs:
            state.state = request.get_tensor(output)
        runtime.hold_loaded(tokens, [*runtime.origins, *[origin] * (len(tokens) - past)])

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


def fastest_reader(
    target: Runtime, core: ov.Core | None = None, plugin: bool = True, stateless: bool = True
) -> PromptReader | None:
    """The reader that reads fastest here, or None where the target's own passes read as fast.
    Where the target runs ggml's kernels: its own passes with their gemm (:class:`GemmReader`)
    and, where ``stateless`` (the budget holds the copies of the cache its passes make), a
    :class:`Reader` on the same graph in each precision. Where ``plugin`` (the budget holds their
    copy of the weights too), a :class:`Reader` on the plugin's kernels in each precision. Each is
    timed at start over one pass of :data:`~engine.core.reading.READ_PASS` tokens after
    :data:`PROBE_CONTEXT` (the gain grows with the context), and logged. The target's cache is
    left empty. A target whose cache the op keeps has no states for a stateless reader to read
    and write: only its own passes read there."""
    core = core or ov.Core()
    plugin, stateless = (plugin, stateless) if target.own is None else (False, False)
    context = min(PROBE_CONTEXT, target.max_context - READ_PASS)
    tokens = [0] * (context + READ_PASS)

    def timed(read: Callable[[], object]) -> float:
        target.fill(context)
        start = time.perf_counter()
        read()
        seconds = time.perf_counter() - start
        target.release()
        return seconds

    def candidates() -> Iterator[PromptReader]:
        if target.library is not None:
            yield GemmReader(target.library)
        stateless_on_ggml = target.library is not None and stateless
        for precision, on in itertools.product(precisions(core), [None] * plugin + [target] * stateless_on_ggml):
            yield Reader(target.ir_dir, target.config, precision, core, on)

    target.forward(tokens[:READ_PASS])  # (the first pass of a shape sets it up)
    own = timed(lambda: target.forward(tokens[context:]))
    best: tuple[float, PromptReader | None] = (own, None)
    for reader in candidates():
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
    chosen = best[1]
    log.info(
        "prompt reader: %s",
        f"{chosen.label}, for runs of {chosen.shortest} tokens or more" if chosen else "none (no faster here)",
    )
    return chosen


def named_reader(
    name: str, target: Runtime, core: ov.Core | None = None, plugin: bool = True, stateless: bool = True
) -> PromptReader | None:
    """The reader :func:`fastest_reader` chose at an earlier start (its ``name``, or "off"), made and
    warmed up again without timing; None where it was none, or where it no longer fits (this
    start's target on other kernels, or a budget that no longer holds it: ``plugin`` and
    ``stateless`` as there)."""
    plugin, stateless = (plugin, stateless) if target.own is None else (False, False)
    if name == GEMM_READER:
        reader: PromptReader | None = GemmReader(target.library) if target.library is not None else None
    elif name.removesuffix(SHARED) in precisions(core or ov.Core()):
        shared = name.endswith(SHARED)
        fits = (target.library is not None and stateless) if shared else plugin
        reader = (
            Reader(target.ir_dir, target.config, name.removesuffix(SHARED), core, target if shared else None)
            if fits
            else None
        )
    else:
        reader = None
    if reader is not None:
        reader.warm_up(target)
    log.info("prompt reader: %s (as timed at an earlier start)", reader.label if reader else "none")
    return reader
