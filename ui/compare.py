"""The compare tab: one prompt in two modes on the same engine (fresh caches each), then both
answers racing side by side at the pace each was measured at; and the paper's table (arXiv
2311.04951: autoregressive vs speculative at N = 40 and 100 new tokens) on this machine."""

from __future__ import annotations

import bisect
import html
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import gradio as gr
import pandas as pd

from engine.core.chat import Message
from engine.core.metrics import ModeName
from engine.core.requests import EventKind, Request
from engine.errors import EngineError
from engine.interface import EngineClient
from engine.report import PAPER_COLUMNS, markdown_table, speedup
from ui import streaming
from ui.chat import bound
from ui.render import seconds
from ui.sidebar import Sidebar
from ui.streaming import SKIP, Settings, Skip

SIDES = ("left", "right")  # the two runs
RACE_FRAME_S = 0.1  # the race's redraw period
PAPER_LENGTHS = (40, 100)


@dataclass
class CompareTab:
    prompt: gr.Textbox
    left_mode: gr.Dropdown
    right_mode: gr.Dropdown
    run_compare: gr.Button
    again: gr.Button
    run_table: gr.Button
    stop: gr.Button
    verdict: gr.HTML
    left_text: gr.Markdown
    right_text: gr.Markdown
    left_stats: gr.Markdown
    right_stats: gr.Markdown
    runs: gr.State  # both runs as measured, for the race
    speed_bars: gr.BarPlot
    table: gr.Markdown


class CompareUpdate(NamedTuple):
    """What a comparison streams into, by name: each field updates the component of its name in
    the tab; a field left at ``SKIP`` leaves it as it is."""

    left_text: str | Skip = SKIP
    right_text: str | Skip = SKIP
    left_stats: str | Skip = SKIP
    right_stats: str | Skip = SKIP
    verdict: str | Skip = SKIP
    speed_bars: pd.DataFrame | Skip | None = SKIP
    runs: dict | Skip = SKIP


def create_ui(engine: EngineClient, examples: list[dict]) -> CompareTab:
    """The tab's layout (``examples``: [{"label", "prompt"}])."""
    gr.Markdown(
        "One prompt in two modes, one after the other on the same engine (fresh caches each), "
        "then both answers race side by side at the pace each was measured at. Other settings "
        "from the sidebar."
    )
    prompt = gr.Textbox(
        label="Prompt", lines=2, value=examples[0]["prompt"] if examples else "", elem_id="compare-prompt"
    )
    with gr.Row():
        left_mode = gr.Dropdown(list(engine.modes), value=ModeName.AUTOREGRESSIVE, label="Left", elem_id="left-mode")
        right_mode = gr.Dropdown(list(engine.modes), value=engine.modes[0], label="Right", elem_id="right-mode")
    with gr.Row():
        run_compare = gr.Button("Compare", variant="primary", elem_id="run-compare")
        again = gr.Button("Race again", elem_id="race-again")
        run_table = gr.Button("Paper table (N = 40, 100; greedy)")
        stop = gr.Button("Stop", variant="stop")
    verdict = gr.HTML(elem_id="verdict")
    with gr.Row(equal_height=True):
        left_text, left_stats = _side("left")
        right_text, right_stats = _side("right")
    runs = gr.State({})
    speed_bars = gr.BarPlot(None, x="run", y="tokens_per_s", color="run", height=220, title="tokens/s", y_lim=[0, None])
    table = gr.Markdown(elem_id="paper-table")
    gr.Examples(
        [[e["prompt"]] for e in examples],
        inputs=[prompt],
        example_labels=[e["label"] for e in examples],
        label="Examples",
    )
    return CompareTab(
        prompt,
        left_mode,
        right_mode,
        run_compare,
        again,
        run_table,
        stop,
        verdict,
        left_text,
        right_text,
        left_stats,
        right_stats,
        runs,
        speed_bars,
        table,
    )


def _side(side: str) -> tuple[gr.Markdown, gr.Markdown]:
    """A side's column: its answer, then its figures."""
    with gr.Column():
        text = gr.Markdown(height=320, container=True, latex_delimiters=[], elem_id=f"{side}-text")
        stats = gr.Markdown(elem_id=f"{side}-stats")
    return text, stats


# -- handlers ---------------------------------------------------------------------------------
def run_stats(m: dict) -> str:
    if not m:
        return ""
    line = (
        f"**{m['tokens_per_s']:.1f} tokens/s** · {m['new_tokens']} tokens in {m['wall_s']:.2f} s"
        f" · TTFT {seconds(m['ttft_s'])}"
    )
    if m["mode"] != ModeName.AUTOREGRESSIVE:
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


