"""From the command to an answer: ``python app.py`` with the models prepared, started as a user
starts it, timed until it answers a short question through the API, with its peak resident memory.

    python -m benchmarks.startup [--runs 2] [--json OUT] [--table OUT] [APP ARGS ...]

The first run adds ``--remeasure`` (what start times on a machine it has not measured: the kernels
per model, the prompt reader, the pass costs, the op's candidates); the later ones start as a
restart does, reading those back (engine.core.measured). Loopback only: the app is started here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from benchmarks.chaos import app_server
from benchmarks.report import add_output_arguments, peak_rss_gib, write_text
from engine.cli import run_cli
from engine.report import Column, markdown_table

QUESTION = "Write a Python function that reverses a string."
COLUMNS = [
    Column("start", "start"),
    Column("serving (s)", "serving_s", "{:.1f}"),
    Column("answered (s)", "answered_s", "{:.1f}"),
    Column("peak resident (GiB)", "peak_rss_gib", "{:.2f}"),
    Column("measured", "measured"),
]


def one_start(app_args: list[str], label: str, max_tokens: int) -> dict:
    """Start the app, ask one question, and say how long each took from the command."""
    start = time.monotonic()
    with app_server(app_args) as (url, pid):
        serving = time.monotonic() - start
        body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens}
        reply = httpx.post(f"{url}v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        answered = time.monotonic() - start
        health = httpx.get(f"{url}health", timeout=10).json()
        peak = peak_rss_gib(pid)
    return {
        "start": label,
        "serving_s": serving,
        "answered_s": answered,
        "peak_rss_gib": peak,
        "measured": health.get("measured", "-"),
        "op_kernels": health.get("op kernels"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="starts: the first measures afresh, the rest read back")
    parser.add_argument("--max-tokens", type=int, default=32, help="the answer's length")
    add_output_arguments(parser, json=Path("bench-results/startup.json"), table=Path("bench-results/startup.md"))
    args, app_args = parser.parse_known_args(argv)

    def startup() -> None:
        rows = []
        for run in range(args.runs):
            first = run == 0
            label = "measuring (--remeasure)" if first else "restart"
            rows.append(one_start([*app_args, *(["--remeasure"] if first else [])], label, args.max_tokens))
            print(markdown_table(rows[-1:], COLUMNS), flush=True)
        table = markdown_table(rows, COLUMNS)
        print(table)
        write_text(args.table, table + "\n")
        write_text(
            args.json,
            json.dumps({"settings": vars(args) | {"app_args": app_args}, "rows": rows}, indent=1, default=str),
        )

    return run_cli(startup)


if __name__ == "__main__":
    sys.exit(main())
