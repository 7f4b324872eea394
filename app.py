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
import contextlib
import html
import importlib
import io
import json
import logging
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no usage pings to the internet

import gradio as gr
import pandas as pd
from fastapi import APIRouter

from engine.api.openai import build_router
from engine.cli import ASSETS, is_loopback
from engine.core.modes import MODES
from engine.core.service import Engine, Loading, Request
from engine.errors import EngineError
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.tools import paper
from engine.tools.report import markdown_table, speedup

AUTH_ENV = "SPECCHAT_AUTH"
API_KEY_ENV = "SPECCHAT_API_KEY"
ENGINE_QUEUE: dict[str, Any] = {"concurrency_limit": None}  # the engine orders the requests itself
PAPER_LENGTHS = (40, 100)
PLOT_EVERY_S = 0.25  # redraw the live plot at most this often
# A handler waiting for the engine yields this often: Gradio can stop a handler only between yields.
HEARTBEAT_S = 0.5
# While the engine serves several requests, each chat redraws at most this often (rounds in
# between are drawn together): rendering every round of every user takes CPU from the engine.
SHARED_REDRAW_S = 0.25
LEGEND = {
    "draft": "accepted draft token",
    "target": "target correction",
    "bonus": "target bonus token",
    "autoregressive": "target, one pass per token",
}
THEME = gr.themes.Soft(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate")


# -- settings and conversation ----------------------------------------------------------------
def make_request(messages, mode, k, temperature, top_p, max_new_tokens, seed, reuse_cache=True) -> Request:
    """The sidebar's settings as an engine request; the engine refuses what is out of range."""
    return Request(
        messages=tuple(messages),
        mode=mode,
        k=_whole(k),
        max_new_tokens=_whole(max_new_tokens),
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


def conversation(turns: list[dict]) -> list[dict]:
    """What the model sees: the plain text of every turn that did not fail."""
    return [{"role": t["role"], "content": t["content"]} for t in turns if not t.get("failed")]


def load_examples(path: Path = ASSETS / "examples.json") -> list[dict]:
    return json.loads(path.read_text())


# -- rendering --------------------------------------------------------------------------------
def coloured_html(pieces: list) -> str:
    """The answer as escaped HTML spans, one run per provenance (no markdown: a token view)."""
    runs: list[list] = []
    for text, provenance in pieces:
        if runs and runs[-1][1] == provenance:
            runs[-1][0] += text
        elif text:
            runs.append([text, provenance])
    spans = "".join(
        f'<span class="tok tok-{html.escape(p)}">{html.escape(text).replace(chr(10), "<br>")}</span>'
        for text, p in runs
    )
    return f'<div class="token-view">{spans}</div>'


def render_turn(turn: dict, colour: bool) -> str:
    if turn["role"] == "assistant" and turn.get("failed"):
        return f"⚠️ **Could not answer:** {turn['content']}"
    if turn["role"] == "assistant" and colour and turn.get("pieces"):
        return coloured_html(turn["pieces"])
    return turn["content"]


def render_chat(turns: list[dict], colour: bool) -> list[dict]:
    """The chatbot's messages; an empty user message is not drawn, only the error it caused."""
    return [
        {"role": t["role"], "content": render_turn(t, colour)}
        for t in turns
        if t["role"] == "assistant" or t["content"].strip()
    ]


def legend_html() -> str:
    items = "".join(f'<span class="tok tok-{p}">{html.escape(label)}</span>' for p, label in LEGEND.items())
    return f'<div class="legend">{items}</div>'


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
def respond(engine, message, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed):
    """Send ``message``; stream the answer into the chat, the metrics panel and the plot."""
    turns = [*turns, {"role": "user", "content": message or ""}]
    yield from stream_answer(engine, turns, colour, (mode, k, temperature, top_p, max_new_tokens, seed), box="")


def retry(engine, turns, colour, mode, k, temperature, top_p, max_new_tokens, seed):
    """Drop the last answer and ask the last user message again."""
    users = [i for i, t in enumerate(turns) if t["role"] == "user"]
    if not users:
        gr.Warning("Nothing to retry yet: send a message first.")
        return
    last = users[-1]
    turns = [*turns[:last], {"role": "user", "content": turns[last]["content"]}]
    yield from stream_answer(engine, turns, colour, (mode, k, temperature, top_p, max_new_tokens, seed), box=gr.skip())


def stream_answer(engine, turns, colour, settings, box):
    """Answer the last user turn. Closing this generator (Stop) closes the engine stream,
    which cancels the request within one round."""
    answer: dict[str, Any] = {"role": "assistant", "content": "", "pieces": []}
    turns = [*turns, answer]
    throughput = Throughput()
    events = engine.generate(make_request(conversation(turns[:-1]), *settings))
    try:
        if engine.full:  # a place in the queue is news only when the engine is full
            place = max(engine.waiting, 1)
            waiting = f'<div class="metrics empty">The engine is full: you are number {place} in the queue.</div>'
            yield box, render_chat(turns, colour), turns, waiting, {}, gr.skip()
        drawn_at = 0.0
        for event in events.waiting(HEARTBEAT_S):
            if event is None:  # nothing new: yield anyway, so that Stop can take effect now
                yield (gr.skip(),) * 6
                continue
            if event.kind == "error":
                answer["content"], answer["failed"], turns[-2]["failed"] = event.error, True, True
                turns[-2]["content"] = clipped(turns[-2]["content"])  # a refused paste is not drawn whole
                gr.Warning(event.error)
            else:
                answer["content"] += event.text
                answer["pieces"] += [list(piece) for piece in event.pieces]
            throughput.add(event.metrics)
            if not event.final and time.monotonic() - drawn_at < (SHARED_REDRAW_S if engine.serving > 1 else 0):
                continue
            drawn_at = time.monotonic()
            status = {"delta": "streaming…", "error": "error"}.get(event.kind, "")
            yield (
                box,
                render_chat(turns, colour),
                turns,
                metrics_html(event.metrics, status),
                event.metrics,
                throughput.plot(event.final),
            )
    finally:
        events.close()


def stopped(metrics):
    """The metrics panel once Stop has cancelled a stream (unchanged if none was streaming: a
    finished stream's metrics carry its finish reason)."""
    return metrics_html(metrics, "stopped") if metrics and not metrics["finish_reason"] else gr.skip()


def clear_chat():
    return "", [], [], metrics_html({}), {}, None


def status_html(state: str) -> str:
    """A banner while the models are prepared (or could not be); nothing once they serve."""
    if state == "ok":
        return ""
    kind, _, detail = state.partition(": ")
    icon = {"loading": "⏳ Preparing the models", "failed": "⚠️ The models could not be prepared"}.get(kind, "⚠️ Busy")
    return f'<div class="status status-{html.escape(kind)}">{icon}: {html.escape(detail or state)}</div>'


def refresh_status(engine):
    """The banner's next state; the timer stops once the models serve."""
    state = engine.state
    return status_html(state), gr.Timer(active=state.startswith("loading"))


def draft_length_for(mode):
    """K only matters where tokens are drafted."""
    return gr.update(interactive=mode != "autoregressive")


# -- compare handlers -------------------------------------------------------------------------
def run_stats(m: dict) -> str:
    if not m:
        return ""
    line = (
        f"**{m['tokens_per_s']:.1f} tokens/s** · {m['new_tokens']} tokens in {m['wall_s']:.2f} s"
        f" · TTFT {_seconds(m['ttft_s'])}"
    )
    if m["mode"] != "autoregressive":
        line = (
            f"mode **{m['mode']}** · {line} · acceptance {m['acceptance_rate']:.0%}"
            f" · mean accepted length {m['mean_accepted_length']:.2f}"
        )
    return line


def verdict_html(finals: dict, temperature: float) -> str:
    """Speedup (AR wall / SD wall) and whether both runs produced the same tokens."""
    if len(finals) < 2:
        return ""
    ar, sd = finals["autoregressive"], finals["speculative"]
    times = speedup(ar.metrics["wall_s"], sd.metrics["wall_s"]) or 0.0
    if ar.token_ids == sd.token_ids:
        badge = '<span class="badge same">✓ identical output</span>'
    else:
        why = " (sampling: equal only in distribution)" if temperature > 0 else ""
        badge = f'<span class="badge differ">outputs differ{html.escape(why)}</span>'
    walls = f"AR {ar.metrics['wall_s']:.2f} s / SD {sd.metrics['wall_s']:.2f} s"
    return (
        f'<div class="verdict"><span class="speedup">{times:.2f}× speedup</span>'
        f'<span class="detail">{walls}</span>{badge}</div>'
    )


def speed_frame(finals: dict) -> pd.DataFrame | None:
    """Tokens/s of both modes (0 for one still to run): the bar chart draws only the bars it first saw."""
    if not finals:
        return None
    rows = [
        (mode, finals[mode].metrics["tokens_per_s"] if mode in finals else 0.0)
        for mode in ("autoregressive", "speculative")
    ]
    return pd.DataFrame(rows, columns=["mode", "tokens_per_s"]).astype({"mode": str, "tokens_per_s": float})


def compare(engine, prompt, mode, k, temperature, top_p, max_new_tokens, seed):
    """Autoregressive, then the sidebar's speculative mode (the default one if the sidebar says
    autoregressive), on the same prompt with fresh caches; both stream."""
    fast = mode if mode != "autoregressive" else engine.modes[0]
    messages = ({"role": "user", "content": prompt},)
    texts = {"autoregressive": "", "speculative": ""}
    metrics: dict[str, dict] = {"autoregressive": {}, "speculative": {}}
    finals: dict = {}

    def outputs():
        return (
            texts["autoregressive"],
            texts["speculative"],
            run_stats(metrics["autoregressive"]),
            run_stats(metrics["speculative"]),
            verdict_html(finals, float(temperature)),
            speed_frame(finals),
        )

    requests = {
        side: make_request(messages, run_mode, k, temperature, top_p, max_new_tokens, seed, reuse_cache=False)
        for side, run_mode in (("autoregressive", "autoregressive"), ("speculative", fast))
    }
    try:  # both sides checked before either runs
        for request in requests.values():
            engine.check(request)
    except EngineError as exc:
        gr.Warning(str(exc))
        texts["speculative"] = f"⚠️ **Could not answer:** {exc}"
        yield outputs()
        return
    for side, request in requests.items():
        events = engine.generate(request)
        try:
            for event in events.waiting(HEARTBEAT_S):
                if event is None:
                    yield (gr.skip(),) * 6
                    continue
                if event.kind == "error":
                    gr.Warning(event.error)
                    texts[side] = f"⚠️ **Could not answer:** {event.error}"
                    yield outputs()
                    return
                texts[side] += event.text
                metrics[side] = event.metrics
                if event.final:
                    finals[side] = event
                yield outputs()
        finally:
            events.close()


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


# -- layout and wiring ------------------------------------------------------------------------
def build_app(engine, examples: list[dict] | None = None) -> gr.Blocks:
    """The whole UI on one engine. ``examples``: [{"label", "prompt"}] (default: assets/examples.json)."""
    examples = load_examples() if examples is None else examples
    max_tokens = max(16, min(2048, engine.max_context))
    with gr.Blocks(
        title="SpecChat · speculative decoding on CPU", analytics_enabled=False, fill_height=True, fill_width=True
    ) as demo:
        turns = gr.State([])
        status = gr.HTML(status_html(engine.state), elem_id="status")
        status_timer = gr.Timer(1.0, active=engine.state != "ok")
        status_timer.tick(
            partial(refresh_status, engine), None, [status, status_timer], queue=False, api_visibility="private"
        )

        with gr.Sidebar(width=360, label="Settings"):
            gr.Markdown("## ⚡ SpecChat\nA small draft model proposes *K* tokens; the target checks them in one pass.")
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
                16, max_tokens, value=min(256, max_tokens), step=8, label="Max new tokens", elem_id="max-new-tokens"
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
            chatbot = gr.Chatbot(
                label="Chat",
                height=520,
                elem_id="chatbot",
                latex_delimiters=[],
                buttons=["copy", "copy_all"],
                placeholder="Ask for some code. Tokens stream as the target accepts them.",
            )
            with gr.Row(equal_height=True):
                colour = gr.Checkbox(False, label="Colour tokens by provenance", scale=0, min_width=260)
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
                again = gr.Button("Retry", size="sm", elem_id="retry")
                clear = gr.Button("Clear", size="sm", elem_id="clear")
            gr.Examples(
                [[e["prompt"]] for e in examples],
                inputs=[message],
                example_labels=[e["label"] for e in examples],
                label="Examples",
            )

        with gr.Tab("Compare"):
            gr.Markdown(
                "One prompt, autoregressive then the sidebar's speculative mode on the same engine "
                "(fresh caches each); settings from the sidebar."
            )
            prompt = gr.Textbox(label="Prompt", lines=2, value=examples[0]["prompt"] if examples else "")
            with gr.Row():
                run_compare = gr.Button("Compare", variant="primary")
                run_table = gr.Button("Paper table (N = 40, 100; greedy)")
                stop_compare = gr.Button("Stop", variant="stop")
            verdict = gr.HTML(elem_id="verdict")
            with gr.Row(equal_height=True):
                with gr.Column():
                    gr.Markdown("#### Autoregressive")
                    ar_text = gr.Markdown(height=320, container=True, latex_delimiters=[])
                    ar_stats = gr.Markdown()
                with gr.Column():
                    gr.Markdown("#### Speculative")
                    sd_text = gr.Markdown(height=320, container=True, latex_delimiters=[])
                    sd_stats = gr.Markdown()
            speed_bars = gr.BarPlot(
                None,
                x="mode",
                y="tokens_per_s",
                color="mode",
                height=220,
                title="tokens/s",
                y_title="tokens/s",
                y_lim=[0, None],
                color_map={"autoregressive": "#94a3b8", "speculative": "#4f46e5"},
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
        chat_out = [message, chatbot, turns, metrics_panel, metrics_json, tps_plot]
        chat_events = [
            gr.on(
                [message.submit, send.click],
                partial(respond, engine),
                [message, turns, colour, *settings],
                chat_out,
                api_name="respond",
                show_progress_on=chatbot,
                **ENGINE_QUEUE,
            ),
            again.click(
                partial(retry, engine),
                [turns, colour, *settings],
                chat_out,
                api_name="retry",
                show_progress_on=chatbot,
                **ENGINE_QUEUE,
            ),
        ]
        stop.click(None, cancels=chat_events).then(
            stopped, metrics_json, metrics_panel, queue=False, api_visibility="private"
        )
        clear.click(clear_chat, None, chat_out, cancels=chat_events, api_name="clear", queue=False)

        def engine_health() -> dict:
            """Whether the engine is making progress, and how many requests wait for it or use it."""
            return {"healthy": engine.healthy, "pending": engine.pending}

        gr.api(engine_health, api_name="health", queue=False)
        chatbot.clear(clear_chat, None, chat_out, cancels=chat_events, queue=False, api_visibility="private")
        colour.change(render_chat, [turns, colour], chatbot, queue=False, api_visibility="private")
        mode.change(draft_length_for, mode, k, queue=False, api_visibility="private")

        compare_out = [ar_text, sd_text, ar_stats, sd_stats, verdict, speed_bars]
        compare_events = [
            run_compare.click(
                partial(compare, engine), [prompt, *settings], compare_out, api_name="compare", **ENGINE_QUEUE
            ),
            run_table.click(partial(paper_table, engine), [prompt, k], table, api_name="paper_table", **ENGINE_QUEUE),
        ]
        stop_compare.click(None, cancels=compare_events)  # type: ignore[arg-type]  # Gradio takes its events here
    demo.queue(default_concurrency_limit=None, max_size=64)
    return demo


# -- launch -----------------------------------------------------------------------------------
def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int | None = None,
    share: bool = False,
    auth: tuple[str, str] | None = None,
    block: bool = True,
    api: APIRouter | None = None,
    api_key: str | None = None,
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
            show_error=False,  # users see the handlers' own messages; tracebacks go to the log
            max_file_size="1mb",  # nothing here takes uploads
            theme=THEME,
            css_paths=[ASSETS / "style.css"],
            footer_links=["api", "settings"],
        )
    if api is not None:
        demo.server_app.include_router(api)
    local = str(demo.local_url)
    for warning in launch_warnings(host, share, auth, bool(api_key)):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
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
    return parser.parse_args(argv)


def start_engine(args: argparse.Namespace) -> Engine:
    """Prepare the models (converting them on first use) and load them, once."""
    target, draft = prepare_from_args(args)
    logging.getLogger("specchat.prepare").info(f"loading and warming up the models on {args.device}")
    return Engine(
        target.path,
        draft.path,
        device=args.device,
        max_input_tokens=args.max_input_tokens,
        max_sessions=args.max_sessions,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        auth = parse_auth(args.auth or os.environ.get(AUTH_ENV))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = Loading(lambda: start_engine(args), tuple(MODES))  # the server listens meanwhile
    models = {
        role: {"source": getattr(args, role), "precision": getattr(args, f"{role}_precision")}
        for role in ("target", "draft")
    }
    api = build_router(engine, args.target, models, args.api_key)
    try:
        launch(build_app(engine), args.host, args.port, args.share, auth, api=api, api_key=args.api_key)
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


# `specchat COMMAND`: the app, and the tools as they run with `python -m MODULE`.
COMMANDS = {
    "serve": ("app", "the chat app, its OpenAI-compatible API and /health on one port"),
    "prepare": ("engine.prepare.pipeline", "fetch and convert the models (the first start does it too)"),
    "bench": ("engine.tools.bench", "tokens/s of our modes and the peers on a prompt set, as a table"),
    "chaos": ("engine.tools.chaos", "normal and misbehaving users against the app, on loopback"),
    "loadtest": ("engine.tools.loadtest", "1, 2, 4, 8 users chatting at once: speed, TTFT, exactness, memory"),
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
