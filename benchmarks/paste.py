"""One long paste, as a user pastes a file into the chat: when its answer starts and ends, and
what the process's resident memory peaks at while the prompt is read, for each length asked
(``cap``: the longest the engine's input cap accepts). Each paste starts on empty caches.

    python -m benchmarks.paste --tokens 6000,cap --mode best
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.report import add_output_arguments, write_text
from engine.core.memory import peak_resident_bytes, reset_peak_rss, resident_bytes
from engine.core.requests import Request
from engine.core.service import Engine
from engine.errors import EngineError
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.report import Column, markdown_table

GB = 1e9
COLUMNS = [
    Column("prompt tokens", "prompt_tokens", "{:,}"),
    Column("mode", "mode"),
    Column("TTFT s", "ttft_s", "{:.1f}"),
    Column("wall s", "wall_s", "{:.1f}"),
    Column("read tokens/s", "prefill_tokens_per_s", "{:.0f}"),
    Column("RSS before GB", "rss_before_gb", "{:.2f}"),
    Column("peak GB", "peak_gb", "{:.2f}"),
    Column("after GB", "rss_after_gb", "{:.2f}"),
    Column("budget GB", "budget_gb", "{:.2f}"),
]


def paste(engine: Engine, words: int, mode: str, max_new_tokens: int) -> dict:
    """``"word " * words`` answered on empty caches: its timings and the process's memory."""
    request = Request(
        ({"role": "user", "content": "word " * words},), mode=mode, max_new_tokens=max_new_tokens, reuse_cache=False
    )
    prompt_tokens = len(engine.check(request))
    reset_peak_rss()
    before = resident_bytes()
    start, ttft, final = time.perf_counter(), None, None
    for event in engine.generate(request):
        if event.kind == "delta" and ttft is None:
            ttft = time.perf_counter() - start
        if event.final:
            final = event
    if final is None or final.kind != "done":
        raise EngineError(f"the {prompt_tokens:,}-token paste failed: {final.error if final else 'no final event'}")
    after = resident_bytes()
    return {
        "prompt_tokens": prompt_tokens,
        "mode": mode,
        "ttft_s": ttft,
        "wall_s": time.perf_counter() - start,
        "prefill_tokens_per_s": final.metrics.get("prefill_tokens_per_s"),
        "rss_before_gb": before / GB,
        "peak_gb": max(peak_resident_bytes(), before, after) / GB,  # (at least every reading taken)
        "rss_after_gb": after / GB,
        "budget_gb": engine.budget.limit / GB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paste", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--tokens", default="6000", help="paste lengths, comma separated ('cap': the input cap's)")
    parser.add_argument("--mode", default="best")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    try:
        target, draft = prepare_from_args(args)
        engine = Engine(target.path, draft.path)
        # ("word " is one token each; the chat template adds a few)
        lengths = [engine.max_input_tokens - 64 if t == "cap" else int(t) for t in args.tokens.split(",")]
        rows = []
        for words in lengths:
            rows.append(paste(engine, words, args.mode, args.max_new_tokens))
            print(f"  {rows[-1]}", file=sys.stderr)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = markdown_table(rows, COLUMNS)
    print(text)
    write_text(args.table, text + "\n")
    write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
