"""What the command-line entry points share: a user-facing error is one line, not a traceback;
whether an address stays on this machine; where the assets are (next to ``engine`` in a checkout
and in an installed package alike)."""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from engine.errors import EngineError

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CODING_PROMPTS = ASSETS / "prompts" / "coding.jsonl"


def run_cli(command: Callable[[], object]) -> int:
    """Run ``command``; an :class:`EngineError` prints ``error: ...`` and exits with 2."""
    try:
        command()
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") stays on this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def free_port() -> int:
    """A TCP port free on the loopback address now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
