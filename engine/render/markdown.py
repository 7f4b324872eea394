"""An answer as HTML: its Markdown rendered, its code highlighted, and, on request, each
token's provenance drawn on the rendered text.

Provenance is known per character of the Markdown source, but the reader sees rendered text:
fences, emphasis marks and list markers are gone, code sits in highlighted spans. So the
source is rendered first, and then every character of every text node of the HTML is matched to
its character in the source (rendered text is, in order, a subsequence of its source: Markdown
only removes characters) and wrapped in a span of that character's provenance. The spans sit
inside the text nodes, so they never break the rendered structure, code blocks included.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from functools import cache

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.lexers.special import TextLexer
from pygments.util import ClassNotFound

# Source characters a rendered character may lie ahead of the previous one: Markdown removes
# fences with their language, link targets, table rules. Beyond it a character is taken to be
# the renderer's own (it keeps the previous provenance).
LOOKAHEAD = 400
_TAG = re.compile(r"(<[^>]*>)")
LIGHT_STYLE, DARK_STYLE = "friendly", "github-dark"


def _highlighted(code: str, language: str, _attrs: str) -> str:
    try:
        lexer = get_lexer_by_name(language) if language else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    return highlight(code, lexer, HtmlFormatter(nowrap=True))


@cache
def _markdown() -> MarkdownIt:
    # Raw HTML in an answer is shown as text (a model's output is not markup for the page).
    return MarkdownIt("commonmark", {"html": False, "breaks": True, "highlight": _highlighted}).enable(
        ["table", "strikethrough"]
    )


def render(source: str, provenance: Sequence[str] | None = None) -> str:
    """``source`` (Markdown) as HTML on one line (newlines as entities: a chat that renders
    Markdown around it takes the whole as one HTML block). ``provenance``: one kind per source
    character; each rendered character is wrapped in ``<span class="tok tok-KIND">``."""
    rendered = _markdown().render(source)
    if provenance is not None:
        rendered = _overlay(rendered, source, provenance)
    return f'<div class="answer">{rendered.replace(chr(10), "&#10;")}</div>'


def _overlay(rendered: str, source: str, provenance: Sequence[str]) -> str:
    out: list[str] = []
    at, kind = 0, provenance[0] if provenance else ""
    for i, part in enumerate(_TAG.split(rendered)):
        text = html.unescape(part)
        if i % 2 or not text.strip():  # a tag, or the space between two
            out.append(part)
            continue
        runs: list[list[str]] = []
        for char in text:
            found = source.find(char, at, at + LOOKAHEAD)
            if found >= 0:
                at = found + 1
                kind = provenance[found] if found < len(provenance) else kind
            if runs and runs[-1][0] == kind:
                runs[-1][1] += char
            else:
                runs.append([kind, char])
        out += [f'<span class="tok tok-{html.escape(k)}">{html.escape(t, quote=False)}</span>' for k, t in runs]
    return "".join(out)


def provenance_of(pieces: Sequence[Sequence[str]]) -> list[str]:
    """One provenance per character, from an answer's (text, provenance) pieces."""
    return [kind for text, kind in pieces for _ in text]


def highlight_css() -> str:
    """The code colours, light and dark (Gradio marks dark mode with a ``dark`` class)."""
    light = HtmlFormatter(style=LIGHT_STYLE).get_style_defs(".answer pre")
    dark = HtmlFormatter(style=DARK_STYLE).get_style_defs(".dark .answer pre")
    return f"{light}\n{dark}"
