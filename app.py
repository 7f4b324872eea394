"""SpecChat: a chat web app over the speculative-decoding engine.

``python app.py [--target SPEC] [--draft SPEC] [--host H] [--port N] [--share] [--auth USER:PASS]``,
or ``specchat serve ...`` once installed (``pip install .``; ``specchat --help`` lists the tools).

One file, read top to bottom: rendering helpers, the handlers (small functions that
stream by ``yield``), the layout and its event wiring in ``build_app``, then the
launch. Per-browser data lives in ``gr.State``; the one engine is shared. Handlers run
concurrently and the engine serves their requests in arrival order, so a bad request is
answered at once, never after the answers ahead of it; a waiting user sees how many are ahead.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import html
import importlib
import inspect
import io
import json
import logging
import math
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import lru_cache, partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no usage pings to the internet

import gradio as gr
import pandas as pd
from fastapi import APIRouter, FastAPI

from engine.api.openai import build_router
from engine.cli import ASSETS, is_loopback, run_cli
from engine.cluster import deploy as cluster
from engine.core.modes import MODES
from engine.core.service import Loading, Request
from engine.errors import EngineError
from engine.prepare.pipeline import add_model_arguments, cache_dir_from_args
from engine.render import markdown, transcript
from engine.startup import start_engine
from engine.tools import paper
from engine.tools.report import markdown_table, speedup

AUTH_ENV = "SPECCHAT_AUTH"
SECRET_ENV = "SPECCHAT_BROWSER_SECRET"
API_KEY_ENV = "SPECCHAT_API_KEY"
ENGINE_QUEUE: dict[str, Any] = {"concurrency_limit": None}  # the engine orders the requests itself
PAPER_LENGTHS = (40, 100)
# A streaming answer is redrawn at most this often (rounds in between are drawn together), its
# live plot less often still: a browser re-renders the whole answer at every redraw, and on the
# same CPU that is time taken from decoding (a 256-token answer in Chromium on this 2-core
# machine: 11.8 tokens/s when every round was drawn, 15.3 so; docs/benchmarks.md, "The chat in a browser").
REDRAW_S = 0.3
PLOT_EVERY_S = 1.0
# A handler waiting for the engine yields this often: Gradio can stop a handler only between yields.
HEARTBEAT_S = 0.5
QUEUE_POLL_S = 0.02  # how often Gradio's idle queue looks for new events (its default: 1 ms); see quiet_queue
PROGRESS_POLL_S = 0.1  # how often it looks for progress to send (its default: 10 ms)
LEGEND = {
    "draft": "accepted draft token",
    "target": "target correction",
    "bonus": "target bonus token",
    "autoregressive": "target, one pass per token",
}
CUT = ("length", "cancelled")  # finish reasons of an answer Continue can extend
CONTINUE = "continue"  # the option a cut answer's footer offers
MAX_CAP = 8192  # the largest cap on new tokens the form offers (0: none but the context)
SIDES = ("left", "right")  # the compare tab's two runs
RACE_FRAME_S = 0.1  # the race's redraw period
STORE_KEY = "specchat-conversations"  # where each browser keeps its conversations
MAX_CONVERSATIONS = 30  # kept per browser, the oldest dropped first
TITLE_LENGTH = 48
EXPORTS = Path(tempfile.gettempdir()) / "specchat-exports"  # exported files, kept an hour
EXPORTS_KEPT_S = 3600
# What a stored answer's figures must hold for its footer to be drawn.
METRIC_KEYS = frozenset(
    {
        "mode",
        "new_tokens",
        "tokens_per_s",
        "acceptance_rate",
        "mean_accepted_length",
        "finish_reason",
        "expected_speedup",
        "ttft_s",
        "prompt_tokens",
        "cached_tokens",
        "target_passes",
        "draft_s",
        "target_s",
        "target_kv_bytes",
        "draft_kv_bytes",
    }
)
# Phones: the settings start closed (they would cover the chat), the compact metrics line shows.
CLOSE_SIDEBAR_ON_PHONES = """() => {
  if (window.innerWidth < 768) document.querySelector('#sidebar .toggle-button, .sidebar .toggle-button')?.click();
}"""
THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate")


# -- settings and conversation ----------------------------------------------------------------
def make_request(
    messages, mode, k, temperature, top_p, max_new_tokens, seed, *, context: int, reuse_cache=True, answer_ids=()
) -> Request:
    """The sidebar's settings as an engine request; the engine refuses what is out of range.
    ``max_new_tokens`` 0: until the model stops, within its ``context``. ``answer_ids``: the
    tokens of an answer this request continues."""
    cap = _whole(max_new_tokens)
    return Request(
        messages=tuple(messages),
        answer_ids=tuple(answer_ids),
        mode=mode,
        k=_whole(k),
        max_new_tokens=context if cap == 0 else cap,
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None or (_finite(seed) and seed < 0) else _whole(seed),
        reuse_cache=reuse_cache,
    )


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _whole(value):
    """A form's whole number (Gradio sends 4.0 for 4) as an int; anything else as it came."""
    return int(value) if _finite(value) and value == int(value) else value


def clipped(text: str, keep: int = 2000) -> str:
    """A refused message as the chat shows it: its start, and how long it was."""
    return text if len(text) <= keep else f"{text[:keep]}… ({len(text):,} characters in all)"


def conversation(turns: list[dict], system: str = "") -> list[dict]:
    """What the model sees: the system prompt (if any), then the plain text of every turn that
    did not fail."""
    said = [{"role": t["role"], "content": t["content"]} for t in turns if not t.get("failed")]
    return ([{"role": "system", "content": system}] if system and system.strip() else []) + said


def load_examples(path: Path = ASSETS / "examples.json") -> list[dict]:
    return json.loads(path.read_text())


def cut(turn: dict) -> bool:
    """An answer the cap (or a Stop) cut short, which Continue can extend from where it stopped."""
    m = turn.get("metrics") or {}
    return not turn.get("failed") and bool(turn.get("token_ids")) and m.get("finish_reason") in CUT


