"""The chat tab: its layout, the handlers that stream an answer into it (small functions that
``yield``), and their wiring. Each handler streams into the chat outputs: the message box, the
chat, the turns, the metrics panel, the metrics, the plot and the compact metrics line (phones).

Handlers run concurrently and the engine serves their requests in arrival order, so a bad
request is answered at once, never after the answers ahead of it; a waiting user sees how many
are ahead."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import gradio as gr

from engine.interface import EngineClient
from ui import streaming
from ui.render import CONTINUE, cut, footer_line, header_html, legend_html, metrics_html, render_chat, turn_of
from ui.sidebar import Sidebar


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
def respond(engine, message, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed, system=""):
    """Send ``message``; stream the answer into the chat, the metrics panel and the plot."""
    turns = [*turns, {"role": "user", "content": message or ""}]
    settings = (mode, k, temperature, top_p, max_new_tokens, seed)
    yield from stream_answer(engine, turns, colour, settings, system, box="")


def retry(engine, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed, system=""):
    """Drop the last answer and ask the last user message again (the chat's retry button)."""
    users = [i for i, t in enumerate(turns) if t["role"] == "user"]
    if not users:
        gr.Warning("Nothing to retry yet: send a message first.")
        return
    last = users[-1]
    turns = [*turns[:last], {"role": "user", "content": turns[last]["content"]}]
    settings = (mode, k, temperature, top_p, max_new_tokens, seed)
    yield from stream_answer(engine, turns, colour, settings, system, box=gr.skip())


def edit(engine, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed, system, edited: gr.EditData):
    """A user message edited in the chat: the conversation goes on from it, answered again."""
    at = turn_of(turns, edited.index)  # type: ignore[arg-type]  # one index: a message, not a cell
    turns = [*turns[:at], {"role": "user", "content": str(edited.value)}]
    settings = (mode, k, temperature, top_p, max_new_tokens, seed)
    yield from stream_answer(engine, turns, colour, settings, system, box=gr.skip())


def undo(turns, colour, undone: gr.UndoData):
    """The chat's undo: the last message and its answer go; the message returns to the box."""
    at = turn_of(turns, undone.index)  # type: ignore[arg-type]
    return turns[at]["content"], render_chat(turns[:at], colour), turns[:at]


def continue_answer(engine, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed, system=""):
    """Extend the last answer, cut by its cap or a Stop, from where it stopped (its tokens are
    in the session's KV caches: only the last is read again)."""
    if not turns or not cut(turns[-1]):
        gr.Warning("Nothing to continue: the last answer was not cut short.")
        return
    settings = (mode, k, temperature, top_p, max_new_tokens, seed)
    yield from stream_answer(engine, turns, colour, settings, system, box=gr.skip(), continuing=True)


def chosen_option(
    engine, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed, system, chosen: gr.SelectData
):
    """An option under an answer was clicked: Continue is the one there is."""
    if chosen.value == CONTINUE or (isinstance(chosen.value, dict) and chosen.value.get("value") == CONTINUE):
        yield from continue_answer(engine, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed, system)


def clipped(text: str, keep: int = 2000) -> str:
    """A refused message as the chat shows it: its start, and how long it was."""
    return text if len(text) <= keep else f"{text[:keep]}… ({len(text):,} characters in all)"


def stream_answer(engine: EngineClient, turns, colour, settings, system, box, continuing=False):
    """Answer the last user turn (or, ``continuing``, extend the last answer). Closing this
    generator (Stop) closes the engine stream, which cancels the request within one round."""
    if continuing:
        answer = {**turns[-1], "pieces": list(turns[-1]["pieces"]), "token_ids": list(turns[-1]["token_ids"])}
        turns = [*turns[:-1], answer]
    else:
        answer = {"role": "assistant", "content": "", "pieces": [], "token_ids": []}
        turns = [*turns, answer]
    request = streaming.make_request(
        streaming.conversation(turns[:-1], system),
        *settings,
        context=engine.max_context,
        answer_ids=answer["token_ids"],
    )
    throughput = streaming.Throughput()
    events = engine.generate(request)
    try:
        if engine.full:  # a place in the queue is news only when the engine is full
            place = max(engine.waiting, 1)
            waiting = f'<div class="metrics empty">The engine is full: you are number {place} in the queue.</div>'
            yield box, render_chat(turns, colour), turns, waiting, {}, gr.skip(), gr.skip()
        drawn_at = 0.0
        for event in events.waiting(streaming.HEARTBEAT_S):
            if event is None:  # nothing new: yield anyway, so that Stop can take effect now
                yield (gr.skip(),) * 7
                continue
            if event.kind == "error":
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
            status = {"delta": "streaming…", "error": "error"}.get(event.kind, "")
            # A copy: Gradio keeps what is yielded by reference, and this answer grows on.
            shown = [*turns[:-1], {**answer, "pieces": list(answer["pieces"]), "token_ids": list(answer["token_ids"])}]
            yield (
                box,
                render_chat(shown, colour),
                shown,
                metrics_html(event.metrics, status),
                event.metrics,
                throughput.plot(event.final),
                footer_line(event.metrics),
            )
    finally:
        events.close()


def stopped(turns, colour, metrics):
    """The chat and metrics once Stop has cancelled a stream (unchanged if none was streaming: a
    finished answer's metrics carry its finish reason): the answer so far can be continued."""
    m = turns[-1].get("metrics") if turns and turns[-1]["role"] == "assistant" else None
    if not m or m["finish_reason"]:  # (no answer under way: nothing was stopped)
        return gr.skip(), gr.skip(), gr.skip()
    turns = [*turns[:-1], {**turns[-1], "metrics": {**turns[-1]["metrics"], "finish_reason": "cancelled"}}]
    return render_chat(turns, colour), turns, metrics_html(metrics, "stopped")


def clear_chat():
    return "", [], [], metrics_html({}), {}, None, ""


def engine_bound(fn: Callable, engine: EngineClient) -> Callable:
    """``partial(fn, engine)`` as Gradio can read it: Gradio finds the parameter that takes an
    event's data (``gr.EditData``...) by its type hint, which a partial hides."""
    if inspect.isgeneratorfunction(fn):

        def bound(*args):
            yield from fn(engine, *args)
    else:

        def bound(*args):
            return fn(engine, *args)

    bound.__signature__ = inspect.Signature(list(inspect.signature(fn).parameters.values())[1:])  # type: ignore[attr-defined]
    bound.__annotations__ = {name: hint for name, hint in fn.__annotations__.items() if name != "engine"}
    bound.__name__, bound.__doc__ = fn.__name__, fn.__doc__
    return bound


# -- wiring -----------------------------------------------------------------------------------
def outputs(chat: ChatTab, sidebar: Sidebar) -> list[gr.components.Component]:
    """What an answer streams into (the handlers' order)."""
    return [chat.message, chat.chatbot, chat.turns, *sidebar.panels, chat.metrics_line]


def wire(engine: EngineClient, chat: ChatTab, sidebar: Sidebar, saved: dict[str, Any]) -> list:
    """The chat's events; ``saved``: what keeps the conversation after each (see
    :func:`ui.conversations.saving`). Returns the events that answer, which Stop and leaving a
    conversation cancel."""
    chat_in = [chat.turns, chat.colour, *sidebar.settings, sidebar.system]
    chat_out = outputs(chat, sidebar)
    answering: dict[str, Any] = {"show_progress_on": chat.chatbot, **streaming.ENGINE_QUEUE}
    private: dict[str, Any] = {"queue": False, "api_visibility": "private"}
    chat_events = [
        gr.on(
            [chat.message.submit, chat.send.click],
            partial(respond, engine),
            [chat.message, *chat_in],
            chat_out,
            api_name="respond",
            **answering,
        ),
        chat.chatbot.retry(partial(retry, engine), chat_in, chat_out, api_name="retry", **answering),
        chat.chatbot.edit(engine_bound(edit, engine), chat_in, chat_out, api_visibility="private", **answering),
        chat.chatbot.option_select(
            engine_bound(chosen_option, engine), chat_in, chat_out, api_visibility="private", **answering
        ),
    ]
    for event in chat_events:
        event.then(**saved, **private)
    chat.stop.click(None, cancels=chat_events).then(
        stopped,
        [chat.turns, chat.colour, sidebar.metrics_json],
        [chat.chatbot, chat.turns, sidebar.metrics_panel],
        **private,
    ).then(**saved, **private)
    chat.chatbot.undo(undo, [chat.turns, chat.colour], [chat.message, chat.chatbot, chat.turns], **private).then(
        **saved, **private
    )
    chat.clear.click(clear_chat, None, chat_out, cancels=chat_events, api_name="clear", queue=False).then(
        **saved, **private
    )
    chat.chatbot.clear(clear_chat, None, chat_out, cancels=chat_events, **private).then(**saved, **private)
    chat.colour.change(render_chat, [chat.turns, chat.colour], chat.chatbot, **private)
    return chat_events
