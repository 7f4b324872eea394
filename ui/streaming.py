"""How a handler turns the sidebar's settings into an engine request and paces what it streams
to the page. Handlers read these periods as ``streaming.REDRAW_S`` (at call time), so that a
test can make every round drawn."""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import gradio as gr
import pandas as pd

from engine.core.requests import Request
from engine.core.turns import PAGE, USER

# A streaming answer is redrawn at most this often (rounds in between are drawn together), its
# live plot less often still: a browser re-renders the whole answer at every redraw, and on the
# same CPU that is time taken from decoding (a 256-token answer in Chromium on this 2-core
# machine: 11.8 tokens/s when every round was drawn, 15.3 so; docs/benchmarks.md, "The chat in a browser").
REDRAW_S = 0.3
PLOT_EVERY_S = 1.0
# A handler waiting for the engine yields this often: Gradio can stop a handler only between yields.
HEARTBEAT_S = 0.5
ENGINE_QUEUE: dict[str, Any] = {"concurrency_limit": None}  # how handlers that answer queue: the engine orders them
# How the page's bookkeeping events run (keeping a conversation, redrawing the chat, opening another):
# at once, beside the queue, out of the API, and with no progress shown (they take milliseconds; an
# overlay would flicker over the conversation list and the header after every answer, and take the
# clicks meant for them while it shows).
BOOKKEEPING: dict[str, Any] = {"queue": False, "api_visibility": "private", "show_progress": "hidden"}


def client_of(request: gr.Request | None) -> str:
    """Who asks from the page: the logged-in user, else the browser session (Gradio's session hash;
    each tab has one); "" where Gradio gave neither (a handler called directly)."""
    if request is None:
        return ""
    if request.username:
        return USER + request.username
    return PAGE + request.session_hash if request.session_hash else ""


def make_request(
    messages,
    mode,
    k,
    temperature,
    top_p,
    max_new_tokens,
    seed,
    *,
    context: int,
    reuse_cache=True,
    answer_ids=(),
    client: str = "",
) -> Request:
    """The sidebar's settings as an engine request; the engine refuses what is out of range.
    ``max_new_tokens`` 0: until the model stops, within its ``context``. ``answer_ids``: the
    tokens of an answer this request continues. ``client``: who asks (:func:`client_of`)."""
    cap = whole(max_new_tokens)
    return Request(
        messages=tuple(messages),
        answer_ids=tuple(answer_ids),
        mode=mode,
        k=whole(k),
        max_new_tokens=context if cap == 0 else cap,
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None or (_finite(seed) and seed < 0) else whole(seed),
        reuse_cache=reuse_cache,
        client=client,
    )


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def whole(value):
    """A form's whole number (Gradio sends 4.0 for 4) as an int; anything else as it came."""
    return int(value) if _finite(value) and value == int(value) else value


def conversation(turns: list[dict], system: str = "") -> list[dict]:
    """What the model sees: the system prompt (if any), then the plain text of every turn that
    did not fail."""
    said = [{"role": t["role"], "content": t["content"]} for t in turns if not t.get("failed")]
    return ([{"role": "system", "content": system}] if system and system.strip() else []) + said


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