# -- rendering --------------------------------------------------------------------------------
def render_answer(turn: dict, colour: bool) -> str:
    """An answer as the chat draws it: Markdown (Gradio renders it and highlights its code), or
    with ``colour`` our own rendering with each token's provenance drawn on it."""
    if turn.get("failed"):
        return f"⚠️ **Could not answer:** {turn['content']}"
    if colour and turn.get("pieces"):
        return coloured(turn["content"], tuple(markdown.provenance_of(turn["pieces"])))
    return turn["content"]


@lru_cache(maxsize=128)
def coloured(content: str, provenance: tuple[str, ...]) -> str:
    """An answer rendered with its provenance, once: a chat redraws every earlier answer too."""
    return markdown.render(content, provenance)


def footer_line(m: dict) -> str:
    """An answer's figures on one line: the footer under it, and the compact line on phones."""
    if not m:
        return ""
    speculative = m["mode"] != "autoregressive"
    parts = [m["mode"], f"{m['new_tokens']} tokens", f"{m['tokens_per_s']:.1f} tokens/s"]
    if speculative:
        parts += [f"acceptance {m['acceptance_rate']:.0%}", f"{m['mean_accepted_length']:.2f} tokens/pass"]
    if m.get("speedup_vs_ar") is not None and speculative:
        parts.append(f"{m['speedup_vs_ar']:.2f}× vs autoregressive (measured)")
    elif speculative and m["finish_reason"]:
        parts.append(f"≈{m['expected_speedup']:.2f}× vs autoregressive (expected)")
    if m.get("sharing", 1) > 1:
        parts.append(f"served with {m['sharing'] - 1} other request{'s' * (m['sharing'] > 2)}")
    return " · ".join(parts)


def footer_details(m: dict) -> str:
    """What the footer opens to: the figures that do not fit on its line."""
    rows = [
        ("time to first token", _seconds(m["ttft_s"])),
        ("prompt tokens (found in the KV cache)", f"{m['prompt_tokens']} ({m['cached_tokens']})"),
        ("target passes", f"{m['target_passes']}"),
        ("draft / target time", f"{m['draft_s']:.2f} / {m['target_s']:.2f} s"),
        ("KV cache", _bytes(m["target_kv_bytes"] + m["draft_kv_bytes"])),
        ("finish", m["finish_reason"]),
    ]
    if m.get("replica"):  # (served by an engine replica of a cluster)
        rows.append(("replica", m["replica"]))
    return "\n".join(["| | |", "|---|---|", *(f"| {label} | {value} |" for label, value in rows)])


def footer_message(turn: dict, last: bool) -> dict | None:
    """The finished answer's footer: Gradio's collapsible "thought" line under it, holding the
    figures; an answer cut short offers Continue as the footer's option. (None while streaming:
    a footer redrawn at every round costs the browser, and so the engine, more than the rest.)"""
    m = turn.get("metrics")
    if turn.get("failed") or not m or not m["finish_reason"]:  # (while streaming: the metrics panel)
        return None
    footer: dict[str, Any] = {
        "role": "assistant",
        "content": footer_details(m),
        "metadata": {"title": footer_line(m), "status": "done"},
    }
    if last and cut(turn):  # (Continue extends the last answer only)
        footer["options"] = [{"value": CONTINUE, "label": "Continue ▸"}]
    return footer


def drawn(turns: list[dict], colour: bool) -> list[tuple[int, dict]]:
    """The chatbot's messages, each with the turn it draws (footers draw their answer's turn);
    an empty user message is not drawn, only the error it caused."""
    messages: list[tuple[int, dict]] = []
    for i, t in enumerate(turns):
        if t["role"] == "user":
            if t["content"].strip():
                messages.append((i, {"role": "user", "content": t["content"]}))
            continue
        messages.append((i, {"role": "assistant", "content": render_answer(t, colour)}))
        if footer := footer_message(t, last=i == len(turns) - 1):
            messages.append((i, footer))
    return messages


def render_chat(turns: list[dict], colour: bool) -> list[dict]:
    return [message for _, message in drawn(turns, colour)]


def turn_of(turns: list[dict], index: int) -> int:
    """The turn a chatbot message (by its index, as Gradio's events give it) draws."""
    return drawn(turns, colour=False)[index][0]


def legend_html() -> str:
    items = "".join(f'<span class="tok tok-{p}">{html.escape(label)}</span>' for p, label in LEGEND.items())
    return f'<div class="legend">{items}</div>'


def last_metrics(turns: list[dict]) -> dict:
    """The figures of the conversation's last answer (empty before the first)."""
    return next((t["metrics"] for t in reversed(turns) if t.get("metrics")), {})


def header_html(engine, turns: list[dict]) -> str:
    """The models in use and how much of the context the conversation fills."""
    models = engine.models
    if not models:
        return '<div class="chat-header">models loading…</div>'
    last = last_metrics(turns)
    used = last["prompt_tokens"] + last["new_tokens"] if last else 0
    names = " · ".join(
        f'<span class="model"><b>{role}</b> {html.escape(label)}</span>' for role, label in models.items()
    )
    return (
        f'<div class="chat-header">{names}<span class="context">context {used:,} / '
        f"{engine.max_context:,} tokens</span></div>"
    )


