"""The app's page driven in headless Chromium: what the browser test (tests/ui/test_browser.py),
the README screenshots (:mod:`benchmarks.screenshots`) and the browser's cost
(:mod:`benchmarks.browser_cost`) share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from playwright.sync_api import Browser, Page, ViewportSize, expect, sync_playwright

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
ANSWERS = '#chatbot .message:not(.thought) > [data-testid="bot"]'  # answers, not their footers
FOOTERS = "#chatbot .thought"
DESKTOP: ViewportSize = {"width": 1440, "height": 1350}
PHONE: ViewportSize = {"width": 390, "height": 844}
# A whole answer of the real pair without a cap (364 tokens for the LRU example): 90 s at the 4 tokens/s
# of the slowest 2-core machine seen, with room for the engine's start-up timing.
ANSWER_MS = 450_000
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
RACE_WATCH = """() => {
  window.raced = [];
  new MutationObserver(() => {
    const right = document.querySelector('#right-text')?.innerText ?? '';
    if (right !== window.raced.at(-1)) window.raced.push(right);
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: Browser, url: str, viewport: ViewportSize | None = None) -> Page:
    """The app at ``url`` in a new page, once it has restored the browser's open conversation."""
    page = browser.new_page(viewport=viewport or DESKTOP)
    page.set_default_timeout(30_000)
    page.goto(url)
    page.wait_for_selector("#message textarea")
    page.wait_for_function("() => document.querySelector('#conversations input')?.value")  # restored
    return page


def send(page: Page, message: str, mode: str) -> None:
    """Type ``message``, send it and wait until its answer is finished in ``mode``."""
    page.evaluate(WATCH)
    page.fill("#message textarea", message)
    page.click("#send")
    finished(page)
    assert page.get_attribute("#metrics .metrics", "data-mode") == mode


def finished(page: Page) -> None:
    """Wait until the answer streaming (as :data:`WATCH` saw) has finished without an error."""
    page.wait_for_function(
        """() => window.seen.metrics.some(m => m.includes('streaming') || m.includes('error'))
        && /length|stop|context|error/.test(document.querySelector('#metrics .finish')?.innerText)""",
        timeout=ANSWER_MS,
    )
    assert page.inner_text("#metrics .finish") != "error", page.inner_text("#chatbot")


def set_cap(page: Page, tokens: int) -> None:
    page.fill("#max-new-tokens input[type=number]", str(tokens))
    page.press("#max-new-tokens input[type=number]", "Enter")


def answers(page: Page) -> list[str]:
    return page.locator(ANSWERS).all_inner_texts()


def race(page: Page, left: str, right: str) -> list[str]:
    """Run Compare with ``left`` and ``right`` modes; return the right pane's texts as seen."""
    page.get_by_role("tab", name="Compare").click()
    for side, mode in (("left", left), ("right", right)):
        page.click(f"#{side}-mode input")
        page.get_by_role("option", name=mode, exact=True).last.click()  # (the list just opened)
        page.locator(f"#{side}-mode input").blur()
        expect(page.locator(f"#{side}-mode input")).to_have_value(mode)
    page.evaluate(RACE_WATCH)
    page.click("#run-compare")
    page.wait_for_function(  # both runs, then their race, finished
        """() => window.raced.some(t => t.endsWith('▌'))
            && document.querySelector('#verdict')?.innerText.includes('speedup')""",
        timeout=2 * ANSWER_MS,
    )
    return page.evaluate("window.raced")
