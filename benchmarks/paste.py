"""One long paste, as a user pastes a file into the chat: when its answer starts and ends, and
what the process's resident memory peaks at while the prompt is read, for each length asked
(``cap``: the longest the engine's input cap accepts). Each paste starts on empty caches.
``--beside N``: another user chats meanwhile (answers of N tokens, asked again as each ends),
and their gaps between tokens while the paste is read are set against their gaps alone.

    python -m benchmarks.paste --tokens 6000,cap --mode best
    python -m benchmarks.paste --tokens 8000 --mode autoregressive --beside 64
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time

from benchmarks.report import add_output_arguments, percentile, write_text
from engine.core.budget import GIB
from engine.core.memory import peak_resident_bytes, reset_peak_rss, resident_bytes
from engine.core.requests import Request
from engine.core.service import Engine
from engine.errors import EngineError
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.report import Column, markdown_table
from engine.startup import add_engine_arguments, engine_from_args

COLUMNS = [
    Column("prompt tokens", "prompt_tokens", "{:,}"),
    Column("mode", "mode"),
    Column("TTFT s", "ttft_s", "{:.1f}"),
    Column("wall s", "wall_s", "{:.1f}"),
    Column("read tokens/s", "prefill_tokens_per_s", "{:.0f}"),
    Column("RSS before GiB", "rss_before_gib", "{:.2f}"),
    Column("peak GiB", "peak_gib", "{:.2f}"),
    Column("after GiB", "rss_after_gib", "{:.2f}"),
    Column("budget GiB", "budget_gib", "{:.2f}"),
]
BESIDE_COLUMNS = [
    Column("other user's gap p95 alone ms", "other_p95_alone_ms", "{:.0f}"),
    Column("while the paste is read ms", "other_p95_reading_ms", "{:.0f}"),
    Column("their tokens meanwhile", "other_tokens_reading", "{:,}"),
]
CHATTER = "Write a Python function that tells whether a string is a palindrome, with a docstring."


def _p95_ms(gaps: list[float]) -> float | None:
    p95 = percentile(gaps, 0.95)
    return None if p95 is None else 1000 * p95


def _token_times(engine: Engine, request: Request) -> list[float]:
    """When each of an answer's tokens arrived (``time.perf_counter``)."""
    times: list[float] = []
    for event in engine.generate(request):
        if event.kind == "delta":
            times += [time.perf_counter()] * max(1, len(event.token_ids))
        elif event.kind == "error":
            raise EngineError(f"the other user's answer failed: {event.error}")
    return times


def _gaps(times: list[float], start: float = 0.0, end: float = float("inf")) -> list[float]:
    """Seconds between successive tokens of one answer, for those that arrived in ``[start, end]``."""
    return [b - a for a, b in itertools.pairwise(times) if start <= a and b <= end]


def beside(engine: Engine, words: int, mode: str, max_new_tokens: int, answer_tokens: int) -> dict:
    """:func:`paste`'s row, with another user's gaps between tokens (their 95th percentile) alone
    and while the paste is read; they ask for plain decoding, one token a step."""
    chat = Request(
        ({"role": "user", "content": CHATTER},), mode="autoregressive", max_new_tokens=answer_tokens, client="other"
    )
    alone = _gaps(_token_times(engine, chat))
    answers: list[list[float]] = []
    reading = threading.Event()

    def chatter() -> None:
        while reading.is_set():
            answers.append(_token_times(engine, chat))

    reading.set()
    other = threading.Thread(target=chatter, daemon=True)
    other.start()
    try:
        row = paste(engine, words, mode, max_new_tokens)
        # (its answer ended wall_s after the paste was sent: the read is the ttft_s before that)
        read_end = time.perf_counter() - (row["wall_s"] - row["ttft_s"])
    finally:
        reading.clear()
        other.join()
    window = (read_end - row["ttft_s"], read_end)
    return {
        **row,
        "other_p95_alone_ms": _p95_ms(alone),
        "other_p95_reading_ms": _p95_ms([g for times in answers for g in _gaps(times, *window)]),
        "other_tokens_reading": sum(window[0] <= t <= window[1] for times in answers for t in times),
    }


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
        "rss_before_gib": before / GIB,
        "peak_gib": max(peak_resident_bytes(), before, after) / GIB,  # (at least every reading taken)
        "rss_after_gib": after / GIB,
        "budget_gib": engine.budget.limit / GIB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paste", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--tokens", default="6000", help="paste lengths, comma separated ('cap': the input cap's)")
    parser.add_argument("--mode", default="best")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--beside", type=int, default=0, help="another user chats meanwhile, answers of N tokens")
    add_engine_arguments(parser)  # (the memory limit, the prompt reader and the kernels are read here)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    try:
        target, draft = prepare_from_args(args)
        engine = engine_from_args(args, target, draft)
        # ("word " is one token each; the chat template adds a few)
        lengths = [engine.max_input_tokens - 64 if t == "cap" else int(t) for t in args.tokens.split(",")]
        rows = []
        for words in lengths:
            if args.beside:
                rows.append(beside(engine, words, args.mode, args.max_new_tokens, args.beside))
            else:
                rows.append(paste(engine, words, args.mode, args.max_new_tokens))
            print(f"  {rows[-1]}", file=sys.stderr)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = markdown_table(rows, COLUMNS + (BESIDE_COLUMNS if args.beside else []))
    print(text)
    write_text(args.table, text + "\n")
    write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