def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _seconds(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def metrics_html(m: dict, status: str = "") -> str:
    """The live metrics panel: one card per figure; acceptance only where a draft is used.
    ``status`` shows in the corner (default: the finish reason)."""
    if not m:
        return '<div class="metrics empty">Send a message to see live metrics.</div>'
    speculative = m["mode"] != "autoregressive"  # every other mode drafts tokens
    cards = [
        ("tokens/s", f"{m['tokens_per_s']:.1f}"),
        ("acceptance", f"{m['acceptance_rate']:.0%}" if speculative else "—"),
        ("mean accepted length", f"{m['mean_accepted_length']:.2f}"),
        ("time to first token", _seconds(m["ttft_s"])),
        ("target passes", f"{m['target_passes']}"),
        ("new tokens", f"{m['new_tokens']}"),
        ("draft / target time", f"{m['draft_s']:.2f} / {m['target_s']:.2f} s"),
        ("KV cache", f"{_bytes(m['target_kv_bytes'] + m['draft_kv_bytes'])}"),
        ("requests served together", f"{m.get('sharing', 1)}"),
        ("batch of the last pass", f"{m.get('batch_size', 1)}"),
    ]
    body = "".join(
        f'<div class="card"><div class="value">{html.escape(value)}</div>'
        f'<div class="label">{html.escape(label)}</div></div>'
        for label, value in cards
    )
    mode = html.escape(m["mode"])
    return (
        f'<div class="metrics" data-mode="{mode}">'
        f'<div class="metrics-head"><span class="pill pill-{mode}">{mode}</span>'
        f'<span class="finish">{html.escape(status or m["finish_reason"])}</span></div>'
        f'<div class="cards">{body}</div></div>'
    )


class Throughput:
    """Tokens/s samples of one stream for the live plot: the running average and each round's rate."""

    COLUMNS: ClassVar[dict[str, type]] = {"time_s": float, "tokens_per_s": float, "series": str}

    def __init__(self):
        self.rows: list[tuple[float, float, str]] = []
        self.last = (0.0, 0)  # (wall_s, new_tokens) at the previous sample
        self.drawn_at = 0.0

    def add(self, m: dict) -> None:
        wall, tokens = m.get("wall_s", 0.0), m.get("new_tokens", 0)
        if tokens == self.last[1] or wall <= 0:
            return
        self.rows.append((wall, m["tokens_per_s"], "average"))
        if wall > self.last[0]:  # (the first round's rate includes the prefill, like the average)
            self.rows.append((wall, (tokens - self.last[1]) / (wall - self.last[0]), "this round"))
        self.last = (wall, tokens)

    def frame(self) -> pd.DataFrame | None:
        """The samples so far (None while there are none: a plot first drawn empty stays blank)."""
        if not self.rows:
            return None
        return pd.DataFrame(self.rows, columns=list(self.COLUMNS)).astype(self.COLUMNS)

    def plot(self, final: bool):
        """The plot's new value, or ``gr.skip()`` between redraws."""
        if not final and time.monotonic() - self.drawn_at < PLOT_EVERY_S:
            return gr.skip()
        self.drawn_at = time.monotonic()
        return self.frame()


# -- chat handlers ----------------------------------------------------------------------------
# Each streams into the chat outputs: the message box, the chat, the turns, the metrics panel,
# the metrics, the plot and the compact metrics line (phones).
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


def stream_answer(engine, turns, colour, settings, system, box, continuing=False):
    """Answer the last user turn (or, ``continuing``, extend the last answer). Closing this
    generator (Stop) closes the engine stream, which cancels the request within one round."""
    if continuing:
        answer = {**turns[-1], "pieces": list(turns[-1]["pieces"]), "token_ids": list(turns[-1]["token_ids"])}
        turns = [*turns[:-1], answer]
    else:
        answer = {"role": "assistant", "content": "", "pieces": [], "token_ids": []}
        turns = [*turns, answer]
    request = make_request(
        conversation(turns[:-1], system), *settings, context=engine.max_context, answer_ids=answer["token_ids"]
    )
    throughput = Throughput()
    events = engine.generate(request)
    try:
        if engine.full:  # a place in the queue is news only when the engine is full
            place = max(engine.waiting, 1)
            waiting = f'<div class="metrics empty">The engine is full: you are number {place} in the queue.</div>'
            yield box, render_chat(turns, colour), turns, waiting, {}, gr.skip(), gr.skip()
        drawn_at = 0.0
        for event in events.waiting(HEARTBEAT_S):
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
            if not event.final and time.monotonic() - drawn_at < REDRAW_S:
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


def status_html(state: str) -> str:
    """A banner while the models are prepared (or could not be); nothing once they serve."""
    if state == "ok":
        return ""
    kind, _, detail = state.partition(": ")
    icon = {"loading": "⏳ Preparing the models", "failed": "⚠️ The models could not be prepared"}.get(kind, "⚠️ Busy")
    return f'<div class="status status-{html.escape(kind)}">{icon}: {html.escape(detail or state)}</div>'


def refresh_status(engine, turns):
    """The banner's next state and the header (the models' names, once known); the timer stops
    once the models serve."""
    state = engine.state
    return status_html(state), gr.Timer(active=state.startswith("loading")), header_html(engine, turns)


def draft_length_for(mode):
    """K only matters where tokens are drafted."""
    return gr.update(interactive=mode != "autoregressive")


# -- conversations kept in the browser --------------------------------------------------------
def new_id() -> str:
    return uuid.uuid4().hex[:12]


def title_of(turns: list[dict]) -> str:
    first = next((t["content"].strip() for t in turns if t["role"] == "user" and t["content"].strip()), "")
    line = first.splitlines()[0] if first else ""
    return (line[:TITLE_LENGTH] + "…" if len(line) > TITLE_LENGTH else line) or "New chat"


def remember(store: dict, conv_id: str, turns: list[dict], system: str, title: str = "") -> dict:
    """``store`` with the conversation ``conv_id`` as it is now (the newest first; the oldest
    beyond :data:`MAX_CONVERSATIONS` dropped; its title kept once given). An empty new
    conversation is not kept."""
    kept = dict((store or {}).get("conversations", {}))
    if turns or conv_id in kept:
        title = title or kept.get(conv_id, {}).get("title") or title_of(turns)
        stored = [compact(t, last=i == len(turns) - 1) for i, t in enumerate(turns)]
        kept[conv_id] = {"title": title[:TITLE_LENGTH], "system": system, "turns": stored, "updated": time.time()}
    newest = sorted(kept, key=lambda c: kept[c]["updated"], reverse=True)[:MAX_CONVERSATIONS]
    return {"current": conv_id, "conversations": {c: kept[c] for c in newest}}


def compact(turn: dict, last: bool) -> dict:
    """A turn as the browser keeps it (its storage holds a few MB): provenance as runs, not per
    token; token ids only where Continue may need them (a cut last answer)."""
    kept = {k: v for k, v in turn.items() if k not in ("pieces", "token_ids")}
    if turn.get("pieces"):
        kept["pieces"] = [["".join(t for t, _ in run), kind] for kind, run in groupby(turn["pieces"], itemgetter(1))]
    if last and cut(turn):
        kept["token_ids"] = turn["token_ids"]
    return kept


def sanitized(store) -> dict:
    """A store as the browser sent it, with what this version cannot show left out (an older or
    tampered value must not stop the page from opening)."""
    if not isinstance(store, dict) or not isinstance(store.get("conversations"), dict):
        return {}
    kept = {
        c: v
        for c, v in store["conversations"].items()
        if isinstance(v, dict)
        and isinstance(v.get("title"), str)
        and isinstance(v.get("system"), str)
        and isinstance(v.get("updated"), int | float)
        and isinstance(v.get("turns"), list)
        and all(_well_formed(t) for t in v["turns"])
    }
    return {"current": store.get("current"), "conversations": kept}


def _well_formed(turn) -> bool:
    return (
        isinstance(turn, dict)
        and turn.get("role") in ("user", "assistant")
        and isinstance(turn.get("content"), str)
        and (not turn.get("metrics") or set(turn["metrics"]) >= METRIC_KEYS)
        and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in turn.get("pieces", [])
        )
        and all(isinstance(t, int) for t in turn.get("token_ids", []))
    )


