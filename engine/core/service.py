"""The engine the app and the bench talk to: two models, one worker thread, streamed events.

Every piece of work runs on the single worker thread (:mod:`engine.core.scheduler`), so the KV
caches are never touched by two requests at once; callers read their own request's events only
(:mod:`engine.core.requests`). The worker serves up to ``max_batch`` requests together, each
iteration planned before it runs (:mod:`engine.core.planning`): a first round due, on its
request's own caches, or the shared work, one batched target pass over the requests that generate
together (:mod:`engine.core.batch`), each row verifying its copied draft where the pass's width
pays, or, where none batch, a round of each alone (speculative, on its own caches); then side
work in one more client's share of the time: a slice of a long prompt, a round of a row too wide
to batch (docs/design.md, "Batching"). Further requests wait in the queue. Here the models are
loaded, and a request is checked before it reaches the worker.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from engine import ggml
from engine.core import chat, screen, window
from engine.core.batch import padded_row_error
from engine.core.budget import MemoryBudget, gib
from engine.core.draft_vocab import ids_key
from engine.core.drafters import Drafter, Price
from engine.core.measured import Measured, model_identity
from engine.core.memory import resident_bytes, return_freed_buffers
from engine.core.modes import BEST_K, COPY_WIDTHS, LOOKUP_SPAN, MODES, DrafterParts
from engine.core.pacing import BatchPrices, Pacing, PassCosts
from engine.core.pool import Pools
from engine.core.reader import (
    READERS,
    RESIDENT_PER_READ_BYTE,
    GemmReader,
    PromptReader,
    Reader,
    fastest_reader,
    named_reader,
)
from engine.core.requests import Event, Request, Stream
from engine.core.runtime import DRAFT_CONFIG, FIXED_WIDTHS, TARGET_CONFIG, Runtime, supported_activations
from engine.core.scheduler import Scheduler
from engine.core.sessions import MAX_SESSIONS, Opening, SessionPool
from engine.core.settings import BATCHING, DEFAULTS, KERNELS, Settings
from engine.core.tokenizer import load_tokenizer
from engine.core.turns import ClientBusy, ClientLedger
from engine.core.window import Overflow
from engine.core.worker import CLOSE_TIMEOUT, CLOSED
from engine.errors import EngineError
from engine.ggml import GGML_XML

T = TypeVar("T")
# Tokens per draft pass (see Runtime): one shape for every draft step, where the CPU runs a 2-token
# pass at the cost of a 1-token one; timed at start against 1 (Engine._draft_pass_width).
DRAFT_PASS_WIDTH = 2
# The longest prompt accepted, as a share of the context: room is left for the answer.
INPUT_SHARE = 0.75
# A message longer than this many characters per accepted token is refused without tokenizing it
# (no tokenizer here packs more characters into a token).
MAX_CHARS_PER_TOKEN = 16
# Tokens of answer the input cap leaves room for in the memory budget.
MIN_ANSWER_ROOM = 256
# The entry of Engine.models that says which way the op's passes multiply, per pass shape.
OP_KERNELS = "op kernels"
BATCHING_KEY = "batching"  # (/health's: whether requests generating at once share passes, and why)
log = logging.getLogger("specchat.engine")


class Engine:
    def __init__(self, target_dir: Path, draft_dir: Path | None = None, settings: Settings = DEFAULTS):
        """The models in ``target_dir`` and ``draft_dir`` (prepared; they must share one
        vocabulary, as ``engine.prepare`` checks), served as ``settings`` say. What start times
        (kernels, reader, pass costs) is read where kept for this machine, else timed and kept."""
        return_freed_buffers()
        self.library = settings.library
        if self.library is not None:  # (checked once here, so that a CPU without 14 bits warns once)
            settings = replace(settings, activations=supported_activations(settings.activations, self.library))
            ggml.load_choices(self.library, settings.remeasure)
        self.settings = settings
        self.context_overflow = Overflow(settings.context_overflow)
        self.measured = Measured.open(
            Path(target_dir), _depends_on(target_dir, draft_dir, settings), settings.remeasure
        )
        # (the models' loads run in OpenVINO without the GIL, so the tokenizer's overlaps them)
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, target_dir)
            target_bytes = self._load_models(Path(target_dir), Path(draft_dir) if draft_dir else None)
            self.tokenizer = tokenizer.result()
        self.modes = tuple(m.name for m in MODES.values() if self.draft is not None or not m.needs_draft_model)
        self.max_context = self.target.max_context
        per_token = self.target.kv_bytes_per_token + (self.draft.kv_bytes_per_token if self.draft else 0)
        wanted = settings.max_input_tokens or int(self.max_context * INPUT_SHARE)
        self.reader = self._affordable_reader(per_token, target_bytes, wanted)
        self.pacing = self._pacing()
        self._keep_kernel_choices()
        self.stop_ids = frozenset(_stop_ids(Path(target_dir), self.tokenizer))
        self.fence_ids = frozenset(i for token, i in self.tokenizer.get_vocab().items() if "```" in token)
        self.budget = self._budget(settings.memory_limit, per_token)
        log.info(self.budget.describe())
        # The longest prompt accepted: a share of the context, and what the budget holds beside an answer.
        self.max_input_tokens = min(wanted, self.budget.tokens - MIN_ANSWER_ROOM)
        if self.budget.tokens <= 2 * MIN_ANSWER_ROOM:
            raise EngineError(f"the {self.budget.describe()} is too small to serve a conversation: raise the limit")
        self.sessions = self._sessions()
        self.step_timeout = settings.step_timeout
        self._clients = ClientLedger(settings.client_limits)
        self._tokenizing = threading.Lock()  # the tokenizer's special-token switch is shared state
        self.batches, self.batching = self._batching()  # (whether requests share passes, and why)
        self.scheduler = self._scheduler()

    def _load_models(self, target_dir: Path, draft_dir: Path | None) -> int:
        """Load and warm up both models on their kernels; the bytes the target's weights hold (what
        a prompt reader, a copy of them, would hold too)."""
        s = self.settings
        before = resident_bytes()
        target_config = TARGET_CONFIG if s.config is None else s.config
        self.target = on_kernels(
            lambda lib: Runtime(
                target_dir, s.device, target_config, first_token_alone=True, kernels=lib, activations=s.activations
            ),
            target_dir,
            s.kernels,
            s.library,
            self.measured,
            lambda lib: screen.step_seconds(target_dir, lib, s.device, target_config, s.activations),
        )
        self.target.warm_up()
        target_bytes = resident_bytes() - before
        self.draft = None
        if draft_dir is not None:
            draft_config = DRAFT_CONFIG if s.draft_config is None else s.draft_config
            self.draft = on_kernels(
                lambda lib: Runtime(
                    draft_dir,
                    s.device,
                    draft_config,
                    kept_ids=s.draft_vocab,
                    masked_rollback=True,
                    pass_width=DRAFT_PASS_WIDTH,
                    kernels=lib,
                    activations=s.activations,
                ),
                draft_dir,
                s.kernels,
                s.library,
                self.measured,
                lambda lib: screen.step_seconds(draft_dir, lib, s.device, draft_config, s.activations),
            )
            self.draft.warm_up()
            self.draft.pass_width = self._draft_pass_width()
        return target_bytes

    def _draft_pass_width(self) -> int:
        """The draft's pass width that makes its rounds cheaper here: kept from an earlier start,
        else timed (and kept). A 2-token pass cost 1.3 single ones on ggml's AVX2 kernels, about
        one on AVX-512 (docs/benchmarks.md, "An AVX2 machine")."""
        assert self.draft is not None
        name = "draft pass width"
        kept = self.measured.get(name)
        if kept is None:
            seconds = {w: PassCosts.draft_round(self.draft, w, BEST_K) for w in (1, DRAFT_PASS_WIDTH)}
            kept = min(seconds, key=seconds.__getitem__)
            log.info("%s: %d (a round of %d drafts: %s)", name, kept, BEST_K, _milliseconds(seconds))
            self.measured.put(name, kept)
        return int(kept)

    def _affordable_reader(self, per_token: int, target_bytes: int, wanted: int) -> PromptReader | None:
        """The settings' prompt reader, where the budget holds it beside ``wanted`` tokens of input.
        A stateless reader copies the cache it reads into; on the plugin's kernels it holds a copy
        of the target's weights too (on ggml's it shares them). The target's own passes with
        ggml's gemm need neither, and are the only reader of a target whose cache the op keeps."""
        limit, choice = self.settings.memory_limit, self.settings.prompt_reader
        if self.target.own is not None:
            return self._reader(choice, plugin=False, stateless=False)
        stateless = self._affords_reader(limit, per_token, 0, wanted, "a stateless")
        plugin = stateless and self._affords_reader(limit, per_token, target_bytes, wanted, "the plugin's")
        if choice == "auto" and not stateless and self.target.model is None:
            choice = "off"
        return self._reader(choice, plugin, stateless)

    def _pacing(self) -> Pacing:
        """The settings' pacing, else one priced by what a speculative round costs here against a
        plain step: the paced mode's break-even, and the price of its lookup copies."""
        if self.settings.pacing is not None or self.draft is None:
            return self.settings.pacing or Pacing()
        pacing = Pacing(self._pass_costs())
        log.info("pass costs: %s", pacing.costs.describe())  # type: ignore[union-attr]
        return pacing

    def _sessions(self) -> SessionPool:
        return SessionPool(
            self.target,
            self.draft,
            # (not a method of this engine: the pool would then hold the engine, and a closed
            # engine's models would wait for the garbage collector's next cycle)
            functools.partial(_drafters, self.modes, self.target.vocab_size, self.pacing.worth_copying),
            self.settings.max_sessions or MAX_SESSIONS,
            self._opening(),
        )

    def _opening(self) -> Opening | None:
        """What every conversation starts with, read once (or as a start before read it)."""
        tokens = chat.opening_ids(self.tokenizer)
        return Opening.kept(self.measured, tokens, (self.target, self.draft), self.reader) if tokens else None

    def _scheduler(self) -> Scheduler:
        return Scheduler(
            self.target,
            self.sessions,
            self.budget,
            self.tokenizer,
            self._clients,
            self.pacing,
            self.stop_ids,
            self.fence_ids,
            Pools(self.target.vocab_size, self.pacing.worth_copying, LOOKUP_SPAN, self.settings.shared_pool),
            self.reader,
            BatchPrices(self.pacing.costs) if self.settings.batch_speculation else None,
            self.batches,
        )

    def _batching(self) -> tuple[bool, str]:
        """Whether requests generating at once share batched passes (:attr:`Settings.batching`),
        and why, for ``/health``: under ``auto``, where a row left-padded by 1 to 3 slots gives its
        lone logits bit for bit, as kept for this machine or probed (and kept)."""
        choice = self.settings.batching
        if choice not in BATCHING:
            raise EngineError(f"unknown batching '{choice}': choose one of {', '.join(BATCHING)}")
        if choice != "auto":
            return choice == "on", f"{choice}, as asked"
        name = "batched rows exact"
        exact = self.measured.get(name)
        if exact is None:
            moved = padded_row_error(self.target)
            exact = moved == 0.0
            log.info(
                "batching: %s (a row left-padded in a batched pass moved its logits by up to %.2g here%s)",
                "on" if exact else "off",
                moved,
                "" if exact else ": each request takes its own rounds, every answer its solo run's; --batching on",
            )
            self.measured.put(name, exact)
        return bool(exact), (
            "on: a batched row gives its lone logits here" if exact else "off: a batched row's logits move here"
        )

    def _reader(self, choice: str, plugin: bool, stateless: bool) -> PromptReader | None:
        """The prompt reader ``choice`` names (:data:`~engine.core.reader.READERS`), its weights laid
        out (what it holds is in the process's memory before the budget is drawn up); ``auto``
        tries the readers the budget holds (:func:`~engine.core.reader.fastest_reader`)."""
        if choice not in READERS:
            raise EngineError(f"unknown prompt reader '{choice}': choose one of {', '.join(READERS)}")
        if choice == "off":
            return None
        if choice not in ("auto", "gemm") and self.target.own is not None:
            raise EngineError(
                f"the prompt reader '{choice}' reads into the plugin's states, and this target's cache is "
                "the op's own (its graph was built from a GGUF): its own passes read prompts (gemm, auto or off)"
            )
        if choice == "auto":
            kept = self.measured.get("prompt reader")
            if kept is not None:
                return named_reader(kept, self.target, plugin=plugin, stateless=stateless)
            chosen = fastest_reader(self.target, plugin=plugin, stateless=stateless)
            self.measured.put("prompt reader", chosen.name if chosen is not None else "off")
            return chosen
        reader: PromptReader
        if choice == "gemm":
            if self.target.library is None:
                raise EngineError("the prompt reader 'gemm' reads on ggml's kernels: the target runs the plugin's")
            reader = GemmReader(self.target.library)
        else:
            reader = Reader(self.target.ir_dir, self.target.config, choice)
        reader.warm_up(self.target)
        return reader

    def _pass_costs(self) -> PassCosts:
        """What the passes cost here: kept from an earlier start, else timed (and kept)."""
        assert self.draft is not None
        kept = self.measured.get("pass costs")
        if kept is not None:
            return PassCosts.from_figures(kept)
        costs = PassCosts.read(self.target, self.draft, BEST_K, COPY_WIDTHS)
        self.measured.put("pass costs", costs)
        return costs

    def _keep_kernel_choices(self) -> None:
        """Keep the op's choices per pass shape made so far for later starts, and log them."""
        if self.library is not None:
            made = ggml.save_choices(self.library)
            log.info("op kernels per pass shape (%d timed): %s", len(made), ggml.describe_choices(made))

    def _affords_reader(self, memory_limit: int | None, per_token: int, weights: int, wanted: int, which: str) -> bool:
        """Whether the budget holds a stateless prompt reader (``weights`` more: its own layout of
        the target's weights, if any, and the copies of the cache its passes make) beside
        ``wanted`` tokens of input and an answer; logged where not."""
        reading = self.target.kv_bytes_per_token * RESIDENT_PER_READ_BYTE
        budget = MemoryBudget.of_machine(memory_limit, resident_bytes() + weights, per_token, reading)
        if budget.tokens >= wanted + MIN_ANSWER_ROOM:
            return True
        log.info(
            "prompt reader: not %s one (it would leave room for %s tokens of input, under %s: raise --memory-limit)",
            which,
            f"{max(0, budget.tokens - MIN_ANSWER_ROOM):,}",
            f"{wanted:,}",
        )
        return False

    def _budget(self, memory_limit: int | None, per_token: int) -> MemoryBudget:
        """The memory budget as the process stands (room kept aside for a prompt reader's pass)."""
        per_byte = self.reader.resident_per_read_byte if self.reader is not None else 0
        return MemoryBudget.of_machine(
            memory_limit, resident_bytes(), per_token, self.target.kv_bytes_per_token * per_byte
        )

    # -- the worker -------------------------------------------------------------------------
    def with_models(self, fn: Callable[[Runtime, Runtime | None], T]) -> T:
        """Run ``fn(target, draft)`` on the worker thread, after the queued work, and return its
        result: the one way to use the models' runtimes directly (the tools measure with it)."""
        return self.scheduler.worker.call(lambda: fn(self.target, self.draft))

    @property
    def healthy(self) -> bool:
        """False while a request has made no progress for longer than ``step_timeout``: a stuck
        inference call (the worker recovers, and with it the health, when the call returns)."""
        return not self.scheduler.worker.stuck(self.step_timeout)

    @property
    def models(self) -> dict[str, str]:
        """Each role's model name and precision, and when what start times was measured, for people."""
        roles = {"target": self.target.label} | ({"draft": self.draft.label} if self.draft else {})
        roles |= {"measured": self.measured.describe(), BATCHING_KEY: self.batching}
        if self.library is not None:  # (/health's, not the page's: how many pass shapes took which way)
            roles[OP_KERNELS] = ggml.describe_choices(ggml.choices(self.library))
        return roles

    @property
    def replicas(self) -> int:
        """Engines serving (one; a cluster's remote engine says how many run)."""
        return 1

    @property
    def state(self) -> str:
        """One word for ``/health``."""
        return "ok" if self.healthy else "unhealthy"

    @property
    def pending(self) -> int:
        """Requests waiting for or using the engine."""
        return self.scheduler.pending

    @property
    def waiting(self) -> int:
        """Requests queued, not yet taken up (they wait while the engine is full, or for memory)."""
        return self.scheduler.waiting

    @property
    def full(self) -> bool:
        """Serving as many requests as it serves together: new ones wait."""
        return self.scheduler.full

    # -- generation -------------------------------------------------------------------------
    def check(self, request: Request) -> list[int]:
        """The request's prompt ids, or an :class:`EngineError` saying what is wrong with it."""
        return self._checked(request).ids

    def _checked(self, request: Request) -> chat.Prompt:
        request.check(self.modes, self.max_context)
        prompt = self.prompt(request)
        most = request.tokens_at_most(len(prompt.ids), self.max_context)
        self.budget.check(self.budget.reservation(len(prompt.ids), most), "this request")
        return prompt

    def prompt_ids(self, request: Request) -> list[int]:
        """The request's prompt ids (:meth:`prompt`)."""
        return self.prompt(request).ids

    def prompt(self, request: Request) -> chat.Prompt:
        """The request's prompt within ``max_input_tokens`` or its client's own cap: a longer
        conversation is windowed or refused, as its ``context_overflow`` says
        (:mod:`engine.core.window`); what is refused is checked on characters first, so a
        multi-megabyte paste is never tokenized."""
        cap = min(self.max_input_tokens, self._clients.limits.input_cap(request.client) or self.max_input_tokens)
        read = chat.Prompt(list(request.prompt_ids)) if request.prompt_ids else self._conversation(request, cap)
        if len(read.ids) > cap:
            raise self._too_long(f"{len(read.ids):,} tokens", cap, "the last turn" if read.out_of_view else "")
        if any(not isinstance(t, int) or not 0 <= t < self.target.vocab_size for t in request.answer_ids):
            raise EngineError(f"answer_ids must be token ids from 0 to {self.target.vocab_size - 1}")
        if len(read.ids) + len(request.answer_ids) >= self.max_context:  # (an answer may grow past the input cap)
            raise EngineError(f"the answer fills the model's context ({self.max_context:,} tokens): it cannot go on")
        return read.continued(request.answer_ids)

    def _conversation(self, request: Request, cap: int) -> chat.Prompt:
        """The prompt of the request's messages: the whole conversation, or the window of it that
        fits ``cap`` (the last turn alone where none does, which the caller refuses)."""
        messages = request.messages
        if not messages or not str(messages[-1].get("content", "")).strip():
            raise EngineError("the message is empty: type something first")
        windowed = (request.context_overflow or self.context_overflow) == Overflow.WINDOW
        kept = window.last_turn(messages) if windowed else messages  # (what no window leaves out)
        characters = sum(len(m["content"]) for m in kept)
        if characters > cap * MAX_CHARS_PER_TOKEN:
            part = "the last turn" if len(kept) < len(messages) else ""
            raise self._too_long(f"{characters:,} characters", cap, part)
        with self._tokenizing:
            return window.fit(self.tokenizer, messages, cap) if windowed else chat.prompt(self.tokenizer, messages)

    def _too_long(self, length: str, cap: int, part: str = "") -> EngineError:
        """Why a conversation (or ``part`` of it, which no window leaves out) is refused."""
        if cap < self.max_input_tokens:
            bound = "for a visitor who is not logged in on this shared server"
        elif self.max_input_tokens + MIN_ANSWER_ROOM >= self.budget.tokens:
            bound = f"its memory limit of {gib(self.budget.limit)} holds {self.budget.tokens:,} tokens of cache"
        else:
            bound = f"the model's context holds {self.max_context:,}"
        return EngineError(
            f"{part or 'the conversation'} is {length} long; this server takes at most {cap:,} tokens of input "
            f"({bound}). Shorten the message or clear the chat."
        )

    def text(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens left out)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def generate(self, request: Request) -> Stream:
        """Stream the events of one request (see :class:`Stream` for how to stop it). A request
        that is not valid ends at once with an error event; nothing of it reaches the worker."""
        capped = self._clients.limits.answer_cap(request.client, request.max_new_tokens, self.max_context)
        request = replace(request, max_new_tokens=capped)
        if not self.scheduler.worker.accepting:
            return Stream.refused(CLOSED, request.mode)
        try:
            prompt = self._checked(request)
            release = self._clients.admit(request.client)
        except ClientBusy as exc:
            return Stream.refused(str(exc), request.mode, exc.retry_after)
        except EngineError as exc:
            return Stream.refused(str(exc), request.mode)
        stream = Stream(self.step_timeout, lambda: self.healthy, on_close=release)
        self.scheduler.submit(request, prompt, stream, release)
        return stream

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Serve no more: return once the requests taken are answered, or after ``timeout``
        seconds once those still held are cancelled (the log says which). The models are freed
        with the engine then (a benchmark loads one engine after another in one process). The
        op's choices made while serving are kept for later starts."""
        self.scheduler.worker.close(timeout)
        self._keep_kernel_choices()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, request: Request) -> Event:
        """Generate to the end; return the final event."""
        for event in self.generate(request):
            if event.final:
                return event
        raise EngineError("generation ended without a final event")

    def reset(self) -> None:
        """Empty every session's KV caches (worker thread only)."""
        for session in self.sessions.sessions:
            session.reset()


