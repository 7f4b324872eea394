"""What the page draws from an engine's figures and a conversation's turns: answers (Markdown,
or with each token's provenance), their footers, the header, the metrics panel and the status
banner. Pure functions of their arguments: the handlers decide when to draw."""

from __future__ import annotations

import html
from functools import lru_cache
from typing import Any, Required, TypedDict

from engine.core.metrics import FinishReason, ModeName
from engine.interface import EngineClient
from engine.render import markdown

LEGEND = {
    "draft": "accepted draft token",
    "target": "target correction",
    "bonus": "target bonus token",
    "autoregressive": "target, one pass per token",
}
CUT = (FinishReason.LENGTH, FinishReason.CANCELLED)  # finish reasons of an answer Continue can extend
CONTINUE = "continue"  # the option a cut answer's footer offers


class Turn(TypedDict, total=False):
    """One message of a conversation as the page keeps it (in the browser, and exported as JSON)."""

    role: Required[str]  # "user" or "assistant"
    content: Required[str]  # the text (an answer's so far, while it streams)
    pieces: list[list[str]]  # an answer's text in runs, each with its provenance: [text, kind]
    token_ids: list[int]  # an answer's tokens as generated (Continue extends them, not the text)
    metrics: dict[str, Any]  # an answer's figures (the engine's metrics)
    failed: bool  # the answer is an error message


def cut(turn: Turn) -> bool:
    """An answer the cap (or a Stop) cut short, which Continue can extend from where it stopped."""
    m = turn.get("metrics") or {}
    return not turn.get("failed") and bool(turn.get("token_ids")) and m.get("finish_reason") in CUT


def render_answer(turn: Turn, colour: bool) -> str:
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
    speculative = m["mode"] != ModeName.AUTOREGRESSIVE
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
        ("time to first token", seconds(m["ttft_s"])),
        ("prompt read at", read_rate(m)),
        ("prompt tokens (found in the KV cache)", f"{m['prompt_tokens']} ({m['cached_tokens']})"),
        ("target passes", f"{m['target_passes']}"),
        ("draft / target time", f"{m['draft_s']:.2f} / {m['target_s']:.2f} s"),
        ("KV cache", size(m["target_kv_bytes"] + m["draft_kv_bytes"])),
        ("finish", m["finish_reason"]),
    ]
    if m.get("replica"):  # (served by an engine replica of a cluster)
        rows.append(("replica", m["replica"]))
    return "\n".join(["| | |", "|---|---|", *(f"| {label} | {value} |" for label, value in rows)])


def footer_message(turn: Turn, last: bool) -> dict | None:
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


def out_of_view(turns: list[Turn]) -> tuple[int, int]:
    """How many messages the model did not see when it wrote the last answer (engine.core.window),
    and the turn its view started at (0, 0 where it saw them all). Failed turns were not sent."""
    answered = [i for i, t in enumerate(turns) if t.get("metrics")]
    if not answered:
        return 0, 0
    hidden = turns[answered[-1]]["metrics"].get("messages_out_of_view", 0)
    sent = [i for i, t in enumerate(turns[: answered[-1]]) if not t.get("failed")]
    return (hidden, sent[hidden]) if 0 < hidden < len(sent) else (0, 0)


def out_of_view_note(hidden: int) -> dict:
    """The line above the turns the model still sees: the earlier ones stay here, and in exports."""
    said = f"{hidden} earlier message{' is' if hidden == 1 else 's are'} out of the model's view"
    return {"role": "assistant", "content": f'<div class="out-of-view">{said}</div>'}


def drawn(turns: list[Turn], colour: bool) -> list[tuple[int, dict]]:
    """The chatbot's messages, each with the turn it draws (footers draw their answer's turn, the
    note on what the model no longer sees the turn below it); an empty user message is not
    drawn, only the error it caused."""
    messages: list[tuple[int, dict]] = []
    hidden, view = out_of_view(turns)
    for i, t in enumerate(turns):
        if hidden and i == view:
            messages.append((i, out_of_view_note(hidden)))
        if t["role"] == "user":
            if t["content"].strip():
                messages.append((i, {"role": "user", "content": t["content"]}))
            continue
        messages.append((i, {"role": "assistant", "content": render_answer(t, colour)}))
        if footer := footer_message(t, last=i == len(turns) - 1):
            messages.append((i, footer))
    return messages


