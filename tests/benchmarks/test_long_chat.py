"""The long conversation (benchmarks.long_chat) on the tiny pair: through the API of a server whose
strangers keep a short conversation in view, and of one without limits, both in this process."""

from __future__ import annotations

import json

import pytest

from benchmarks import long_chat
from engine.api.openai import build_router
from engine.cli import free_port
from engine.core.pacing import Pacing
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.core.turns import NO_LIMITS, ClientLimits
from ui.launch import launch
from ui.page import build_app

# A stranger's conversation in view, in tokens: the tiny model's context holds 256 (the server
# without limits takes 192), so a few short turns pass it.
CAP = 130
SESSIONS = 2
TURNS = 4


@pytest.fixture(scope="module")
def urls(ir_target, ir_draft):
    """The server with a stranger's cap, and the one without limits (each keeps SESSIONS)."""
    served = []
    for limits in (ClientLimits(stranger_input_tokens=CAP), NO_LIMITS):
        settings = Settings(
            config=EXACT_CONFIG, max_sessions=SESSIONS, pacing=Pacing(), client_limits=limits, prompt_reader="f32"
        )
        engine = Engine(ir_target, ir_draft, settings)
        demo, api = build_app(engine), build_router(engine, "tiny", {}, None, trust_proxy=True)
        served.append((demo, launch(demo, port=free_port(), block=False, api=api)))
    yield [url for _, url in served]
    for demo, _ in served:
        demo.close()


def test_every_answer_after_a_cut_is_its_windows_read_fresh_and_the_report_is_written(urls, tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # short requests: the tiny context holds 256 tokens
    words = ("cats", "rain", "tea", "maps", "bees")
    prompts.write_text("".join(json.dumps({"prompt": f"Write about {w}."}) + "\n" for w in words))
    out = tmp_path / "long"
    argv = ["--url", urls[0], "--baseline-url", urls[1], "--prompts", str(prompts), "--question-tokens", "0"]
    argv += ["--turns", str(TURNS), "--answer-tokens", "4", "--sessions", str(SESSIONS), "--seconds", "120"]
    argv += ["--timeout", "60", "--json", str(out / "long.json"), "--table", str(out / "long.md")]
    assert long_chat.main(argv) == 0
    record = json.loads((out / "long.json").read_text())
    assert not record["failures"]
    assert [s["mode"] for s in record["summary"]] == ["ar", "best"]
    assert all(s["answered"] == f"{TURNS}/{TURNS}" and s["cuts"] >= 1 for s in record["summary"])
    compared = [r for r in record["turns"] if r["same_as_fresh"] is not None]
    assert compared and all(r["same_as_fresh"] == "yes" for r in compared)
    assert all(r["fresh_cached_tokens"] < r["prompt_tokens"] // 2 for r in compared)  # read afresh
    assert "TTFT / fresh" in (out / "long.md").read_text()


def test_only_loopback_servers_are_talked_to():
    assert long_chat.main(["--url", "http://192.0.2.1:7860/", "--baseline-url", "http://192.0.2.1:7861/"]) != 0
