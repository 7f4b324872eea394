"""Target precisions side by side in one run: each target's autoregressive decode and `best`.

    python -m benchmarks.precision_speed --prompts assets/prompts/coding.jsonl [--precisions int8,int4]
        [--limit N] [--json OUT] [--table OUT]

Every target and the one draft are loaded once; the configurations take turns per prompt,
greedy, every run on empty caches. Speedups are against the first precision's autoregressive
decode; "identical to ar" compares each `best` with the autoregressive decode of its own target.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.bench import COLUMNS, Run, add_prompt_arguments, compare_to_ar, load_prompts, own_run, summarize
from benchmarks.report import add_output_arguments, several_engines_limit, write_text
from engine.cli import run_cli
from engine.core.modes import BY_SHORT_NAME
from engine.core.requests import Request
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.prepare.convert import PRECISIONS
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.report import markdown_table

K = 4


def run_precisions(args: argparse.Namespace) -> None:
    engines = {}
    for precision in args.precisions.split(","):
        target, draft = prepare_from_args(argparse.Namespace(**{**vars(args), "target_precision": precision}))
        # Each engine's budget counts the whole process, where every target is loaded.
        engines[precision] = Engine(target.path, draft.path, Settings(memory_limit=several_engines_limit()))
    runs: list[Run] = []
    for prompt_id, prompt in load_prompts(args.prompts)[: args.limit]:
        for precision, engine in engines.items():
            prompt_ids = engine.prompt_ids(Request(({"role": "user", "content": prompt},)))
            ar, best = (
                own_run(
                    engine, prompt_id, prompt_ids, BY_SHORT_NAME[m].name, K, args.max_new_tokens, f"{precision} {m}"
                )
                for m in ("ar", "best")
            )
            compare_to_ar(engine, prompt_ids, ar, best)
            runs += [ar, best]
            speeds = ", ".join(f"{r.mode} {r.new_tokens / r.wall_s:.1f}" for r in (ar, best))
            print(f"  {prompt_id:>12} {speeds} tokens/s", file=sys.stderr)
    rows = summarize(runs, baseline=runs[0].mode)
    text = markdown_table(rows, COLUMNS)
    print(text)
    write_text(args.table, text + "\n")
    write_text(args.json, json.dumps({"summary": rows, "runs": [r.__dict__ for r in runs]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.precision_speed", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_prompt_arguments(parser)
    parser.add_argument("--precisions", default="int8,int4", help=f"target weights, comma separated, of {PRECISIONS}")
    add_output_arguments(parser)
    return run_cli(lambda: run_precisions(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
