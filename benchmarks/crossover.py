"""Where serving several users with batched plain steps beats speculation, from measured passes.

    python -m benchmarks.crossover [--acceptance 0.7] [--k 4] [--context 200]

Times one-token target steps and (K+1)-token verify passes over 1, 2, 4 and 8 rows, and 2-token
draft steps over as many rows (the draft's pass width in the engine), at a given context length,
on the prepared pair. From them, for U users: plain batched decoding makes U tokens per step;
batched speculation (K draft steps and one verify over U rows per round) makes U x E tokens per
round, E = (1 - a^(K+1)) / (1 - a) at acceptance a (Leviathan et al. 2023); serving the users one
at a time speculatively makes E tokens per lone round. The scheduler (engine/core/scheduler.py)
speculates for a lone request and batches plain steps for several: this table is why.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from engine.cli import run_cli
from engine.core.runtime import DRAFT_CONFIG, TARGET_CONFIG, Runtime
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.report import Column, markdown_table

ROWS = (1, 2, 4, 8)
COLUMNS = [
    Column("users", "users"),
    Column("target step ms", "step_ms", "{:.0f}"),
    Column("verify ms", "verify_ms", "{:.0f}"),
    Column("draft step ms", "draft_ms", "{:.0f}"),
    Column("plain batched tokens/s", "plain", "{:.1f}"),
    Column("batched speculation tokens/s (est.)", "speculative", "{:.1f}"),
    Column("one at a time, speculative tokens/s (est.)", "alone", "{:.1f}"),
]


def pass_seconds(runtime: Runtime, rows: int, width: int, context: int, repeats: int = 5) -> float:
    """Median seconds of a pass of ``width`` tokens over ``rows`` rows, each after ``context`` tokens."""
    request = runtime.compiled.create_infer_request()

    def infer(past: int, tokens: int) -> None:
        request.infer(
            {
                "input_ids": np.full((rows, tokens), 100, dtype=np.int64),
                "attention_mask": np.ones((rows, past + tokens), dtype=np.int64),
                "position_ids": np.tile(np.arange(past, past + tokens, dtype=np.int64), (rows, 1)),
                "beam_idx": np.arange(rows, dtype=np.int32),
                "logits_to_keep": np.array([width], dtype=np.int64),
            }
        )

    infer(0, context)
    times = []
    for i in range(repeats + 1):  # the first pass of a width pays its setup
        start = time.perf_counter()
        infer(context + i * width, width)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def expected_tokens(acceptance: float, k: int) -> float:
    return k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def crossover(target: Runtime, draft: Runtime, acceptance: float, k: int, context: int) -> list[dict]:
    tokens = expected_tokens(acceptance, k)
    rows = []
    for users in ROWS:
        step = pass_seconds(target, users, 1, context)
        verify = pass_seconds(target, users, k + 1, context)
        draft_step = pass_seconds(draft, users, 2, context)
        lone_round = k * pass_seconds(draft, 1, 2, context) + pass_seconds(target, 1, k + 1, context)
        rows.append(
            {
                "users": users,
                "step_ms": 1e3 * step,
                "verify_ms": 1e3 * verify,
                "draft_ms": 1e3 * draft_step,
                "plain": users / step,
                "speculative": users * tokens / (k * draft_step + verify),
                "alone": tokens / lone_round,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.crossover", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--acceptance", type=float, default=0.7, help="draft acceptance (0.70: best on coding)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=200, help="tokens each row holds already")
    args = parser.parse_args(argv)

    def run() -> None:
        target_model, draft_model = prepare_from_args(args)
        target = Runtime(target_model.path, config=TARGET_CONFIG)
        draft = Runtime(draft_model.path, config=DRAFT_CONFIG)
        print(f"acceptance {args.acceptance}, K={args.k}, {args.context} tokens of context per row")
        print(markdown_table(crossover(target, draft, args.acceptance, args.k, args.context), COLUMNS))

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
