"""What every command-line entry point shares: a user-facing error is one line, not a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from engine.errors import EngineError


def run_cli(command: Callable[[], object]) -> int:
    """Run ``command``; an :class:`EngineError` prints ``error: ...`` and exits with 2."""
    try:
        command()
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
