"""An OpenAI-compatible chat API over the engine, for editors and tools (Continue, aider, Open
WebUI, the ``openai`` client): ``POST /v1/chat/completions`` (streamed as server-sent events or
not), ``GET /v1/models`` and ``GET /health``.

Requests go through the same engine queue as the web UI. Errors come in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status a client expects:
400 for a bad field, 401 for a wrong key, 429 with ``Retry-After`` when the caller holds its
share of the queue (``engine.core.turns``), 503 when the engine is unhealthy. Two extensions pick
the decoding: ``mode`` and ``k``; ``context_overflow`` what becomes of a conversation longer than
the input cap (``engine.core.window``). ``usage`` carries the speculative figures as well, and
``messages_out_of_view``: the messages the model did not see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.core.chat import Message as ChatMessage
from engine.core.metrics import FinishReason
from engine.core.requests import DEFAULT_K, DEFAULT_MODE, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, Event, EventKind, Stream
from engine.core.requests import Request as EngineRequest
from engine.core.turns import ADDRESS, KEY
from engine.core.window import Overflow
from engine.interface import EngineClient

# OpenAI's finish reasons for ours: a cancelled or context-limited answer ended early.
# OpenAI names two ends: "length" (any limit) and "stop" (every other end).
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.CONTEXT: "length"}


class Message(BaseModel):
    """A chat message. Its content may come as a list of parts, as the ``openai`` client and
    editors send it: the text parts are joined, anything else is refused (these models read
    text only). A ``developer`` message (OpenAI's newer name) is a system one."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def joined(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
        if kinds - {"text"}:
            raise ValueError(f"only text parts are read here, not {', '.join(sorted(map(str, kinds - {'text'})))}")
        return "".join(str(part.get("text", "")) for part in content)

    def chat(self) -> ChatMessage:
        """The message as the engine's chat template takes it."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletion(BaseModel):
    """The fields of OpenAI's chat completion request that apply here, and two extensions."""

    model_config = ConfigDict(extra="ignore")
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = DEFAULT_TEMPERATURE  # (the engine's: greedy, where OpenAI's is 1)
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    mode: str = DEFAULT_MODE  # extension: the decoding mode
    k: int = DEFAULT_K  # extension: the draft length where the mode takes one
    context_overflow: Overflow | None = None  # extension: past the input cap (None: the server's)

    def engine_request(self) -> EngineRequest:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return EngineRequest(
            messages=tuple(m.chat() for m in self.messages),
            mode=self.mode,
            k=self.k,
            max_new_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_strings=tuple(stops),
            context_overflow=self.context_overflow,
        )


def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    code = {400: "invalid_request", 401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "unavailable"}
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code.get(status)}}, status_code=status
    )


def usage(metrics: dict) -> dict[str, Any]:
    """OpenAI's token counts, and the speculative figures (docs/design.md, "Metrics")."""
    return {
        "prompt_tokens": metrics["prompt_tokens"],
        "completion_tokens": metrics["new_tokens"],
        "total_tokens": metrics["prompt_tokens"] + metrics["new_tokens"],
        "prompt_tokens_details": {"cached_tokens": metrics["cached_tokens"]},
        "drafted_tokens": metrics["drafted"],
        "accepted_tokens": metrics["accepted"],
        "acceptance_rate": metrics["acceptance_rate"],
        "target_passes": metrics["target_passes"],
        "mean_accepted_length": metrics["mean_accepted_length"],
        "tokens_per_second": metrics["tokens_per_s"],
        "time_to_first_token_s": metrics["ttft_s"],
        "mode": metrics["mode"],
        "messages_out_of_view": metrics["messages_out_of_view"],
    }


def client_of(http: Request, keyed: bool, trust_proxy: bool = False) -> str:
    """Who asks: on a server that requires a key (``keyed``; the caller's was checked), that key as
    a short digest; else their address (a stranger); behind a proxy the operator trusts
    (``trust_proxy``), the first address of ``X-Forwarded-For``."""
    given = http.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if keyed and given:
        return KEY + hashlib.sha256(given.encode()).hexdigest()[:12]
    forwarded = http.headers.get("x-forwarded-for", "").split(",")[0].strip() if trust_proxy else ""
    return ADDRESS + (forwarded or (http.client.host if http.client else "unknown"))


