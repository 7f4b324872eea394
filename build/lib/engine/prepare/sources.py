"""What a user can name with ``--target`` / ``--draft``, and how each is recognised.

A spec is one of: an embedded default name (``qwen2.5-coder-1.5b``), a local GGUF
file, a local Hugging Face folder, a ready OpenVINO IR folder, or a hub id.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from engine.errors import PrepareError
from engine.prepare.embedded import EMBEDDED

# Architectures both transformers' GGUF loader and optimum-intel's exporter handle.
SUPPORTED_ARCHITECTURES = {
    "llama",
    "mistral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "starcoder2",
    "stablelm",
    "falcon",
    "gpt2",
    "bloom",
}


class Kind(StrEnum):
    EMBEDDED = "embedded"
    GGUF = "gguf"
    HF_FOLDER = "hf-folder"
    OV_IR = "openvino-ir"
    HUB = "hub"


@dataclass(frozen=True)
class Source:
    spec: str
    kind: Kind
    path: Path | None = None  # GGUF file, HF folder or IR folder

    @property
    def local(self) -> Path:
        """The file or folder on disk (a hub or embedded source has one once fetched: ``local_source``)."""
        if self.path is None:
            raise PrepareError(f"{self.spec}: not on disk yet")
        return self.path

    @property
    def label(self) -> str:
        return self.path.name if self.path else self.spec


def resolve(spec: str) -> Source:
    """Classify a user's model spec, failing with a clear message if it names nothing usable."""
    if spec in EMBEDDED:
        return Source(spec, Kind.EMBEDDED)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise PrepareError(f"{spec}: a model file must be a .gguf file")
        return Source(spec, Kind.GGUF, path.resolve())
    if path.is_dir():
        if (path / "openvino_model.xml").exists():
            validate_ir(path)
            return Source(spec, Kind.OV_IR, path.resolve())
        if (path / "config.json").exists():
            return Source(spec, Kind.HF_FOLDER, path.resolve())
        raise PrepareError(
            f"{spec}: this folder holds neither an OpenVINO IR (openvino_model.xml) "
            f"nor a Hugging Face model (config.json)"
        )
    if _looks_like_hub_id(spec):
        return Source(spec, Kind.HUB)
    names = ", ".join(EMBEDDED)
    raise PrepareError(f"{spec}: no such file or folder, and not a hub id (owner/name) or an embedded model ({names})")


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def validate_ir(folder: Path) -> None:
    """A usable IR folder: a stateful model, its weights, and a Hugging Face tokenizer."""
    missing = [n for n in ("openvino_model.xml", "openvino_model.bin", "config.json") if not (folder / n).exists()]
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer.json")
    if missing:
        raise PrepareError(f"{folder}: not a complete OpenVINO IR folder, missing {', '.join(missing)}")
    head = (folder / "openvino_model.xml").read_text(errors="replace")[:2_000_000]
    if "ReadValue" not in head and "read_value" not in head.lower():
        raise PrepareError(
            f"{folder}: the IR is not stateful (no KV-cache state); export it with "
            f"`optimum-cli export openvino --task text-generation-with-past`"
        )


def check_architecture(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise PrepareError(
            f"{where}: unknown model architecture '{model_type}'; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )


def folder_fingerprint(folder: Path) -> str:
    """Cheap identity of a folder: names, sizes and modification times of its files."""
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        digest.update(f"{f.relative_to(folder)}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return digest.hexdigest()


def hf_model_type(folder: Path) -> str:
    try:
        return json.loads((folder / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError) as exc:
        raise PrepareError(f"{folder}: config.json is unreadable or has no model_type ({exc})") from exc


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}
