"""The app served on an engine for the UI tests, and what they read back through its API."""

from __future__ import annotations

import threading
import time

from benchmarks import chaos
from engine.cli import free_port
from ui import streaming
from ui.launch import launch
from ui.page import build_app

GREEDY = {
    "colour": False,
    "mode": "speculative",
    "k": 4,
    "temperature": 0.0,
    "top_p": 1.0,
    "max_new_tokens": 48,
    "seed": -1,
    "context_overflow": "window",
}
text, last_answer = chaos.message_text, chaos.last_text  # one message's text, the last answer's


def serve(engine, **kwargs):
    demo = build_app(engine)
    url = launch(demo, port=free_port(), block=False, **kwargs)
    return demo, url


def ask(client, message, **settings):
    """Submit a chat message; return the finished job (its outputs are every streamed update)."""
    job = client.submit(message, *{**GREEDY, **settings}.values(), api_name="/respond")
    job.result(timeout=60)
    return job


def greedy_request(engine, message: str, **settings):
    """The engine request the chat makes for ``message`` with the test's settings."""
    values = {**GREEDY, **settings}
    del values["colour"]
    settings = streaming.Settings.from_form(**values)
    return streaming.make_request([{"role": "user", "content": message}], settings)


class SlowEngine:
    """The real engine, read slowly (like a big model on a CPU), recording when the app closes its stream."""

    def __init__(self, engine, delay: float):
        self.engine, self.delay = engine, delay
        self.closed = threading.Event()
        self.final_read = False

    def __getattr__(self, name: str):  # everything else is the real engine's
        return getattr(self.engine, name)

    def generate(self, request):
        return SlowStream(self, self.engine.generate(request))


class SlowStream:
    """An engine stream whose events each arrive ``delay`` late."""

    def __init__(self, engine: SlowEngine, stream):
        self.engine, self.stream = engine, stream

    def waiting(self, every: float):
        for event in self.stream.waiting(every):
            time.sleep(self.engine.delay)
            self.engine.final_read = event is not None and event.final
            yield event

    def close(self) -> None:
        self.stream.close()
        self.engine.closed.set()
