"""The engine the app and the bench talk to: two models, one worker thread, streamed events.

Every piece of work runs on the single worker thread, in arrival order, so the KV
caches are never touched by two requests at once; callers wait in the queue and
read their own request's events only.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine.core.decoding import DecodeConfig, Provenance, decode
from engine.core.metrics import Stats
from engine.core.modes import MODES, DrafterParts
from engine.core.runtime import DRAFT_CONFIG, TARGET_CONFIG, Runtime
from engine.core.sampling import SamplingParams
from engine.core.textstream import IncrementalDecoder, StopStrings
from engine.errors import EngineError

T = TypeVar("T")
# The draft head's vocabulary: the first N ids (BPE merge rank ~ frequency). Off by default:
# on this machine the acceptance it costs outweighs the cheaper draft pass (docs/benchmarks.md).
DRAFT_VOCAB: int | None = None
# Tokens per draft pass (see Runtime): one shape for every draft step.
DRAFT_PASS_WIDTH = 2


@dataclass(frozen=True)
class Request:
    """One generation: a chat (list of {"role", "content"}) or raw prompt token ids."""

    messages: tuple[dict, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    mode: str = "speculative"
    k: int = 4
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    reuse_cache: bool = True  # False: start both KV caches empty (fair benchmarks)


@dataclass
class Event:
    """``delta`` while streaming; a last event ``done`` (or ``error``) carries the final metrics."""

    kind: str
    text: str = ""
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, provenance) per token
    metrics: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def final(self) -> bool:
        return self.kind in ("done", "error")


class Stream:
    """The events of one request, in order, ending with a ``done`` or ``error`` event.

    ``cancel()`` asks the engine to stop after the current round; the stream still ends with
    its final event (finish reason ``cancelled``). ``close()`` cancels and stops reading."""

    def __init__(self) -> None:
        self._events: queue.Queue[Event] = queue.Queue()
        self._cancel = threading.Event()
        self._ended = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Event:
        if self._ended:
            raise StopIteration
        event = self._events.get()
        self._ended = event.final
        return event

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        self.cancel()
        self._ended = True


class Engine:
    def __init__(
        self,
        target_dir: Path,
        draft_dir: Path | None = None,
        device: str = "CPU",
        config: dict | None = None,
        draft_config: dict | None = None,
        draft_vocab: int | None = DRAFT_VOCAB,
    ):
        """``config`` / ``draft_config``: OpenVINO properties of the target / draft (defaults:
        :data:`TARGET_CONFIG` and :data:`DRAFT_CONFIG`). ``draft_vocab``: the draft head computes
        logits for the first N token ids only (None: all). The two models must share one
        vocabulary (``engine.prepare`` checks it)."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.target = Runtime(Path(target_dir), device, TARGET_CONFIG if config is None else config)
        self.draft = (
            Runtime(
                Path(draft_dir),
                device,
                DRAFT_CONFIG if draft_config is None else draft_config,
                vocab_limit=draft_vocab,
                masked_rollback=True,
                pass_width=DRAFT_PASS_WIDTH,
            )
            if draft_dir
            else None
        )
        parts = DrafterParts(self.target.vocab_size, self.draft)
        self.modes = tuple(m.name for m in MODES.values() if self.draft is not None or not m.needs_draft_model)
        self.drafters = {name: build(parts) for name in self.modes if (build := MODES[name].drafter) is not None}
        for runtime in (self.target, self.draft):
            if runtime is not None:
                runtime.warm_up()
        self.stop_ids = frozenset(_stop_ids(Path(target_dir), self.tokenizer))
        self.max_context = self.target.max_context
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._busy = threading.Lock()
        threading.Thread(target=self._work, name="engine-worker", daemon=True).start()

    # -- the worker -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            with self._busy:
                job()

    def with_models(self, fn: Callable[[Runtime, Runtime | None], T]) -> T:
        """Run ``fn(target, draft)`` on the worker thread, after the queued work, and return its
        result: the one way to use the models' runtimes directly (the tools measure with it)."""
        future: Future = Future()

        def job() -> None:
            try:
                future.set_result(fn(self.target, self.draft))
            except BaseException as exc:  # handed back to the caller's thread
                future.set_exception(exc)

        self._jobs.put(job)
        return future.result()

    @property
    def pending(self) -> int:
        """Requests waiting for or using the engine."""
        return self._jobs.qsize() + (1 if self._busy.locked() else 0)

    # -- generation -------------------------------------------------------------------------
    def prompt_ids(self, request: Request) -> list[int]:
        if request.prompt_ids:
            return list(request.prompt_ids)
        if not request.messages or not str(request.messages[-1].get("content", "")).strip():
            raise EngineError("the message is empty: type something first")
        ids: Any = self.tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    def text(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens left out)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def generate(self, request: Request) -> Stream:
        """Stream the events of one request (see :class:`Stream` for how to stop it)."""
        if request.mode not in self.modes:
            raise EngineError(f"unknown mode '{request.mode}': choose one of {', '.join(self.modes)}")
        stream = Stream()
        self._jobs.put(lambda: self._run(request, stream._events, stream._cancel))
        return stream

    def run(self, request: Request) -> Event:
        """Generate to the end; return the final event."""
        for event in self.generate(request):
            if event.final:
                return event
        raise EngineError("generation ended without a final event")

    def _run(self, request: Request, events: queue.Queue, cancel: threading.Event) -> None:
        stats = Stats(request.mode)
        out: list[int] = []
        try:
            prompt = self.prompt_ids(request)
            if not request.reuse_cache:
                self.reset()
                stats.start = time.perf_counter()
            detok = IncrementalDecoder(self.tokenizer)
            stops = StopStrings(request.stop_strings)
            drafter = self.drafters.get(request.mode)
            for round_ in decode(self.target, drafter, prompt, self._decode_config(request), stats):
                pieces = [(detok.push(t), p.value) for t, p in zip(round_.tokens, round_.provenance)]
                out += round_.tokens
                delta, stopped = stops.push("".join(piece for piece, _ in pieces))
                events.put(Event("delta", delta, pieces, stats.snapshot()))
                if stopped:
                    stats.finish_reason = "stop"
                    break
                if cancel.is_set():
                    stats.finish_reason = "cancelled"
                    break
            else:
                tail, stopped = stops.push(detok.flush())
                tail += "" if stopped else stops.flush()
                stats.finish_reason = "stop" if stopped else stats.finish_reason
                if tail:
                    events.put(Event("delta", tail, [(tail, Provenance.TARGET.value)], stats.snapshot()))
            events.put(Event("done", metrics=stats.snapshot(), token_ids=out))
        except EngineError as exc:
            events.put(Event("error", error=str(exc), metrics=stats.snapshot(), token_ids=out))
        except Exception as exc:  # never let one request kill the worker
            events.put(
                Event(
                    "error",
                    error=f"internal error: {type(exc).__name__}: {exc}",
                    metrics=stats.snapshot(),
                    token_ids=out,
                )
            )

    def _decode_config(self, request: Request) -> DecodeConfig:
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p, request.seed)
        mode = MODES[request.mode]
        return DecodeConfig(
            mode.drafter is not None, mode.k(request.k), request.max_new_tokens, sampling, self.stop_ids
        )

    def reset(self) -> None:
        """Empty both KV caches (worker thread only)."""
        for runtime in (self.target, self.draft):
            if runtime is not None:
                runtime.reset()


def _stop_ids(ir_dir: Path, tokenizer) -> set[int]:
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
