"""Several users chatting at once, through the app's own API (gradio_client): for each number of
concurrent users, aggregate and per-user tokens/s, time to first token, queue wait, errors, lost
or mixed answers (each checked against its solo run) and the app's peak memory.

    python -m benchmarks.loadtest               # starts the app (default pair) on a free loopback port
    python -m benchmarks.loadtest --url http://127.0.0.1:7860/ --users 1 2 4 --turns 3

Each user is a multi-turn conversation (one gradio_client session), its messages taken from the
prompt file. The first phase runs the conversations one at a time: their answers are the solo
runs, and its figures the lone user's. Traffic goes to loopback addresses only; every phase is
bounded by its number of turns and by ``--seconds``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.bench import load_prompts
from benchmarks.chaos import last_text, said, the_app
from benchmarks.report import Series, add_output_arguments, line_chart, peak_rss_gib, percentile, write_text
from engine.cli import CODING_PROMPTS, run_cli
from engine.cluster import REPLICA_LOST
from engine.errors import EngineError
from engine.report import Column, markdown_table

COLUMNS = [
    Column("users", "users"),
    Column("answers", "answers"),
    Column("aggregate tokens/s", "aggregate_tokens_per_s", "{:.1f}"),
    Column("vs one user", "aggregate_vs_one", "{:.2f}×"),
    Column("per-user tokens/s p50", "user_tokens_per_s_p50", "{:.1f}"),
    Column("TTFT p50 s", "ttft_p50_s", "{:.2f}"),
    Column("TTFT p95 s", "ttft_p95_s", "{:.2f}"),
    Column("queue wait p95 s", "queue_p95_s", "{:.2f}"),
    Column("largest batch", "largest_batch"),
    Column("errors", "errors"),
    Column("lost", "lost"),
    Column("mixed", "mixed"),
    Column("differ from solo", "differ"),
    Column("peak RSS GiB", "peak_rss_gib", "{:.2f}"),
]
POLL_S = 0.01  # how often a simulated user looks for its answer's first text
ANSWER_FIGURES = ("prompt_tokens", "cached_tokens", "tokens_per_s", "batch_size", "replica")
# Against a cluster (specchat serve --ray): how the answers spread over the engine replicas.
CLUSTER_COLUMNS = [
    Column("replicas", "replicas"),
    Column("affinity", "affinity", "{:.0%}"),
    Column("cut by a killed replica", "killed"),
]


@dataclass
class Answer:
    user: int
    turn: int
    text: str = ""
    error: str = ""
    ttft_s: float | None = None  # as the client saw it: from sending until the first text
    wall_s: float = 0.0
    metrics: dict = field(default_factory=dict)  # the engine's, from the metrics output
    comparable: bool = True  # the conversation so far is the solo run's (no earlier turn failed)

    @property
    def tokens(self) -> int:
        return int(self.metrics.get("new_tokens", 0))

    @property
    def replica(self) -> str | None:
        """The engine replica that served it (None: a single engine)."""
        return self.metrics.get("replica")

    @property
    def killed(self) -> bool:
        """Cut short because the replica writing it died."""
        return REPLICA_LOST in self.error  # (as the page shows it, after its "could not answer")


def chat_metrics(output: Sequence) -> dict:
    """The engine's metrics dict among the chat endpoint's outputs."""
    return next((o for o in output if isinstance(o, dict) and ("tokens_per_s" in o or "replica" in o)), {})


def first_text_seen(job, turn: int) -> bool:
    """Wait until turn ``turn``'s answer shows its first text (True) or the job ends without any
    (False), looking every :data:`POLL_S`. (Iterating a gradio_client job looks every millisecond:
    a client beside the server on two cores then takes a tenth of a core from the engine it measures.)"""
    seen = 0
    while True:
        ended = job.done()
        outputs = job.outputs()
        if any(len(said(o)) == 2 * turn + 2 and last_text(o) for o in outputs[seen:]):
            return True
        if ended:
            return False
        seen = len(outputs)
        time.sleep(POLL_S)


def converse(
    url: str, user: int, messages: list[str], settings: list, max_new_tokens: int, deadline: float
) -> list[Answer]:
    """One user's conversation, a turn after another in one session, until ``deadline``."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    answers: list[Answer] = []
    for turn, message in enumerate(messages):
        if time.monotonic() > deadline:
            break
        answer = Answer(user, turn, comparable=not any(a.error for a in answers))
        start = time.monotonic()
        try:
            job = client.submit(message, False, *settings, max_new_tokens, -1, api_name="/respond")
            if first_text_seen(job, turn):
                answer.ttft_s = time.monotonic() - start
            job.result()
            output = job.outputs()[-1]
            answer.text, answer.metrics = last_text(output), chat_metrics(output)
            if answer.metrics.get("finish_reason") in ("", "error", None):
                answer.error = answer.text or "no answer"
        except Exception as exc:  # a failed turn is a finding of the run, not its end
            answer.error = f"{type(exc).__name__}: {exc}"
        answer.wall_s = time.monotonic() - start
        answers.append(answer)
    return answers


