"""``make screenshots``: the README's screenshots of the app on the default pair with the default
settings (no cap): the Compare race, the chat desktop light and dark, and the phone, written to
assets/*.png. Prints the speedup the chat's footer shows for the example beside the one Compare
measured for it.

    python -m benchmarks.screenshots                 # starts the app (default pair) on a free loopback port
    python -m benchmarks.screenshots --url http://127.0.0.1:7860/ --out /tmp/shots
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.chaos import the_app
from benchmarks.chromium import ANSWERS, FOOTERS, PHONE, answers, chromium, open_page, race, send
from engine.cli import ASSETS, run_cli
from engine.errors import EngineError
from ui.page import load_examples

EXAMPLE = "LRU cache class"


def take(url: str, out: Path) -> None:
    example = next(e for e in load_examples() if e["label"] == EXAMPLE)
    out.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        page = open_page(browser, url)
        page.get_by_role("tab", name="Compare").click()
        page.fill("#compare-prompt textarea", example["prompt"])
        race(page, "autoregressive", "best")
        compared = page.inner_text("#verdict .speedup")
        if "identical output" not in page.inner_text("#verdict"):
            raise EngineError(f"Compare's two answers differ: {page.inner_text('#verdict')}")
        page.click("#race-again")
        page.wait_for_timeout(4000)  # mid-race
        page.screenshot(path=str(out / "race.png"))

        page.get_by_role("tab", name="Chat").click()
        page.get_by_role("button", name=example["label"]).click()
        send(page, example["prompt"], "best")
        footer = page.locator(FOOTERS).inner_text().splitlines()[0]
        if not answers(page)[0]:
            raise EngineError("the chat's answer is empty")
        print(f"footer: {footer}\ncompare: {compared}", flush=True)
        page.get_by_label("Colour tokens by provenance").check()
        page.wait_for_timeout(1000)  # the plot's last redraw
        page.screenshot(path=str(out / "screenshot.png"))

        page.goto(url + "?__theme=dark")
        page.wait_for_selector(ANSWERS)  # the conversation, kept by the browser
        page.get_by_label("Colour tokens by provenance").check()
        page.wait_for_timeout(1000)
        page.screenshot(path=str(out / "screenshot-dark.png"))
        page.set_viewport_size(PHONE)
        page.goto(url)
        page.wait_for_selector(ANSWERS)
        page.wait_for_function("() => !document.querySelector('#sidebar').classList.contains('open')")
        page.wait_for_timeout(1000)
        page.screenshot(path=str(out / "screenshot-phone.png"))
    print(f"wrote race.png, screenshot.png, screenshot-dark.png and screenshot-phone.png to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.screenshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running app (loopback only); default: start one")
    parser.add_argument("--out", type=Path, default=ASSETS, help="where the screenshots go (default: assets/)")
    args, app_args = parser.parse_known_args(argv)

    def screenshots() -> None:
        with the_app(args.url, app_args) as (url, _):
            take(url, args.out)

    return run_cli(screenshots)


if __name__ == "__main__":
    sys.exit(main())
