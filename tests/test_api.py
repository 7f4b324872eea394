"""The OpenAI-compatible API, driven by the official ``openai`` client against the real app on
the tiny engine (same server and port as the UI)."""

from __future__ import annotations

import httpx
import openai
import pytest
from gradio_client import Client

from engine.api.openai import build_router
from engine.cli import free_port
from engine.core.service import Engine
from tests.ui.served import GREEDY, last_answer
from ui.launch import launch
from ui.page import build_app

KEY = "sk-test-key"
MODELS = {
    "target": {"source": "tiny-target", "precision": "fp16"},
    "draft": {"source": "tiny-draft", "precision": "fp16"},
}
CHAT = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def served(engine):
    demo = build_app(engine)
    url = launch(demo, port=free_port(), block=False, api=build_router(engine, "tiny", MODELS, KEY))
    yield url
    demo.close()


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served}v1", api_key=KEY, max_retries=0)


def test_a_streamed_completion_ends_with_usage_and_speculative_figures(client, engine):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mode": "speculative"},  # best may rightly run plain steps on a tiny model
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage.model_dump()
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 3  # it streamed
    assert finish == ["length"] and usage["completion_tokens"] == 24
    assert usage["drafted_tokens"] > 0 and 0 <= usage["acceptance_rate"] <= 1 and usage["mode"] == "speculative"
    assert text == engine.text(engine.run(engine_request(engine)).token_ids)


def engine_request(engine: Engine):
    from engine.core.requests import Request

    return Request(tuple(CHAT), mode="autoregressive", max_new_tokens=24)


def test_greedy_output_equals_the_chat_ui_s_for_the_same_conversation(client, served):
    api = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=48)
    ui = Client(served, verbose=False).submit(
        CHAT[0]["content"], *{**GREEDY, "mode": "best"}.values(), api_name="/respond"
    )
    ui.result(timeout=60)
    assert api.choices[0].message.content == last_answer(ui.outputs()[-1])
    assert api.choices[0].finish_reason == "length" and api.usage.total_tokens > api.usage.completion_tokens


def test_a_wrong_key_gets_401_in_openai_s_shape(served):
    bad = openai.OpenAI(base_url=f"{served}v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        bad.chat.completions.create(model="tiny", messages=CHAT)
    assert raised.value.status_code == 401 and "API key" in raised.value.body["message"]


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("temperature", 7, "temperature must be"),
        ("messages", [{"role": "wizard", "content": "hi"}], "messages.0.role"),
        ("mode", "warp", "unknown mode"),
    ],
)
def test_a_bad_field_gets_400_naming_it(client, field, value, said):
    fields = {"model": "tiny", "messages": CHAT, field: value}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**fields) if field != "mode" else client.chat.completions.create(
            model="tiny", messages=CHAT, extra_body={"mode": value}
        )
    assert raised.value.status_code == 400 and said in raised.value.body["message"]


def test_content_in_parts_and_a_developer_message_read_as_text_and_system(client):
    """Editors and the ``openai`` client send content as a list of text parts, and newer ones a
    ``developer`` message: the same answer as the plain strings."""
    system = "Answer in one line."
    plain = [{"role": "system", "content": system}, *CHAT]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [{"type": "text", "text": "def add("}, {"type": "text", "text": "a, b):"}]},
    ]
    answers = [
        client.chat.completions.create(model="tiny", messages=m, temperature=0, max_tokens=16)
        .choices[0]
        .message.content
        for m in (plain, parts)
    ]
    assert answers[0] == answers[1] and answers[0]


def test_an_image_part_gets_400_saying_only_text_is_read(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [image]}])
    assert raised.value.status_code == 400 and "only text parts" in raised.value.body["message"]
    assert "messages.0.content" in raised.value.body["message"]


def test_models_and_health_describe_the_pair(client, served, engine):
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = httpx.get(f"{served}health")
    running = {role: spec | {"running": engine.models[role]} for role, spec in MODELS.items()}
    expected = {"status": "ok", "models": running, "queue": 0, "replicas": 1, "measured": engine.models["measured"]}
    expected["batching"] = engine.models["batching"]
    assert health.status_code == 200 and health.json() == expected
    assert engine.measured.describe() == expected["measured"]  # (when start timed what it chose)


def test_an_unhealthy_engine_answers_503(client, served, monkeypatch):
    monkeypatch.setattr(Engine, "healthy", property(lambda self: False))
    assert httpx.get(f"{served}health").status_code == 503
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="tiny", messages=CHAT)
    assert raised.value.status_code == 503