def conversation_list(store: dict, conv_id: str) -> dict:
    """The sidebar's list: every kept conversation, newest first, the open one selected."""
    kept = store.get("conversations", {})
    choices = [(kept[c]["title"], c) for c in sorted(kept, key=lambda c: kept[c]["updated"], reverse=True)]
    if conv_id not in kept:
        choices.insert(0, ("New chat", conv_id))
    return gr.update(choices=choices, value=conv_id)


def save(engine, store, conv_id, turns, system):
    """After an answer (or an edit): keep the conversation in the browser; refresh the list and header."""
    store = remember(store, conv_id, turns, system)
    return store, conversation_list(store, conv_id), header_html(engine, turns)


def show(engine, store: dict, conv_id: str, colour: bool) -> tuple:
    """Open the conversation ``conv_id`` of ``store`` (a new, empty one if it is not there)."""
    kept = store.get("conversations", {}).get(conv_id, {})
    turns, system = kept.get("turns", []), kept.get("system", "")
    store = {**store, "current": conv_id}
    return (
        store,
        conv_id,
        turns,
        render_chat(turns, colour),
        system,
        conversation_list(store, conv_id),
        header_html(engine, turns),
        metrics_html({}),
        {},
        None,
        footer_line(last_metrics(turns)),
    )


def restore(engine, store, colour):
    """The page opened: the conversation it had open last, else a new one."""
    store = sanitized(store)
    return show(engine, store, store.get("current") or new_id(), colour)


def new_chat(engine, store, colour):
    return show(engine, store, new_id(), colour)


def delete_chat(engine, store, conv_id, colour):
    """Forget the open conversation; open the newest other one (or a new one)."""
    kept = {c: v for c, v in store.get("conversations", {}).items() if c != conv_id}
    store = {"current": None, "conversations": kept}
    newest = max(kept, key=lambda c: kept[c]["updated"], default=None)
    return show(engine, store, newest or new_id(), colour)


def export_chat(turns, system):
    """The open conversation as a JSON file (everything, for import) and a Markdown file (to read)."""
    if not turns:
        gr.Warning("Nothing to export yet: send a message first.")
        return gr.skip()
    title = title_of(turns)
    messages = [t for t in turns if not t.get("failed")]
    EXPORTS.mkdir(exist_ok=True)
    for old in EXPORTS.iterdir():  # (Gradio serves its own copies; these are only its sources)
        if time.time() - old.stat().st_mtime > EXPORTS_KEPT_S:
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(dir=EXPORTS))
    stem = re.sub(r"[^\w-]+", "-", title).strip("-")[:40] or "conversation"
    (folder / f"{stem}.json").write_text(transcript.to_json(title, system, messages))
    (folder / f"{stem}.md").write_text(transcript.to_markdown(title, system, messages))
    return gr.update(value=[str(folder / f"{stem}.json"), str(folder / f"{stem}.md")], visible=True)


