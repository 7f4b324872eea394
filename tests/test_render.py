"""What people read (engine.render): answers as HTML with provenance drawn on the rendered
text, conversations as files and back."""

from __future__ import annotations

import html
import json
import re

import pytest

from engine.render import markdown, transcript

ANSWER = "Use **a set**:\n\n```python\ndef unique(xs):\n    return list(set(xs))  # <b>\n```\n\nDone & `ok`."


def text_of(rendered: str) -> str:
    return html.unescape(re.sub(r"<[^>]*>", "", rendered))


def spans(rendered: str) -> list[tuple[str, str]]:
    return [(k, html.unescape(t)) for k, t in re.findall(r'<span class="tok tok-(\w+)">([^<]*)</span>', rendered)]


def test_markdown_is_rendered_and_code_highlighted_on_one_line():
    rendered = markdown.render(ANSWER)
    assert "\n" not in rendered  # a chat rendering Markdown around it sees one HTML block
    assert "<strong>a set</strong>" in rendered and "<code>ok</code>" in rendered
    assert '<pre><code class="language-python"><span class="k">def</span>' in rendered
    assert "&lt;b&gt;" in rendered and "<b>" not in rendered  # an answer's markup is shown as text


def test_provenance_is_drawn_on_the_rendered_text_code_included():
    kinds = ["draft"] * ANSWER.index("```") + ["target"] * (len(ANSWER) - ANSWER.index("```"))
    plain, coloured = markdown.render(ANSWER), markdown.render(ANSWER, kinds)
    assert text_of(coloured) == text_of(plain)  # the same text, only wrapped
    assert re.sub(r"</?span[^>]*>", "", coloured) == re.sub(r"</?span[^>]*>", "", plain)  # tags around text only
    runs = spans(coloured)
    assert ("draft", "a set") in runs and ("target", "def") in runs and ("target", "ok") in runs
    assert all(kind == "draft" for kind, text in runs if text in ("Use ", "a set", ":"))


def test_a_provenance_change_inside_markdown_syntax_does_not_break_the_rendering():
    source = "```python\nx = 1\n```"
    kinds = ["draft", "bonus", "target"] * len(source)  # a change at every character, fences included
    coloured = markdown.render(source, kinds[: len(source)])
    assert '<pre><code class="language-python">' in coloured and "```" not in coloured
    assert "".join(text for _, text in spans(coloured)) == "x=1"  # (the spaces sit between spans)


def test_provenance_of_pieces_is_one_kind_per_character():
    assert markdown.provenance_of([["ab", "draft"], ["", "target"], ["c", "bonus"]]) == ["draft", "draft", "bonus"]


MESSAGES = [
    {"role": "user", "content": "Write <!-- a comment --> and ### a heading"},
    {"role": "assistant", "content": "# Title\n\n```py\nx = 1\n```", "metrics": {"tokens_per_s": 20.5}},
]


@pytest.mark.parametrize("export", [transcript.to_json, transcript.to_markdown])
def test_an_exported_conversation_imports_back(export):
    title, system, messages = transcript.parse(
        f"chat.{'json' if export is transcript.to_json else 'md'}", export("My chat", "Be brief.", MESSAGES)
    )
    assert (title, system) == ("My chat", "Be brief.")
    assert [(m["role"], m["content"]) for m in messages] == [(m["role"], m["content"]) for m in MESSAGES]


def test_openai_style_messages_import_with_their_system_prompt():
    data = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert transcript.parse("exported.json", json.dumps(data)) == ("exported", "Be brief.", [data[1]])


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("a.json", "{not json", "not valid JSON"),
        ("a.json", '{"messages": [{"role": "tool", "content": "x"}]}', "message 1 must have a role"),
        ("a.json", '{"messages": []}', "holds no messages"),
        ("a.md", "# Just notes\n\nno markers here", "not a SpecChat export"),
        ("a.json", "[" + ",".join(['{"role": "user", "content": "x"}'] * 1001) + "]", "at most 1,000"),
    ],
)
def test_a_file_that_is_not_a_conversation_is_refused_with_what_is_wrong(name, text, says):
    with pytest.raises(ValueError, match=says):
        transcript.parse(name, text)


def test_a_message_holding_a_marker_line_and_a_byte_order_mark_import_back_whole():
    messages = [{"role": "user", "content": "quote:\n<!-- specchat: assistant -->\nend"}, MESSAGES[1]]
    exported = "\ufeff" + transcript.to_markdown("Quoted", "", messages)
    _, _, imported = transcript.parse("quoted.md", exported)
    assert [m["role"] for m in imported] == ["user", "assistant"] and imported[0]["content"].endswith("end")


def test_a_huge_or_deeply_nested_file_is_refused_at_once():
    systems = json.dumps([{"role": "system", "content": "x"}] * 50_000)
    with pytest.raises(ValueError, match="at most 1,000"):
        transcript.parse("many.json", systems)
    with pytest.raises(ValueError, match="nests its JSON too deeply"):
        transcript.parse("deep.json", "[" * 100_000 + "]" * 100_000)
