"""The page in a real Chromium: tokens stream, metrics move, the mode toggles.

On the real default pair (where it is prepared) it also takes the README screenshot."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

import app
from tests.test_app import SlowEngine, serve

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parent.parent / "assets" / "screenshot.png"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (apt-get install chromium)"),
]

# Records every text the last answer and the metrics panel show, so a stream that is
# fast on the tiny model is still seen update by update.
WATCH = """() => {
  window.seen = {answer: [], metrics: []};
  const record = () => {
    const bots = document.querySelectorAll('#chatbot [data-testid="bot"]');
    const answer = bots.length ? bots[bots.length - 1].innerText : '';
    const metrics = document.querySelector('#metrics')?.innerText ?? '';
    if (answer !== window.seen.answer.at(-1)) window.seen.answer.push(answer);
    if (metrics !== window.seen.metrics.at(-1)) window.seen.metrics.push(metrics);
  };
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_app(browser):
    """Serve the app on an engine and open it in a new page; everything is closed afterwards."""
    opened = []

    def open_app(engine):
        demo, url = serve(engine)
        page = browser.new_page(viewport={"width": 1440, "height": 1350})
        opened.append((demo, page))
        page.set_default_timeout(30_000)
        page.goto(url)
        page.wait_for_selector("#message textarea")
        return page

    yield open_app
    for demo, page in opened:
        page.close()
        demo.close()


def send(page, message: str, mode: str) -> None:
    """Type ``message``, send it and wait until its answer is finished in ``mode``."""
    page.evaluate(WATCH)
    page.fill("#message textarea", message)
    page.click("#send")
    page.wait_for_function("""() => window.seen.metrics.some(m => m.includes('streaming') || m.includes('error'))
        && /length|stop|context|error/.test(document.querySelector('#metrics .finish')?.innerText)""")
    assert page.inner_text("#metrics .finish") != "error", page.inner_text("#chatbot")
    assert page.get_attribute("#metrics .metrics", "data-mode") == mode


def test_tokens_stream_metrics_move_and_the_mode_toggles(open_app, engine, tmp_path):
    page = open_app(engine)
    page.fill("#max-new-tokens input[type=number]", "64")  # two turns within the tiny model's input cap
    page.press("#max-new-tokens input[type=number]", "Enter")
    send(page, "def add(a, b):", "best")  # the default mode
    seen = page.evaluate("window.seen")
    assert len([a for a in seen["answer"] if a]) >= 3, "the answer did not stream"
    assert len(seen["metrics"]) >= 3, "the metrics did not change while streaming"
    assert "%" in page.inner_text("#metrics")  # acceptance, shown in drafting modes only

    page.locator("#mode").get_by_text("autoregressive", exact=True).click()
    send(page, "for i in range(10):", "autoregressive")
    assert "%" not in page.inner_text("#metrics")
    assert page.locator('#chatbot [data-testid="bot"]').count() == 2
    assert "Could not answer" not in page.inner_text("#chatbot")

    page.click("#clear")
    page.locator("#mode").get_by_text("speculative", exact=True).click()
    page.get_by_label("Colour tokens by provenance").check()
    example = next(e for e in app.load_examples() if e["label"] == "LRU cache class")
    page.get_by_role("button", name=example["label"]).click()
    expect(page.locator("#message textarea")).to_have_value(example["prompt"])
    send(page, example["prompt"], "speculative")
    assert page.locator('#chatbot [data-testid="bot"]').count() == 1
    assert page.locator("#chatbot .token-view .tok").count() > 0
    page.wait_for_timeout(500)  # the plot's last redraw
    page.screenshot(path=str(tmp_path / "tiny.png"))
    assert (tmp_path / "tiny.png").stat().st_size > 10_000


@pytest.mark.real
def test_real_pair_answers_in_the_browser_and_the_screenshot_is_taken(open_app, real_pair):
    from engine.core.service import Engine

    page = open_app(Engine(*real_pair))
    page.get_by_label("Colour tokens by provenance").check()
    example = next(e for e in app.load_examples() if e["label"] == "LRU cache class")
    page.get_by_role("button", name=example["label"]).click()
    send(page, example["prompt"], "best")
    assert "class" in page.locator('#chatbot [data-testid="bot"]').inner_text()
    page.wait_for_timeout(500)  # the plot's last redraw
    page.screenshot(path=str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 10_000


def test_stop_button_ends_the_stream_and_keeps_the_partial_answer(open_app, engine):
    slow = SlowEngine(engine, delay=0.05)
    page = open_app(slow)
    page.fill("#max-new-tokens input[type=number]", "200")
    page.press("#max-new-tokens input[type=number]", "Enter")
    page.fill("#message textarea", "def add(a, b):")
    page.click("#send")
    page.wait_for_function("""() => document.querySelector('#metrics .finish')?.innerText.includes('streaming')""")
    page.click("#stop")
    assert slow.closed.wait(5), "Stop did not close the engine stream"
    page.wait_for_function("""() => document.querySelector('#metrics .finish')?.innerText === 'stopped'""")
    answer = page.locator('#chatbot [data-testid="bot"]').inner_text()
    page.wait_for_timeout(500)
    assert answer and page.locator('#chatbot [data-testid="bot"]').inner_text() == answer
    assert not slow.final_read