def import_chat(engine, store, path, colour):
    """A conversation file (JSON or Markdown, as exported) opened as a new conversation; a file
    that is not one is refused with what is wrong, and nothing open is touched."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        title, system, messages = transcript.parse(Path(path).name, text)
    except (ValueError, UnicodeDecodeError) as exc:
        reason = "it is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
        gr.Warning(f"Could not import: {reason}")
        return (gr.skip(),) * 11
    conv_id = new_id()  # (figures recorded in the file are not shown: they describe another run)
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    return show(engine, remember(store, conv_id, turns, system, title), conv_id, colour)


# -- compare handlers -------------------------------------------------------------------------
def run_stats(m: dict) -> str:
    if not m:
        return ""
    line = (
        f"**{m['tokens_per_s']:.1f} tokens/s** · {m['new_tokens']} tokens in {m['wall_s']:.2f} s"
        f" · TTFT {_seconds(m['ttft_s'])}"
    )
    if m["mode"] != "autoregressive":
        line = f"{line} · acceptance {m['acceptance_rate']:.0%} · mean accepted length {m['mean_accepted_length']:.2f}"
    return line


def verdict_html(runs: dict, temperature: float) -> str:
    """Speedup of the right run over the left (left wall / right wall) and whether both
    produced the same tokens."""
    if not all(r["final"] for r in runs.values()):
        return ""
    left, right = runs["left"], runs["right"]
    times = speedup(left["metrics"]["wall_s"], right["metrics"]["wall_s"]) or 0.0
    if left["token_ids"] == right["token_ids"]:
        badge = '<span class="badge same">✓ identical output</span>'
    else:
        why = " (sampling: equal only in distribution)" if temperature > 0 else ""
        badge = f'<span class="badge differ">outputs differ{html.escape(why)}</span>'
    walls = (
        f"{html.escape(right['mode'])} {right['metrics']['wall_s']:.2f} s vs "
        f"{html.escape(left['mode'])} {left['metrics']['wall_s']:.2f} s"
    )
    return (
        f'<div class="verdict"><span class="speedup">{times:.2f}× speedup</span>'
        f'<span class="detail">{walls}</span>{badge}</div>'
    )


def speed_frame(runs: dict) -> pd.DataFrame:
    """Tokens/s of both runs (0 for one still to run): the bar chart draws only the bars it first saw."""
    rows = [
        (f"{side}: {run['mode']}", run["metrics"]["tokens_per_s"] if run["final"] else 0.0)
        for side, run in runs.items()
    ]
    return pd.DataFrame(rows, columns=["run", "tokens_per_s"]).astype({"run": str, "tokens_per_s": float})


def compare(engine, prompt, left, right, k, temperature, top_p, max_new_tokens, seed, system=""):
    """The prompt in the ``left`` mode, then in the ``right`` one, each with fresh caches (both
    stream); then both answers race side by side at their measured pace."""
    messages = conversation([{"role": "user", "content": prompt}], system)
    settings = (k, temperature, top_p, max_new_tokens, seed)
    requests = {
        side: make_request(messages, mode, *settings, context=engine.max_context, reuse_cache=False)
        for side, mode in zip(SIDES, (left, right))
    }
    runs: dict[str, dict[str, Any]] = {
        side: {"mode": request.mode, "text": "", "metrics": {}, "token_ids": [], "timeline": [], "final": False}
        for side, request in requests.items()
    }
    try:  # both sides checked before either runs
        for request in requests.values():
            engine.check(request)
    except EngineError as exc:
        gr.Warning(str(exc))
        yield "", f"⚠️ **Could not answer:** {exc}", "", "", "", None, gr.skip()
        return
    for side, request in requests.items():
        run, drawn_at = runs[side], 0.0
        events = engine.generate(request)
        try:
            for event in events.waiting(HEARTBEAT_S):
                if event is None:
                    yield (gr.skip(),) * 7
                    continue
                if event.kind == "error":
                    gr.Warning(event.error)
                    run["text"] = f"⚠️ **Could not answer:** {event.error}"
                    yield *compare_frame(runs, temperature), gr.skip()
                    return
                run["text"] += event.text
                run["metrics"] = event.metrics
                run["timeline"].append((event.metrics["wall_s"], len(run["text"]), event.metrics["new_tokens"]))
                run["token_ids"], run["final"] = event.token_ids, event.final
                if event.final or time.monotonic() - drawn_at >= REDRAW_S:
                    drawn_at = time.monotonic()
                    yield *compare_frame(runs, temperature), gr.skip()
        finally:
            events.close()
    yield from ((*frame, runs) for frame in race(runs, temperature))


def compare_frame(runs: dict, temperature: float) -> tuple:
    """The compare outputs as the runs stand (the one running shows what it has so far)."""
    texts = [runs[s]["text"] for s in SIDES]
    stats = [run_stats(runs[s]["metrics"]) if runs[s]["final"] else "" for s in SIDES]
    return *texts, *stats, verdict_html(runs, temperature), speed_frame(runs)


def race(runs: dict, temperature: float):
    """Both answers again from nothing, each at the pace it was measured at, with live counters;
    the verdict once both have finished."""
    if not runs or not all(r["final"] for r in runs.values()):  # (nothing raced yet)
        return
    start = time.monotonic()
    end = max(run["metrics"]["wall_s"] for run in runs.values())
    while (now := time.monotonic() - start) < end:
        shown = [_raced(runs[side], now) for side in SIDES]
        yield shown[0][0], shown[1][0], shown[0][1], shown[1][1], "", gr.skip()
        time.sleep(RACE_FRAME_S)
    yield compare_frame(runs, temperature)


def _raced(run: dict, now: float) -> tuple[str, str]:
    """A run's text and live counter at ``now`` seconds into its replay."""
    walls = [wall for wall, _, _ in run["timeline"]]
    at = bisect.bisect_right(walls, now)
    if at >= len(walls):
        return run["text"], run_stats(run["metrics"])
    chars, tokens = run["timeline"][at - 1][1:] if at else (0, 0)
    return run["text"][:chars] + " ▌", f"**{tokens / max(now, 1e-3):.1f} tokens/s** · {tokens} tokens · {now:.1f} s"


PAPER_COLUMNS = [c for c in paper.COLUMNS if c.key not in ("setup", "target_kv_kib", "draft_kv_kib")]


def paper_table(engine, prompt, k):
    """AR vs SD at N = 40 and 100 new tokens, greedy, fresh caches: the paper's table."""
    messages = ({"role": "user", "content": prompt},)
    rows: list[dict] = []
    for n in PAPER_LENGTHS:
        ar_wall = None
        for mode in ("autoregressive", "speculative"):
            request = Request(messages, mode=mode, k=_whole(k), max_new_tokens=n, temperature=0.0, reuse_cache=False)
            events = engine.generate(request)
            try:
                for event in events.waiting(HEARTBEAT_S):
                    if event is None:
                        yield gr.skip()
                        continue
                    if event.kind == "error":
                        gr.Warning(event.error)
                        yield table_markdown(rows, f"⚠️ {event.error}")
                        return
                    m = event.metrics
                    if not event.final:
                        yield table_markdown(rows, f"running {mode}, N={n}: {m['new_tokens']}/{n} tokens…")
            finally:
                events.close()
            ar_wall = m["wall_s"] if mode == "autoregressive" else ar_wall
            speculative = mode == "speculative"
            rows.append(
                {
                    "mode": f"speculative (K={int(k)})" if speculative else mode,
                    "n": n,
                    "tokens_per_s": m["tokens_per_s"],
                    "speedup_vs_ar": speedup(ar_wall, m["wall_s"]),
                    "acceptance_rate": m["acceptance_rate"] if speculative else None,
                    "mean_accepted_length": m["mean_accepted_length"],
                }
            )
            yield table_markdown(rows, "")
    yield table_markdown(rows, "greedy, fresh KV caches per run; speedup = AR wall time / SD wall time")


