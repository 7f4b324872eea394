"""The paste benchmark's figures on the tiny pair."""

from __future__ import annotations

from benchmarks.paste import BESIDE_COLUMNS, COLUMNS, beside, paste
from engine.core.runtime import EXACT_CONFIG
from engine.core.service import Engine
from engine.core.settings import Settings
from engine.report import markdown_table


def test_a_paste_reports_its_length_timings_and_memory(engine):
    row = paste(engine, 25, "best", 4)  # (a tiny tokenizer: about 5 tokens a word)
    assert row["prompt_tokens"] >= 25 and 0 < row["ttft_s"] <= row["wall_s"]
    assert 0 < row["rss_before_gib"] <= row["peak_gib"] and row["rss_after_gib"] <= row["peak_gib"]
    assert row["budget_gib"] > 0 and f"{row['prompt_tokens']} | best" in markdown_table([row], COLUMNS)


def test_another_user_keeps_getting_tokens_while_a_paste_is_read(long_target):
    engine = Engine(long_target, None, Settings(config=EXACT_CONFIG, max_sessions=2, prompt_reader="f32"))
    row = beside(engine, 600, "autoregressive", 2, answer_tokens=6)  # (about 3,000 tokens)
    assert row["other_tokens_reading"] > 0 and row["other_p95_alone_ms"] > 0 and row["other_p95_reading_ms"] > 0
    assert row["other_p95_reading_ms"] < 1000 * row["ttft_s"]  # served between the paste's passes, not after them
    assert "| autoregressive |" in markdown_table([row], COLUMNS + BESIDE_COLUMNS)
