"""Normal users and misbehaving ones on one server at once: every normal answer must arrive
intact, every bad request must get a clear message quickly, and the engine must end healthy.

    python -m benchmarks.chaos                       # starts the app (default pair) on a free loopback port
    python -m benchmarks.chaos --url http://127.0.0.1:7860/

Traffic goes to loopback addresses only, and every loop is bounded in count and time. The
misbehaving users send: NaN settings (through Gradio's REST API, which takes them), a
megabyte message, a closed stream mid-answer, and Stop while a long prompt is prefilled. The
flood (``benchmarks.flood``) adds unfair API clients: a greedy one, a slow reader, one that
disconnects over and over and one that pastes huge prompts; the app it starts runs with a shared
link's limits (``--public-limits --trust-proxy``). The normal users answer first alone, then beside
all of them: their time to first token and speed are compared in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

from benchmarks.bench import load_prompts
from benchmarks.flood import FLOOD
from benchmarks.report import add_output_arguments, peak_rss_gib, write_text
from engine.cli import CODING_PROMPTS, free_port, is_loopback, run_cli
from engine.errors import EngineError
from engine.report import Column, markdown_table

# The chat endpoint's settings after the message and the colouring flag: mode, K, temperature,
# top-p, max new tokens, seed.
GREEDY = ["best", 4, 0.0, 1.0]
CLEAR_WITHIN_S = 2.0
# The story closed mid-answer asks for this many tokens at least: still being written when its first
# update arrives, even from tiny test models that answer 24 tokens within that time.
STORY_TOKENS = 192
COLUMNS = [
    Column("user", "kind"),
    Column("requests", "requests"),
    Column("as expected", "as_expected"),
    Column("slowest answer s", "slowest_s", "{:.2f}"),
    Column("what was expected", "expected"),
]


@dataclass
class Tally:
    kind: str
    expected: str
    requests: int = 0
    as_expected: int = 0
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def record(self, ok: bool, seconds: float, what: str) -> None:
        self.requests += 1
        self.as_expected += ok
        self.slowest_s = max(self.slowest_s, seconds)
        if not ok:
            self.failures.append(what)


def require_loopback(url: str) -> None:
    if not is_loopback(urlparse(url).hostname or ""):
        raise EngineError(f"{url}: the chaos run sends traffic to loopback addresses only")


def answer(url: str, message: str, max_new_tokens: int, timeout_s: float) -> tuple[str, float, dict]:
    """One greedy chat turn through the app's own API: (the answer's text, seconds, its figures)."""
    from gradio_client import Client

    start = time.monotonic()
    job = Client(url, verbose=False).submit(message, False, *GREEDY, max_new_tokens, -1, api_name="/respond")
    output = job.result(timeout=timeout_s)
    figures = output[3] if len(output) > 3 and isinstance(output[3], dict) else {}
    return last_text(output), time.monotonic() - start, figures


def raw_call(url: str, api_name: str, body: str, timeout_s: float = 60) -> list:
    """An endpoint called over Gradio's REST API with a hand-written JSON body (NaN included),
    within ``timeout_s`` in all (its event stream's heartbeats do not extend it)."""
    deadline = time.monotonic() + timeout_s
    posted = httpx.post(
        f"{url}gradio_api/call/{api_name}",
        content=body,
        timeout=timeout_s,
        headers={"content-type": "application/json"},
    )
    data = []
    with httpx.stream("GET", f"{url}gradio_api/call/{api_name}/{posted.json()['event_id']}", timeout=timeout_s) as r:
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{api_name} did not finish within {timeout_s:g} s")
            if line.startswith("data: "):
                data.append(line.removeprefix("data: "))
    return json.loads(data[-1]) if data and data[-1] != "null" else []


def message_text(message: dict) -> str:
    """The text of one chat message as Gradio's API returns it."""
    return "".join(p["text"] for p in message["content"] if p.get("type") == "text")


def said(output: list) -> list[dict]:
    """The chat messages in an output of the chat endpoint, without the answers' footers (the
    collapsible lines of figures, which Gradio marks with a title); none in an output that
    leaves the chat as it was (a handler's heartbeat while it waits: an update, not a list)."""
    if not output or not isinstance(output[1], list):
        return []
    return [m for m in output[1] if not (m.get("metadata") or {}).get("title")]


def last_text(output: list) -> str:
    """The text of the last chat message in an output of the chat endpoint (empty if none)."""
    messages = said(output)
    return message_text(messages[-1]) if messages else ""


def nan_settings(url: str, n: int) -> tuple[bool, str]:
    data = ["hello", [], False, *GREEDY[:2], None, 1.0, n, -1, "window", ""]
    body = json.dumps({"data": data}).replace("null", "NaN")
    text = last_text(raw_call(url, "respond", body, 30))
    return "temperature must be" in text, text[:80]


def huge_message(url: str, n: int) -> tuple[bool, str]:
    body = json.dumps({"data": ["x" * 2**20, [], False, *GREEDY, n, -1, "window", ""]})
    text = last_text(raw_call(url, "respond", body, 30))
    return "characters long" in text, text[:80]


def closed_mid_answer(url: str, n: int) -> tuple[bool, str]:
    """Submit, read the first update, close while the answer still runs (the other users'
    answers then show whether it was left behind cleanly)."""
    from gradio_client import Client

    job = Client(url, verbose=False).submit(
        "Write a long story about a fox.", False, *GREEDY, max(n, STORY_TOKENS), -1, api_name="/respond"
    )
    deadline = time.monotonic() + 60
    while not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.05)
    running = bool(job.outputs()) and not job.done()
    job.cancel()
    return running, "closed while answering" if running else "ended before it was closed"


