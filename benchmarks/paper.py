"""``python -m benchmarks.paper``: the seed paper's experiments (arXiv 2311.04951) on this machine.

1. the target drafting for itself at K=1: acceptance ~1 shows the mechanism is sound;
2. autoregressive vs speculative at N=40 and N=100 new tokens, K from 1 to 8;
3. the target at each precision (int4 draft), with KV-cache memory per model.
Steps 1 and 2 run on the default target (the GGUF's own blocks for the embedded pair).
Writes ``assets/paper_table.md`` and ``assets/paper_chart.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.bench import add_prompt_arguments, load_prompts, run_bench, summarize
from benchmarks.report import Series, line_chart, several_engines_limit, write_text
from engine import report
from engine.cli import ASSETS, run_cli
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.prepare.convert import PRECISIONS, Compression
from engine.prepare.pipeline import (
    DEFAULT_PRECISION,
    add_model_arguments,
    cache_dir_from_args,
    draft_compression,
    prepare_one,
)
from engine.report import Column, markdown_table


def _rows(engine: Engine, prompts, ks: list[int], n: int, label: str) -> list[dict]:
    runs = run_bench(engine, prompts, ["ar", "sd"], ks, n, {})
    rows = summarize(runs)
    kv = {r.mode: r.extra for r in runs}
    for row in rows:
        row.update(
            setup=label,
            n=n,
            target_kv_kib=kv[row["mode"]]["target_kv_bytes"] / 1024,
            draft_kv_kib=kv[row["mode"]]["draft_kv_bytes"] / 1024,
        )
    return rows


def _setup(target: Path, draft: Path, prompts, ks: list[int], ns: list[int], label: str) -> list[dict]:
    """One engine's rows, the engine closed and freed before the next one loads."""
    with Engine(target, draft, Settings(memory_limit=several_engines_limit())) as engine:
        return [row for n in ns for row in _rows(engine, prompts, ks, n, label)]


def run_paper(args: argparse.Namespace) -> None:
    cache = cache_dir_from_args(args)
    prompts = load_prompts(args.prompts)[: args.limit or 2]
    draft = prepare_one(args.draft, draft_compression(), cache).path
    default = DEFAULT_PRECISION["target"]
    precisions = [default, *(p for p in PRECISIONS if p != default)]
    targets = {p: prepare_one(args.target, Compression(p), cache).path for p in precisions}
    rows: list[dict] = []

    rows += _setup(targets[default], targets[default], prompts, [1], [40], f"target drafts for itself ({default})")
    for precision, target in targets.items():
        ks = list(range(1, 9)) if precision == default else [4]
        rows += _setup(target, draft, prompts, ks, [40, 100], f"target {precision}, draft int4")

    table = markdown_table(rows, COLUMNS)
    print(table)
    write_text(ASSETS / "paper_table.md", table + "\n")
    _chart([r for r in rows if r["setup"] == f"target {default}, draft int4"], ASSETS / "paper_chart.png", default)
    print(f"wrote {ASSETS / 'paper_table.md'} and {ASSETS / 'paper_chart.png'}")


COLUMNS = [
    Column("setup", "setup"),
    *report.PAPER_COLUMNS,
    Column("target KV KiB", "target_kv_kib", "{:.0f}"),
    Column("draft KV KiB", "draft_kv_kib", "{:.0f}"),
]


def _chart(rows: list[dict], out: Path, precision: str) -> None:
    series = []
    for n, colour in ((40, "tab:blue"), (100, "tab:orange")):
        sd = [r for r in rows if r["n"] == n and r["mode"].startswith("sd")]
        ar = next(r for r in rows if r["n"] == n and r["mode"] == "ar")
        series += [
            Series(
                f"speculative, N={n}",
                [int(r["mode"].split("-k")[1]) for r in sd],
                [r["tokens_per_s"] for r in sd],
                colour,
            ),
            Series(f"autoregressive, N={n}", [], [ar["tokens_per_s"]], colour),
        ]
    title = f"Qwen2.5-Coder 1.5B {precision} target, 0.5B int4 draft, 2 CPU cores"
    line_chart(series, out, title, "draft length K", "tokens/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paper", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_prompt_arguments(parser)
    return run_cli(lambda: run_paper(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