def columns(rows: list[dict]) -> list[Column]:
    return COLUMNS + CLUSTER_COLUMNS if any(r["replicas"] for r in rows) else COLUMNS


def affinity(answers: list[Answer]) -> float | None:
    """The share of follow-up turns served by the replica that served the conversation's turn
    before (the one holding its KV caches), among those whose replica did not die."""
    lost = {a.replica for a in answers if a.killed}
    before = {(a.user, a.turn): a.replica for a in answers}
    follow_ups = [(a.replica, before.get((a.user, a.turn - 1))) for a in answers if a.turn and not a.error]
    counted = [now == then for now, then in follow_ups if then is not None and then not in lost]
    return sum(counted) / len(counted) if counted else None


def spread(answers: list[Answer], seconds: float) -> dict[str, dict]:
    """Each replica's answers, tokens and tokens/s over the phase."""
    by_replica: dict[str, dict] = {}
    for a in answers:
        if a.replica and not a.error:
            row = by_replica.setdefault(a.replica, {"answers": 0, "tokens": 0})
            row["answers"] += 1
            row["tokens"] += a.tokens
    for row in by_replica.values():
        row["tokens_per_s"] = row["tokens"] / seconds if seconds else 0.0
    return by_replica


def summarize(users: int, answers: list[Answer], seconds: float, solo: dict[tuple[int, int], str]) -> dict:
    """One row of the table (``solo``: the lone runs' answers, by user and turn). Answers after a
    failed turn are not compared (lost, mixed or different): their conversation is no longer the
    solo run's, and may well get another turn's solo answer."""
    served = [a for a in answers if not a.error]
    others = {text for (u, _), text in solo.items()}
    expected = [solo.get((a.user, a.turn)) if a.comparable else None for a in served]
    differing = {(a.user, a.turn): e for a, e in zip(served, expected, strict=True) if e is not None and a.text != e}
    replicas = spread(answers, seconds)
    return {
        "users": users,
        "answers": len(answers),
        "tokens": sum(a.tokens for a in served),
        "seconds": seconds,
        "aggregate_tokens_per_s": sum(a.tokens for a in served) / seconds if seconds else 0.0,
        "user_tokens_per_s_p50": percentile([a.tokens / a.wall_s for a in served if a.wall_s], 0.5),
        "ttft_p50_s": percentile([a.ttft_s for a in served if a.ttft_s is not None], 0.5),
        "ttft_p95_s": percentile([a.ttft_s for a in served if a.ttft_s is not None], 0.95),
        "queue_p95_s": percentile([a.metrics.get("queue_s", 0.0) for a in served], 0.95),
        "largest_batch": max((a.metrics.get("batch_size", 1) for a in served), default=0),
        "errors": sum(bool(a.error) and not a.killed for a in answers),
        "killed": sum(a.killed for a in answers),
        "replicas": len(replicas) or None,
        "affinity": affinity(answers) if replicas else None,
        "per_replica": replicas,
        "lost": sum(not a.text for a in served),
        "mixed": sum(e is not None and a.text != e and a.text in others for a, e in zip(served, expected)),
        "differ": len(differing),
        "failures": [f"user {a.user} turn {a.turn}: {a.error}" for a in answers if a.error],
        "per_answer": [
            {
                "user": a.user,
                "turn": a.turn,
                "tokens": a.tokens,
                "wall_s": a.wall_s,
                "ttft_s": a.ttft_s,
                "error": a.error,
                **{k: a.metrics.get(k) for k in ANSWER_FIGURES},
                **(_difference(a.text, differing[a.user, a.turn]) if (a.user, a.turn) in differing else {}),
            }
            for a in answers
        ],
    }


