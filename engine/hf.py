"""transformers, imported so that an optional dependency that cannot load does not break it.

optimum-intel requires torchvision, and the registry's torchvision is a CUDA build that cannot
load next to the CPU torch ("operator torchvision::nms does not exist"). transformers imports
torchvision whenever it is installed (with Pillow, which Gradio brings), so every model-class
import would fail. Nothing here needs torchvision; a process that imports transformers' model
classes or tokenizers calls :func:`hide_unloadable_torchvision` first (:func:`auto_tokenizer`
does). This is what lets a plain
``pip install -r requirements.txt`` (a Hugging Face Space's build) work without ``--no-deps``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("specchat.prepare")


def hide_unloadable_torchvision() -> bool:
    """Hide torchvision from this process if it is installed but cannot be imported.

    Returns whether it is hidden. ``importlib.util.find_spec`` answers None for a module whose
    ``sys.modules`` entry is None, which is how transformers decides it is absent.
    """
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"] is None
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # a build for another torch: RuntimeError, ImportError, OSError
        for name in [n for n in sys.modules if n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        log.debug(f"torchvision cannot load here ({type(exc).__name__}: {exc}); hidden from transformers")
        return True
    return False


def auto_tokenizer(folder: str | Path, **kwargs: Any) -> Any:
    """``transformers.AutoTokenizer.from_pretrained``, torchvision hidden first if it cannot load."""
    hide_unloadable_torchvision()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, **kwargs)


def tokenizer_tokens(tokenizer: Any) -> list[str]:
    """A Hugging Face tokenizer's tokens, ordered by id."""
    return [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]


def vocabulary_digest(tokens: list[str]) -> str:
    """A vocabulary's fingerprint: its tokens, ordered by id (the digest a prepared model's manifest
    records, engine.prepare.vocab; a ranking of its ids, engine.core.draft_vocab)."""
    return hashlib.sha256("\n".join(tokens).encode()).hexdigest()