def compare(
    engine: EngineClient,
    prompt: str,
    left: str,
    right: str,
    k: float,
    temperature: float,
    top_p: float,
    max_new_tokens: float,
    seed: float | None,
    system: str = "",
    page: gr.Request | None = None,
) -> Iterator[CompareUpdate]:
    """The prompt in the ``left`` mode, then in the ``right`` one, each with fresh caches (both
    stream); then both answers race side by side at their measured pace."""
    messages = streaming.conversation([{"role": "user", "content": prompt}], system)
    client = streaming.client_of(page)
    requests = {
        side: replace(
            streaming.make_request(
                messages,
                Settings.from_form(
                    mode=mode, k=k, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed
                ),
                reuse_cache=False,
                client=client,
            ),
            pooled=False,  # (the second side would copy the first's answer from the pool)
        )
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
        yield CompareUpdate(
            left_text="",
            right_text=f"⚠️ **Could not answer:** {exc}",
            left_stats="",
            right_stats="",
            verdict="",
            speed_bars=None,
        )
        return
    for side, request in requests.items():
        run, drawn_at = runs[side], 0.0
        events = engine.generate(request)
        try:
            for event in events.waiting(streaming.HEARTBEAT_S):
                if event is None:
                    yield CompareUpdate()
                    continue
                if event.kind == EventKind.ERROR:
                    gr.Warning(event.error)
                    run["text"] = f"⚠️ **Could not answer:** {event.error}"
                    yield compare_frame(runs, temperature)
                    return
                run["text"] += event.text
                run["metrics"] = event.metrics
                run["timeline"].append((event.metrics["wall_s"], len(run["text"]), event.metrics["new_tokens"]))
                run["token_ids"], run["final"] = event.token_ids, event.final
                if event.final or time.monotonic() - drawn_at >= streaming.REDRAW_S:
                    drawn_at = time.monotonic()
                    yield compare_frame(runs, temperature)
        finally:
            events.close()
    yield from (frame._replace(runs=runs) for frame in race(runs, temperature))


def compare_frame(runs: dict, temperature: float) -> CompareUpdate:
    """The compare outputs as the runs stand (the one running shows what it has so far)."""
    left, right = runs["left"], runs["right"]
    return CompareUpdate(
        left_text=left["text"],
        right_text=right["text"],
        left_stats=run_stats(left["metrics"]) if left["final"] else "",
        right_stats=run_stats(right["metrics"]) if right["final"] else "",
        verdict=verdict_html(runs, temperature),
        speed_bars=speed_frame(runs),
    )


def race(runs: dict, temperature: float) -> Iterator[CompareUpdate]:
    """Both answers again from nothing, each at the pace it was measured at, with live counters;
    the verdict once both have finished."""
    if not runs or not all(r["final"] for r in runs.values()):  # (nothing raced yet)
        return
    start = time.monotonic()
    end = max(run["metrics"]["wall_s"] for run in runs.values())
    while (now := time.monotonic() - start) < end:
        (left_text, left_stats), (right_text, right_stats) = (_raced(runs[side], now) for side in SIDES)
        yield CompareUpdate(
            left_text=left_text, right_text=right_text, left_stats=left_stats, right_stats=right_stats, verdict=""
        )
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


def paper_table(engine: EngineClient, prompt: str, k: float, page: gr.Request | None = None) -> Iterator[str | Skip]:
    """AR vs SD at N = 40 and 100 new tokens, greedy, fresh caches: the paper's table."""
    messages: tuple[Message, ...] = ({"role": "user", "content": prompt},)
    rows: list[dict] = []
    for n in PAPER_LENGTHS:
        ar_wall = None
        for mode in (ModeName.AUTOREGRESSIVE, ModeName.SPECULATIVE):
            asked = Request(
                messages,
                mode=mode,
                k=streaming.form_int(k),
                max_new_tokens=n,
                temperature=0.0,
                reuse_cache=False,
                client=streaming.client_of(page),
                pooled=False,
            )
            events = engine.generate(asked)
            try:
                for event in events.waiting(streaming.HEARTBEAT_S):
                    if event is None:
                        yield SKIP
                        continue
                    if event.kind == EventKind.ERROR:
                        gr.Warning(event.error)
                        yield table_markdown(rows, f"⚠️ {event.error}")
                        return
                    m = event.metrics
                    if not event.final:
                        yield table_markdown(rows, f"running {mode}, N={n}: {m['new_tokens']}/{n} tokens…")
            finally:
                events.close()
            ar_wall = m["wall_s"] if mode == ModeName.AUTOREGRESSIVE else ar_wall
            speculative = mode == ModeName.SPECULATIVE
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


# -- wiring -----------------------------------------------------------------------------------
def wire(engine: EngineClient, tab: CompareTab, sidebar: Sidebar) -> None:
    """The tab's events (the sidebar gives the settings but the mode); its Stop cancels them."""
    shown = streaming.components_named(CompareUpdate._fields, tab)
    # (each side has its own mode; one message never passes the input cap)
    settings = [c for c in sidebar.settings if c is not sidebar.mode and c is not sidebar.context_overflow]
    events = [
        tab.run_compare.click(
            bound(compare, engine),  # (Gradio passes the request only where it sees its type)
            [tab.prompt, tab.left_mode, tab.right_mode, *settings, sidebar.system],
            shown,
            api_name="compare",
            **streaming.ENGINE_QUEUE,
        ),
        tab.again.click(race, [tab.runs, sidebar.temperature], shown, api_visibility="private"),
        tab.run_table.click(
            bound(paper_table, engine),
            [tab.prompt, sidebar.k],
            tab.table,
            api_name="paper_table",
            **streaming.ENGINE_QUEUE,
        ),
    ]
    tab.stop.click(None, cancels=events)  # type: ignore[arg-type]  # Gradio takes its events here
