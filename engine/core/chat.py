"""A conversation as prompt token ids, with what people typed kept as plain text.

The chat template adds its own control tokens (``<|im_start|>``, ``<|im_end|>``...). Text a
person types that looks like one must not become one: "<|im_start|>system" in a message would
otherwise open a system turn of its own. So the template is rendered around placeholders, its
own parts are tokenized as usual, and every message's content with special tokens split into
ordinary text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

from engine.core.runtime import common_prefix
from engine.errors import EngineError

ROLES = ("system", "user", "assistant")
_PLACEHOLDER = "\x00specchat-content-{}\x00"
_PLACEHOLDERS = re.compile("\x00specchat-content-(\\d+)\x00")


class Message(TypedDict):
    """One message of a conversation, as chat templates and OpenAI's API have it."""

    role: str  # one of ROLES
    content: str


def check_messages(messages: Sequence[Message]) -> None:
    """Refuse what no template should see: unknown roles, content that is not text, lone surrogates."""
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise EngineError(f"message {i + 1}: role must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise EngineError(f"message {i + 1}: content must be text")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise EngineError(
                f"message {i + 1}: the text holds an unpaired surrogate (a broken character): send valid UTF-8"
            ) from None


class Prompt(NamedTuple):
    """A conversation's prompt ids, and where its answers are: each assistant message's content
    with the token before it (the token whose logits gave the answer's first), as ``(start, stop)``.
    ``spans``: each message's tokens, from the template's text before it to its content's end;
    ``out_of_view``: the messages of the conversation left out of it (engine.core.window)."""

    ids: list[int]
    spoken: tuple[tuple[int, int], ...] = ()
    spans: tuple[tuple[int, int], ...] = ()
    out_of_view: int = 0

    def continued(self, answer_ids: Sequence[int]) -> Prompt:
        """The prompt with an answer cut short appended: the answer goes on from its last token."""
        if not answer_ids:
            return self
        answer = (len(self.ids) - 1, len(self.ids) + len(answer_ids))
        return self._replace(ids=[*self.ids, *answer_ids], spoken=(*self.spoken, answer))


def prompt(tokenizer: Any, messages: Sequence[Message]) -> Prompt:
    """The conversation through ``tokenizer``'s chat template, ready for the assistant's answer."""
    placeheld = [{"role": m["role"], "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(placeheld, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    spoken: list[tuple[int, int]] = []
    spans = [(0, 0)] * len(messages)
    before = 0  # where the template's text before the next message starts
    for i, part in enumerate(_PLACEHOLDERS.split(rendered)):
        if i % 2:  # a message's content: plain text, whatever it looks like
            index, start = int(part), len(ids)
            message = messages[index]
            ids += tokenizer.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
            spans[index] = (before, len(ids))
            if message["role"] == "assistant" and start > 0:
                spoken.append((start - 1, len(ids)))
        else:  # the template's own text and control tokens
            before = len(ids)
            ids += tokenizer.encode(part, add_special_tokens=False) if part else []
    return Prompt(ids, tuple(spoken), tuple(spans))


def prompt_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """The conversation's prompt ids (:func:`prompt`)."""
    return prompt(tokenizer, messages).ids


def opening_ids(tokenizer: Any) -> list[int]:
    """The ids every conversation of one user message starts with under ``tokenizer``'s chat
    template (its default system turn and the user's turn up to the message): none without a
    template."""
    try:
        first, second = (prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in ("a", "b"))
    except ValueError:  # no chat template: prompts come as ids
        return []
    return first[: common_prefix(first, second)]
