"""The paste benchmark's figures on the tiny pair."""

from __future__ import annotations

from benchmarks.paste import COLUMNS, paste
from engine.report import markdown_table


def test_a_paste_reports_its_length_timings_and_memory(engine):
    row = paste(engine, 25, "best", 4)  # (a tiny tokenizer: about 5 tokens a word)
    assert row["prompt_tokens"] >= 25 and 0 < row["ttft_s"] <= row["wall_s"]
    assert 0 < row["rss_before_gb"] <= row["peak_gb"] and row["rss_after_gb"] <= row["peak_gb"]
    assert row["budget_gb"] > 0 and f"{row['prompt_tokens']} | best" in markdown_table([row], COLUMNS)