def table_markdown(rows: list[dict], note: str) -> str:
    return markdown_table(rows, PAPER_COLUMNS) + (f"\n\n_{note}_" if note else "")


def engine_bound(fn: Callable, engine) -> Callable:
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


# -- layout and wiring ------------------------------------------------------------------------
def build_app(engine, examples: list[dict] | None = None, secret: str | None = None) -> gr.Blocks:
    """The whole UI on one engine. ``examples``: [{"label", "prompt"}] (default:
    assets/examples.json). ``secret``: the key the conversations kept in each browser are
    encrypted with (default: a new one, so they last as long as this server)."""
    examples = load_examples() if examples is None else examples
    max_tokens = max(16, min(MAX_CAP, engine.max_context))
    with gr.Blocks(
        title="SpecChat · speculative decoding on CPU",
        analytics_enabled=False,
        fill_height=True,
        fill_width=True,
        delete_cache=(3600, 3600),  # exported files
    ) as demo:
        turns = gr.State([])
        conv_id = gr.State(new_id)
        store = gr.BrowserState({}, storage_key=STORE_KEY, secret=secret)
        status = gr.HTML(status_html(engine.state), elem_id="status")
        status_timer = gr.Timer(1.0, active=engine.state != "ok")

        with gr.Sidebar(width=360, label="Settings", elem_id="sidebar"):
            gr.Markdown("## ⚡ SpecChat\nA small draft model proposes *K* tokens; the target checks them in one pass.")
            with gr.Accordion("Conversations", open=True):
                conversations = gr.Dropdown([], label="Open conversation", elem_id="conversations", filterable=False)
                with gr.Row():
                    new = gr.Button("New chat", size="sm", elem_id="new-chat")
                    delete = gr.Button("Delete", size="sm", variant="stop", elem_id="delete-chat")
                with gr.Row():
                    export = gr.Button("Export", size="sm", elem_id="export")
                    upload = gr.UploadButton(
                        "Import", size="sm", file_types=[".json", ".md"], type="filepath", elem_id="import"
                    )
                exported = gr.File(label="Exported (JSON, Markdown)", file_count="multiple", visible=False)
            system = gr.Textbox(
                "",
                label="System prompt",
                lines=2,
                max_lines=8,
                placeholder="Empty: the model's own default",
                elem_id="system",
            )
            mode = gr.Radio(
                list(engine.modes),
                label="Decoding mode",
                elem_id="mode",
                value=engine.modes[0],
                info=" · ".join(f"{m}: {MODES[m].help}" for m in engine.modes),
            )
            k = gr.Slider(1, 8, value=4, step=1, label="Draft length K")
            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature", info="0 = greedy")
            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
            max_new_tokens = gr.Slider(
                0,
                max_tokens,
                value=0,
                step=8,
                label="Max new tokens",
                info="0 = until the model stops (within the context); a cut answer can be continued",
                elem_id="max-new-tokens",
            )
            seed = gr.Number(-1, precision=0, minimum=-1, label="Seed", info="-1 = a new random seed each time")
            gr.Markdown("### Live metrics")
            metrics_panel = gr.HTML(metrics_html({}), elem_id="metrics")
            tps_plot = gr.LinePlot(
                None,
                x="time_s",
                y="tokens_per_s",
                color="series",
                x_title="time (s)",
                y_title="tokens/s",
                title="tokens/s while streaming",
                height=220,
                elem_id="tps-plot",
                color_map={"average": "#4f46e5", "this round": "#10b981"},
            )
            with gr.Accordion("All metrics (JSON)", open=False):
                metrics_json = gr.JSON(label="metrics")

        with gr.Tab("Chat"):
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

        with gr.Tab("Compare"):
            gr.Markdown(
                "One prompt in two modes, one after the other on the same engine (fresh caches each), "
                "then both answers race side by side at the pace each was measured at. Other settings "
                "from the sidebar."
            )
            prompt = gr.Textbox(
                label="Prompt", lines=2, value=examples[0]["prompt"] if examples else "", elem_id="compare-prompt"
            )
            with gr.Row():
                left_mode = gr.Dropdown(list(engine.modes), value="autoregressive", label="Left", elem_id="left-mode")
                right_mode = gr.Dropdown(list(engine.modes), value=engine.modes[0], label="Right", elem_id="right-mode")
            with gr.Row():
                run_compare = gr.Button("Compare", variant="primary", elem_id="run-compare")
                again = gr.Button("Race again", elem_id="race-again")
                run_table = gr.Button("Paper table (N = 40, 100; greedy)")
                stop_compare = gr.Button("Stop", variant="stop")
            verdict = gr.HTML(elem_id="verdict")
            panes = []
            with gr.Row(equal_height=True):
                for side in SIDES:
                    with gr.Column():
                        text = gr.Markdown(height=320, container=True, latex_delimiters=[], elem_id=f"{side}-text")
                        stats = gr.Markdown(elem_id=f"{side}-stats")
                        panes.append((text, stats))
            runs = gr.State({})
            speed_bars = gr.BarPlot(
                None, x="run", y="tokens_per_s", color="run", height=220, title="tokens/s", y_lim=[0, None]
            )
            table = gr.Markdown(elem_id="paper-table")
            gr.Examples(
                [[e["prompt"]] for e in examples],
                inputs=[prompt],
                example_labels=[e["label"] for e in examples],
                label="Examples",
            )

        # -- wiring --
        settings = [mode, k, temperature, top_p, max_new_tokens, seed]
        chat_in = [turns, colour, *settings, system]
        chat_out = [message, chatbot, turns, metrics_panel, metrics_json, tps_plot, metrics_line]
        opened = [store, conv_id, turns, chatbot, system, conversations, header, *chat_out[3:]]
        saved: dict[str, Any] = {
            "fn": partial(save, engine),
            "inputs": [store, conv_id, turns, system],
            "outputs": [store, conversations, header],
        }
        answering: dict[str, Any] = {"show_progress_on": chatbot, **ENGINE_QUEUE}
        chat_events = [
            gr.on(
                [message.submit, send.click],
                partial(respond, engine),
                [message, *chat_in],
                chat_out,
                api_name="respond",
                **answering,
            ),
            chatbot.retry(partial(retry, engine), chat_in, chat_out, api_name="retry", **answering),
            chatbot.edit(engine_bound(edit, engine), chat_in, chat_out, api_visibility="private", **answering),
            chatbot.option_select(
                engine_bound(chosen_option, engine), chat_in, chat_out, api_visibility="private", **answering
            ),
        ]
        for event in chat_events:
            event.then(**saved, queue=False, api_visibility="private")
        stop.click(None, cancels=chat_events).then(
            stopped,
            [turns, colour, metrics_json],
            [chatbot, turns, metrics_panel],
            queue=False,
            api_visibility="private",
        ).then(**saved, queue=False, api_visibility="private")
        chatbot.undo(undo, [turns, colour], [message, chatbot, turns], queue=False, api_visibility="private").then(
            **saved, queue=False, api_visibility="private"
        )
        clear.click(clear_chat, None, chat_out, cancels=chat_events, api_name="clear", queue=False).then(
            **saved, queue=False, api_visibility="private"
        )
        chatbot.clear(clear_chat, None, chat_out, cancels=chat_events, queue=False, api_visibility="private").then(
            **saved, queue=False, api_visibility="private"
        )
        system.blur(**saved, queue=False, api_visibility="private")

        def engine_health() -> dict:
            """Whether the engine is making progress, and how many requests wait for it or use it."""
            return {"healthy": engine.healthy, "pending": engine.pending}

        gr.api(engine_health, api_name="health", queue=False)
        private: dict[str, Any] = {"queue": False, "api_visibility": "private"}
        status_timer.tick(partial(refresh_status, engine), turns, [status, status_timer, header], **private)
        demo.load(partial(restore, engine), [store, colour], opened, **private)
        demo.load(None, js=CLOSE_SIDEBAR_ON_PHONES)
        # Leaving a conversation: its answer stopped, the conversation kept as it stands, then the next opened.
        leaving: dict[str, Any] = {
            "fn": remember,
            "inputs": [store, conv_id, turns, system],
            "outputs": store,
            "cancels": chat_events,
            **private,
        }
        new.click(**leaving).then(partial(new_chat, engine), [store, colour], opened, **private)
        delete.click(partial(delete_chat, engine), [store, conv_id, colour], opened, cancels=chat_events, **private)
        conversations.input(**leaving).then(partial(show, engine), [store, conversations, colour], opened, **private)
        # (the import queued: a warning reaches the page only through the queue)
        upload.upload(**leaving).then(
            partial(import_chat, engine), [store, upload, colour], opened, api_visibility="private"
        )
        export.click(export_chat, [turns, system], exported, api_visibility="private")
        colour.change(render_chat, [turns, colour], chatbot, **private)
        mode.change(draft_length_for, mode, k, **private)

        compare_out = [panes[0][0], panes[1][0], panes[0][1], panes[1][1], verdict, speed_bars]
        compare_events = [
            run_compare.click(
                partial(compare, engine),
                [prompt, left_mode, right_mode, k, temperature, top_p, max_new_tokens, seed, system],
                [*compare_out, runs],
                api_name="compare",
                **ENGINE_QUEUE,
            ),
            again.click(race, [runs, temperature], compare_out, api_visibility="private"),
            run_table.click(partial(paper_table, engine), [prompt, k], table, api_name="paper_table", **ENGINE_QUEUE),
        ]
        stop_compare.click(None, cancels=compare_events)  # type: ignore[arg-type]  # Gradio takes its events here
    demo.queue(default_concurrency_limit=None, max_size=64)
    quiet_queue(demo)
    return demo


