"""The page in a real Chromium on the tiny pair: tokens stream, metrics move, the mode toggles;
the chat's features (system prompt, Markdown with provenance, Stop and Continue, edit/undo/retry,
conversations kept across reloads with export and import, footers and header, the phone
layout, the Compare race). The README's screenshots are taken on purpose, by
``make screenshots`` (benchmarks/screenshots.py)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from playwright.sync_api import expect

from benchmarks.chromium import (
    ANSWERS,
    CHROMIUM,
    FOOTERS,
    PHONE,
    WATCH,
    answers,
    chromium,
    finished,
    open_page,
    race,
    send,
    set_cap,
)
from engine.core import chat
from engine.core.pacing import Pacing
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.core.turns import PUBLIC_LIMITS
from tests.test_decoding import slowed
from tests.ui.served import SlowEngine, serve
from ui.page import load_examples

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture
def open_app(browser):
    """Serve the app on an engine and open it in a new page; everything is closed afterwards."""
    opened = []

    def open_app(engine, viewport: dict | None = None):
        demo, url = serve(engine)
        page = open_page(browser, url, viewport)
        opened.append((demo, page))
        return page

    yield open_app
    for demo, page in opened:
        page.close()
        demo.close()


def test_tokens_stream_metrics_move_and_the_mode_toggles(open_app, engine, tmp_path):
    page = open_app(engine, viewport={"width": 1366, "height": 768})
    for shown in ("#metrics", "#tps-plot", "#mode"):  # the live figures and the switch, without scrolling
        box = page.locator(shown).bounding_box()
        assert box is not None and box["y"] + box["height"] <= 768, shown
    set_cap(page, 64)  # two turns within the tiny model's input cap
    send(page, "def add(a, b):", "best")  # the default mode
    seen = page.evaluate("window.seen")
    assert len([a for a in seen["answer"] if a]) >= 3, "the answer did not stream"
    assert len(seen["metrics"]) >= 3, "the metrics did not change while streaming"
    assert "%" in page.inner_text("#metrics")  # acceptance, shown in drafting modes only
    box = page.locator("#mode").bounding_box()  # still in view with every card filled
    assert box is not None and box["y"] + box["height"] <= 768

    page.locator("#mode").get_by_text("autoregressive", exact=True).click()
    send(page, "for i in range(10):", "autoregressive")
    assert "%" not in page.inner_text("#metrics")
    assert page.locator(ANSWERS).count() == 2
    assert "Could not answer" not in page.inner_text("#chatbot")

    page.click("#clear")
    page.locator("#mode").get_by_text("speculative", exact=True).click()
    page.get_by_label("Colour tokens by provenance").check()
    example = next(e for e in load_examples() if e["label"] == "LRU cache class")
    page.get_by_role("button", name=example["label"]).click()
    expect(page.locator("#message textarea")).to_have_value(example["prompt"])
    send(page, example["prompt"], "speculative")
    assert page.locator(ANSWERS).count() == 1
    assert page.locator("#chatbot .answer .tok").count() > 0
    page.wait_for_timeout(500)  # the plot's last redraw
    page.screenshot(path=str(tmp_path / "tiny.png"))
    assert (tmp_path / "tiny.png").stat().st_size > 10_000


def test_stop_button_ends_the_stream_and_keeps_the_partial_answer_which_can_be_continued(open_app, engine):
    slow = SlowEngine(engine, delay=0.05)
    page = open_app(slow)
    set_cap(page, 200)
    page.fill("#message textarea", "def add(a, b):")
    page.click("#send")
    page.wait_for_function("""() => document.querySelector('#metrics .finish')?.innerText.includes('streaming')""")
    page.click("#stop")
    assert slow.closed.wait(5), "Stop did not close the engine stream"
    page.wait_for_function("""() => document.querySelector('#metrics .finish')?.innerText === 'stopped'""")
    answer = page.locator(ANSWERS).inner_text()
    page.wait_for_timeout(500)
    assert answer and page.locator(ANSWERS).inner_text() == answer
    assert not slow.final_read
    slow.delay = 0
    page.evaluate(WATCH)
    page.get_by_role("button", name="Continue ▸").click()
    finished(page)
    assert page.locator(ANSWERS).count() == 1 and page.locator(ANSWERS).inner_text().startswith(answer)


class MarkdownEngine:
    """The real engine with the text of its answers replaced by a Markdown answer, token for
    token (each token's provenance kept): the tiny models do not write Markdown."""

    ANSWER = "Here is **the function**:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nUse `add(1, 2)`."

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, request):
        return MarkdownStream(self.engine.generate(request), iter(re.findall(r"\s*\S+", self.ANSWER)))