def stop_during_prefill(url: str, n: int) -> tuple[bool, str]:
    """A long prompt (about 3,600 tokens), cancelled half a second in: still being prefilled (or,
    on a server with a shorter input cap, refused at once with the length and the limit)."""
    from gradio_client import Client

    job = Client(url, verbose=False).submit(
        "Summarize: " + "the fox runs. " * 600, False, *GREEDY, n, -1, api_name="/respond"
    )
    time.sleep(0.5)
    outputs = job.outputs()
    refused = bool(outputs) and "characters long" in last_text(outputs[-1])
    running = not job.done()
    job.cancel()
    return running or refused, "refused" if refused else "cancelled while read"


MISBEHAVIOUR: dict[str, tuple[Callable[[str, int], tuple[bool, str]], str]] = {
    "NaN settings": (nan_settings, "a message naming the field"),
    "1 MB message": (huge_message, "a message with the length and the limit"),
    "closes mid-answer": (closed_mid_answer, "closed while answering, the others unharmed"),
    "Stop during prefill": (stop_during_prefill, "cancelled within 2 s, the others unharmed"),
}


@dataclass
class Figures:
    """What the normal users measured in one phase: each answer's time to first token (queue
    included) and its tokens/s after the first."""

    ttft_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)

    def add(self, m: dict) -> None:
        if m.get("ttft_s") is not None and m.get("new_tokens", 0) > 1:
            self.ttft_s.append(m["ttft_s"])
            self.tokens_per_s.append((m["new_tokens"] - 1) / max(m["wall_s"] - m["ttft_s"], 1e-9))

    def row(self, phase: str) -> dict:
        return {
            "phase": phase,
            "answers": len(self.ttft_s),
            "ttft_p95_s": float(np.percentile(self.ttft_s, 95)) if self.ttft_s else None,
            "tokens_per_s": statistics.median(self.tokens_per_s) if self.tokens_per_s else None,
        }


PHASE_COLUMNS = [
    Column("normal users", "phase"),
    Column("answers", "answers"),
    Column("TTFT p95 s", "ttft_p95_s", "{:.2f}"),
    Column("tokens/s after the first (median)", "tokens_per_s", "{:.1f}"),
]
# The flood may cost normal users at most this much (issue: a shared link no one can take down).
TTFT_BOUND, SPEED_BOUND = 2.0, 0.7


