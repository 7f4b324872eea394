"""A conversation longer than a stranger's input cap, through the API of a server with a shared
link's limits (``--public-limits``: 4,096 tokens in view without a login): every turn answers, the
first token after a cut comes as soon as the same window's read fresh, the turns after a cut reuse
its caches, and every greedy answer after a cut is its window's own (engine.core.window).

    python -m benchmarks.long_chat                    # the default pair, 12 turns, ar and best
    python -m benchmarks.long_chat --turns 6 --answer-tokens 64 [APP ARGS ...]

Turn after turn the user asks a coding request over a listing of Python's own standard library
(``--question-tokens`` of it), answered greedily up to ``--answer-tokens``: about 700 tokens a turn
by default, the same questions in every mode. For each mode, on a server started with
``--public-limits``:

1. the conversation: each turn's time to first token, wall time, tokens read and found cached, and
   ``usage.messages_out_of_view``; a turn where that grew is a cut;
2. from the first cut on, each turn's window (the system prompt and the messages still in view)
   sent as a new conversation, read afresh: the server's sessions are taken over by tiny requests
   first, and its ``cached_tokens`` must say so. Its answer must be the conversation's, and at a
   cut the conversation's first token must come within 1.2x the fresh one's.

Then, on a server without limits, the same questions in a conversation that never cuts: a turn
after a cut that does not cut again must take no longer than there (its first token and its steps).

A failed turn, a window not read afresh or an answer unlike its window's exits non-zero; the times
are reported against their targets, with each server's peak resident memory. Traffic goes to the
loopback servers this run starts (or ``--url`` and ``--baseline-url``), every loop bounded by its
turns and by ``--seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.bench import load_prompts
from benchmarks.chaos import the_app
from benchmarks.report import add_output_arguments, peak_rss_gib, write_text
from engine.cli import CODING_PROMPTS, run_cli
from engine.core.budget import GIB
from engine.core.metrics import ModeName
from engine.core.modes import BY_SHORT_NAME, MODES
from engine.errors import EngineError
from engine.report import Column, markdown_table

SYSTEM = "Answer with code."
# Each question's listing: a module of Python's standard library from its first definition on (the
# same text for one Python version), a module per turn.
LISTINGS = (
    "textwrap",
    "shlex",
    "heapq",
    "statistics",
    "calendar",
    "difflib",
    "queue",
    "glob",
    "fractions",
    "string",
    "csv",
    "graphlib",
    "pprint",
    "json.decoder",
    "contextlib",
    "functools",
)
# Characters of such a listing per token of Qwen2.5's tokenizer (about: the prompt tokens say).
CHARS_PER_TOKEN = 4.0
# The bounds: the first token after a cut within this many times the window's read fresh,
# and a turn after a cut within this many times the same turn where nothing was cut.
CUT_TTFT_BOUND, AFTER_CUT_BOUND = 1.2, 1.0
# A request was read afresh where less than this share of its prompt was found cached (as
# tests/test_window.py judges a cut).
FRESH_SHARE = 0.5
# Who asks (X-Forwarded-For): each conversation, each window read fresh and the requests that take
# the sessions over a client of its own, with its own pool of answers to draft from (engine.core.pool).
FORGETTER, CONVERSATION, FRESH, NEVER_CUT = range(4)


def client(kind: int, mode: int = 0, turn: int = 0) -> str:
    return f"10.{kind}.{mode}.{turn}"


TURN_COLUMNS = [
    Column("mode", "mode"),
    Column("turn", "turn"),
    Column("prompt tokens", "prompt_tokens"),
    Column("cached", "cached_tokens"),
    Column("out of view", "out_of_view"),
    Column("cut", "cut"),
    Column("TTFT s", "ttft_s", "{:.2f}"),
    Column("wall s", "wall_s", "{:.1f}"),
    Column("fresh TTFT s", "fresh_ttft_s", "{:.2f}"),
    Column("TTFT / fresh", "ttft_vs_fresh", "{:.2f}×"),
    Column("= fresh", "same_as_fresh"),
    Column("never cut: TTFT s", "never_cut_ttft_s", "{:.2f}"),
    Column("TTFT / never cut", "ttft_vs_never_cut", "{:.2f}×"),
    Column("step / never cut", "step_vs_never_cut", "{:.2f}×"),
]
SUMMARY_COLUMNS = [
    Column("mode", "mode"),
    Column("turns answered", "answered"),
    Column("cuts", "cuts"),
    Column(f"cut TTFT / fresh (≤ {CUT_TTFT_BOUND}×)", "cut_ttft_vs_fresh", "{:.2f}×"),
    Column("after a cut: TTFT / never cut (≤ 1×)", "after_ttft_vs_never_cut", "{:.2f}×"),
    Column("step / never cut (≤ 1×)", "after_step_vs_never_cut", "{:.2f}×"),
    Column("answers = fresh", "same_as_fresh"),
]


def code_listing(module: str, chars: int, part: int = 0) -> str:
    """About ``chars`` characters of ``module``'s source in whole lines from its first definition
    on, the ``part``-th such piece ("": none asked)."""
    if chars <= 0:
        return ""
    lines = inspect.getsource(importlib.import_module(module)).splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith(("def ", "class ")))
    piece: list[str] = []
    for line in lines[first:]:
        piece.append(line)
        if sum(map(len, piece)) >= chars:
            if part == 0:
                return "".join(piece)
            piece, part = [], part - 1
    raise EngineError(f"{module} holds too few listings of {chars:,} characters")


def questions(turns: int, listing_tokens: int, prompts: Path) -> list[str]:
    """The user's messages, one a turn: a coding request of ``prompts`` over a listing of about
    ``listing_tokens`` tokens (none: the requests alone), each unlike the others."""
    requests = [p for _, p in load_prompts(prompts)]
    chars = round(listing_tokens * CHARS_PER_TOKEN)
    asked = []
    for turn in range(turns):
        listing = code_listing(LISTINGS[turn % len(LISTINGS)], chars, turn // len(LISTINGS))
        request = requests[turn % len(requests)]
        asked.append(f"{request}\n\nIt goes beside this code:\n\n```python\n{listing}```" if listing else request)
    if len(set(asked)) < len(asked):
        raise EngineError(f"{prompts} holds fewer than {turns} requests: pass --question-tokens to tell them apart")
    return asked


@dataclass
class Reply:
    """One streamed chat completion as its client saw it."""

    text: str = ""
    error: str = ""
    ttft_s: float | None = None  # from sending until the first text
    wall_s: float = 0.0
    usage: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    @property
    def out_of_view(self) -> int:
        return int(self.usage.get("messages_out_of_view", 0))

    @property
    def fresh(self) -> bool:
        """Read afresh: less than :data:`FRESH_SHARE` of its prompt was found cached."""
        return self.cached_tokens < FRESH_SHARE * self.prompt_tokens

    @property
    def step_s(self) -> float | None:
        """Seconds per answer token after the first."""
        tokens = int(self.usage.get("completion_tokens", 0))
        return (self.wall_s - self.ttft_s) / (tokens - 1) if self.ttft_s is not None and tokens > 1 else None

    def read(self, response: httpx.Response, start: float, deadline: float) -> None:
        """The server-sent events of ``response``, to ``[DONE]``, an error or ``deadline``."""
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                self.error = "no end within --timeout"
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                self.error = chunk["error"]["message"]
                return
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk["choices"]:
                if content := choice["delta"].get("content"):
                    if self.ttft_s is None:
                        self.ttft_s = time.monotonic() - start
                    self.text += content


@dataclass
class Server:
    """An app this run talks to over loopback: its URL, its pid where started here, how many
    conversations' caches it keeps (``--max-sessions``)."""

    url: str
    pid: int | None
    sessions: int
    timeout_s: float
    forgotten: Iterator[int] = field(default_factory=itertools.count)
    start_peak_gib: float | None = None  # its peak resident memory while it started

    def ask(self, messages: Sequence[dict], mode: str, max_tokens: int, asker: str) -> Reply:
        """One greedy answer to ``messages``, streamed, as ``asker`` (an address: :func:`client`)."""
        body = {
            "messages": list(messages),
            "mode": mode,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "context_overflow": "window",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reply, start = Reply(), time.monotonic()
        try:
            with httpx.stream(
                "POST",
                f"{self.url}v1/chat/completions",
                json=body,
                headers={"X-Forwarded-For": asker},
                timeout=self.timeout_s,
            ) as response:
                if response.status_code != 200:
                    reply.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
                else:
                    reply.read(response, start, start + self.timeout_s)
        except httpx.HTTPError as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
        reply.wall_s = time.monotonic() - start
        if not reply.error and not reply.usage:
            reply.error = "the stream ended without its usage"
        return reply

    def forget(self) -> None:
        """Take over every session of the server with a tiny conversation of its own (each under a
        system prompt of its own, so none continues another): no cache of an earlier request
        serves the next one (sessions are found by prompt prefix, whoever asks:
        engine.core.sessions)."""
        for n in itertools.islice(self.forgotten, self.sessions):
            tiny = [{"role": "system", "content": f"{n}."}, {"role": "user", "content": "Say ok."}]
            reply = self.ask(tiny, ModeName.AUTOREGRESSIVE, 1, client(FORGETTER))
            if reply.error:
                raise EngineError(f"a request taking over a session failed: {reply.error}")

    def memory(self) -> dict[str, float | None]:
        """Its peak resident memory while it started, since (:meth:`reset_peak`) and now, in GiB
        (None: not ours)."""
        peak = {"start_peak_gib": self.start_peak_gib, "peak_gib": peak_rss_gib(self.pid)}
        return peak | {"resident_gib": resident_gib(self.pid)}

    def reset_peak(self) -> None:
        """Measure its peak resident memory from now on (the kernel's high-water mark, reset; what
        it was is :attr:`start_peak_gib`)."""
        self.start_peak_gib = peak_rss_gib(self.pid)
        if self.pid:
            with contextlib.suppress(OSError):
                Path(f"/proc/{self.pid}/clear_refs").write_text("5")


def resident_gib(pid: int | None) -> float | None:
    """A process's resident memory now, in GiB (None where it cannot be read)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path(f"/proc/{pid}/status").read_text().splitlines() if pid else []
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024 / GIB
    return None


@dataclass
class Turn:
    number: int  # from 1
    sent: list[dict]  # the messages sent for it
    reply: Reply
    cut: bool = False  # more messages out of view than the turn before


def window(turn: Turn) -> list[dict]:
    """What the model saw of the conversation at ``turn``: the system prompt and the messages after
    those ``messages_out_of_view`` counts."""
    return [turn.sent[0], *turn.sent[1 + turn.reply.out_of_view :]]


def converse(
    server: Server, asked: Sequence[str], mode: str, args: argparse.Namespace, asker: str, run: str
) -> list[Turn]:
    """One conversation of ``asked`` (``run``: its name in the progress lines), each answer sent
    back with the next question, until a turn fails or ``--seconds`` have passed."""
    deadline = time.monotonic() + args.seconds
    messages = [{"role": "system", "content": SYSTEM}]
    turns: list[Turn] = []
    for number, question in enumerate(asked, 1):
        if time.monotonic() > deadline:
            break
        messages.append({"role": "user", "content": question})
        reply = server.ask(messages, mode, args.answer_tokens, asker)
        hidden = turns[-1].reply.out_of_view if turns else 0
        turns.append(Turn(number, list(messages), reply, cut=reply.out_of_view > hidden))
        said(run, number, reply)
        if reply.error:
            break
        messages.append({"role": "assistant", "content": reply.text})
    return turns


def first_cut(turns: Sequence[Turn]) -> int | None:
    return next((t.number for t in turns if t.cut), None)


def read_fresh(
    server: Server, turns: Sequence[Turn], mode: str, args: argparse.Namespace, index: int, run: str
) -> dict[int, Reply]:
    """Each turn's window from the first cut on, sent as a new conversation after the server's
    sessions were taken over (``index``: the mode's, naming its clients; ``run``: the progress
    lines'), until ``--seconds`` have passed: the replies by turn."""
    deadline = time.monotonic() + args.seconds
    cut = first_cut(turns)
    replies = {}
    for turn in turns:
        if cut is None or turn.number < cut or turn.reply.error or time.monotonic() > deadline:
            continue
        server.forget()
        replies[turn.number] = server.ask(window(turn), mode, args.answer_tokens, client(FRESH, index, turn.number))
        said(run, turn.number, replies[turn.number])
    return replies


def said(run: str, number: int, reply: Reply) -> None:
    """One line of progress: a long run shows each turn as it ends."""
    figures = f"{reply.prompt_tokens} tokens ({reply.cached_tokens} cached), {reply.out_of_view} out of view"
    ttft = f"{reply.ttft_s:.2f}" if reply.ttft_s is not None else "–"
    print(f"{run} turn {number}: {reply.error or figures}, TTFT {ttft} s, {reply.wall_s:.1f} s", flush=True)


def ratio(value: float | None, baseline: float | None) -> float | None:
    return value / baseline if value is not None and baseline else None


def turn_rows(mode: str, turns: Sequence[Turn], fresh: dict[int, Reply], never: dict[int, Reply]) -> list[dict]:
    """A row per turn of the conversation, beside its window read fresh and the never-cut turn."""
    rows = []
    for turn in turns:
        reply, alone, baseline = turn.reply, fresh.get(turn.number), never.get(turn.number)
        rows.append(
            {
                "mode": mode,
                "turn": turn.number,
                "prompt_tokens": reply.prompt_tokens,
                "cached_tokens": reply.cached_tokens,
                "out_of_view": reply.out_of_view,
                "cut": "cut" if turn.cut else "",
                "ttft_s": reply.ttft_s,
                "engine_ttft_s": reply.usage.get("time_to_first_token_s"),
                "wall_s": reply.wall_s,
                "answer_tokens": reply.usage.get("completion_tokens"),
                "tokens_per_s": reply.usage.get("tokens_per_second"),
                "fresh_ttft_s": alone.ttft_s if alone else None,
                "fresh_cached_tokens": alone.cached_tokens if alone else None,
                "ttft_vs_fresh": ratio(reply.ttft_s, alone.ttft_s) if alone else None,
                "same_as_fresh": ("yes" if alone.text == reply.text else "NO") if alone and not alone.error else None,
                "never_cut_ttft_s": baseline.ttft_s if baseline else None,
                "never_cut_wall_s": baseline.wall_s if baseline else None,
                "ttft_vs_never_cut": ratio(reply.ttft_s, baseline.ttft_s) if baseline else None,
                "step_vs_never_cut": ratio(reply.step_s, baseline.step_s) if baseline else None,
                "wall_vs_never_cut": ratio(reply.wall_s, baseline.wall_s) if baseline else None,
                "error": reply.error,
                "answer": reply.text,
                "fresh_answer": alone.text if alone and alone.text != reply.text else None,
            }
        )
    return rows


def summary(mode: str, asked: int, turns: Sequence[Turn], rows: Sequence[dict]) -> dict:
    """The mode's figures against the issue's bounds: the worst cut's first token against its
    window's read fresh, the worst turn after a cut (not cutting again) against the never-cut one."""
    cut = first_cut(turns) or len(turns) + 1
    at_cuts = [r["ttft_vs_fresh"] for r in rows if r["cut"] and r["ttft_vs_fresh"] is not None]
    after = [r for r in rows if r["turn"] > cut and not r["cut"]]
    compared = [r["same_as_fresh"] for r in rows if r["same_as_fresh"] is not None]

    def worst(key: str) -> float | None:
        return max((r[key] for r in after if r[key] is not None), default=None)

    return {
        "mode": mode,
        "answered": f"{sum(not t.reply.error for t in turns)}/{asked}",
        "cuts": sum(t.cut for t in turns),
        "cut_ttft_vs_fresh": max(at_cuts, default=None),
        "after_ttft_vs_never_cut": worst("ttft_vs_never_cut"),
        "after_step_vs_never_cut": worst("step_vs_never_cut"),
        "after_wall_vs_never_cut": worst("wall_vs_never_cut"),
        "same_as_fresh": f"{compared.count('yes')}/{len(compared)}",
    }


def targets(rows: Sequence[dict]) -> list[str]:
    """Where the times miss the issue's bounds (reported, not failed: one run's times are noisy)."""
    missed = []
    for r in rows:
        if r["cut_ttft_vs_fresh"] is not None and r["cut_ttft_vs_fresh"] > CUT_TTFT_BOUND:
            missed.append(f"{r['mode']}: a cut's first token took {r['cut_ttft_vs_fresh']:.2f}× its window's fresh")
        for key, what in (("after_ttft_vs_never_cut", "first token"), ("after_step_vs_never_cut", "steps")):
            if r[key] is not None and r[key] > AFTER_CUT_BOUND:
                missed.append(f"{r['mode']}: after a cut, a turn's {what} took {r[key]:.2f}× the never-cut turn's")
    return missed


def failures(mode: str, asked: int, turns: Sequence[Turn], fresh: dict[int, Reply], never: Sequence[Turn]) -> list:
    """What makes the run fail: turns that failed or were not asked, a conversation that never cut
    (nothing checked) or a baseline that did, windows not read afresh, answers unlike their window's."""
    found = [f"{mode} conversation turn {t.number}: {t.reply.error}" for t in turns if t.reply.error]
    found += [f"{mode} never-cut turn {t.number}: {t.reply.error}" for t in never if t.reply.error]
    found += [f"{mode} window of turn {n}: {r.error}" for n, r in fresh.items() if r.error]
    for run, asked_in in (("conversation", turns), ("never-cut", never)):
        if len(asked_in) < asked and not any(t.reply.error for t in asked_in):
            found.append(f"{mode} {run}: {len(asked_in)} of {asked} turns asked within --seconds")
    if turns and first_cut(turns) is None:
        found.append(
            f"{mode}: no turn passed the cap, nothing after a cut to check (more --turns or --question-tokens)"
        )
    found += [
        f"{mode} never-cut turn {t.number}: {t.reply.out_of_view} messages out of view on the server without limits"
        for t in never
        if t.reply.out_of_view
    ]
    by_number = {t.number: t for t in turns}
    for n, r in fresh.items():
        if r.error:
            continue
        seen = by_number[n].reply.prompt_tokens
        if not r.fresh or r.out_of_view or r.prompt_tokens != seen:
            found.append(
                f"{mode} window of turn {n}: {r.cached_tokens} of {r.prompt_tokens} tokens cached (the conversation "
                f"saw {seen}), {r.out_of_view} out of view: not its window read afresh whole (is --sessions the "
                "server's --max-sessions?)"
            )
        elif r.text != by_number[n].reply.text:
            found.append(f"{mode} turn {n}: the answer differs from its window's sent fresh")
    return found


def mode_name(short: str) -> str:
    if short in BY_SHORT_NAME:
        return BY_SHORT_NAME[short].name
    if short in MODES:
        return short
    raise EngineError(f"unknown mode {short!r}: choose from {', '.join(BY_SHORT_NAME)}")


@contextlib.contextmanager
def served(url: str | None, app_args: list[str], args: argparse.Namespace) -> Iterator[Server]:
    """The app at ``url``, or one started with ``app_args`` and ``--sessions`` as its
    ``--max-sessions`` (``--trust-proxy``: each run's client is named by its address), its peak
    memory measured from when it serves."""
    started = ["--trust-proxy", "--max-sessions", str(args.sessions), *app_args]
    with the_app(url, started) as (at, pid):
        server = Server(at, pid, args.sessions, args.timeout)
        server.reset_peak()
        yield server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_chat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running app with --public-limits (loopback only); default: start one")
    parser.add_argument("--baseline-url", help="a running app without limits (loopback only); default: start one")
    parser.add_argument("--modes", default="ar,best", help=f"comma separated, of: {', '.join(BY_SHORT_NAME)}")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--question-tokens", type=int, default=500, help="each question's code listing, about")
    parser.add_argument("--answer-tokens", type=int, default=192, help="each greedy answer at most")
    parser.add_argument("--prompts", type=Path, default=CODING_PROMPTS, help="the coding requests, one a turn")
    parser.add_argument(
        "--sessions", type=int, default=2, help="the servers' --max-sessions: how many requests take them over"
    )
    parser.add_argument("--seconds", type=float, default=3600, help="each conversation starts no turn after this")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a request may take")
    add_output_arguments(parser, json=Path("bench-results/long_chat.json"), table=Path("bench-results/long_chat.md"))
    args, app_args = parser.parse_known_args(argv)

    def long_chat() -> None:
        modes = {short: mode_name(short) for short in args.modes.split(",")}
        asked = questions(args.turns, args.question_tokens, args.prompts)
        conversations: dict[str, list[Turn]] = {}
        fresh: dict[str, dict[int, Reply]] = {}
        never: dict[str, list[Turn]] = {}
        memory = {}
        with served(args.url, ["--public-limits", *app_args], args) as server:
            for i, (short, mode) in enumerate(modes.items()):
                server.forget()
                conversations[short] = converse(
                    server, asked, mode, args, client(CONVERSATION, i), f"{short} conversation"
                )
                fresh[short] = read_fresh(server, conversations[short], mode, args, i, f"{short} window read fresh")
            memory["--public-limits"] = server.memory()
        with served(args.baseline_url, app_args, args) as server:
            # Paced modes first: on a server without limits every client drafts from one pool of
            # earlier answers, where a plain run's would be the paced one's to copy.
            for i, (short, mode) in enumerate(sorted(modes.items(), key=lambda m: not MODES[m[1]].paced)):
                server.forget()
                never[short] = converse(server, asked, mode, args, client(NEVER_CUT, i), f"{short} never cut")
            memory["no limits"] = server.memory()
        rows, summaries, failed = [], [], []
        for short in modes:
            by_turn = {t.number: t.reply for t in never[short]}
            rows += (mode_rows := turn_rows(short, conversations[short], fresh[short], by_turn))
            summaries.append(summary(short, len(asked), conversations[short], mode_rows))
            failed += failures(short, len(asked), conversations[short], fresh[short], never[short])
        table = markdown_table(rows, TURN_COLUMNS) + "\n\n" + markdown_table(summaries, SUMMARY_COLUMNS)
        for name, m in memory.items():
            if m["peak_gib"] is not None:
                table += f"\n\nServer with {name}, resident memory: peak while conversing {m['peak_gib']:.2f} GiB"
                table += f", while starting {m['start_peak_gib'] or 0:.2f}, at the end {m['resident_gib'] or 0:.2f}"
        missed = targets(summaries)
        table += "\n\n" + ("\n".join(f"- target missed: {m}" for m in missed) or "Every time within its target.")
        print(table)
        for failure in failed:
            print(f"  {failure}", file=sys.stderr)
        write_text(args.table, table + "\n")
        record = {
            "settings": vars(args) | {"app_args": app_args},
            "summary": summaries,
            "turns": rows,
            "memory_gib": memory,
            "targets_missed": missed,
            "failures": failed,
        }
        write_text(args.json, json.dumps(record, indent=1, default=str))
        if failed:
            raise EngineError(f"{len(failed)} failures (listed above)")

    return run_cli(long_chat)


if __name__ == "__main__":
    sys.exit(main())
