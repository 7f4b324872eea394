"""A lean wrapper over one OpenVINO ``InferRequest`` on a stateful causal-LM IR.

The request's states are the KV cache. ``tokens`` mirrors what they hold, so any
call can reuse the longest cached prefix and roll back the rest by trimming the
states: nothing already computed is computed again.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openvino as ov

from engine import ggml, manifest
from engine.core import graph, hugepages
from engine.core.draft_vocab import Ids
from engine.core.kv_cache import OwnCache
from engine.core.reading import ReadPass, common_prefix
from engine.errors import ContextLimitError, EngineError, PrepareError
from engine.ggml import GEMM_INPUT, GGML_XML

log = logging.getLogger("specchat.engine")

# What a label adds on ggml's kernels, and with 14-bit activations on them.
ON_GGML = " · ggml kernels"
IN_14_BITS = ", 14-bit activations"
# Bits per activation on ggml's kernels unless asked for others: llama.cpp's.
DEFAULT_ACTIVATIONS = 8
EXACT_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
# Activations are quantized for the int4 matmuls in groups matching the weights' group size:
# on this CPU that cuts a decode step by a quarter against the plugin's default of 32
# (docs/design.md, "Dynamic quantization group size").
DYNAMIC_QUANTIZATION = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 128}
# The target's default. With it, a verify pass of up to 32 tokens computes each row bit for
# bit as single-token steps do (tests/test_runtime.py; the real int4 target on AVX-512 CPUs, not
# on AVX2-only ones, where rows differ by up to 4e-5: tests/test_real_pair.py), so greedy
# speculative decoding equals autoregressive decoding exactly. The CPU default u8 KV cache
# breaks that: its per-block quantization depends on how many tokens a pass appends. With f32
# compute the plugin keeps a bf16 cache in f32 anyway (a prompt read grew the process alike with
# either, 72 KB per token: docs/benchmarks.md, "Memory"), so the cache is asked for in f32, and
# its size is counted as it is held.
TARGET_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", **DYNAMIC_QUANTIZATION}
# The draft's rounding cannot change the output, so it runs with the fastest settings measured.
# f32 compute: on an AMX machine the plugin's default bf16 made a draft step slower, and on an
# AVX-512 machine without AMX no faster (docs/benchmarks.md, "Tried and dropped").
DRAFT_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", **DYNAMIC_QUANTIZATION}
# A masked rollback compacts the cache once it holds more dropped entries than this; the
# compaction costs one ordinary trim.
MAX_MASKED = 64
# The pass widths of one row a graph whose cache the op keeps runs on copies compiled for that
# width alone (FixedShapes): a plain step, a draft's 2-token pass and a 1-token verify, and a
# verify of the paced mode's K = 4 drafts (engine.core.modes.BEST_K + 1).
FIXED_WIDTHS = (1, 2, 5)
# The inputs whose second dimension is a pass's width (the tokens and their positions).
WIDTH_INPUTS = ("input_ids", "position_ids")
# The most passes Runtime.settle runs for one width: a shape met once a pass (a model's head) is
# chosen after 60, each of the op's ten candidates called six times (a guard, not a tuning).
SETTLING_PASSES = 100


def _kv_heads(cfg: dict) -> int:
    return int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def state_tensor(entries: np.ndarray) -> ov.Tensor:
    """``entries`` as a tensor a state can be set to, without a copy of our own: the plugin copies
    what a state is set to (a batch's rebuild: docs/design.md, "Batching")."""
    return ov.Tensor(np.ascontiguousarray(entries), shared_memory=True)


def release_states(request: ov.InferRequest, empty: np.ndarray) -> None:
    """Set every state of ``request`` to ``empty`` (no entries): the plugin frees their memory
    (a ``reset_state`` keeps it)."""
    for state in request.query_state():
        state.state = ov.Tensor(empty)


def model_label(ir_dir: Path, hf_config: dict) -> str:
    """The model's name and weight precision, for people: from its manifest, else its config."""
    recorded = manifest.read(ir_dir)
    if recorded is not None:
        name = Path(str(recorded.get("source") or ir_dir)).name  # (a folder's name, not its path, for visitors)
        return f"{name} · {recorded.get('precision', '?')}"
    return Path(str(hf_config.get("_name_or_path") or ir_dir)).name


def supported_activations(bits: int | None, library: Path) -> int:
    """The bits the op in ``library`` multiplies by when ``bits`` are asked for
    (engine.ggml.ACTIVATIONS; None: 8, llama.cpp's rounding and the faster: 14 showed no functional
    gain, docs/benchmarks.md, "Activations in 14 bits"): where the CPU cannot do 14, 8, with
    a warning."""
    if bits is None:
        return DEFAULT_ACTIVATIONS
    if bits not in ggml.ACTIVATIONS:
        raise EngineError(f"activations of {bits} bits: choose one of {', '.join(map(str, ggml.ACTIVATIONS))}")
    if bits == 14 and not ggml.fine_activations(library):
        log.warning("14-bit activations take AVX-512 VNNI, which this CPU lacks: 8-bit ones, as llama.cpp's")
        return 8
    return bits


class FixedShapes:
    """Copies of a graph whose cache the op keeps, each compiled for passes of one shape (rows and
    width), every other shape fixed too: on them the plugin infers no shapes between nodes (for a
    custom op, in a graph of dynamic shapes, it wraps every input in a Constant and clones the node
    on every pass) and lays out its buffers once. A draft step took 0.74-0.8 of the dynamic
    graph's time on an AVX-512 AMD EPYC, a plain target step 0.83-0.86, their logits bit for bit
    the same (docs/benchmarks.md, "Passes of fixed shapes"). Their weights are the graph's
    constants, shared, not copied (about 10 MB of buffers a copy); the caches are the op's, so
    any copy passes over any cache. A row alone at ``widths`` is compiled on its first pass (half
    a second for the default target, as start warms them up); a batched plain step (several rows,
    one token each) is compiled in the background on its first pass, which and every pass of its
    shape until then run on the dynamic graph. Shared by a runtime's forks and its batches."""

    def __init__(self, model: ov.Model, core: ov.Core, device: str, config: dict, widths: Sequence[int]):
        self.model, self.core, self.device, self.config = model, core, device, config
        self.widths = frozenset(widths)
        self._compiled: dict[tuple[int, int], ov.CompiledModel | None] = {}  # (None: it failed)
        self._pending: dict[tuple[int, int], Future] = {}
        self._lock = threading.Lock()  # (forks on other threads may pass at a new width at once)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fixed-shapes")

    def compiled(self, width: int, rows: int = 1) -> ov.CompiledModel | None:
        """The copy for passes of ``rows`` rows ``width`` tokens wide; None where that shape has
        none (yet)."""
        shape = (rows, width)
        if rows == 1 and width in self.widths:
            with self._lock:
                if shape not in self._compiled:
                    self._compiled[shape] = self._compile(shape)
                return self._compiled[shape]
        if rows == 1 or width != 1:
            return None
        with self._lock:
            if shape not in self._compiled and shape not in self._pending:
                self._pending[shape] = self._background.submit(self._compile, shape)
            done = self._pending.get(shape)
            if done is not None and done.done():
                del self._pending[shape]
                try:
                    self._compiled[shape] = done.result()
                except Exception as exc:  # (no pass's fault: the dynamic graph serves that shape on)
                    log.warning("batched steps of %d rows: no copy of fixed shapes (%s)", rows, exc)
                    self._compiled[shape] = None
            return self._compiled.get(shape)

    def request(
        self, requests: dict[tuple[int, int], ov.InferRequest], dynamic: ov.InferRequest, width: int, rows: int = 1
    ) -> ov.InferRequest:
        """The request a pass of ``rows`` rows ``width`` tokens wide runs on: one of ``requests``
        (a cache's or a batch's own, made on first use) on the copy for that shape, else
        ``dynamic``, on the graph of dynamic shapes."""
        compiled = self.compiled(width, rows)
        if compiled is None:
            return dynamic
        if (rows, width) not in requests:
            requests[rows, width] = compiled.create_infer_request()
        return requests[rows, width]

    def _compile(self, shape: tuple[int, int]) -> ov.CompiledModel:
        fixed = self.model.clone()
        fixed.reshape({i.get_any_name(): self._shape(i, *shape) for i in fixed.inputs})
        return self.core.compile_model(fixed, self.device, self.config)

    @staticmethod
    def _shape(model_input: ov.Output, rows: int, width: int) -> ov.PartialShape:
        """``rows`` rows of ``width`` tokens: every dynamic first dimension is the rows'; other
        dimensions than the tokens' kept as they are (the attention mask, unused where the op keeps
        the cache, grows with it)."""
        if model_input.get_any_name() in WIDTH_INPUTS:
            return ov.PartialShape([rows, width])
        dims = list(model_input.get_partial_shape())
        return ov.PartialShape([ov.Dimension(rows) if dims[0].is_dynamic else dims[0], *dims[1:]])


class Runtime:
    """One model, one request, one KV cache."""

    def __init__(
        self,
        ir_dir: Path,
        device: str = "CPU",
        config: dict | None = None,
        core: ov.Core | None = None,
        kept_ids: Ids | None = None,
        masked_rollback: bool = False,
        pass_width: int = 1,
        first_token_alone: bool = False,
        kernels: Path | None = None,
        activations: int | None = None,
        fixed_widths: Sequence[int] = FIXED_WIDTHS,
    ):
        """``kept_ids``: compute logits for these token ids only (a cheaper draft head: FR-Spec's,
        engine.core.draft_vocab), most wanted first; every other id gets -inf, so a row still spans
        the whole vocabulary (:func:`engine.core.graph.keep_vocabulary`; on ggml's interleaved rows
        the first multiple of 8 of them are kept). None: every id.

        ``kernels``: the GgmlLinear op's library (engine.prepare.kernels): the IR's graph whose
        linear layers run ggml's kernels on the GGUF's own blocks is read (engine.prepare.ggml_ir)
        instead of the one the plugin's kernels run. ``activations``: on those, the bits the op's
        own Q4_K and Q6_K kernels multiply by (engine.ggml.ACTIVATIONS): 8 as llama.cpp does, or 14
        in the blocks that need them where the CPU can (else 8, with a warning), nearer the file's
        model and slightly slower; None: 8.

        ``masked_rollback``: roll back by masking the dropped entries out of attention instead of
        copying the cache. For the draft, copying every state out and back in costs about a third
        of one of its steps, and slows its next step by as much (docs/design.md, "Rollback by masking"); masking
        costs nothing, but the attention sums then run over other slots and may round
        differently. So it is for the draft, whose rounding cannot change the output. (A graph
        whose cache the op keeps rolls back by length whatever this says: free and exact.)

        ``pass_width``: :meth:`sync` feeds at least this many tokens per pass, re-feeding cached
        ones (rolled back for free when masked). The CPU plugin pays a setup cost on every pass
        whose token count differs from the previous pass's, about a quarter of a draft step; a
        draft fed 2 tokens on every step (its catch-up after an accepted round needs 2) never pays
        it, and a 2-token step costs what a 1-token step does (docs/design.md, "One pass width for the draft").

        ``first_token_alone``: a pass into an empty cache goes over its first token alone. On this
        CPU a pass with a past computes every row bit for bit alike, whatever its width, but the
        first pass into an empty cache rounds differently with its width (docs/design.md, "Why
        greedy speculative output is exact"). Starting every cache with one token makes the cache
        entries, and so the answer, the same whatever the cache held before and however the
        prompt is chunked. For the target, whose rounding is the output.

        ``fixed_widths``: where the op keeps the cache, passes of one row this many tokens wide
        run on copies of the graph compiled for that width alone (:class:`FixedShapes`)."""
        if pass_width > 1 and not masked_rollback:
            raise ValueError("pass_width > 1 re-feeds a cached token every step: it needs masked_rollback")
        core = core or ov.Core()
        self.ir_dir = Path(ir_dir)
        xml = self.ir_dir / "openvino_model.xml"
        self.kernels = "openvino"
        self.library = kernels
        self.activations: int | None = None  # the op's activation bits, on ggml's kernels
        self._flags = 0  # every pass's flags on ggml's kernels (engine.ggml.GEMM_INPUT), but GEMM
        if kernels is not None:  # (the IR's graph whose linear layers run ggml's kernels)
            ggml.register(core, kernels)
            xml, self.kernels = self.ir_dir / GGML_XML, "ggml"
            self.activations = supported_activations(activations, kernels)
            self._flags = ggml.FINE if self.activations == 14 else 0
        try:
            model = core.read_model(xml)
        except RuntimeError as exc:
            raise PrepareError(f"{ir_dir}: cannot read the OpenVINO model ({exc})") from exc
        graph.slice_logits(model)
        if kept_ids is not None:
            kept = graph.keep_vocabulary(model, kept_ids, kernels)
            log.info("%s: its head computes %d token ids' logits, -inf elsewhere", self.ir_dir.name, len(kept))
        # (ggml's kernels stream their weights from huge pages: a plain step is faster by about 6%:
        # engine.core.hugepages)
        if kernels is not None:
            hugepages.move_weights(model)
        self.config = dict(config or {})
        self.compiled = core.compile_model(model, device, self.config)
        # On ggml's kernels the compiled model reads the graph's weights where they lie: kept, a
        # prompt reader made from it shares them (engine.core.reader). (The plugin's kernels lay
        # out a copy: kept, the graph's would stay resident beside it.)
        self.model = model if kernels is not None else None
        names = {name for i in model.inputs for name in i.get_names()}
        self._has_gemm_input = GEMM_INPUT in names
        self.request = self.compiled.create_infer_request()
        self.vocab_size: int = self.compiled.output("logits").get_partial_shape()[2].get_length()
        hf_config = json.loads((Path(ir_dir) / "config.json").read_text())
        self.label = model_label(self.ir_dir, hf_config) + (ON_GGML if self.kernels == "ggml" else "")
        self.label += IN_14_BITS if self.activations == 14 else ""
        self.max_context: int = int(hf_config.get("max_position_embeddings", 32768))
        precision: ov.Type = self.compiled.get_property("KV_CACHE_PRECISION")
        own_cache = ggml.KV_CACHES in names  # (the op keeps its cache in f32, whatever the plugin's)
        self._kv_bytes_per_token = self._kv_bytes(hf_config, 4 if own_cache else precision.bitwidth / 8)
        # A state holding no entries (every layer's keys and values: batch, KV heads, entries, head size).
        self.empty_state = np.zeros((1, _kv_heads(hf_config), 0, _head_dim(hf_config)), dtype=np.float32)
        # Where the graph's attention is the op's, the cache it keeps (engine.core.kv_cache): no states.
        self.own: OwnCache | None = None
        if own_cache:
            assert kernels is not None
            layers = int(hf_config["num_hidden_layers"])
            self.own = OwnCache(kernels, layers, _kv_heads(hf_config), _head_dim(hf_config))
        self.fixed = FixedShapes(model, core, device, self.config, fixed_widths) if own_cache else None
        self._requests: dict[tuple[int, int], ov.InferRequest] = {}  # (this cache's, on self.fixed's copies)
        self.tokens: list[int] = []  # what the cache holds, in order (dropped entries excluded)
        # What wrote each of them: a prompt reader's pass (engine.core.reader), None for this
        # request's own passes. A reader's entries round with where its pass started and ended.
        self.origins: list[ReadPass | None] = []
        self.masked_rollback = masked_rollback
        self.pass_width = pass_width
        self.first_token_alone = first_token_alone
        self._mask = np.ones(0, dtype=np.int64)  # one entry per cache slot: 0 = dropped
        self.passes = 0

    @staticmethod
    def _kv_bytes(cfg: dict, per_value: float) -> int:
        return int(2 * cfg["num_hidden_layers"] * _kv_heads(cfg) * _head_dim(cfg) * per_value)

    def fork(self) -> Runtime:
        """Another KV cache, empty, on the same compiled model: the weights stay loaded once."""
        twin = copy.copy(self)
        twin.request = self.compiled.create_infer_request()
        twin._requests = {}
        twin.own = self.own.other() if self.own is not None else None
        twin.passes = 0
        twin.reset()
        return twin

    @property
    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes_per_token

    @property
    def slots(self) -> int:
        """Entries the cache holds, masked-out ones included."""
        return len(self._mask)

    @property
    def kv_cache_bytes(self) -> int:
        return self.own.bytes if self.own is not None else self.slots * self.kv_bytes_per_token

    def warm_up(self) -> None:
        """Run the shapes decoding uses once, so the first request does not pay for kernel setup
        (nor for compiling the copies of fixed shapes: half a second each)."""
        fixed = self.fixed.widths if self.fixed is not None else ()
        for n in sorted({8, 1, 5, self.pass_width, *fixed}):
            self.forward([0] * n, rows=n)
        self.reset()

    def settle(self, width: int) -> None:
        """Run passes ``width`` tokens wide, each rolled back, until the op has chosen its kernels
        for every shape they take: on a shape's first calls it takes its candidates in turn
        (engine.ggml.CANDIDATES), and a pass timed meanwhile prices the slower ones too (on the
        AVX-512 AMD EPYC Zen 4 a first start read a 2-token pass at 1.36 steps, one that settled
        its passes first 1.21). Needs a cache that holds tokens."""
        if self.library is None:
            return
        kept = len(self.tokens)
        for _ in range(SETTLING_PASSES):
            before = ggml.timing_calls(self.library)
            self.forward([0] * width, rows=width)
            self.trim(kept)
            if ggml.timing_calls(self.library) == before:
                return

    def release(self) -> None:
        """Empty the cache and give its memory back (``reset`` keeps the plugin's buffers for the
        next request; this frees them: a conversation whose entries were copied elsewhere)."""
        if self.own is not None:
            self.own.free()
        else:
            release_states(self.request, self.empty_state)
        self.tokens, self.origins = [], []
        self._mask = np.ones(0, dtype=np.int64)

    def reset(self) -> None:
        if self.own is None:  # (the op's cache: the next pass writes from its first entry)
            self.request.reset_state()
        self.tokens, self.origins = [], []
        self._mask = np.ones(0, dtype=np.int64)

    def trim(self, keep: int) -> None:
        """Roll the KV cache back to its first ``keep`` tokens."""
        if keep >= len(self.tokens):
            return
        if keep == 0:
            self.reset()
            return
        if self.own is not None:  # (the next pass writes after the entries kept)
            self._mask = self._mask[:keep]
            del self.tokens[keep:]
            del self.origins[keep:]
            return
        slots = np.flatnonzero(self._mask)
        if self.masked_rollback:
            self._mask[slots[keep] :] = 0
            dropped = len(self._mask) - keep
            if dropped > MAX_MASKED:
                self._gather(slots[:keep])
        else:
            self._gather(slots[:keep])
        del self.tokens[keep:]
        del self.origins[keep:]

    def _gather(self, slots: np.ndarray) -> None:
        """Keep only the cache entries at ``slots``: a copy of every state out and back in (a
        prefix, every trim of a cache without holes, sliced rather than gathered). Not a view of
        what was read (``ov.Tensor(tensor, begin, end)``): the plugin keeps a view it is set to
        beside its own copy of the entries, twice the cache's memory until the state is set again,
        for no gain in time on AVX2 (docs/design.md, "Rollback cost")."""
        prefix = slots[-1] == len(slots) - 1
        for state in self.request.query_state():
            entries = state.state.data
            state.state = state_tensor(entries[:, :, : len(slots)] if prefix else np.take(entries, slots, axis=2))
        self._mask = np.ones(len(slots), dtype=np.int64)

    def hold(self, tokens: Sequence[int]) -> None:
        """Make the cache hold exactly ``tokens`` (trim to the shared prefix, one pass over the rest)."""
        self.trim(common_prefix(self.tokens, tokens))
        if len(tokens) > len(self.tokens):
            self.forward(tokens[len(self.tokens) :])

    def fill(self, context: int) -> None:
        """Make the cache hold ``context`` entries of zeros, the states set directly (no prefill):
        what a pass costs at a length, without paying for the prompt first."""
        if self.own is not None:
            self.own.zeros(context)
        else:
            shape = self.empty_state.shape
            zeros = state_tensor(np.zeros((*shape[:2], context, shape[3]), dtype=np.float32))
            for state in self.request.query_state():  # (a tensor of its own each would double the peak)
                state.state = zeros
        self.hold_loaded([0] * context)

    def entries(self) -> dict[str, np.ndarray]:
        """A copy of every state (the cache's entries), by name: what :meth:`load` takes back."""
        if self.own is not None:
            return self.own.read(len(self.tokens))
        return {state.name: state.state.data.copy() for state in self.request.query_state()}

    def load(
        self, tokens: Sequence[int], entries: dict[str, np.ndarray], origins: Sequence[ReadPass | None] = ()
    ) -> None:
        """Make the cache hold ``tokens`` from ``entries`` (:meth:`entries` of a cache that held
        them first, or a longer run of tokens starting with them): nothing is computed. A
        token's entries depend only on the tokens before it, so a cache holding an opening many
        conversations share can seed every new one. ``origins``: what wrote them (:attr:`origins`)."""
        if self.own is not None:
            self.own.write(entries, len(tokens))
        for state in self.request.query_state():
            state.state = state_tensor(entries[state.name][:, :, : len(tokens)])
        self.hold_loaded(tokens, origins)

    def hold_loaded(self, tokens: Sequence[int], origins: Sequence[ReadPass | None] = ()) -> None:
        """The states were just set from outside (a batch row copied back, a prompt reader's pass):
        they hold ``tokens``, the first of them written by ``origins``, the rest by this request."""
        self.tokens = list(tokens)
        self.origins = [*origins[: len(tokens)], *[None] * (len(tokens) - len(origins))]
        self._mask = np.ones(len(self.tokens), dtype=np.int64)

    def pass_inputs(self, gemm: bool = False) -> dict[str, np.ndarray]:
        """The graph's inputs a pass sets besides the tokens: on ggml's kernels, its flags
        (engine.ggml.GEMM_INPUT): whether its gemm multiplies (a prompt reader's passes only, whose
        rows round with where they fall in a pass; every other pass computes a row alike at any
        width), and the activations' bits."""
        flags = ggml.GEMM if gemm else self._flags
        return {GEMM_INPUT: np.array([flags], dtype=np.int64)} if self._has_gemm_input else {}

    def _cache_inputs(self, past: int) -> dict[str, np.ndarray]:
        """Where the op keeps the cache: which one a pass writes, after how many entries."""
        if self.own is None:
            return {}
        return {
            ggml.KV_CACHES: np.array([self.own.id], dtype=np.int64),
            ggml.KV_PASTS: np.array([past], dtype=np.int64),
        }

    def forward(self, new_tokens: Sequence[int], rows: int = 1, gemm: bool = False) -> np.ndarray:
        """Append ``new_tokens`` to the cache; return logits of the last ``rows`` of them
        (``gemm``: :meth:`pass_inputs`)."""
        if self.first_token_alone and not self.tokens and len(new_tokens) > 1:
            first = self.forward(new_tokens[:1], gemm=gemm)
            rest = self.forward(new_tokens[1:], rows, gemm)
            return np.concatenate([first, rest])[-rows:] if rows >= len(new_tokens) else rest
        past, m = len(self.tokens), len(new_tokens)
        if past + m > self.max_context:
            raise ContextLimitError(f"{past + m} tokens exceed the model's context of {self.max_context}")
        self._mask = np.concatenate([self._mask, np.ones(m, dtype=np.int64)])
        request = self.pass_request(m)
        request.infer(
            {
                "input_ids": np.asarray([new_tokens], dtype=np.int64),
                "attention_mask": self._mask[None],
                "position_ids": np.arange(past, past + m, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
                "logits_to_keep": np.array([min(rows, m)], dtype=np.int64),
                **self.pass_inputs(gemm),
                **self._cache_inputs(past),
            }
        )
        self.tokens.extend(new_tokens)
        self.origins.extend([None] * m)
        self.passes += 1
        return request.get_tensor("logits").data[0].astype(np.float32, copy=True)

    def pass_request(self, width: int) -> ov.InferRequest:
        """The request a pass of one row ``width`` tokens wide runs on: on a copy of the graph
        compiled for that width (:attr:`fixed`), else on the graph of dynamic shapes."""
        return self.request if self.fixed is None else self.fixed.request(self._requests, self.request, width)

    def feed(self, tokens: Sequence[int], chunk: int) -> Iterator[int]:
        """Make the cache hold all of ``tokens`` but the last ``chunk`` or fewer, in passes of
        ``chunk`` tokens (after trimming it to the prefix it shares with them); yield how many
        tokens it holds after each pass, so a caller can report progress and stop between them.
        A pass's memory grows with its width times the context (the attention scores), so no
        pass is wider than ``chunk``."""
        self.trim(common_prefix(self.tokens, tokens))
        while len(tokens) - len(self.tokens) > chunk:
            self.forward(tokens[len(self.tokens) : len(self.tokens) + chunk])
            yield len(self.tokens)

    def sync(self, tokens: Sequence[int], rows: int = 1) -> np.ndarray:
        """Make the cache hold ``tokens``: trim it to the longest prefix it shares with them (less
        what a pass of ``pass_width`` re-feeds), forward the rest; return the logits of the last
        ``rows`` positions. Nothing already computed is computed again."""
        start = max(0, min(common_prefix(self.tokens, tokens), len(tokens) - max(rows, self.pass_width)))
        self.trim(start)
        return self.forward(tokens[start:], rows)