def _difference(text: str, solo: str) -> dict:
    """Where an answer leaves its solo run's text, and both texts (to trace why)."""
    at = next((i for i, (a, b) in enumerate(zip(text, solo)) if a != b), min(len(text), len(solo)))
    return {"differs_from_solo_at": at, "text": text, "solo_text": solo}


def run_phase(url: str, conversations: list[list[str]], args: argparse.Namespace, together: bool) -> tuple[list, float]:
    """The conversations at once (``together``) or one after another; (their answers, seconds)."""
    settings = [args.mode, args.k, 0.0, 1.0]
    deadline = time.monotonic() + args.seconds
    start = time.monotonic()
    talk = [
        lambda u=u, msgs=msgs: converse(url, u, msgs, settings, args.max_new_tokens, deadline)
        for u, msgs in enumerate(conversations)
    ]
    if together:
        with ThreadPoolExecutor(len(talk)) as pool:
            answers = [a for f in [pool.submit(t) for t in talk] for a in f.result()]
    else:
        answers = [a for t in talk for a in t()]
    return answers, time.monotonic() - start


def main(argv: list[str] | None = None, on_phase: Callable[[int], None] | None = None) -> int:
    """``on_phase(users)`` is called as each phase of users together starts (a fault to inject)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running app (loopback only); default: start one")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent users per phase")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--prompts", type=Path, default=CODING_PROMPTS)
    parser.add_argument("--mode", default="best")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=900, help="each phase starts no turn after this")
    add_output_arguments(parser, json=Path("bench-results/loadtest.json"), table=Path("bench-results/loadtest.md"))
    parser.add_argument("--chart", type=Path, default=Path("bench-results/loadtest.png"))
    args, app_args = parser.parse_known_args(argv)

    def loadtest() -> None:
        prompts = [p for _, p in load_prompts(args.prompts)]
        most = max(args.users)
        # User u opens with prompt u (first turns as in benchmarks.bench), then takes every most-th.
        conversations = [[prompts[(u + t * most) % len(prompts)] for t in range(args.turns)] for u in range(most)]
        with the_app(args.url, app_args) as (url, pid):
            alone, seconds = run_phase(url, conversations, args, together=False)
            solo = {(a.user, a.turn): a.text for a in alone if not a.error}
            rows = []
            for users in args.users:
                if users == 1:  # the solo runs are the lone user's phase
                    answers, took = alone, seconds
                else:
                    if on_phase:
                        on_phase(users)
                    answers, took = run_phase(url, conversations[:users], args, together=True)
                rows.append(summarize(users, answers, took, solo))
                rows[-1]["peak_rss_gib"] = peak_rss_gib(pid)
                print(markdown_table(rows[-1:], columns(rows)), flush=True)
        one = next((r for r in rows if r["users"] == 1), None)
        for row in rows:
            row["aggregate_vs_one"] = row["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"] if one else None
        table = markdown_table(rows, columns(rows))
        print(table)
        for row in rows:
            for failure in row["failures"]:
                print(f"  {row['users']} users: {failure}", file=sys.stderr)
        write_text(args.table, table + "\n")
        record = {"settings": vars(args) | {"app_args": app_args}, "rows": rows}
        write_text(args.json, json.dumps(record, indent=1, default=str))
        users = [r["users"] for r in rows]
        line_chart(
            [
                Series("aggregate tokens/s", users, [r["aggregate_tokens_per_s"] for r in rows], "#4f46e5"),
                Series("TTFT p95 (s) x 10", users, [10 * (r["ttft_p95_s"] or 0) for r in rows], "#f59e0b"),
            ],
            args.chart,
            f"{args.mode}, greedy, {args.max_new_tokens} new tokens, {args.turns} turns per user",
            "concurrent users",
            "tokens/s  |  seconds x 10",
        )
        if any(r["errors"] or r["lost"] or r["mixed"] for r in rows):
            raise EngineError("some answers were lost, mixed or failed (listed above)")

    return run_cli(loadtest)


if __name__ == "__main__":
    sys.exit(main())
