"""The chaos run (benchmarks.chaos) against the app on the tiny pair: normal and misbehaving
users at once, bounded, on loopback."""

from __future__ import annotations

import pytest

from benchmarks import chaos
from tests.ui.served import serve


@pytest.fixture(scope="module")
def url(engine):
    demo, url = serve(engine)
    yield url
    demo.close()


def test_a_chaos_run_leaves_every_normal_answer_intact(url):
    """Normal and misbehaving users together (bounded, loopback): benchmarks.chaos on tiny models."""
    tallies = chaos.run(url, ["def add(a, b):", "class Stack:"], users=2, rounds=1, max_new_tokens=24, seconds=120)
    assert [t.kind for t in tallies] == ["normal", *chaos.MISBEHAVIOUR, "engine at the end"]
    assert all(t.requests and t.as_expected == t.requests for t in tallies), [t.failures for t in tallies]
