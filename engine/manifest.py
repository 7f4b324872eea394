"""The record `engine.prepare` writes beside each model it converts (source, precision, tool
versions, vocabulary): read back by the preparation, to reuse a model, and by the engine, to name
it for people."""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "manifest.json"


def read(folder: Path) -> dict | None:
    """The manifest of the model in ``folder``, or None where there is none (a model not
    prepared here: an IR folder a user brought) or it cannot be read."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):  # unreadable: as if there were none
        return None
    return data if isinstance(data, dict) else None
