"""The speedup ceiling of exact drafting with a given pair on this machine.

    python -m benchmarks.ceiling --prompts assets/prompts/coding.jsonl --max-new-tokens 128

For each prompt it decodes greedily (the target's answer), records where the draft
model's own greedy prediction agrees with that answer (teacher-forced: what it would
draft at each position while its drafts are right) and how far prompt lookup's copy
would be right there, and measures the pass costs: a target pass for each verify width
(runs of equal widths, so no pass pays for a change of shape), a draft step, a prefill.
A clairvoyant drafter that drafts exactly the tokens the target will accept, choosing
per round between the draft model and prompt lookup, then has a minimum cost per answer
(dynamic programming over the rounds). Its draft steps carry the engine's next-token guess
(measured along the answer: a step whose guess is right drafts two tokens). No exact
drafting policy with this draft and guesser can beat it: it never drafts a rejected token,
never trims a cache and never pays for a change of pass width.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.bench import add_prompt_arguments, load_prompts
from engine.cli import run_cli
from engine.core.drafters import LookupDrafter, NextTokenGuesser
from engine.core.modes import LOOKUP_SPAN
from engine.core.requests import Request
from engine.core.runtime import Runtime
from engine.core.service import Engine
from engine.errors import EngineError
from engine.prepare.pipeline import add_model_arguments, prepare_from_args
from engine.report import Column, markdown_table, speedup

MAX_WIDTH = LOOKUP_SPAN + 1  # the widest verify: a full lookup copy plus the bonus row


@dataclass(frozen=True)
class Costs:
    """Seconds per pass: ``verify[w]`` for a target pass over w tokens (w >= 1), ``draft`` per draft step."""

    verify: Sequence[float]
    draft: float


@dataclass(frozen=True)
class Answer:
    prefill_s: float
    draft_runs: Sequence[int]  # at each position: how many draft predictions from there match the answer
    lookup_runs: Sequence[int]  # at each position: how many tokens of prompt lookup's copy match the answer
    guess_hits: Sequence[bool] = ()  # at each position: the draft's guesser guesses the draft's token

    def draft_steps(self, start: int, count: int) -> int:
        """Draft steps to draft ``count`` tokens from ``start``: a step whose guess is right drafts two."""
        steps, position = 0, start
        while position < start + count:
            steps += 1
            hit = position < len(self.guess_hits) and self.guess_hits[position]
            position += 2 if hit and position + 1 < start + count else 1
        return steps


def runs_from_matches(matches: Sequence[bool]) -> list[int]:
    """At each position, the length of the run of matches starting there."""
    runs = [0] * (len(matches) + 1)
    for i in range(len(matches) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if matches[i] else 0
    return runs[:-1]


def min_decode_seconds(answer: Answer, costs: Costs, use_lookup: bool = True) -> float:
    """The clairvoyant drafter's decode time: best[i] = least time to emit the first i tokens.

    A round at position i drafts j tokens it knows will be accepted (from the draft model at
    one draft step each, two where the step's guess is right, or copied by lookup at no cost)
    and verifies them with the target's bonus token in one pass of width j + 1, advancing j + 1
    positions."""
    n = len(answer.draft_runs)
    best = [0.0] + [float("inf")] * n
    widest = len(costs.verify) - 1
    for i in range(n):
        copy = answer.lookup_runs[i] if use_lookup else 0
        for j in range(min(max(answer.draft_runs[i], copy), widest - 1) + 1):
            seconds = costs.verify[j + 1] + (0.0 if j <= copy else answer.draft_steps(i, j) * costs.draft)
            end = min(n, i + j + 1)
            best[end] = min(best[end], best[i] + seconds)
    return best[n]


def measure_costs(target: Runtime, draft: Runtime, context: list[int], repeats: int = 7) -> Costs:
    """Median pass times after ``context``; each width runs ``repeats`` times in a row."""
    target.reset()
    target.forward(context)
    verify = [0.0]
    for width in range(1, MAX_WIDTH + 1):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            target.forward(context[:width])
            times.append(time.perf_counter() - start)
            target.trim(len(context))
        verify.append(statistics.median(times[1:]))
    draft.reset()
    draft.forward(context)
    steps = []
    for token in context[: repeats * 4]:
        start = time.perf_counter()
        draft.sync([*draft.tokens, token])
        steps.append(time.perf_counter() - start)
    return Costs(verify, statistics.median(steps))


def analyse(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], Answer]:
    """The target's greedy answer, its prefill time, and the draft's, lookup's and guesser's
    record along it."""
    final = engine.run(
        Request(prompt_ids=tuple(prompt_ids), mode="autoregressive", max_new_tokens=max_new_tokens, reuse_cache=False)
    )
    if final.kind == "error":
        raise EngineError(final.error)
    answer = final.token_ids
    return answer, engine.with_models(lambda target, draft: _record(target, _only(draft), prompt_ids, answer))


def _only(draft: Runtime | None) -> Runtime:
    if draft is None:
        raise EngineError("the ceiling needs a draft model")
    return draft


def _record(target: Runtime, draft: Runtime, prompt_ids: list[int], answer: list[int]) -> Answer:
    target.reset()
    start = time.perf_counter()
    target.forward(prompt_ids)
    prefill = time.perf_counter() - start
    predictions = draft_predictions(draft, prompt_ids, answer)
    return Answer(
        prefill,
        runs_from_matches([p == t for p, t in zip(predictions, answer)]),
        lookup_runs(prompt_ids, answer, target.vocab_size),
        guess_hits(prompt_ids, answer, predictions, target.vocab_size),
    )


def draft_predictions(draft: Runtime, prompt_ids: list[int], answer: list[int]) -> list[int]:
    """The draft's greedy token at each position of the answer, given the answer before it."""
    draft.reset()
    predictions = [int(np.argmax(draft.forward(prompt_ids)[-1]))]
    for token in answer[:-1]:
        predictions.append(int(np.argmax(draft.sync([*draft.tokens, token])[-1])))
    return predictions


def lookup_runs(prompt_ids: list[int], answer: list[int], vocab_size: int) -> list[int]:
    """At each position, how many tokens of prompt lookup's copy equal the answer."""
    lookup = LookupDrafter(vocab_size, min_ngram=2, span=LOOKUP_SPAN)
    context = np.asarray([*prompt_ids, *answer])
    runs = []
    for i in range(len(answer)):
        copy = lookup.lookup(context[: len(prompt_ids) + i], LOOKUP_SPAN)
        runs.append(next((j for j, t in enumerate(copy) if i + j >= len(answer) or answer[i + j] != t), len(copy)))
    return runs


def guess_hits(prompt_ids: list[int], answer: list[int], predictions: list[int], vocab_size: int) -> list[bool]:
    """At each position, whether the engine's guesser, learning as the draft drafts, guesses the
    draft's token."""
    guesser = NextTokenGuesser(vocab_size)
    hits = []
    for i, prediction in enumerate(predictions):
        before = [*prompt_ids, *answer[:i]]
        hits.append(guesser.guess(before) == prediction)
        guesser.learn(before, prediction)
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_prompt_arguments(parser)
    return run_cli(lambda: print(report(*measure(parser.parse_args(argv)))))


def measure(args: argparse.Namespace) -> tuple[list[tuple[str, int, Answer]], Costs]:
    target, draft = prepare_from_args(args)
    engine = Engine(target.path, draft.path)
    prompts = load_prompts(args.prompts)[: args.limit]
    answers = []
    for prompt_id, prompt in prompts:
        prompt_ids = engine.prompt_ids(Request(({"role": "user", "content": prompt},)))
        tokens, answer = analyse(engine, prompt_ids, args.max_new_tokens)
        answers.append((prompt_id, len(tokens), answer))
        print(
            f"  {prompt_id:>12} {len(tokens)} tokens, draft agrees on "
            f"{sum(r > 0 for r in answer.draft_runs) / max(1, len(tokens)):.0%}",
            file=sys.stderr,
        )
    context = engine.prompt_ids(Request(({"role": "user", "content": prompts[0][1]},))) * 2
    return answers, engine.with_models(lambda t, d: measure_costs(t, _only(d), context))


COLUMNS = [
    Column("prompt", "prompt"),
    Column("tokens", "tokens"),
    Column("ceiling, draft model", "draft", "{:.2f}×"),
    Column("ceiling, draft model or prompt lookup", "lookup", "{:.2f}×"),
]


def report(answers: list[tuple[str, int, Answer]], costs: Costs) -> str:
    """Per prompt and in all: the clairvoyant drafters' speedup over autoregressive decoding."""
    rows = []
    for label, group in [*((pid, [(pid, n, a)]) for pid, n, a in answers), ("all", answers)]:
        ar = sum(a.prefill_s + n * costs.verify[1] for _, n, a in group)
        ceilings = [
            speedup(ar, sum(a.prefill_s + min_decode_seconds(a, costs, lookup) for _, _, a in group))
            for lookup in (False, True)
        ]
        rows.append(
            {"prompt": label, "tokens": sum(n for _, n, _ in group), "draft": ceilings[0], "lookup": ceilings[1]}
        )
    return (
        f"target pass: 1 token {costs.verify[1] * 1e3:.1f} ms, 4 tokens {costs.verify[4] * 1e3:.1f} ms, "
        f"{MAX_WIDTH} tokens {costs.verify[MAX_WIDTH] * 1e3:.1f} ms; draft step {costs.draft * 1e3:.1f} ms\n"
        + markdown_table(rows, COLUMNS)
    )


if __name__ == "__main__":
    sys.exit(main())
