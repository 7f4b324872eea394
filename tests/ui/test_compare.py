"""The compare tab over HTTP on the tiny engine: both modes stream and race, the paper's table."""

from __future__ import annotations

import pytest
from gradio_client.exceptions import AppError

from benchmarks import chaos


def test_compare_streams_both_modes_and_greedy_outputs_are_identical(client):
    job = client.submit("def add(a, b):", "autoregressive", "hybrid", 4, 0.0, 1.0, 48, -1, api_name="/compare")
    ar_text, sd_text, ar_stats, sd_stats, verdict, bars = job.result(timeout=60)
    assert len(job.outputs()) >= 4
    assert ar_text and ar_text == sd_text
    assert "tokens/s" in ar_stats and "acceptance" in sd_stats and "acceptance" not in ar_stats
    assert "identical output" in verdict and "speedup" in verdict and "hybrid" in verdict
    assert [row[0] for row in bars["data"]] == ["left: autoregressive", "right: hybrid"]
    texts = [o[1] for o in job.outputs() if isinstance(o[1], str)]
    assert any(t.endswith(" ▌") for t in texts)  # the race replayed the answer as it was measured


def test_compare_with_a_bad_setting_fails_before_running_anything(url, client):
    with pytest.raises(AppError, match="not in the list of choices"):  # Gradio itself refuses an unknown mode
        client.predict("def add(a, b):", "autoregressive", "warp-speed", 4, 0.0, 1.0, 48, -1, api_name="/compare")
    body = '{"data": ["def add(a, b):", "autoregressive", "hybrid", NaN, 0, 1, 48, -1, ""]}'
    ar_text, sd_text, *_ = chaos.raw_call(url, "compare", body)
    assert ar_text == "" and "k must be a whole number" in sd_text


def test_paper_table_has_a_row_per_mode_and_length(client):
    table = client.predict("def add(a, b):", 4, api_name="/paper_table")
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [dict(zip(cells(lines[0]), cells(line))) for line in lines[1:]]
    assert [(r["mode"].split()[0], r["N"]) for r in rows] == [
        ("autoregressive", "40"),
        ("speculative", "40"),
        ("autoregressive", "100"),
        ("speculative", "100"),
    ]
    assert all(r["speedup vs ar"].endswith("×") for r in rows)


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]