def run(
    url: str, prompts: list[str], users: int, rounds: int, max_new_tokens: int, seconds: float, flood: bool
) -> tuple[list[Tally], list[dict]]:
    """Solo answers first; then the normal users alone (where ``flood``), then beside the
    misbehaving users (and the flood), each phase bounded by ``seconds``."""
    solo = {p: answer(url, p, max_new_tokens, seconds)[0] for p in prompts}
    normal = Tally("normal", "the answer it gets alone, intact")
    kinds = {**MISBEHAVIOUR, **(FLOOD if flood else {})}
    bad = {kind: Tally(kind, expected) for kind, (_, expected) in kinds.items()}

    def normal_users(figures: Figures, deadline: float) -> Callable[[int], None]:
        def user(i: int) -> None:
            for r in range(rounds):
                if time.monotonic() > deadline:
                    return
                prompt = prompts[(i + r) % len(prompts)]
                try:
                    text, took, m = answer(url, prompt, max_new_tokens, seconds)
                    normal.record(
                        text == solo[prompt], took, f"{prompt[:30]!r}: {text[:80]!r} differs from its solo run"
                    )
                    figures.add(m)
                except Exception as exc:  # a lost answer is a finding, not a crash of the run
                    normal.record(False, 0.0, f"{prompt[:30]!r}: {type(exc).__name__}: {exc}")

        return user

    def bad_user(kind: str, deadline: float) -> None:
        action = kinds[kind][0]
        for _ in range(rounds):
            if time.monotonic() > deadline:
                return
            start = time.monotonic()
            try:
                ok, what = action(url, max_new_tokens)
                took = time.monotonic() - start
                quick = kind not in MISBEHAVIOUR or took <= CLEAR_WITHIN_S or kind == "closes mid-answer"
                bad[kind].record(
                    ok and quick, took, f"{what if ok else 'not as expected: ' + str(what)} ({took:.1f} s)"
                )
            except Exception as exc:
                bad[kind].record(False, 0.0, f"{type(exc).__name__}: {exc}")

    alone, together = Figures(), Figures()
    if flood:
        with ThreadPoolExecutor(users) as pool:
            list(pool.map(normal_users(alone, time.monotonic() + seconds), range(users)))
    deadline = time.monotonic() + seconds
    with ThreadPoolExecutor(users + len(bad)) as pool:
        futures = [pool.submit(normal_users(together, deadline), i) for i in range(users)]
        futures += [pool.submit(bad_user, kind, deadline) for kind in bad]
        for future in futures:
            future.result()
    health = Tally("engine at the end", "healthy, idle, answering as alone")
    from gradio_client import Client

    health_api = Client(url, verbose=False)
    state = health_api.predict(api_name="/health")
    settle = time.monotonic() + 10  # (a dropped stream's request ends within a round)
    while state["pending"] and time.monotonic() < settle:
        time.sleep(0.2)
        state = health_api.predict(api_name="/health")
    text, took, _ = answer(url, prompts[0], max_new_tokens, seconds)
    health.record(state["healthy"] and state["pending"] == 0 and text == solo[prompts[0]], took, f"health {state}")
    phases = [together.row("beside the misbehaving users" + (" and the flood" if flood else ""))]
    if flood:
        phases.insert(0, alone.row("alone"))
        slower = together.row("")["ttft_p95_s"] or 0.0
        slowed = Tally("normal under the flood", f"TTFT p95 within {TTFT_BOUND}x, speed within {SPEED_BOUND}x")
        ok = bool(phases[0]["ttft_p95_s"]) and slower <= TTFT_BOUND * max(phases[0]["ttft_p95_s"], 0.5)
        ok = ok and (phases[1]["tokens_per_s"] or 0.0) >= SPEED_BOUND * (phases[0]["tokens_per_s"] or 0.0)
        slowed.record(ok, 0.0, f"alone {phases[0]}, with the flood {phases[1]}")
        return [normal, *bad.values(), slowed, health], phases
    return [normal, *bad.values(), health], phases


@contextlib.contextmanager
def app_server(app_args: list[str], timeout_s: float = 900) -> Iterator[tuple[str, int]]:
    """``python app.py`` on a free loopback port, until the block ends: (its URL, its pid)."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]  # the checkout
    process = subprocess.Popen(
        [sys.executable, str(root / "app.py"), "--host", "127.0.0.1", "--port", str(port), *app_args],
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EngineError(f"the app exited with {process.returncode} before serving")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}health", timeout=2).status_code == 200:  # listening, and the models ready
                    break
            time.sleep(0.2)  # (the serving time is read to a fifth of a second)
        else:
            raise EngineError(f"the app did not serve within {timeout_s:.0f} s")
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def the_app(url: str | None, app_args: list[str]) -> Iterator[tuple[str, int | None]]:
    """The app running at ``url`` (loopback only), or else one started for the run with
    ``app_args``: (its URL, its pid where started here)."""
    with contextlib.nullcontext((url, None)) if url else app_server(app_args) as (served, pid):
        require_loopback(served)
        yield served, pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running app (loopback only); default: start one")
    parser.add_argument("--prompts", type=Path, default=CODING_PROMPTS)
    parser.add_argument("--users", type=int, default=3, help="normal users")
    parser.add_argument("--rounds", type=int, default=3, help="requests per user")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=600, help="stop starting requests after this, per phase")
    parser.add_argument("--no-flood", action="store_true", help="leave out the unfair API clients")
    add_output_arguments(parser)
    args, app_args = parser.parse_known_args(argv)
    flood = not args.no_flood
    if flood:  # a shared link's limits, each flood client one address
        app_args = ["--public-limits", "--trust-proxy", *app_args]

    def chaos() -> None:
        prompts = [p for _, p in load_prompts(args.prompts)][: args.users]
        with the_app(args.url, app_args) as (url, pid):
            tallies, phases = run(url, prompts, args.users, args.rounds, args.max_new_tokens, args.seconds, flood)
            peak = peak_rss_gib(pid)
            memory = f"\napp peak RSS: {peak:.1f} GiB" if peak else ""
        table = markdown_table([asdict(t) for t in tallies], COLUMNS)
        table += "\n\n" + markdown_table(phases, PHASE_COLUMNS) + memory
        print(table)
        for t in tallies:
            for failure in t.failures:
                print(f"  {t.kind}: {failure}", file=sys.stderr)
        write_text(args.table, table + "\n")
        write_text(args.json, json.dumps({"users": [asdict(t) for t in tallies], "phases": phases}, indent=1))
        if any(t.as_expected < t.requests for t in tallies):
            raise EngineError("some requests did not go as expected (listed above)")

    return run_cli(chaos)


if __name__ == "__main__":
    sys.exit(main())
