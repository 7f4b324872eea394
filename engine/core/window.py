"""What the model sees of a conversation longer than its client's input cap (``--context-overflow``).

``window`` (the default), as llama.cpp's server shifts its context: the system prompt stays and the
oldest whole turns are left out, in large steps. A cut leaves out enough turns that the rest holds
at most :data:`KEPT_SHARE` of the cap, so the next turns fit without another cut. The kept window
is read into a session's caches once; the turns after it continue those caches as any
conversation's turns do (:mod:`engine.core.sessions`), so long as the window starts at the same
message turn after turn. So the start is a function of the conversation alone that moves only
when a turn would pass the cap: :func:`window_start` replays the rule over every turn asked so far.

``stop`` refuses the conversation instead. A last turn that alone is longer than the cap is
refused either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from engine.core.chat import Message, Prompt, prompt

# A cut leaves at most this share of the cap in view: the turns after it fill the rest.
KEPT_SHARE = 0.5


class Overflow(StrEnum):
    """What happens to a conversation longer than its client's input cap."""

    WINDOW = "window"  # the oldest turns leave the model's view
    STOP = "stop"  # the conversation is refused


def window_start(turns: Sequence[tuple[int, int]], fixed: int, cap: int) -> int:
    """The first turn kept in view. ``turns``: each turn's token offsets in the conversation's
    prompt, as (where it starts, where the conversation ended when that turn was asked);
    ``fixed``: what a window holds besides its turns (the system prompt, the template's own
    tokens around them). The rule is replayed turn by turn: where a turn would take the window
    past ``cap``, its start moves to the first later turn from which the window holds at most
    :data:`KEPT_SHARE` of the cap, else the cap, else to the turn itself (too long alone)."""
    start = 0
    for asked, (_, end) in enumerate(turns):
        if fixed + end - turns[start][0] > cap:
            later = [(fixed + end - turns[t][0], t) for t in range(start + 1, asked + 1)]
            fits = next((t for size, t in later if size <= cap), asked)
            start = next((t for size, t in later if size <= cap * KEPT_SHARE), fits)
    return start


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """Where each turn of ``messages`` starts: the first message after the system prompt, then
    every later user message."""
    head = system_length(messages)
    return [head] + [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]


def system_length(messages: Sequence[Message]) -> int:
    """How many messages the system prompt takes: the leading system messages."""
    return next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))


def last_turn(messages: Sequence[Message]) -> list[Message]:
    """The shortest window of ``messages``: the system prompt and the last turn."""
    return [*messages[: system_length(messages)], *messages[turn_starts(messages)[-1] :]]


def fit(tokenizer: Any, messages: Sequence[Message], cap: int) -> Prompt:
    """The prompt of ``messages`` where it holds at most ``cap`` tokens, else of the window
    :func:`window_start` keeps (its ``out_of_view``: the messages left out), else of the last turn
    alone (longer than ``cap``: the caller refuses it). The offsets of the turns are those of the
    whole conversation's prompt, set against the two prompts tokenized anyway: the whole
    conversation and the last turn."""
    whole = prompt(tokenizer, messages)
    if len(whole.ids) <= cap:
        return whole
    head, starts = system_length(messages), turn_starts(messages)
    shortest = prompt(tokenizer, last_turn(messages))
    if len(shortest.ids) > cap:
        return shortest._replace(out_of_view=starts[-1] - head)
    end = whole.spans[-1][1]  # (the template's closing follows: it is in ``fixed``)
    fixed = len(shortest.ids) - (end - whole.spans[starts[-1]][0])
    # Where each turn starts; the first where the whole conversation measures its own length (the
    # template's opening is not the text between two turns). A turn is asked at its first message's end.
    offsets = [fixed + end - len(whole.ids)] + [whole.spans[i][0] for i in starts[1:]]
    asked = [whole.spans[i][1] for i in starts[:-1]] + [end]
    start = window_start(list(zip(offsets, asked)), fixed, cap)
    system = list(messages[:head])
    # (a template that renders turns unalike measures them only roughly: the window is checked whole)
    while len((kept := prompt(tokenizer, [*system, *messages[starts[start] :]])).ids) > cap:
        start += 1
    return kept._replace(out_of_view=starts[start] - head)
