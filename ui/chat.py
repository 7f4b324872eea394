"""The chat tab: its layout, the handlers that stream an answer into it (small functions that
``yield``), and their wiring. Each handler streams updates of the chat outputs by name
(:class:`ChatUpdate`): the message box, the chat, the turns, the metrics panel, the metrics, the
plot and the compact metrics line (phones).

Handlers run concurrently and the engine serves their requests in arrival order, so a bad
request is answered at once, never after the answers ahead of it; a waiting user sees how many
are ahead."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import gradio as gr

from engine.core.metrics import FinishReason
from engine.core.requests import EventKind
from engine.interface import EngineClient
from ui import streaming
from ui.render import (
    CONTINUE,
    Turn,
    cut,
    footer_line,
    header_html,
    legend_html,
    metrics_html,
    reading_line,
    render_chat,
    turn_of,
)
from ui.sidebar import Sidebar
from ui.streaming import SKIP, Settings, Skip

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class ChatTab:
    turns: gr.State
    header: gr.HTML
    chatbot: gr.Chatbot
    metrics_line: gr.HTML
    colour: gr.Checkbox
    message: gr.Textbox
    send: gr.Button
    stop: gr.Button
    clear: gr.Button


class ChatUpdate(NamedTuple):
    """What an answer streams into, by name: each field updates the component of its name in the
    chat tab or the sidebar (:func:`outputs`); a field left at ``SKIP`` leaves it as it is."""

    message: str | Skip = SKIP  # the message box
    chatbot: list[dict] | Skip = SKIP  # the chat as drawn
    turns: list[Turn] | Skip = SKIP  # the conversation as kept
    metrics_panel: str | Skip = SKIP  # the figures' cards
    metrics_json: dict | Skip = SKIP  # the figures
    tps_plot: pd.DataFrame | Skip | None = SKIP  # tokens/s while streaming
    metrics_line: str | Skip = SKIP  # the compact figures line (phones)


def create_ui(engine: EngineClient, examples: list[dict]) -> ChatTab:
    """The tab's layout (``examples``: [{"label", "prompt"}])."""
    turns = gr.State([])
    header = gr.HTML(header_html(engine, []), elem_id="header")
    chatbot = gr.Chatbot(
        label="Chat",
        show_label=False,
        height=520,
        elem_id="chatbot",
        latex_delimiters=[],
        editable="user",
        buttons=["copy", "copy_all"],
        placeholder="Ask for some code. Tokens stream as the target accepts them.",
    )
    metrics_line = gr.HTML(elem_id="metrics-line")
    with gr.Row():  # (on a phone the legend wraps below the checkbox)
        colour = gr.Checkbox(False, label="Colour tokens by provenance", scale=0, min_width=260)
        with gr.Column(scale=1, min_width=300):
            gr.HTML(legend_html())
    with gr.Row(equal_height=True):
        message = gr.Textbox(
            placeholder="Type a message and press Enter",
            show_label=False,
            scale=6,
            lines=1,
            max_lines=8,
            elem_id="message",
            autofocus=True,
        )
        send = gr.Button("Send", variant="primary", scale=1, min_width=90, elem_id="send")
    with gr.Row():
        stop = gr.Button("Stop", variant="stop", size="sm", elem_id="stop")
        clear = gr.Button("Clear", size="sm", elem_id="clear")
    gr.Examples(
        [[e["prompt"]] for e in examples],
        inputs=[message],
        example_labels=[e["label"] for e in examples],
        label="Examples",
    )
    return ChatTab(turns, header, chatbot, metrics_line, colour, message, send, stop, clear)


