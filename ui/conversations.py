"""The conversations each browser keeps (in its local storage, sealed with the server's key):
saving, listing, opening, deleting, exporting and importing them, and the wiring of the
sidebar's controls for them."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import gradio as gr

from engine.interface import EngineClient
from engine.render import transcript
from ui import streaming
from ui.chat import ChatTab
from ui.render import Turn, cut, footer_line, header_html, last_metrics, metrics_html, render_chat
from ui.sidebar import Sidebar
from ui.streaming import SKIP, Skip

if TYPE_CHECKING:
    import pandas as pd

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


@dataclass
class Stores:
    conv_id: gr.State  # the open conversation's id (None until the page has loaded)
    store: gr.BrowserState  # every conversation kept: {"current", "conversations": {id: ...}}


class Opened(NamedTuple):
    """A conversation opened, by name: each field updates the component of its name in the
    stores, the chat tab or the sidebar; a field left at ``SKIP`` leaves it as it is."""

    store: dict | Skip = SKIP
    conv_id: str | Skip = SKIP
    turns: list[Turn] | Skip = SKIP
    chatbot: list[dict] | Skip = SKIP
    system: str | Skip = SKIP
    conversations: dict | Skip = SKIP  # the list's choices, the open one selected
    header: str | Skip = SKIP
    metrics_panel: str | Skip = SKIP
    metrics_json: dict | Skip = SKIP
    tps_plot: pd.DataFrame | Skip | None = SKIP
    metrics_line: str | Skip = SKIP


class Saved(NamedTuple):
    """A conversation kept, by name (as :class:`Opened`): the store, the list and the header."""

    store: dict
    conversations: dict
    header: str


def create_stores(secret: str | None) -> Stores:
    """``secret``: the key the conversations kept in each browser are sealed with (None: a new
    one, so that they last as long as this server). The open conversation's id is set by
    :func:`restore` as the page loads (not by a callable default: Gradio would run it as a load
    event of its own, which may land after the restore and give the open conversation a second id)."""
    return Stores(gr.State(None), gr.BrowserState({}, storage_key=STORE_KEY, secret=secret))


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def title_of(turns: list[Turn]) -> str:
    first = next((t["content"].strip() for t in turns if t["role"] == "user" and t["content"].strip()), "")
    line = first.splitlines()[0] if first else ""
    return (line[:TITLE_LENGTH] + "…" if len(line) > TITLE_LENGTH else line) or "New chat"


def remember(store: dict, conv_id: str, turns: list[Turn], system: str, title: str = "") -> dict:
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


def compact(turn: Turn, last: bool) -> Turn:
    """A turn as the browser keeps it (its storage holds a few MB): provenance as runs, not per
    token; token ids only where Continue may need them (a cut last answer)."""
    kept = Turn(role=turn["role"], content=turn["content"])
    if "metrics" in turn:
        kept["metrics"] = turn["metrics"]
    if "failed" in turn:
        kept["failed"] = turn["failed"]
    if turn.get("pieces"):
        kept["pieces"] = [["".join(t for t, _ in run), kind] for kind, run in groupby(turn["pieces"], itemgetter(1))]
    if last and cut(turn):
        kept["token_ids"] = turn["token_ids"]
    return kept


def sanitized(store: object) -> dict:
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


def _well_formed(turn: object) -> bool:
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


def save(engine: EngineClient, store: dict, conv_id: str, turns: list[Turn], system: str) -> Saved:
    """After an answer (or an edit): keep the conversation in the browser; refresh the list and header."""
    store = remember(store, conv_id, turns, system)
    return Saved(store=store, conversations=conversation_list(store, conv_id), header=header_html(engine, turns))


def show(engine: EngineClient, store: dict, conv_id: str, colour: bool) -> Opened:
    """Open the conversation ``conv_id`` of ``store`` (a new, empty one if it is not there)."""
    kept = store.get("conversations", {}).get(conv_id, {})
    turns, system = kept.get("turns", []), kept.get("system", "")
    store = {**store, "current": conv_id}
    return Opened(
        store=store,
        conv_id=conv_id,
        turns=turns,
        chatbot=render_chat(turns, colour),
        system=system,
        conversations=conversation_list(store, conv_id),
        header=header_html(engine, turns),
        metrics_panel=metrics_html({}),
        metrics_json={},
        tps_plot=None,
        metrics_line=footer_line(last_metrics(turns)),
    )


def restore(engine: EngineClient, store: object, colour: bool) -> Opened:
    """The page opened: the conversation it had open last, else a new one (``store``: as the
    browser sent it)."""
    store = sanitized(store)
    return show(engine, store, store.get("current") or new_id(), colour)


def new_chat(engine: EngineClient, store: dict, colour: bool) -> Opened:
    """New chat: a new, empty conversation opened."""
    return show(engine, store, new_id(), colour)


def delete_chat(engine: EngineClient, store: dict, conv_id: str, colour: bool) -> Opened:
    """Forget the open conversation; open the newest other one (or a new one)."""
    kept = {c: v for c, v in store.get("conversations", {}).items() if c != conv_id}
    store = {"current": None, "conversations": kept}
    newest = max(kept, key=lambda c: kept[c]["updated"], default=None)
    return show(engine, store, newest or new_id(), colour)


def export_chat(turns: list[Turn], system: str) -> dict[str, Any]:
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


def import_chat(engine: EngineClient, store: dict, path: str, colour: bool) -> Opened:
    """A conversation file (JSON or Markdown, as exported) opened as a new conversation; a file
    that is not one is refused with what is wrong, and nothing open is touched."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        title, system, messages = transcript.parse(Path(path).name, text)
    except (ValueError, UnicodeDecodeError) as exc:
        reason = "it is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
        gr.Warning(f"Could not import: {reason}")
        return Opened()
    conv_id = new_id()  # (figures recorded in the file are not shown: they describe another run)
    turns = [Turn(role=m["role"], content=m["content"]) for m in messages]
    return show(engine, remember(store, conv_id, turns, system, title), conv_id, colour)


