"""A conversation as a file people keep: JSON (everything, for import) or Markdown (for reading,
and for import too: each message starts with a marker line Markdown viewers do not show)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

FORMAT = "specchat-conversation"
ROLES = ("user", "assistant")
MAX_MESSAGES = 1000
MAX_CHARACTERS = 1_000_000
_MARKER = re.compile(r"^<!-- specchat: (system|user|assistant) -->\n(?:#{1,6} [^\n]*\n)?", re.MULTILINE)
_MARKER_LINE = re.compile(r"^<!-- specchat: \w+ -->$", re.MULTILINE)
_HEADINGS = {"system": "System prompt", "user": "User", "assistant": "Assistant"}


def to_json(title: str, system: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``messages``: {"role", "content"} each, plus any figures worth keeping (``metrics``)."""
    kept = [{k: m[k] for k in ("role", "content", "metrics") if k in m} for m in messages]
    return json.dumps({"format": FORMAT, "title": title, "system": system, "messages": kept}, indent=2)


def to_markdown(title: str, system: str, messages: Sequence[Mapping[str, Any]]) -> str:
    parts = [f"# {title}\n"]
    for role, content in [("system", system)] * bool(system) + [(m["role"], m["content"]) for m in messages]:
        body = _MARKER_LINE.sub(lambda m: m.group(0).replace("<!--", "<!-- "), content.strip())  # (not a marker)
        parts.append(f"<!-- specchat: {role} -->\n### {_HEADINGS[role]}\n\n{body}\n")
    return "\n".join(parts)


def parse(name: str, text: str) -> tuple[str, str, list[dict]]:
    """An exported file back as (title, system prompt, messages). JSON may also be a bare list
    of chat messages or an object with ``messages`` (OpenAI's form). Raises ValueError saying
    what is wrong."""
    if len(text) > MAX_CHARACTERS:
        raise ValueError(f"{name} is {len(text):,} characters long; at most {MAX_CHARACTERS:,} are imported")
    text = text.removeprefix("\ufeff")  # (a byte-order mark some editors write)
    if name.lower().endswith(".json") or text.lstrip()[:1] in ("{", "["):
        title, system, messages = _from_json(name, text)
    else:
        title, system, messages = _from_markdown(name, text)
    return title, system, _checked(name, messages)


def _from_json(name: str, text: str) -> tuple[str, str, list[dict]]:
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except RecursionError:
        raise ValueError(f"{name} nests its JSON too deeply to be a conversation") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError(f"{name}: expected a list of messages, or an object with 'messages'")
    _count(name, data["messages"])
    said = [m for m in data["messages"] if not (isinstance(m, dict) and m.get("role") == "system")]
    systems = [m.get("content") for m in data["messages"] if isinstance(m, dict) and m.get("role") == "system"]
    system = systems[-1] if systems else data.get("system") or ""
    return str(data.get("title") or _stem(name)), str(system), said


def _from_markdown(name: str, text: str) -> tuple[str, str, list[dict]]:
    pieces = _MARKER.split(text.replace("\r\n", "\n"))
    if len(pieces) < 3:
        raise ValueError(f"{name} is not a SpecChat export: no '<!-- specchat: user -->' lines")
    heading = re.match(r"# (.+)", pieces[0].strip())
    system, messages = "", []
    for role, content in zip(pieces[1::2], pieces[2::2]):
        if role == "system":
            system = content.strip()
        else:
            messages.append({"role": role, "content": content.strip()})
    return heading.group(1).strip() if heading else _stem(name), system, messages


def _count(name: str, messages: list) -> None:
    if not messages:
        raise ValueError(f"{name} holds no messages")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"{name} holds {len(messages):,} messages; at most {MAX_MESSAGES:,} are imported")


def _checked(name: str, messages: list) -> list[dict]:
    _count(name, messages)
    kept = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{name}: message {i} must have a role (user or assistant) and text content")
        kept.append(
            {"role": m["role"], "content": m["content"]} | ({"metrics": m["metrics"]} if "metrics" in m else {})
        )
    return kept


def _stem(name: str) -> str:
    return re.sub(r"\.(json|md|markdown|txt)$", "", name.rsplit("/", 1)[-1], flags=re.IGNORECASE) or "imported"