def build_router(
    engine: EngineClient, model_id: str, models: dict[str, Any], api_key: str | None, trust_proxy: bool = False
) -> APIRouter:
    """The API's routes over ``engine``; ``models`` describes the pair for ``/health``;
    ``trust_proxy``: a caller's address is the first of ``X-Forwarded-For``."""
    router = APIRouter()

    def refusal(http: Request) -> JSONResponse | None:
        """A wrong key or an unhealthy engine, answered before any work (a client over its share
        is refused by the engine: 429 with ``Retry-After``)."""
        if api_key:
            given = http.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given.encode(), api_key.encode()):
                return error(401, "a valid API key is needed: Authorization: Bearer KEY", "invalid_request_error")
        if not engine.healthy:
            return error(503, f"the engine is not ready ({engine.state}); try again later", "server_error")
        return None

    @router.get("/health")
    def health() -> JSONResponse:
        # (each role's model as running, once loaded: its kernels, e.g. "... · gguf · ggml kernels")
        running = engine.models
        described = {
            role: spec | ({"running": running[role]} if role in running else {}) for role, spec in models.items()
        }
        body = {"status": engine.state, "models": described, "queue": engine.pending, "replicas": engine.replicas}
        # (when the kernels, the reader and the passes were timed; the op's choices per pass shape)
        body |= {name: running[name] for name in ("measured", "batching", "op kernels") if name in running}
        return JSONResponse(body, status_code=200 if engine.healthy else 503)

    @router.get("/v1/models")
    def list_models(http: Request) -> JSONResponse:
        if api_key and (refused := refusal(http)) and refused.status_code == 401:
            return refused
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "specchat",
                        "modes": list(engine.modes),
                    }
                ],
            }
        )

    @router.post("/v1/chat/completions", response_model=None)
    def chat_completions(http: Request, body: dict[str, Any]) -> JSONResponse | StreamingResponse:
        if refused := refusal(http):
            return refused
        try:
            asked = ChatCompletion.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return error(400, f"{where}: {first['msg']}", "invalid_request_error", where)
        request = dataclasses.replace(asked.engine_request(), client=client_of(http, bool(api_key), trust_proxy))
        stream = engine.generate(request)
        if stream.refusal and stream.retry_after is not None:  # its client holds its share
            refused = error(429, stream.refusal, "rate_limit_error")
            refused.headers["Retry-After"] = str(round(stream.retry_after))
            return refused
        if stream.refusal:  # checked (and tokenized) once, by the engine
            return error(400, stream.refusal, "invalid_request_error")
        completion = f"chatcmpl-{uuid.uuid4().hex}"
        if asked.stream:
            include_usage = bool(asked.stream_options and asked.stream_options.include_usage)
            chunks = sse(completion, model_id, stream, include_usage)
            return StreamingResponse(closing(stream, chunks), media_type="text/event-stream")
        return whole(completion, model_id, stream)

    return router


def envelope(completion: str, model_id: str, kind: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
    """What every completion body and chunk carries around its choices."""
    return {
        "id": completion,
        "object": kind,
        "created": int(time.time()),
        "model": model_id,
        "choices": choices,
        **extra,
    }


def finish_reason(metrics: dict) -> str:
    return FINISH_REASONS.get(metrics["finish_reason"], "stop")


def whole(completion: str, model_id: str, stream: Stream) -> JSONResponse:
    """A non-streamed answer: every event read, one JSON body."""
    text, final = "", Event(EventKind.ERROR, error="no answer")
    try:
        for event in stream:
            text += event.text
            final = event
    finally:
        stream.close()
    if final.kind == EventKind.ERROR:
        return error(503, final.error, "server_error")
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish_reason(final.metrics),
    }
    return JSONResponse(envelope(completion, model_id, "chat.completion", [choice], usage=usage(final.metrics)))


async def closing(stream: Stream, chunks: Iterator[str]) -> AsyncIterator[str]:
    """``chunks`` read off the event loop. A client that goes away cancels the response, and so
    the engine stream at once, also while the request waits in line: its place is free for its
    client's next request (a sync iterator would run on until the next chunk failed to send)."""
    try:
        while (chunk := await anyio.to_thread.run_sync(next, chunks, None, abandon_on_cancel=True)) is not None:
            yield chunk
    finally:
        stream.close()


def sse(completion: str, model_id: str, stream: Stream, include_usage: bool) -> Iterator[str]:
    """Server-sent events: a role chunk, a chunk per text delta, the finish reason, the usage
    (if asked), ``[DONE]``. A client that goes away closes the engine stream, which cancels it."""

    def chunk(choices: list[dict], **extra: Any) -> str:
        return f"data: {json.dumps(envelope(completion, model_id, 'chat.completion.chunk', choices, **extra))}\n\n"

    def delta(content: dict, finish: str | None = None) -> str:
        return chunk([{"index": 0, "delta": content, "finish_reason": finish}])

    try:
        yield delta({"role": "assistant", "content": ""})
        final = Event(EventKind.ERROR, error="no answer")
        for event in stream:
            final = event
            if event.kind == EventKind.ERROR:
                yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
                break
            if event.text:
                yield delta({"content": event.text})
        else:
            yield delta({}, finish_reason(final.metrics))
            if include_usage:
                yield chunk([], usage=usage(final.metrics))
        yield "data: [DONE]\n\n"
    finally:
        stream.close()