class MarkdownStream:
    def __init__(self, stream, words):
        self.stream, self.words = stream, words

    def waiting(self, every: float):
        for event in self.stream.waiting(every):
            if event is not None and event.pieces:
                event.pieces = [(next(self.words, ""), kind) for _, kind in event.pieces]
                event.text = "".join(text for text, _ in event.pieces)
            yield event

    def close(self) -> None:
        self.stream.close()


def test_answers_render_markdown_with_highlighted_code_and_provenance_on_the_rendered_text(open_app, engine):
    page = open_app(MarkdownEngine(engine))
    set_cap(page, 40)
    send(page, "def add(a, b):", "best")
    answer = page.locator(ANSWERS)
    assert answer.locator("strong").inner_text() == "the function" and "**" not in answer.inner_text()
    assert answer.locator("pre code").count() == 1 and "```" not in answer.inner_text()
    assert answer.locator("pre code [class*=token]").count() > 0  # Gradio's highlighting
    page.get_by_label("Colour tokens by provenance").check()
    page.wait_for_selector("#chatbot .answer pre code .tok")
    assert answer.locator("pre code .k").count() > 0  # highlighted by us, provenance drawn inside
    assert answer.locator("strong .tok").count() > 0 and "**" not in answer.inner_text()
    kinds = set(answer.locator(".tok").evaluate_all("spans => spans.map(s => s.className)"))
    assert kinds and all(kind.startswith("tok tok-") for kind in kinds)
    assert page.locator(".legend .tok-draft").is_visible()


def test_system_prompt_footer_header_and_continue_extend_a_capped_answer_exactly(open_app, engine):
    page = open_app(engine)
    set_cap(page, 16)
    page.fill("#system textarea", "Answer briefly.")
    send(page, "def add(a, b):", "best")
    footer = page.locator(FOOTERS).inner_text()
    assert "best · 16 tokens" in footer and "tokens/s" in footer and "acceptance" in footer
    # (the header is drawn in the update after the answer's last: waited for, not raced)
    page.wait_for_function("() => !document.querySelector('#header').innerText.includes('context 0 ')")
    header = page.inner_text("#header")
    assert "target" in header and "draft" in header and f"/ {engine.max_context:,} tokens" in header
    page.evaluate(WATCH)
    page.get_by_role("button", name="Continue ▸").click()  # the cut answer's footer offers it
    finished(page)
    assert page.locator(ANSWERS).count() == 1 and "· 16 tokens" in page.locator(FOOTERS).inner_text()
    continued = answers(page)[0]

    page.click("#new-chat")
    page.wait_for_function("() => !document.querySelector('#system textarea').value")  # kept per conversation
    page.fill("#system textarea", "Answer briefly.")
    set_cap(page, 32)
    send(page, "def add(a, b):", "best")
    assert answers(page) == [continued]  # Continue extended the answer as if it had never been cut
    assert page.get_by_role("button", name="Continue ▸").count() == 1  # (cut again, at 32)


def test_edit_undo_and_retry_use_the_chats_own_buttons(open_app, engine):
    page = open_app(engine)
    set_cap(page, 16)
    send(page, "def add(a, b):", "best")
    send(page, "class Stack:", "best")
    first, second = answers(page)
    page.evaluate(WATCH)
    page.locator('#chatbot button[aria-label="Retry"]').click()
    finished(page)
    assert answers(page) == [first, second]  # greedy: the same answer again

    page.locator('#chatbot button[aria-label="Undo"]').click()
    expect(page.locator("#message textarea")).to_have_value("class Stack:")
    expect(page.locator(ANSWERS)).to_have_count(1)

    page.evaluate(WATCH)
    page.locator('#chatbot button[aria-label="Edit"]').first.click()
    page.fill("#chatbot textarea", "class Stack:")
    page.locator('#chatbot button[aria-label="Submit"]').click()
    finished(page)
    assert page.locator('#chatbot [data-testid="user"]').all_inner_texts() == ["class Stack:"]
    edited = answers(page)
    assert len(edited) == 1 and edited != [first]
    page.click("#new-chat")
    send(page, "class Stack:", "best")
    assert answers(page) == edited  # answered again, as that message alone