def quiet_queue(demo: gr.Blocks) -> None:
    """Gradio's queue looks for new events every millisecond while it is idle and for progress
    every 10 ms: 5% of a core with no one connected, taken from decoding on the same cores. At
    QUEUE_POLL_S a new request waits up to 20 ms more to start; the lone user's answers ran 2–9%
    faster (docs/benchmarks.md, "The tenth session's measurements")."""
    demo._queue.sleep_when_free = QUEUE_POLL_S
    demo._queue.progress_update_sleep_when_free = PROGRESS_POLL_S


# -- launch -----------------------------------------------------------------------------------
def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    auth: tuple[str, str] | None = None,
    block: bool = True,
    api: APIRouter | None = None,
) -> str:
    """Serve ``demo`` (and ``api``'s routes on the same port) and return its local URL. Where no
    share link can be made (no internet, no tunnel client), say so in one line and keep serving
    locally."""
    gradio_says = io.StringIO()
    with contextlib.redirect_stdout(gradio_says) if share else contextlib.nullcontext():
        demo.launch(
            server_name=host,
            server_port=port,
            share=share,
            auth=auth,
            prevent_thread_lock=True,
            quiet=True,
            **page_options(),
        )
    if api is not None:
        demo.server_app.include_router(api)
    local = str(demo.local_url)
    if share and demo.share_url:
        print(f"serving at {local} and at the public link {demo.share_url}", flush=True)
    elif share:
        said = next((line.strip() for line in gradio_says.getvalue().splitlines() if line.strip()), "")
        reason = said.removeprefix("Could not create share link.").strip().rstrip(".") or "no tunnel"
        print(
            f"share link unavailable: Gradio could not open its tunnel ({reason}; it needs internet access); "
            f"serving locally at {local}",
            flush=True,
        )
    else:
        print(f"serving at {local}", flush=True)
    if block:
        demo.block_thread()
    return local


