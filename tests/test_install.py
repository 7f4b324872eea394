"""How a new machine installs and starts the app: a Hugging Face Space's own steps
(``pip install -r requirements.txt`` alone, then ``python app.py`` with the Space's environment)
and ``pip install .`` giving the ``specchat`` command, each in a fresh venv, on tiny models.
Traffic goes only to the loopback address of the servers started here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from engine.cli import free_port
from engine.prepare import pipeline

ROOT = Path(__file__).resolve().parents[1]
BROKEN_TORCHVISION = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


def test_a_torchvision_that_cannot_load_is_hidden_from_transformers(tmp_path):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(BROKEN_TORCHVISION)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    load = "from transformers import PreTrainedModel"

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)

    assert "torchvision::nms" in run(load).stderr  # the break this guards against
    guarded = run(f"from engine.hf import hide_unloadable_torchvision as h\nprint(h())\n{load}")
    assert guarded.returncode == 0, guarded.stderr
    assert guarded.stdout.strip() == "True"


def test_prepared_models_go_to_persistent_storage_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.delenv(pipeline.CACHE_ENV, raising=False)
    monkeypatch.setattr(pipeline, "PERSISTENT_STORAGE", tmp_path / "data")
    assert pipeline.default_cache_dir() != tmp_path / "data" / "specchat"  # no /data: the user's cache
    (tmp_path / "data").mkdir()
    assert pipeline.default_cache_dir() == tmp_path / "data" / "specchat"
    monkeypatch.setenv(pipeline.CACHE_ENV, str(tmp_path / "mine"))
    assert pipeline.default_cache_dir() == tmp_path / "mine"


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv with what a Space's build runs: ``pip install -r requirements.txt``, nothing else."""
    venv = tmp_path_factory.mktemp("space") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "-r", ROOT / "requirements.txt"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


def checkout(folder: Path) -> Path:
    """The repository's files as a fresh clone has them."""
    leave_out = shutil.ignore_patterns(".venv", ".git", "bench-results", "__pycache__", "build", "*.egg-info")
    shutil.copytree(ROOT, folder, ignore=leave_out)
    return folder


@contextmanager
def serving(command: list[str], env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(command, env={**os.environ, **env}, cwd=cwd)
    try:
        yield process
    finally:
        process.terminate()
        process.wait(timeout=60)


def health_until_ready(url: str, process: subprocess.Popen, timeout_s: float = 600) -> list[int]:
    """The distinct /health statuses seen, in order, until it answers 200."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        try:
            status = httpx.get(f"{url}health", timeout=10).status_code
        except httpx.TransportError:
            status = 0  # not listening yet
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"not ready within {timeout_s} s: {seen}")


def assert_serves_ui_and_api(url: str) -> None:
    page = httpx.get(url, timeout=30)
    assert page.status_code == 200 and "gradio" in page.text.lower()
    client = openai.OpenAI(base_url=f"{url}v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "def add(a, b):"}], temperature=0, max_tokens=8
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 8


@pytest.mark.install
@pytest.mark.slow
def test_a_space_build_installs_and_serves(fresh_venv, hf_target, hf_draft, tmp_path):
    python = fresh_venv / "bin" / "python"
    listed = subprocess.run([python, "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    assert "+cpu" in next(line for line in listed.splitlines() if line.startswith("torch "))  # no CUDA torch
    space = checkout(tmp_path / "space")
    port = free_port()
    env = {  # what a Space sets, and the models chosen in its settings
        "GRADIO_SERVER_NAME": "0.0.0.0",
        "GRADIO_SERVER_PORT": str(port),
        "HOME": str(tmp_path / "home"),
        "SPECCHAT_TARGET": str(hf_target),
        "SPECCHAT_DRAFT": str(hf_draft),
        "SPECCHAT_TARGET_PRECISION": "fp16",
        "SPECCHAT_DRAFT_PRECISION": "fp16",
    }
    with serving([python, "app.py"], env, cwd=space) as process:
        url = f"http://127.0.0.1:{port}/"
        assert health_until_ready(url, process)[-2:] == [503, 200]  # listening while the models are prepared
        assert_serves_ui_and_api(url)


@pytest.mark.install
@pytest.mark.slow
def test_pip_install_gives_the_specchat_command(fresh_venv, hf_target, hf_draft, tmp_path):
    python = fresh_venv / "bin" / "python"
    source = checkout(tmp_path / "source")  # pip builds in the source folder: not in this checkout
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", source], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    specchat = fresh_venv / "bin" / "specchat"
    helped = subprocess.run([specchat, "--help"], capture_output=True, text=True, check=True).stdout
    assert all(command in helped for command in ("serve", "prepare"))
    shipped = "import importlib.util as u; print([bool(u.find_spec(m)) for m in ('ui', 'benchmarks', 'engine.tools')])"
    found = subprocess.run([python, "-c", shipped], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert found.stdout.strip() == "[True, False, False]"  # the UI ships; measurement stays in the checkout
    port = free_port()
    command = [specchat, "serve", "--target", str(hf_target), "--draft", str(hf_draft), "--port", str(port)]
    command += ["--target-precision", "fp16", "--draft-precision", "fp16"]
    elsewhere = tmp_path / "elsewhere"  # not the checkout: the assets come from the package
    elsewhere.mkdir()
    with serving(command, {"HOME": str(tmp_path / "home")}, cwd=elsewhere) as process:
        url = f"http://127.0.0.1:{port}/"
        assert health_until_ready(url, process)[-2:] == [503, 200]
        assert_serves_ui_and_api(url)
