"""The served model's tokenizer, read without transformers.

Importing transformers (and the torch it brings) is most of a restart on a small CPU, and a few
hundred MB that serving never uses. A prepared folder carries its tokenizer as ``tokenizer.json``
(the Rust backend transformers' fast tokenizers wrap, written by ``save_pretrained``) with its chat
template, so serving reads those directly: the same backend, and the template rendered as
transformers renders it (``transformers.utils.chat_template_utils``: a sandboxed Jinja environment
with ``trim_blocks``, ``lstrip_blocks``, loop controls, its own ``tojson``, ``raise_exception`` and
``strftime_now``, and the named special tokens as variables). A folder with only a slow tokenizer
(no ``tokenizer.json``) goes through transformers as before. ``tests/test_tokenizer.py`` holds the
two to the same ids, text and prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.hf import auto_tokenizer

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization, in its order, for the tokenizers that ask for it
_CLEAN_UP = [(f" {s}", s.strip()) for s in (".", "?", "!", ",", "' ", "n't", "'m", "'s", "'ve", "'re")]


class ChatTokenizer:
    """``tokenizer.json`` and the chat template of a folder, with the part of a transformers
    tokenizer's interface the engine uses (``encode``, ``decode``, ``apply_chat_template``,
    ``get_vocab``, ``convert_tokens_to_ids``, ``eos_token_id``, ``unk_token_id``).

    As in transformers, ``encode`` flips a switch of the backend (``split_special_tokens``):
    threads that encode at once take a lock around it (engine.core.service does)."""

    def __init__(self, folder: Path) -> None:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self._backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._backend.no_truncation()
        self._backend.no_padding()
        self.special_tokens = {k: _content(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(folder, config)
        self.eos_token_id = self.convert_tokens_to_ids(self.special_tokens.get("eos_token"))
        self.unk_token_id = self.convert_tokens_to_ids(self.special_tokens.get("unk_token"))

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """``text``'s ids; ``split_special_tokens``: text that looks like a control token is
        tokenized as ordinary text."""
        self._backend.encode_special_tokens = split_special_tokens
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, tokenize: bool = False
    ) -> str | list[int]:
        """The conversation rendered as text, or with ``tokenize`` its ids."""
        text: str = self._template.render(
            messages=list(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self) -> Any:
        if self.chat_template is None:  # (the error transformers raises, which callers expect)
            raise ValueError("this tokenizer has no chat template: send prompts as token ids")
        return _jinja_environment().from_string(self.chat_template)


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a prepared model's folder: :class:`ChatTokenizer` where it has a
    ``tokenizer.json``, else transformers' own."""
    folder = Path(folder)
    return ChatTokenizer(folder) if (folder / "tokenizer.json").exists() else auto_tokenizer(folder)


def _content(token: str | dict[str, Any]) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The folder's default chat template: ``chat_template.jinja`` as transformers 5 saves it,
    else the config's, which may be a list of named templates."""
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _jinja_environment() -> Any:
    """A Jinja environment that renders chat templates as transformers does."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # (Jinja's own escapes HTML characters, which a prompt must not have)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env