def render_chat(turns: list[Turn], colour: bool) -> list[dict]:
    return [message for _, message in drawn(turns, colour)]


def turn_of(turns: list[Turn], index: int) -> int:
    """The turn a chatbot message (by its index, as Gradio's events give it) draws."""
    return drawn(turns, colour=False)[index][0]


def legend_html() -> str:
    items = "".join(f'<span class="tok tok-{p}">{html.escape(label)}</span>' for p, label in LEGEND.items())
    return f'<div class="legend">{items}</div>'


def last_metrics(turns: list[Turn]) -> dict:
    """The figures of the conversation's last answer (empty before the first)."""
    return next((t["metrics"] for t in reversed(turns) if t.get("metrics")), {})


# What the header shows of an engine's models: each role's, and when start's figures were measured.
HEADER_ENTRIES = ("target", "draft", "measured")


def header_html(engine: EngineClient, turns: list[Turn]) -> str:
    """The models in use and how much of the context the conversation fills."""
    models = engine.models
    if not models:
        return '<div class="chat-header">models loading…</div>'
    last = last_metrics(turns)
    used = last["prompt_tokens"] + last["new_tokens"] if last else 0
    names = " · ".join(
        f'<span class="model"><b>{role}</b> {html.escape(label)}</span>'
        for role, label in models.items()
        if role in HEADER_ENTRIES
    )
    return (
        f'<div class="chat-header">{names}<span class="context">context {used:,} / '
        f"{engine.max_context:,} tokens</span></div>"
    )


def size(n: float) -> str:
    """A number of bytes for people (B, KiB, MiB, GiB)."""
    units = ("B", "KiB", "MiB", "GiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def seconds(s: float | None) -> str:
    """A duration for people: milliseconds below a second; a dash where there is none."""
    if s is None:
        return "—"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def metrics_html(m: dict, status: str = "") -> str:
    """The live metrics panel: one card per figure; acceptance only where a draft is used.
    ``status`` shows in the corner (default: the finish reason)."""
    if not m:
        return '<div class="metrics empty">Send a message to see live metrics.</div>'
    speculative = m["mode"] != ModeName.AUTOREGRESSIVE  # every other mode drafts tokens
    cards = [
        ("tokens/s", f"{m['tokens_per_s']:.1f}"),
        ("acceptance", f"{m['acceptance_rate']:.0%}" if speculative else "—"),
        ("mean accepted length", f"{m['mean_accepted_length']:.2f}"),
        ("time to first token", seconds(m["ttft_s"])),
        ("prompt read at", read_rate(m)),
        ("target passes", f"{m['target_passes']}"),
        ("new tokens", f"{m['new_tokens']}"),
        ("draft / target time", f"{m['draft_s']:.2f} / {m['target_s']:.2f} s"),
        ("KV cache", f"{size(m['target_kv_bytes'] + m['draft_kv_bytes'])}"),
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


def read_rate(m: dict) -> str:
    """How fast the prompt's reading passes went; a dash where the prompt was short enough for
    its first round to read (then no reading pass is timed apart from the first token's work)."""
    rate = m.get("prefill_tokens_per_s")
    return f"{rate:,.0f} tokens/s" if rate else "—"


def reading_line(m: dict) -> str:
    """Where a long prompt's reading is, for the chat while the answer has not started."""
    read, total, rate = m["prompt_read"], m["prompt_tokens"], m.get("prefill_tokens_per_s")
    left = f" · about {seconds((total - read) / rate)} left" if rate else ""
    return f"*Reading your message: {read:,} of {total:,} tokens ({read / max(total, 1):.0%}){left}*"


def status_html(state: str) -> str:
    """A banner while the models are prepared (or could not be); nothing once they serve."""
    if state == "ok":
        return ""
    kind, _, detail = state.partition(": ")
    icon = {"loading": "⏳ Preparing the models", "failed": "⚠️ The models could not be prepared"}.get(kind, "⚠️ Busy")
    return f'<div class="status status-{html.escape(kind)}">{icon}: {html.escape(detail or state)}</div>'
