"""The speedup a chat answer's footer shows beside the one Compare measures for the same prompt,
through the app's API on the default pair, a few times (docs/benchmarks.md, "The chat in a
browser"): the footer's speedup is against the plain decoding the engine measured last.

    python -m benchmarks.footer_speedup              # starts the app (default pair) on a free loopback port
    python -m benchmarks.footer_speedup --runs 3 --url http://127.0.0.1:7860/
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.chaos import the_app
from engine.cli import run_cli
from engine.errors import EngineError
from ui.page import load_examples

EXAMPLE = "LRU cache class"


def measure(url: str, prompt: str, runs: int) -> None:
    from gradio_client import Client

    for run in range(runs):
        settings = (4, 0.0, 1.0, 0, -1, "")  # K, greedy, top-p, no cap, seed, no system prompt
        compared = Client(url, verbose=False).predict(prompt, "autoregressive", "best", *settings, api_name="/compare")
        m = Client(url, verbose=False).predict(prompt, False, "best", *settings, api_name="/respond")[3]
        if "identical output" not in compared[4] or m["speedup_vs_ar"] is None:
            raise EngineError(f"run {run + 1}: Compare's answers differ, or the footer has no measured speedup")
        speedup = compared[4].split("× speedup")[0].rsplit(">", 1)[1]
        print(f"run {run + 1}: Compare {speedup}×, footer {m['speedup_vs_ar']:.2f}× ({m['new_tokens']} tokens)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.footer_speedup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running app (loopback only); default: start one")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--example", default=EXAMPLE, help="the example prompt, by its label")
    args, app_args = parser.parse_known_args(argv)

    def footer_speedup() -> None:
        prompt = next(e["prompt"] for e in load_examples() if e["label"] == args.example)
        with the_app(args.url, app_args) as (url, _):
            measure(url, prompt, args.runs)

    return run_cli(footer_speedup)


if __name__ == "__main__":
    sys.exit(main())