def page_options() -> dict[str, Any]:
    """How the page is served, alone or mounted in the cluster's ingress."""
    return {
        "show_error": False,  # users see the handlers' own messages; tracebacks go to the log
        "max_file_size": "1mb",  # (the only uploads: conversations to import)
        "theme": THEME,
        "css_paths": [ASSETS / "style.css"],
        "css": markdown.highlight_css(),
        "footer_links": ["api", "settings"],
    }


def web_app(args: argparse.Namespace, engine) -> FastAPI:
    """The page and the API on ``engine`` as one ASGI app: what the cluster's ingress serves."""
    server = FastAPI()
    server.include_router(build_router(engine, args.target, model_sources(args), args.api_key))
    demo = build_app(engine, secret=browser_secret(cache_dir_from_args(args)))
    return gr.mount_gradio_app(server, demo, path="/", auth=parse_auth(args.auth), **page_options())


def model_sources(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Each role's source and precision as given, for /health."""
    return {
        role: {"source": getattr(args, role), "precision": getattr(args, f"{role}_precision")}
        for role in ("target", "draft")
    }


def launch_warnings(host: str, share: bool, auth: tuple[str, str] | None, keyed: bool = False) -> list[str]:
    """What an operator should hear before strangers can reach the app or its API without a login."""
    if is_loopback(host) and not share:
        return []
    reach = "a public share link" if share else f"the address {host}"
    said = [] if auth else [f"{reach} serves the app without a login: pass --auth USER:PASS (or ${AUTH_ENV})"]
    if not keyed and not is_loopback(host):
        said.append(f"the address {host} serves the API (/v1) without a key: pass --api-key KEY (or ${API_KEY_ENV})")
    return said


def parse_auth(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not (sep and user and password):
        raise ValueError(f"--auth / ${AUTH_ENV} must look like USER:PASS")
    return user, password


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Chat with an LLM on CPU, sped up by speculative decoding (OpenVINO).")
    add_model_arguments(parser)
    parser.add_argument("--device", default="CPU", help="OpenVINO device for both models")
    parser.add_argument(
        "--host",
        default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to listen on (0.0.0.0: every interface; default: $GRADIO_SERVER_NAME or loopback)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        help="default: $GRADIO_SERVER_PORT or 7860",
    )
    parser.add_argument("--share", action="store_true", help="also ask Gradio for a public link")
    parser.add_argument("--auth", metavar="USER:PASS", help=f"require a login (default: ${AUTH_ENV})")
    parser.add_argument("--api-key", help=f"the key /v1 needs as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    parser.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        help="the longest conversation accepted, in tokens (default: 3/4 of the context)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=int(os.environ["SPECCHAT_MAX_SESSIONS"]) if os.environ.get("SPECCHAT_MAX_SESSIONS") else None,
        help="conversations whose KV caches are kept, so their next turn prefills only what is new "
        "(default: $SPECCHAT_MAX_SESSIONS, else what fits in half the free memory)",
    )
    cluster.add_cluster_arguments(parser)
    return parser.parse_args(argv)


def browser_secret(folder: Path) -> str | None:
    """The key the conversations kept in browsers are sealed with (against tampering, not prying:
    the page holds it), kept in the cache folder so that they open again after a restart
    (``$SPECCHAT_BROWSER_SECRET`` overrides it; None, a key for this run only, where the folder
    cannot be written)."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = folder / "browser-secret"
    try:
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(24))
        return path.read_text().strip() or None
    except OSError as exc:
        logging.getLogger("specchat").warning(f"conversations kept in browsers will not survive a restart: {exc}")
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    args.auth = args.auth or os.environ.get(AUTH_ENV)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        auth = parse_auth(args.auth)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in launch_warnings(args.host, args.share, auth, bool(args.api_key)):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if args.ray is not None:  # (the page is built in the ingress, from module `app`, also when run as a script)
        return run_cli(lambda: cluster.serve_forever(args, partial(importlib.import_module("app").web_app, args)))
    engine = Loading(lambda: start_engine(args), tuple(MODES))  # the server listens meanwhile
    api = build_router(engine, args.target, model_sources(args), args.api_key)
    try:
        demo = build_app(engine, secret=browser_secret(cache_dir_from_args(args)))
        launch(demo, args.host, args.port, args.share, auth, api=api)
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


# `specchat COMMAND`: the app, and the tools as they run with `python -m MODULE`.
COMMANDS = {
    "serve": ("app", "the chat app, its OpenAI-compatible API and /health on one port (--ray: on a cluster)"),
    "prepare": ("engine.prepare.pipeline", "fetch and convert the models (the first start does it too)"),
    "bench": ("engine.tools.bench", "tokens/s of our modes and the peers on a prompt set, as a table"),
    "chaos": ("engine.tools.chaos", "normal and misbehaving users against the app, on loopback"),
    "loadtest": ("engine.tools.loadtest", "1, 2, 4, 8 users chatting at once: speed, TTFT, exactness, memory"),
    "scaleout": ("engine.tools.scaleout", "the app on a local two-node Ray cluster, a replica killed mid-run"),
    "crossover": ("engine.tools.crossover", "where batched plain steps beat speculation, from measured passes"),
    "ceiling": ("engine.tools.ceiling", "the speedup a clairvoyant drafter would reach, from measured costs"),
    "paper": ("engine.tools.paper", "the paper's table (arXiv 2311.04951) on this machine"),
    "llama-cpp": ("engine.tools.llamacpp", "build llama.cpp's server, the peer of the benchmarks"),
    "quant-report": ("engine.tools.quant_report", "how far int8 and int4 move the logits from fp16"),
}


def cli(argv: list[str] | None = None) -> int:
    """The installed ``specchat`` command: ``specchat COMMAND [ARGS]``, ARGS as the command's own ``--help``."""
    parser = argparse.ArgumentParser(
        prog="specchat",
        description="An LLM chat on CPU, sped up by speculative decoding (OpenVINO).",
        epilog="commands:\n" + "\n".join(f"  {name:<13} {what}" for name, (_, what) in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    sys.argv[0] = f"specchat {args.command}"  # the command's usage line names it so
    return module.main(args.args)


if __name__ == "__main__":
    sys.exit(main())
