"""How a handler turns the sidebar's settings into an engine request, names what it streams to
the page and paces it. Handlers read these periods as ``streaming.REDRAW_S`` (at call time), so
that a test can make every round drawn."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import gradio as gr
import pandas as pd

from engine.core.chat import Message
from engine.core.requests import DEFAULT_MAX_NEW_TOKENS, Request
from engine.core.turns import PAGE, USER
from ui.render import Turn

# The form's "Max new tokens" for no cap (the engine's None), and the form's default.
UNCAPPED = 0
FORM_MAX_NEW_TOKENS = UNCAPPED if DEFAULT_MAX_NEW_TOKENS is None else DEFAULT_MAX_NEW_TOKENS
# A streaming answer is redrawn at most this often (rounds in between are drawn together), its
# live plot less often still: a browser re-renders the whole answer at every redraw, and on the
# same CPU that is time taken from decoding (docs/benchmarks.md, "The chat in a browser").
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
# A handler updates its outputs by name, with a NamedTuple whose fields are named as the components
# they update (see components_named); a field left at SKIP leaves its component as it is.
Skip = dict[str, Any]
SKIP: Skip = gr.skip()


def components_named(fields: Sequence[str], *tabs: object) -> list[gr.components.Component]:
    """The components named ``fields``, in their order, each taken from the tab (a dataclass of
    components) that has one by that name: the outputs of a handler that updates ``fields``."""
    named = {name: component for tab in tabs for name, component in vars(tab).items()}
    return [named[field] for field in fields]


def client_of(request: gr.Request | None) -> str:
    """Who asks from the page: the logged-in user, else the browser session (Gradio's session hash;
    each tab has one); "" where Gradio gave neither (a handler called directly)."""
    if request is None:
        return ""
    if request.username:
        return USER + request.username
    return PAGE + request.session_hash if request.session_hash else ""


@dataclass(frozen=True)
class Settings:
    """The sidebar's decoding settings, one value from the form to the engine request. Its fields
    are named as the sidebar's components and ordered as the handlers take them."""

    mode: str
    k: int
    temperature: float
    top_p: float
    max_new_tokens: int  # UNCAPPED: until the model stops, within its context
    seed: int | None  # None: a new random seed each time
    context_overflow: str | None = None  # past the input cap (engine.core.window); None: the server's

    @classmethod
    def from_form(
        cls,
        *,
        mode: str,
        k: float,
        temperature: float,
        top_p: float,
        max_new_tokens: float,
        seed: float | None,
        context_overflow: str | None = None,
    ) -> Settings:
        """The settings as the form sends them (4.0 for 4; seed -1: a new random one). What is out
        of range passes as it came, for the engine to refuse with its reason (an API caller is
        not held to the form's ranges)."""
        return cls(
            mode=mode,
            k=form_int(k),
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=form_int(max_new_tokens),
            seed=None if seed is None or (_finite(seed) and seed < 0) else form_int(seed),
            context_overflow=context_overflow,
        )


def make_request(
    messages: Sequence[Message],
    settings: Settings,
    *,
    reuse_cache: bool = True,
    answer_ids: Sequence[int] = (),
    client: str = "",
) -> Request:
    """``settings`` as an engine request; the engine refuses what is out of range.
    ``max_new_tokens`` :data:`UNCAPPED`: until the model stops, within its context. ``answer_ids``: the
    tokens of an answer this request continues. ``client``: who asks (:func:`client_of`)."""
    return Request(
        messages=tuple(messages),
        answer_ids=tuple(answer_ids),
        mode=settings.mode,
        k=settings.k,
        max_new_tokens=None if settings.max_new_tokens == UNCAPPED else settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=settings.seed,
        reuse_cache=reuse_cache,
        client=client,
        context_overflow=settings.context_overflow,
    )


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def form_int(value: float) -> int:
    """A form's integer (Gradio sends 4.0 for 4) as an int. Anything else comes back as it came,
    typed as the int it should be, for the engine's range checks to refuse."""
    return int(value) if _finite(value) and value == int(value) else cast(int, value)


def conversation(turns: list[Turn], system: str = "") -> list[Message]:
    """What the model sees: the system prompt (if any), then the plain text of every turn that
    did not fail."""
    said: list[Message] = [{"role": t["role"], "content": t["content"]} for t in turns if not t.get("failed")]
    opening: list[Message] = [{"role": "system", "content": system}] if system and system.strip() else []
    return opening + said


class Throughput:
    """Tokens/s samples of one stream for the live plot: the running average and each round's rate."""

    COLUMNS: ClassVar[dict[str, type]] = {"time_s": float, "tokens_per_s": float, "series": str}

    def __init__(self) -> None:
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

    def plot(self, final: bool) -> pd.DataFrame | Skip | None:
        """The plot's new value, or ``gr.skip()`` between redraws."""
        if not final and time.monotonic() - self.drawn_at < PLOT_EVERY_S:
            return gr.skip()
        self.drawn_at = time.monotonic()
        return self.frame()
