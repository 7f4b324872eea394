"""The load benchmark (benchmarks.loadtest) against the app on the tiny f32 pair: concurrent
multi-turn users through the app's own API, every answer equal to its solo run."""

from __future__ import annotations

import json

import pytest

from benchmarks import chaos, loadtest
from engine.core.pacing import Pacing
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine
from engine.core.settings import Settings
from tests.ui.served import serve


@pytest.fixture(scope="module")
def url(ir_target, ir_draft):
    demo, url = serve(
        Engine(
            ir_target,
            ir_draft,
            Settings(config=EXACT_CONFIG, max_sessions=4, pacing=Pacing(), prompt_reader="f32", batching="on"),
        )
    )
    yield url
    demo.close()


def test_concurrent_users_get_their_solo_answers_and_the_report_is_written(url, tmp_path):
    out = tmp_path / "load"
    prompts = tmp_path / "prompts.jsonl"  # short ones: the tiny model's context is 256 tokens
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "rain", "tea")))
    argv = ["--url", url, "--prompts", str(prompts), "--users", "1", "3", "--turns", "2"]
    argv += ["--max-new-tokens", "24", "--seconds", "120"]
    argv += ["--json", str(out / "load.json"), "--table", str(out / "load.md"), "--chart", str(out / "load.png")]
    assert loadtest.main(argv) == 0
    rows = {r["users"]: r for r in json.loads((out / "load.json").read_text())["rows"]}
    assert rows[1]["answers"] == 2 * 3 and rows[3]["answers"] == 3 * 2
    for row in rows.values():
        assert row["errors"] == row["lost"] == row["mixed"] == row["differ"] == 0, row["failures"]
        assert row["aggregate_tokens_per_s"] > 0 and row["ttft_p95_s"] is not None
    assert rows[1]["largest_batch"] == 1 and rows[3]["largest_batch"] >= 2
    assert "aggregate tokens/s" in (out / "load.md").read_text()
    assert (out / "load.png").stat().st_size > 1000


def test_only_loopback_addresses_are_load_tested():
    assert loadtest.main(["--url", "http://192.0.2.1:7860/", "--users", "1", "--turns", "1"]) != 0


def test_a_heartbeat_output_says_nothing():
    """While the engine is busy the chat handler yields skips, which gradio_client hands over as
    updates, not message lists: they hold no message (and no error)."""
    assert chaos.said([{"__type__": "update"}, {"__type__": "update"}]) == []
    assert (
        chaos.last_text(["", [{"role": "user", "metadata": None, "content": [{"text": "hi", "type": "text"}]}]]) == "hi"
    )


def test_an_answer_not_its_solo_runs_is_counted_and_kept_with_where_it_leaves_it():
    answers = [loadtest.Answer(0, 0, text="def f(): return 1"), loadtest.Answer(1, 0, text="same")]
    row = loadtest.summarize(2, answers, 1.0, {(0, 0): "def f(): return 2", (1, 0): "same"})
    assert row["differ"] == 1 and row["mixed"] == 0
    differing, alike = row["per_answer"]
    assert differing["differs_from_solo_at"] == 16 and differing["solo_text"] == "def f(): return 2"
    assert "text" not in alike