def _drafters(modes: Sequence[str], vocab_size: int, price: Price, draft: Runtime | None) -> dict[str, Drafter]:
    """Every mode's drafter over one session's draft cache."""
    parts = DrafterParts(vocab_size, draft, price)
    return {name: build(parts) for name in modes if (build := MODES[name].drafter) is not None}


def _stop_ids(ir_dir: Path, tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    gen = ir_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def _depends_on(target_dir: Path, draft_dir: Path | None, s: Settings) -> dict[str, Any]:
    """What the figures measured at start depend on, besides the CPU and the kernels' build."""
    return {
        "target": model_identity(Path(target_dir)),
        "draft": model_identity(Path(draft_dir)) if draft_dir else None,
        "settings": [
            s.device,
            TARGET_CONFIG if s.config is None else s.config,
            DRAFT_CONFIG if s.draft_config is None else s.draft_config,
            ids_key(s.draft_vocab),
            s.memory_limit,
            s.max_input_tokens,
        ],
        "kernels": [s.kernels, str(s.library), s.activations, s.prompt_reader],
        "widths": [BEST_K, COPY_WIDTHS, DRAFT_PASS_WIDTH, FIXED_WIDTHS],
    }


def on_kernels(
    build: Callable[[Path | None], Runtime],
    ir_dir: Path,
    choice: str,
    library: Path | None,
    measured: Measured,
    linears_seconds: Callable[[Path | None], float | None] = lambda kernels: None,
) -> Runtime:
    """The runtime of the model in ``ir_dir`` on the kernels ``choice`` names (:data:`KERNELS`):
    ``build(library)`` makes it on ggml's, ``build(None)`` on the plugin's. ``auto`` keeps the
    faster, as ``measured`` keeps it for this machine, else as ``linears_seconds`` (the same
    arguments; engine.core.screen) shows one of them slower by its margin, else timing a plain step
    on each, one in memory at a time (logged); a model without a graph on ggml's kernels (one not
    from a GGUF file) runs the plugin's."""
    if choice not in KERNELS:
        raise EngineError(f"unknown kernels '{choice}': choose one of {', '.join(KERNELS)}")
    on_ggml = library is not None and (ir_dir / GGML_XML).exists()
    if choice == "ggml" and not on_ggml:
        raise EngineError(f"{ir_dir.name}: ggml's kernels run a model prepared from a GGUF file (or the embedded one)")
    if choice == "openvino" or not on_ggml:
        return build(None)
    if choice == "ggml":
        return build(library)
    name = f"kernels for {ir_dir.name}"
    kept = measured.get(name)
    if kept is not None:
        log.info("%s: %s (measured %s)", name, kept, measured.describe())
        return build(library if kept == "ggml" else None)
    faster = _screened(name, library, linears_seconds)
    if faster is not None:
        measured.put(name, faster)
        return build(library if faster == "ggml" else None)
    times: dict[str, float] = {}
    runtime = None
    for kernels in (None, library):
        runtime = None  # (the last one's weights go before the next is laid out)
        return_freed_buffers()
        runtime = build(kernels)
        times[runtime.kernels] = plain_step_seconds(runtime)
    assert runtime is not None
    faster = min(times, key=times.__getitem__)
    log.info("%s: %s (a plain step: %s)", name, faster, _milliseconds(times))
    measured.put(name, faster)
    if runtime.kernels != faster:
        runtime = None
        return_freed_buffers()
        runtime = build(None)
    return runtime


def _screened(name: str, library: Path | None, linears_seconds: Callable[[Path | None], float | None]) -> str | None:
    """The kernels whose linear layers are faster than the other's by the screen's margin (logged),
    so that the other is not built whole; None where neither is, or they were not timed."""
    times: dict[str, float] = {}
    for kernels, label in ((None, "openvino"), (library, "ggml")):
        seconds = linears_seconds(kernels)
        if seconds is None:
            return None
        times[label] = seconds
        return_freed_buffers()
    faster, slower = sorted(times, key=times.__getitem__)
    if times[slower] < screen.MARGIN * times[faster]:
        return None
    log.info(
        "%s: %s (a step's linear layers, timed in parts: %s; the other not built whole)",
        name,
        faster,
        _milliseconds(times),
    )
    return faster


def _milliseconds(seconds: dict[Any, float]) -> str:
    """Timings for the log: ``candidate 12.3 ms, ...``."""
    return ", ".join(f"{k} {1e3 * t:.1f} ms" for k, t in seconds.items())


def plain_step_seconds(runtime: Runtime, context: int = 64, steps: int = 8) -> float:
    """The median time of a plain step after ``context`` tokens (the cache given back after)."""
    runtime.forward(list(range(1, context + 1)))
    seconds = screen.median_seconds(lambda: runtime.forward([1]), steps)
    runtime.release()
    return seconds