def test_conversations_survive_a_reload_and_can_be_switched_exported_and_imported(open_app, engine, tmp_path):
    page = open_app(engine)
    set_cap(page, 16)
    page.fill("#system textarea", "Be brief.")
    send(page, "def add(a, b):", "best")
    first = answers(page)
    kept(page, "def add(a, b):")
    page.reload()
    page.wait_for_selector(ANSWERS)
    assert answers(page) == first and page.input_value("#system textarea") == "Be brief."
    assert page.input_value("#conversations input") == "def add(a, b):"

    page.click("#new-chat")
    expect(page.locator(ANSWERS)).to_have_count(0)
    set_cap(page, 16)
    send(page, "class Stack:", "best")
    kept(page, "class Stack:")
    page.click("#conversations input")
    page.get_by_role("option", name="def add(a, b):").click()
    page.wait_for_function("() => document.querySelector('#system textarea').value === 'Be brief.'")
    assert answers(page) == first

    page.click("#export")
    links = page.locator("#sidebar a[download]")
    expect(links).to_have_count(2)
    with page.expect_download() as download:
        links.first.click()
    exported = tmp_path / download.value.suggested_filename
    download.value.save_as(exported)
    assert json.loads(exported.read_text())["system"] == "Be brief."

    page.click("#new-chat")
    upload(page, exported)
    page.wait_for_function("() => document.querySelector('#system textarea').value === 'Be brief.'")
    assert answers(page) == first
    (tmp_path / "notes.md").write_text("# notes, not a conversation")
    upload(page, tmp_path / "notes.md")
    expect(page.get_by_text("not a SpecChat export")).to_be_visible()
    assert answers(page) == first  # nothing open was touched


def test_a_conversation_past_a_strangers_cap_goes_on_its_oldest_turns_out_of_view_and_exported_whole(
    open_app, ir_target, ir_draft, tmp_path
):
    """A shared link's limits with a small cap: turns that pass it twice over are all answered,
    the page says above the turns in view how many earlier ones the model no longer sees, and the
    export still holds every message."""
    cap = 96
    limits = replace(PUBLIC_LIMITS, stranger_input_tokens=cap)
    engine = Engine(
        ir_target, ir_draft, Settings(config=EXACT_CONFIG, pacing=Pacing(), client_limits=limits, prompt_reader="off")
    )
    page = open_app(engine)
    set_cap(page, 12)
    questions = [f"def f{i}(a, b):" for i in range(9)]
    for question in questions:
        send(page, question, "best")
    note = page.locator("#chatbot .out-of-view")
    expect(note).to_have_count(1)
    hidden = int(note.inner_text().split()[0])
    assert 0 < hidden < 2 * len(questions) and "earlier messages are out of the model's view" in note.inner_text()
    assert page.locator(ANSWERS).filter(has_not=note).count() == len(questions)
    assert "Could not answer" not in page.inner_text("#chatbot")

    page.click("#export")
    with page.expect_download() as download:
        page.locator("#sidebar a[download]").first.click()
    exported = tmp_path / download.value.suggested_filename
    download.value.save_as(exported)
    messages = json.loads(exported.read_text())["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == questions
    assert len(messages) == 2 * len(questions) and messages[-1]["metrics"]["messages_out_of_view"] == hidden
    assert len(chat.prompt_ids(engine.tokenizer, messages)) > 2 * cap  # (the cap passed twice over)


def kept(page, title: str) -> None:
    """Wait until the open conversation is kept in the browser under ``title`` (the answer's
    save lands after the answer: a reload or a list opened before it would not show it)."""
    expect(page.locator("#conversations input")).to_have_value(title)


def upload(page, path: Path) -> None:
    with page.expect_file_chooser() as chooser:
        page.click("#import")
    chooser.value.set_files(str(path))


def test_on_a_phone_the_settings_start_closed_and_a_compact_metrics_line_shows(open_app, engine):
    page = open_app(engine, viewport=PHONE)
    page.wait_for_function("() => !document.querySelector('#sidebar').classList.contains('open')")
    page.evaluate(WATCH)
    page.fill("#message textarea", "def add(a, b):")
    page.click("#send")
    page.wait_for_function("() => /tokens\\/s/.test(document.querySelector('#metrics-line').innerText)")
    assert page.locator("#metrics-line").is_visible()
    finished(page)  # (no cap: until the model stops or its context is full)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]  # nothing wider than the screen


def test_compare_races_the_two_answers_side_by_side_with_any_mode_as_the_fast_side(open_app, engine, monkeypatch):
    slowed(monkeypatch, engine.target, 0.02)  # a race long enough to be seen
    page = open_app(engine)
    set_cap(page, 48)
    seen = race(page, "speculative", "best")
    final = seen[-1]
    replayed = [text for text in seen if text.endswith("▌")]
    assert len(replayed) >= 3, "the answers did not race"
    lengths = [len(text) for text in replayed]
    assert lengths == sorted(lengths) and lengths[-1] <= len(final) + 2  # growing, from nothing to the answer
    verdict = page.inner_text("#verdict")
    assert "identical output" in verdict and "best" in verdict and "speculative" in verdict
    assert "tokens/s" in page.inner_text("#left-stats") and "tokens/s" in page.inner_text("#right-stats")
    page.click("#race-again")
    page.wait_for_function("() => document.querySelector('#right-text').innerText.endsWith('▌')")
