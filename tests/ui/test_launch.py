"""Serving the page: the login, the share link, the warnings, health, the page while the models
are prepared (or could not be), uploads, the command line's flags."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest
from gradio_client import Client

import app
from engine.api.openai import build_router
from engine.cli import free_port
from engine.core.turns import NO_LIMITS, PUBLIC_LIMITS
from engine.errors import PrepareError
from engine.loading import Loading
from tests.ui.served import GREEDY, ask, last_answer, serve
from ui import page
from ui.launch import launch
from ui.options import launch_warnings, parse_auth
from ui.page import build_app
from ui.render import status_html


def test_the_page_states_the_limits_a_shared_server_sets_and_a_private_one_none(engine):
    said = "This shared server allows each visitor 2 answers at once"
    assert said in json.dumps(build_app(engine, limits=PUBLIC_LIMITS).config, default=str)
    assert "This shared server" not in json.dumps(build_app(engine).config, default=str)
    args = app.parse_args(["--host", "0.0.0.0"])
    assert args.client_limits == PUBLIC_LIMITS and not args.shared_pool
    args = app.parse_args([])
    assert args.client_limits == NO_LIMITS and args.shared_pool


def test_wrong_password_is_refused_and_every_route_needs_the_login(engine):
    demo, url = serve(engine, auth=("ada", "lovelace"))
    try:
        with pytest.raises(ValueError, match="Could not login"):
            Client(url, auth=("ada", "babbage"), verbose=False)
        for route in ("config", "gradio_api/info"):
            assert httpx.get(url + route).status_code == 401
        assert httpx.post(url + "gradio_api/queue/join", json={}).status_code == 401
        answer = Client(url, auth=("ada", "lovelace"), verbose=False).predict(
            "def add(a, b):", *{**GREEDY, "max_new_tokens": 16}.values(), api_name="/respond"
        )
        assert answer[3]["new_tokens"] > 0
    finally:
        demo.close()


def test_an_idle_queue_looks_for_events_at_the_quiet_period_not_every_millisecond(engine):
    queue = build_app(engine)._queue  # its idle polling takes CPU time from decoding
    assert queue.sleep_when_free == page.QUEUE_POLL_S >= 0.01
    assert queue.progress_update_sleep_when_free == page.PROGRESS_POLL_S >= 0.05


def test_auth_is_read_as_user_colon_password():
    assert parse_auth("ada:pa:ss") == ("ada", "pa:ss")
    assert parse_auth(None) is None
    with pytest.raises(ValueError):
        parse_auth("ada")


def test_share_without_internet_says_so_once_and_serves_locally(engine, capsys):
    demo, url = serve(engine, share=True)
    try:
        said = capsys.readouterr().out.strip().splitlines()
        assert httpx.get(url).status_code == 200
        if demo.share_url is None:  # no internet here: the expected case
            assert len(said) == 1 and said[0].startswith("share link unavailable:") and url in said[0]
    finally:
        demo.close()


def test_serving_beyond_loopback_or_by_share_link_without_a_login_is_warned_about():
    assert launch_warnings("127.0.0.1", share=False, auth=None) == []
    assert launch_warnings("localhost", share=False, auth=None) == []
    assert launch_warnings("::1", share=False, auth=None) == []
    assert launch_warnings("127.0.0.1", share=True, auth=("ada", "pw")) == []
    assert [w.split(" serves ")[1][:20] for w in launch_warnings("0.0.0.0", share=False, auth=None)] == [
        "the app without a lo",
        "the API (/v1) withou",
    ]
    assert len(launch_warnings("127.0.0.1", share=True, auth=None)) == 1  # the API stays on loopback
    assert len(launch_warnings("0.0.0.0", share=False, auth=("ada", "pw"))) == 1
    assert launch_warnings("0.0.0.0", share=False, auth=("ada", "pw"), keyed=True) == []


def test_health_says_whether_the_engine_makes_progress(client, engine):
    assert client.predict(api_name="/health") == {"healthy": True, "pending": 0}


def test_uploads_over_a_megabyte_are_refused(url):
    small = httpx.post(f"{url}gradio_api/upload", files={"files": ("a.txt", b"x" * 1000)})
    big = httpx.post(f"{url}gradio_api/upload", files={"files": ("b.txt", b"x" * 2_000_000)})
    assert small.status_code == 200 and big.status_code == 413


def test_the_server_listens_at_once_and_says_so_until_the_models_are_ready(engine):
    """A first start: the page, the chat and /health answer while the models are prepared."""
    ready = threading.Event()

    def load():
        logging.getLogger("specchat.prepare").info("dequantizing the target")
        ready.wait(30)
        return engine

    loading = Loading(load, engine.modes)
    demo = build_app(loading)
    url = launch(demo, port=free_port(), block=False, api=build_router(loading, "tiny", {}, None))
    try:
        health = httpx.get(f"{url}health")
        assert health.status_code == 503 and health.json()["status"] == "loading: dequantizing the target"
        early = last_answer(ask(Client(url, verbose=False), "def add(a, b):").outputs()[-1])
        assert "still being prepared (dequantizing the target)" in early
        ready.set()
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}health").json()["status"] == "ok"
        answer = ask(Client(url, verbose=False), "def add(a, b):").outputs()[-1]
        assert answer[3]["new_tokens"] > 0 and "Could not answer" not in last_answer(answer)
    finally:
        ready.set()
        demo.close()


def test_a_failed_preparation_is_shown_and_the_server_stays_up(engine):
    def load():
        raise PrepareError("not enough free disk in /cache: 0.1 GiB free")

    loading = Loading(load, engine.modes)
    demo = build_app(loading)
    url = launch(demo, port=free_port(), block=False, api=build_router(loading, "tiny", {}, None))
    try:
        deadline = time.monotonic() + 5
        while loading.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{url}health")
        assert health.status_code == 503 and health.json()["status"].startswith("failed: not enough free disk")
        assert status_html(loading.state).startswith('<div class="status status-failed">')
    finally:
        demo.close()


def test_flags_fall_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    monkeypatch.setenv("GRADIO_SERVER_PORT", "7861")
    monkeypatch.setenv("SPECCHAT_TARGET", "/models/target.gguf")
    args = app.parse_args([])
    assert (args.host, args.port, args.target) == ("0.0.0.0", 7861, "/models/target.gguf")
    assert app.parse_args(["--host", "127.0.0.1"]).host == "127.0.0.1"
