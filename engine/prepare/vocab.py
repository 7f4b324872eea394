"""Vocabulary identity of a model source, read without converting anything.

Speculative decoding compares token ids of two models, so the draft must use the
target's vocabulary. GGUF files carry their token list in the header; Hugging Face
and OpenVINO IR folders carry a Hugging Face tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import PrepareError
from engine.hf import auto_tokenizer, tokenizer_tokens, vocabulary_digest
from engine.prepare.sources import Kind, Source

if TYPE_CHECKING:
    from gguf import ReaderField

_PADDING = re.compile(r"\[PAD\d+\]")


def _gguf_field(path: Path, name: str) -> ReaderField:
    from engine.prepare.gguf_file import open_gguf

    try:
        reader = open_gguf(path)
    except Exception as exc:  # the reader raises ValueError, KeyError, struct errors...
        raise PrepareError(f"{path}: not a readable GGUF file ({exc})") from exc
    field = reader.fields.get(name)
    if field is None:
        raise PrepareError(f"{path}: GGUF header has no '{name}'")
    return field


def gguf_architecture(path: Path) -> str:
    field = _gguf_field(path, "general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def _gguf_tokens(path: Path) -> list[str]:
    field = _gguf_field(path, "tokenizer.ggml.tokens")
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _hf_tokens(folder: Path) -> list[str]:

    try:
        tok = auto_tokenizer(folder)
    except Exception as exc:  # transformers raises OSError, ValueError, ...
        raise PrepareError(f"{folder}: cannot load its tokenizer ({exc})") from exc
    return tokenizer_tokens(tok)


@dataclass(frozen=True)
class Vocabulary:
    size: int
    digest: str

    @classmethod
    def of(cls, source: Source) -> Vocabulary:
        return cls.of_tokens(_gguf_tokens(source.local) if source.kind == Kind.GGUF else _hf_tokens(source.local))

    @classmethod
    def of_tokens(cls, tokens: list[str]) -> Vocabulary:
        # GGUF pads its token list to the embedding rows with "[PADn]"; a tokenizer has no such rows.
        tokens = [t for t in tokens if not _PADDING.fullmatch(t)]
        return cls(len(tokens), vocabulary_digest(tokens))

    def describe(self) -> str:
        return f"{self.size} tokens, vocabulary {self.digest[:10]}"
