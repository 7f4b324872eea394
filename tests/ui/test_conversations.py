"""The conversations each browser keeps: the store, its titles and its limits, export and import."""

from __future__ import annotations

import gradio as gr
import pytest

from ui import conversations
from ui.render import CONTINUE, footer_message


def test_conversations_are_kept_newest_first_and_the_oldest_dropped(monkeypatch):
    store: dict = {}
    for n in range(conversations.MAX_CONVERSATIONS + 2):
        monkeypatch.setattr(conversations.time, "time", lambda n=n: 1000.0 + n)
        store = conversations.remember(store, f"c{n}", [{"role": "user", "content": f"question {n}\nmore"}], "")
    kept = store["conversations"]
    assert len(kept) == conversations.MAX_CONVERSATIONS and "c0" not in kept and "c1" not in kept
    assert kept["c5"]["title"] == "question 5" and store["current"] == f"c{conversations.MAX_CONVERSATIONS + 1}"
    assert conversations.remember(store, "new", [], "") == {**store, "current": "new"}  # an empty new chat is not kept
    listed = conversations.conversation_list(store, "c5")
    assert listed["value"] == "c5" and listed["choices"][0] == (
        f"question {conversations.MAX_CONVERSATIONS + 1}",
        f"c{n}",
    )


def test_the_browser_keeps_provenance_as_runs_and_token_ids_only_for_a_cut_last_answer():
    answer = {
        "role": "assistant",
        "content": "abc",
        "pieces": [["a", "draft"], ["b", "draft"], ["c", "target"]],
        "token_ids": [1, 2, 3],
        "metrics": {"finish_reason": "length"},
    }
    assert conversations.compact(answer, last=True) == {**answer, "pieces": [["ab", "draft"], ["c", "target"]]}
    assert "token_ids" not in conversations.compact(answer, last=False)
    figures = dict.fromkeys(conversations.METRIC_KEYS, 0) | {"mode": "best", "finish_reason": "length", "ttft_s": 0.1}
    answer["metrics"] = figures
    assert footer_message(answer, last=True)["options"][0]["value"] == CONTINUE
    assert "options" not in footer_message(answer, last=False)  # Continue: under the last answer only


def test_a_stored_value_of_another_shape_opens_as_a_new_conversation(engine):
    for stored in (None, "junk", {"conversations": []}, {"conversations": {"a": {"title": 1}}}):
        store, _, turns, *_ = conversations.restore(engine, stored, False)
        assert turns == [] and store.get("conversations", {}) == {}
    tampered = {"role": "assistant", "content": "x", "metrics": {"mode": "best"}}  # figures missing
    store = {"current": "a", "conversations": {"a": {"title": "t", "system": "", "updated": 1.0, "turns": [tampered]}}}
    assert conversations.restore(engine, store, False)[2] == []


def test_an_exported_conversation_imports_as_a_new_one_and_a_bad_file_changes_nothing(engine, tmp_path):
    turns = [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "```python\nreturn a + b\n```", "metrics": {"new_tokens": 9}},
    ]
    files = conversations.export_chat(turns, "Be brief.")["value"]
    assert [f.rsplit(".", 1)[1] for f in files] == ["json", "md"]
    for path in files:
        store, conv_id, opened, _chat, system, *_ = conversations.import_chat(engine, {}, path, False)
        assert [(t["role"], t["content"]) for t in opened] == [(t["role"], t["content"]) for t in turns]
        assert system == "Be brief." and store["conversations"][conv_id]["title"] == "def add(a, b):"
    bad = tmp_path / "notes.md"
    bad.write_text("# notes, not a conversation")
    with pytest.warns(UserWarning, match="not a SpecChat export"):
        unchanged = conversations.import_chat(engine, {}, str(bad), False)
    assert unchanged == (gr.skip(),) * len(unchanged)
