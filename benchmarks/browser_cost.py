"""What a browser on the server's own CPU costs decoding: one answer from the engine alone, then
the same prompt streamed in headless Chromium on this machine (the real default pair).

    python -m benchmarks.browser_cost                 # "LRU cache class", best, 256 new tokens, twice
    python -m benchmarks.browser_cost --runs 3 --tokens 128

Prints tokens/s (the engine's own figure, as the answer's footer shows it) and the CPU seconds
Chromium used over each answer (from /proc). docs/benchmarks.md, "The chat in a browser".
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import app
from benchmarks.chromium import FOOTERS, chromium, set_cap
from engine.cli import free_port
from engine.core.requests import Request
from engine.startup import start_engine
from ui.launch import launch
from ui.page import build_app, load_examples


def chromium_cpu_s() -> float:
    """CPU seconds used so far by every Chromium process."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "chrom" in text[text.index("(") + 1 : text.rindex(")")]:
            fields = text[text.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.browser_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="LRU cache class")
    parser.add_argument("--mode", default="best")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    engine = start_engine(app.parse_args([]))  # the default pair, prepared as `make run` does
    prompt = next(e["prompt"] for e in load_examples() if e["label"] == args.example)
    request = Request(({"role": "user", "content": prompt},), mode=args.mode, max_new_tokens=args.tokens)
    for run in range(args.runs):
        alone = engine.run(replace(request, reuse_cache=False)).metrics["tokens_per_s"]
        print(f"engine alone, run {run + 1}: {alone:.1f} tokens/s", flush=True)
    demo = build_app(engine)
    url = launch(demo, port=free_port(), block=False)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 1100})
        page.goto(url)
        page.wait_for_selector("#message textarea")
        set_cap(page, args.tokens)
        page.locator("#mode").get_by_text(args.mode, exact=True).click()
        for run in range(args.runs):
            page.click("#new-chat")
            time.sleep(1)
            before = chromium_cpu_s()
            page.fill("#message textarea", prompt)
            page.click("#send")
            page.wait_for_function(
                f"() => document.querySelector('{FOOTERS}')?.innerText.includes('{args.tokens} tokens')",
                timeout=300_000,
            )
            footer = page.locator(FOOTERS).inner_text().splitlines()[0]
            print(f"in Chromium, run {run + 1}: {footer} · Chromium {chromium_cpu_s() - before:.1f} CPU s", flush=True)
    demo.close()


if __name__ == "__main__":
    main()