# -- handlers ---------------------------------------------------------------------------------
class Answers:
    """The answer each browser session is streaming, so that Stop can end it in its own handler:
    the handler draws the answer as far as it came and returns, a normal end for Gradio. (With
    Gradio's ``cancels=`` the page cancels the event itself, and where the cancelled event's last,
    empty message lands after the cancel (a busy server) the page reads it as an error: the chat
    then stays under Gradio's error overlay and Continue cannot be clicked.)"""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self._stops: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def answering(self, request: gr.Request | None) -> Iterator[threading.Event]:
        """The Stop flag of the answer this browser tab starts (a tab has one answer at a time)."""
        stop, session = threading.Event(), request.session_hash if request is not None else None
        with self._lock:
            if session is not None:
                self._stops[session] = stop
        try:
            yield stop
        finally:
            with self._lock:
                if session is not None and self._stops.get(session) is stop:
                    del self._stops[session]

    def answer(
        self,
        request: gr.Request | None,
        turns: list[Turn],
        form: ChatForm,
        box: str | Skip,
        continuing: bool = False,
    ) -> Iterator[ChatUpdate]:
        """:func:`stream_answer` of ``turns`` with the form's settings, for the chat's handlers
        (which take this object first, as ``answers``), with the session's Stop flag."""
        with self.answering(request) as stop:
            client = streaming.client_of(request)
            yield from stream_answer(
                self.engine, turns, form.colour, form.settings, form.system, box, continuing, stop, client
            )

    def stop(self, request: gr.Request) -> None:
        """Stop: end the session's answer (nothing if none is streaming)."""
        with self._lock:
            stop = self._stops.get(request.session_hash) if request.session_hash is not None else None
        if stop is not None:
            stop.set()


@dataclass(frozen=True)
class ChatForm:
    """What every answering handler reads besides its own event: the turns, the colour checkbox,
    the sidebar's settings and the system prompt."""

    turns: list[Turn]
    colour: bool
    settings: Settings
    system: str


# The form's inputs as Gradio passes them after a handler's own (``wire``'s ``chat_in``), named as
# the API shows them: the turns, the colour, the settings as the sidebar orders them, the system prompt.
FORM_INPUTS = ("turns", "colour", *(f.name for f in fields(Settings)), "system")


def form_of(values: tuple[Any, ...]) -> ChatForm:
    turns, colour, *settings, system = values
    return ChatForm(turns, colour, Settings.from_form(**dict(zip(FORM_INPUTS[2:-1], settings, strict=True))), system)


def respond(answers: Answers, form: ChatForm, message: str | None, request: gr.Request) -> Iterator[ChatUpdate]:
    """Send ``message``; stream the answer into the chat, the metrics panel and the plot."""
    turns = [*form.turns, Turn(role="user", content=message or "")]
    yield from answers.answer(request, turns, form, box="")


def retry(answers: Answers, form: ChatForm, request: gr.Request) -> Iterator[ChatUpdate]:
    """Drop the last answer and ask the last user message again (the chat's retry button)."""
    users = [i for i, t in enumerate(form.turns) if t["role"] == "user"]
    if not users:
        gr.Warning("Nothing to retry yet: send a message first.")
        return
    last = users[-1]
    turns = [*form.turns[:last], Turn(role="user", content=form.turns[last]["content"])]
    yield from answers.answer(request, turns, form, box=SKIP)


def edit(answers: Answers, form: ChatForm, edited: gr.EditData, request: gr.Request) -> Iterator[ChatUpdate]:
    """A user message edited in the chat: the conversation goes on from it, answered again."""
    at = turn_of(form.turns, edited.index)  # type: ignore[arg-type]  # one index: a message, not a cell
    turns = [*form.turns[:at], Turn(role="user", content=str(edited.value))]
    yield from answers.answer(request, turns, form, box=SKIP)


def undo(turns: list[Turn], colour: bool, undone: gr.UndoData) -> ChatUpdate:
    """The chat's undo: the last message and its answer go; the message returns to the box."""
    at = turn_of(turns, undone.index)  # type: ignore[arg-type]
    return ChatUpdate(message=turns[at]["content"], chatbot=render_chat(turns[:at], colour), turns=turns[:at])


def chosen_option(answers: Answers, form: ChatForm, chosen: gr.SelectData, request: gr.Request) -> Iterator[ChatUpdate]:
    """An option under an answer was clicked: Continue is the one there is. It extends the last
    answer, cut by its cap or a Stop, from where it stopped (its tokens are in the session's KV
    caches: only the last is read again)."""
    if chosen.value != CONTINUE and not (isinstance(chosen.value, dict) and chosen.value.get("value") == CONTINUE):
        return
    if not form.turns or not cut(form.turns[-1]):
        gr.Warning("Nothing to continue: the last answer was not cut short.")
        return
    yield from answers.answer(request, form.turns, form, box=SKIP, continuing=True)


def clipped(text: str, keep: int = 2000) -> str:
    """A refused message as the chat shows it: its start, and how long it was."""
    return text if len(text) <= keep else f"{text[:keep]}… ({len(text):,} characters in all)"


