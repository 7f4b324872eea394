"""The record `engine.prepare` writes beside each model it converts (source, precision, tool
versions, vocabulary): read back by the preparation, to reuse a model, and by the engine, to name
it for people."""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "manifest.json"


def read(folder: Path) -> dict | None:
    """The manifest of the model in ``folder``, or None where there is none (a model not
    prepared here: an IR folder a user brought)."""
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None
