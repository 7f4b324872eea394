"""Unfair clients for the chaos run (``benchmarks.chaos``): what one stranger on a shared link
might do to take the server for themselves, through the OpenAI-compatible API.

Each flood client calls from an address of its own, given in ``X-Forwarded-For`` (the app runs
with ``--trust-proxy``): on a server with per-client limits (``--public-limits``) each is one
client, as four strangers would be. The traffic itself goes to the loopback server the run
started, and every loop is bounded in count and time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

# A greedy client opens this many streams at once (a shared link's limits let two run and two wait),
# each of up to TOKENS new tokens, as do the slow reader and the disconnecting client.
GREEDY_STREAMS, TOKENS = 8, 256
# A slow reader takes one event of its stream this often, for at most SLOW_READ_S.
SLOW_READ_EVERY_S, SLOW_READ_S = 1.0, 20.0
# A disconnecting client opens and drops this many streams per round.
DROPS = 4
ESSAY = "Write a long essay about the history of computing, from the abacus to today."
HUGE = "word " * 20000  # about 20,000 tokens: beyond a stranger's cap
LONG = "Summarize this log:\n" + "INFO request served in 12 ms\n" * 400  # about 3,600 tokens: within it


@functools.cache
def http() -> httpx.Client:
    """One HTTP client for every flood request, each on a connection of its own that closes when
    its response does (a dropped stream is a closed connection). A client per request would build
    a TLS context each time: tens of milliseconds of the load generator's CPU, which on a 2-core
    machine is taken from the server it measures."""
    return httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))


def stream(url: str, address: str, content: str, max_tokens: int, timeout_s: float = 120) -> httpx.Response:
    """A streamed chat completion from ``address``, opened (the caller reads and closes it)."""
    request = http().build_request(
        "POST",
        f"{url}v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True},
        headers={"X-Forwarded-For": address},
        timeout=timeout_s,
    )
    return http().send(request, stream=True)


def read_all(response: httpx.Response, deadline: float, every_s: float = 0.0) -> int:
    """Read a stream's events to its end (or ``deadline``), one per ``every_s``; how many."""
    events = 0
    try:
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if time.monotonic() > deadline:
                break
            if every_s:
                time.sleep(every_s)
    finally:
        response.close()
    return events


def greedy(url: str, max_tokens: int) -> tuple[bool, str]:
    """Many streams at once: some are served (its share), the rest refused with ``Retry-After``."""

    def one(_: int) -> int:
        response = stream(url, "10.0.0.1", ESSAY, TOKENS)
        if response.status_code != 200:
            response.close()
            return response.status_code if "retry-after" in response.headers else -response.status_code
        read_all(response, time.monotonic() + 120)
        return 200

    with ThreadPoolExecutor(GREEDY_STREAMS) as pool:
        codes = list(pool.map(one, range(GREEDY_STREAMS)))
    served, refused = codes.count(200), codes.count(429)
    return served >= 1 and refused >= 1 and served + refused == len(codes), f"{served} served, {refused} 429"


def slow_reader(url: str, max_tokens: int) -> tuple[bool, str]:
    """A stream read one event a second: it holds its request, never anyone else's."""
    response = stream(url, "10.0.0.2", ESSAY, TOKENS)
    if response.status_code != 200:
        response.close()
        return response.status_code == 429, f"status {response.status_code}"
    events = read_all(response, time.monotonic() + SLOW_READ_S, SLOW_READ_EVERY_S)
    return events > 0, f"{events} events read"


def disconnects(url: str, max_tokens: int) -> tuple[bool, str]:
    """Streams dropped after their first event, over and over."""
    first, refused = 0, []
    for _ in range(DROPS):
        response = stream(url, "10.0.0.3", ESSAY, TOKENS)
        try:
            if response.status_code == 200:
                first += any(line.startswith("data: ") for line in response.iter_lines())
            else:
                refused.append(f"{response.status_code}: {response.read().decode()[:120]}")
        finally:
            response.close()
    return first >= 1, f"{first} of {DROPS} dropped after their first event" + "".join(f"; {r}" for r in refused)


def huge_prompt(url: str, max_tokens: int) -> tuple[bool, str]:
    """A 20,000-token paste (refused at once, with the cap) and a 3,600-token one (read, answered)."""
    start = time.monotonic()
    refused = http().post(
        f"{url}v1/chat/completions",
        json={"messages": [{"role": "user", "content": HUGE}], "max_tokens": max_tokens},
        headers={"X-Forwarded-For": "10.0.0.4"},
        timeout=60,
    )
    refused_s = time.monotonic() - start
    answered = http().post(
        f"{url}v1/chat/completions",
        json={"messages": [{"role": "user", "content": LONG}], "max_tokens": max_tokens},
        headers={"X-Forwarded-For": "10.0.0.4"},
        timeout=600,
    )
    # (a server whose own cap is lower, a tiny model's, refuses the 3,600 tokens too, as clearly)
    read = answered.status_code == 200 or (answered.status_code == 400 and "at most" in answered.text)
    ok = refused.status_code == 400 and "at most" in refused.text and refused_s < 5 and read
    return ok, f"20k: {refused.status_code} in {refused_s:.1f} s; 3.6k: {answered.status_code}"


FLOOD: dict[str, tuple[Callable[[str, int], tuple[bool, str]], str]] = {
    "greedy (8 streams)": (greedy, "its share served, the rest 429 with Retry-After"),
    "slow reader": (slow_reader, "served at its pace, no one else slowed"),
    "disconnects": (disconnects, "each dropped stream ends its request"),
    "huge prompt": (huge_prompt, "20k refused at once with the cap; 3.6k answered"),
}