def stream_answer(
    engine: EngineClient,
    turns: list[Turn],
    colour: bool,
    settings: Settings,
    system: str,
    box: str | Skip,
    continuing: bool = False,
    stop: threading.Event | None = None,
    client: str = "",
) -> Iterator[ChatUpdate]:
    """Answer the last user turn (or, ``continuing``, extend the last answer); while a long
    message is read, say how far in the answer's place. ``stop`` set (Stop): the answer ends as
    far as it came, marked ``cancelled`` so that Continue can extend it. Closing this generator
    (Gradio's cancel) ends it without drawing. Either closes the engine stream, which cancels the
    request within one round."""
    if continuing:
        answer: Turn = {**turns[-1], "pieces": list(turns[-1]["pieces"]), "token_ids": list(turns[-1]["token_ids"])}
        turns = [*turns[:-1], answer]
    else:
        answer = Turn(role="assistant", content="", pieces=[], token_ids=[])
        turns = [*turns, answer]
    request = streaming.make_request(
        streaming.conversation(turns[:-1], system),
        settings,
        answer_ids=answer["token_ids"],
        client=client,
    )
    throughput = streaming.Throughput()
    placeholder = False  # the answer's place shows how far the message is read
    events = engine.generate(request)
    try:
        if engine.full:  # a place in the queue is news only when the engine is full
            place = max(engine.waiting, 1)
            waiting = f'<div class="metrics empty">The engine is full: you are number {place} in the queue.</div>'
            yield ChatUpdate(
                message=box, chatbot=render_chat(turns, colour), turns=turns, metrics_panel=waiting, metrics_json={}
            )
        drawn_at = 0.0
        for event in events.waiting(streaming.HEARTBEAT_S):
            if stop is not None and stop.is_set():
                if answer.get("metrics"):
                    answer["metrics"] = {**answer["metrics"], "finish_reason": FinishReason.CANCELLED}
                    yield drawn(box, turns, answer, colour, "stopped", throughput.plot(final=True))
                elif placeholder:  # (stopped while the message was read: it stays, unanswered)
                    yield ChatUpdate(
                        message=box,
                        chatbot=render_chat(turns[:-1], colour),
                        turns=turns[:-1],
                        metrics_panel=metrics_html({}),
                        metrics_json={},
                        metrics_line="",
                    )
                return
            if event is None:  # nothing new: yield anyway, so that Stop can take effect now
                yield ChatUpdate()
                continue
            if event.kind == EventKind.PROGRESS:
                if time.monotonic() - drawn_at >= streaming.REDRAW_S:
                    drawn_at, placeholder = time.monotonic(), True
                    reading: Turn = {**answer, "content": reading_line(event.metrics)}
                    yield drawn(box, turns, reading, colour, "reading…", gr.skip(), event.metrics)
                continue
            if event.kind == EventKind.ERROR:
                gr.Warning(event.error)
                if not continuing:  # (a continued answer keeps what it had)
                    answer["content"], answer["failed"], turns[-2]["failed"] = event.error, True, True
                    turns[-2]["content"] = clipped(turns[-2]["content"])  # a refused paste is not drawn whole
            else:
                answer["content"] += event.text
                answer["pieces"] += [list(piece) for piece in event.pieces]
                answer["token_ids"] += [] if event.final else event.token_ids
                answer["metrics"] = event.metrics
            throughput.add(event.metrics)
            if not event.final and time.monotonic() - drawn_at < streaming.REDRAW_S:
                continue
            drawn_at = time.monotonic()
            status = {EventKind.DELTA: "streaming…", EventKind.ERROR: "error"}.get(event.kind, "")
            yield drawn(box, turns, answer, colour, status, throughput.plot(event.final), event.metrics)
    finally:
        events.close()


def drawn(
    box: str | Skip,
    turns: list[Turn],
    answer: Turn,
    colour: bool,
    status: str,
    plot: pd.DataFrame | Skip | None,
    metrics: dict | None = None,
) -> ChatUpdate:
    """The chat outputs with ``answer`` as the last turn (``metrics``: the figures to show, by
    default the answer's own)."""
    metrics = answer.get("metrics", {}) if metrics is None else metrics
    # A copy: Gradio keeps what is yielded by reference, and this answer grows on.
    copied: Turn = {**answer, "pieces": list(answer["pieces"]), "token_ids": list(answer["token_ids"])}
    shown = [*turns[:-1], copied]
    return ChatUpdate(
        message=box,
        chatbot=render_chat(shown, colour),
        turns=shown,
        metrics_panel=metrics_html(metrics, status),
        metrics_json=metrics,
        tps_plot=plot,
        metrics_line=footer_line(metrics),
    )