# -- wiring -----------------------------------------------------------------------------------
def saving(engine: EngineClient, stores: Stores, chat: ChatTab, sidebar: Sidebar) -> dict[str, Any]:
    """The event that keeps the open conversation in the browser, as ``.then(**saving(...))`` takes it."""
    return {
        "fn": partial(save, engine),
        "inputs": [stores.store, stores.conv_id, chat.turns, sidebar.system],
        "outputs": streaming.components_named(Saved._fields, stores, chat, sidebar),
    }


def wire(
    engine: EngineClient, demo: gr.Blocks, stores: Stores, chat: ChatTab, sidebar: Sidebar, chat_events: list
) -> None:
    """The sidebar's conversation controls; leaving a conversation stops its answer (``chat_events``)."""
    private = streaming.BOOKKEEPING
    store, colour = stores.store, chat.colour
    opened = streaming.components_named(Opened._fields, stores, chat, sidebar)
    sidebar.system.blur(**saving(engine, stores, chat, sidebar), **private)
    demo.load(partial(restore, engine), [store, colour], opened, **private)
    # Leaving a conversation: its answer stopped, the conversation kept as it stands, then the next opened.
    leaving: dict[str, Any] = {
        "fn": remember,
        "inputs": [store, stores.conv_id, chat.turns, sidebar.system],
        "outputs": store,
        "cancels": chat_events,
        **private,
    }
    sidebar.new.click(**leaving).then(partial(new_chat, engine), [store, colour], opened, **private)
    sidebar.delete.click(
        partial(delete_chat, engine), [store, stores.conv_id, colour], opened, cancels=chat_events, **private
    )
    sidebar.conversations.input(**leaving).then(
        partial(show, engine), [store, sidebar.conversations, colour], opened, **private
    )
    # (the import queued: a warning reaches the page only through the queue)
    sidebar.upload.upload(**leaving).then(
        partial(import_chat, engine), [store, sidebar.upload, colour], opened, api_visibility="private"
    )
    sidebar.export.click(export_chat, [chat.turns, sidebar.system], sidebar.exported, api_visibility="private")
