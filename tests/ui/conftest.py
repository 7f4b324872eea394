"""Fixtures of the UI tests: the app served on the tiny engine, read over its API."""

from __future__ import annotations

import pytest
from gradio_client import Client

from tests.ui.served import serve
from ui import streaming


@pytest.fixture(autouse=True)
def every_round_drawn(monkeypatch):
    """The tiny models answer within one redraw period: here every round is drawn."""
    monkeypatch.setattr(streaming, "REDRAW_S", 0.0)


@pytest.fixture(scope="module")
def url(engine):
    demo, url = serve(engine)
    yield url
    demo.close()


@pytest.fixture
def client(url):
    return Client(url, verbose=False)