def clear_chat() -> ChatUpdate:
    """Clear: an empty message box, chat and panel."""
    return ChatUpdate(
        message="",
        chatbot=[],
        turns=[],
        metrics_panel=metrics_html({}),
        metrics_json={},
        tps_plot=None,
        metrics_line="",
    )


def bound(fn: Callable[..., Any], *leading: object) -> Callable[..., Any]:
    """``partial(fn, *leading)`` as Gradio can read it: Gradio finds the parameters that take an
    event's data (``gr.EditData``...) or its request (``gr.Request``) by their type hints, which a
    partial hides."""
    parameters = list(inspect.signature(fn).parameters.values())[len(leading) :]
    return _handler(fn, parameters, lambda args: (*leading, *args))


def answering(fn: Callable[..., Iterator[ChatUpdate]], answers: Answers) -> Callable[..., Any]:
    """``fn(answers, form, *own)`` as a Gradio handler that takes its own inputs and then the
    form's (:data:`FORM_INPUTS`), which reach ``fn`` as one :class:`ChatForm`."""
    own = list(inspect.signature(fn).parameters.values())[2:]
    form = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in FORM_INPUTS]
    return _handler(fn, own + form, lambda args: (answers, form_of(args[len(own) :]), *args[: len(own)]))


def _handler(
    fn: Callable[..., Any], parameters: list[inspect.Parameter], arguments: Callable[[tuple], tuple]
) -> Callable[..., Any]:
    """A function of ``parameters`` (with ``fn``'s type hints, its name and doc) that calls ``fn``
    with ``arguments(args)``."""
    if inspect.isgeneratorfunction(fn):

        def handler(*args: Any) -> Any:
            yield from fn(*arguments(args))
    else:

        def handler(*args: Any) -> Any:
            return fn(*arguments(args))

    handler.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    handler.__annotations__ = {p.name: fn.__annotations__[p.name] for p in parameters if p.name in fn.__annotations__}
    handler.__name__, handler.__doc__ = fn.__name__, fn.__doc__
    return handler


# -- wiring -----------------------------------------------------------------------------------
def outputs(chat: ChatTab, sidebar: Sidebar) -> list[gr.components.Component]:
    """What an answer streams into: the components a :class:`ChatUpdate` names, in its order."""
    return streaming.components_named(ChatUpdate._fields, chat, sidebar)


def wire(answers: Answers, chat: ChatTab, sidebar: Sidebar, saved: dict[str, Any]) -> list:
    """The chat's events; ``saved``: what keeps the conversation after each (see
    :func:`ui.conversations.saving`). Returns the events that answer, which leaving a
    conversation cancels."""
    chat_in = [chat.turns, chat.colour, *sidebar.settings, sidebar.system]
    chat_out = outputs(chat, sidebar)
    queued: dict[str, Any] = {"show_progress_on": chat.chatbot, **streaming.ENGINE_QUEUE}
    private = streaming.BOOKKEEPING
    chat_events = [
        gr.on(
            [chat.message.submit, chat.send.click],
            answering(respond, answers),
            [chat.message, *chat_in],
            chat_out,
            api_name="respond",
            **queued,
        ),
        chat.chatbot.retry(answering(retry, answers), chat_in, chat_out, api_name="retry", **queued),
        chat.chatbot.edit(answering(edit, answers), chat_in, chat_out, api_visibility="private", **queued),
        chat.chatbot.option_select(
            answering(chosen_option, answers), chat_in, chat_out, api_visibility="private", **queued
        ),
    ]
    for event in chat_events:
        event.then(**saved, **private)
    chat.stop.click(answers.stop, None, None, **private)
    chat.chatbot.undo(undo, [chat.turns, chat.colour], chat_out, **private).then(**saved, **private)
    chat.clear.click(
        clear_chat, None, chat_out, cancels=chat_events, api_name="clear", queue=False, show_progress="hidden"
    ).then(**saved, **private)
    chat.chatbot.clear(clear_chat, None, chat_out, cancels=chat_events, **private).then(**saved, **private)
    chat.colour.change(render_chat, [chat.turns, chat.colour], chat.chatbot, **private)
    return chat_events
