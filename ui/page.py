"""The whole page on one engine: the status banner, the sidebar and the two tabs laid out,
then wired. Per-browser data lives in ``gr.State`` and the browser's storage; the one engine is
shared by every visitor."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import NamedTuple

import gradio as gr

from engine.cli import ASSETS
from engine.core.turns import NO_LIMITS, ClientLimits
from engine.core.window import Overflow
from engine.interface import EngineClient
from ui import chat, compare, conversations, sidebar, streaming
from ui.render import Turn, header_html, status_html

QUEUE_POLL_S = 0.02  # how often Gradio's idle queue looks for new events (its default: 0.001 s); see quiet_queue
PROGRESS_POLL_S = 0.1  # how often it looks for progress to send (its default: 0.01 s)


def load_examples(path: Path = ASSETS / "examples.json") -> list[dict]:
    """The prompts the Examples under each tab offer: [{"label", "prompt"}]."""
    return json.loads(path.read_text())


def build_app(
    engine: EngineClient,
    examples: list[dict] | None = None,
    secret: str | None = None,
    limits: ClientLimits = NO_LIMITS,
    overflow: str = Overflow.WINDOW,
) -> gr.Blocks:
    """The whole UI on one engine. ``examples``: [{"label", "prompt"}] (default:
    assets/examples.json). ``secret``: the key the conversations kept in each browser are
    encrypted with (default: a new one, so they last as long as this server). ``limits``: what
    the engine allows each visitor, stated on the page. ``overflow``: the page's setting for a
    conversation past the input cap, as it starts (the server's ``--context-overflow``)."""
    examples = load_examples() if examples is None else examples
    with gr.Blocks(
        title="SpecChat · speculative decoding on CPU",
        analytics_enabled=False,
        fill_height=True,
        fill_width=True,
        delete_cache=(3600, 3600),  # exported files
    ) as demo:
        stores = conversations.create_stores(secret)
        status = gr.HTML(status_html(engine.state), elem_id="status")
        if said := limits.describe():
            gr.Markdown(f"This shared server allows each visitor {said}.", elem_id="limits")
        status_timer = gr.Timer(1.0, active=engine.state != "ok")
        side = sidebar.create_ui(engine, overflow)
        with gr.Tab("Chat"):
            chat_tab = chat.create_ui(engine, examples)
        with gr.Tab("Compare"):
            compare_tab = compare.create_ui(engine, examples)

        saved = conversations.saving(engine, stores, chat_tab, side)
        chat_events = chat.wire(chat.Answers(engine), chat_tab, side, saved)

        def engine_health() -> dict:
            """Whether the engine is making progress, and how many requests wait for it or use it."""
            return {"healthy": engine.healthy, "pending": engine.pending}

        gr.api(engine_health, api_name="health", queue=False)
        status_timer.tick(
            partial(refresh_status, engine),
            chat_tab.turns,
            [{"status": status, "timer": status_timer, "header": chat_tab.header}[f] for f in StatusUpdate._fields],
            **streaming.BOOKKEEPING,
        )
        conversations.wire(engine, demo, stores, chat_tab, side, chat_events)
        sidebar.wire(demo, side)
        compare.wire(engine, compare_tab, side)
    demo.queue(default_concurrency_limit=None, max_size=64)
    quiet_queue(demo)
    return demo


class StatusUpdate(NamedTuple):
    """The banner, its timer and the chat's header, as :func:`refresh_status` updates them."""

    status: str
    timer: gr.Timer
    header: str


def refresh_status(engine: EngineClient, turns: list[Turn]) -> StatusUpdate:
    """The banner's next state and the header (the models' names, once known); the timer stops
    once the models serve."""
    state = engine.state
    return StatusUpdate(
        status=status_html(state), timer=gr.Timer(active=state.startswith("loading")), header=header_html(engine, turns)
    )


def quiet_queue(demo: gr.Blocks) -> None:
    """Gradio's queue looks for new events every millisecond while it is idle and for progress
    a hundred times a second, taking a share of a core from decoding with no one connected. At QUEUE_POLL_S a
    new request waits a little longer to start, and answers run faster (docs/benchmarks.md,
    "Gradio's idle queue")."""
    demo._queue.sleep_when_free = QUEUE_POLL_S
    demo._queue.progress_update_sleep_when_free = PROGRESS_POLL_S
