"""What a new user meets: the app as ``make run`` starts it (no flags: the default budget of this
machine) on the real pair, asked with every setting as it came: through the API with no length,
by two such users at once, and from the page in a real Chromium. And the engine on a budget as
small as its models plus 1 GiB."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from benchmarks import chaos
from benchmarks.chromium import ANSWERS, CHROMIUM, chromium, open_page, send
from engine.core.budget import GIB, machine_memory
from engine.core.memory import resident_bytes
from engine.core.pacing import Pacing
from engine.core.requests import Request
from engine.core.service import Engine
from engine.core.settings import Settings

pytestmark = pytest.mark.real
QUESTION = "What is the capital of France? Answer in one word."
CODE_QUESTIONS = (  # answers of a few dozen tokens: several rounds each
    "Write a Python function that checks whether a number is prime. Reply with the code only.",
    "Write a Python function that counts the vowels in a string. Reply with the code only.",
)


@pytest.fixture(scope="module")
def app(real_pair) -> str:
    """``python app.py`` with no flags, on a loopback port: its URL."""
    with chaos.app_server([]) as (url, _pid):
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}v1", api_key="none", max_retries=0, timeout=300)


def test_a_question_without_a_length_is_answered_through_the_api(app):
    answer = _client(app).chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}])
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and "Paris" in (choice.message.content or "")


def _stream(url: str, question: str) -> tuple[list[float], str, str | None]:
    """When each piece of the answer arrived, the answer, and its finish reason."""
    arrivals, pieces, finish = [], [], None
    chunks = _client(url).chat.completions.create(
        model="any", messages=[{"role": "user", "content": question}], stream=True
    )
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return arrivals, "".join(pieces), finish


def test_two_users_without_a_length_are_answered_side_by_side(app):
    """Neither is refused, and neither waits for the other's whole answer."""
    with ThreadPoolExecutor(2) as pool:
        (a_times, a_text, a_finish), (b_times, b_text, b_finish) = pool.map(lambda q: _stream(app, q), CODE_QUESTIONS)
    assert a_finish == b_finish == "stop" and "def " in a_text and "def " in b_text
    assert a_times[0] < b_times[-1] and b_times[0] < a_times[-1]


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed (apt-get install chromium)")
def test_the_page_answers_a_question_with_every_setting_as_it_came_and_shows_its_figures(app):
    with chromium() as browser:
        page = open_page(browser, app)
        send(page, QUESTION, "best")  # (the default mode)
        answer = page.locator(ANSWERS).last.inner_text()
        assert "Paris" in answer and "Could not answer" not in answer
        figures = page.inner_text("#metrics")
        assert "tokens/s" in figures and page.inner_text("#metrics .finish") == "stop"
        page.close()


@pytest.fixture(scope="module")
def tight_engine(real_pair):
    """The real pair on a budget of its models plus 1 GiB (what this process held before them
    aside). Memory is what it tests, so neither engine times its passes at start (``Pacing()``:
    every paced round may pay), and the probe that learns the models' size may use the machine's
    memory (whatever modules before left in this process)."""
    before = resident_bytes()
    probe = Engine(*real_pair, Settings(prompt_reader="off", pacing=Pacing(), memory_limit=machine_memory()))
    models = probe.budget.base - before
    probe.close()
    del probe
    engine = Engine(
        *real_pair, Settings(memory_limit=resident_bytes() + models + GIB, prompt_reader="off", pacing=Pacing())
    )
    yield engine
    engine.close()


def test_on_a_budget_of_the_models_plus_1_gib_two_questions_without_a_length_are_answered_together(tight_engine):
    engine = tight_engine
    assert engine.budget.tokens < engine.max_context / 4  # far less room than one whole context
    streams = [engine.generate(Request(({"role": "user", "content": q},))) for q in CODE_QUESTIONS]
    assert not any(stream.refusal for stream in streams), [stream.refusal for stream in streams]
    finals = [next(event for event in stream if event.final) for stream in streams]
    assert all(final.kind == "done" and final.metrics["finish_reason"] == "stop" for final in finals)
    assert all(final.metrics["peak_sharing"] == 2 for final in finals)
