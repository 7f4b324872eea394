"""What an engine measures at start, kept for the next start on the same machine: which kernels
each model runs faster on, which prompt reader reads faster, and what the passes cost (and what
it computes there, the chat template opening's cache entries). None of it
changes until the CPU, the kernels' build, the models or the settings do, and timing it all took
a start most of its time (docs/operations.md, "Start"). As FFTW keeps its "wisdom", the figures
are kept beside the prepared target, in a file named by everything they depend on; another CPU,
build, model or setting finds no file and measures afresh, and ``--remeasure`` does so anyway."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from engine import machine

log = logging.getLogger("specchat.engine")
FOLDER = "measured"


def model_identity(ir_dir: Path) -> str:
    """A prepared model as its graphs are on disk: a model prepared again is another model."""
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(ir_dir.glob("openvino_model*.xml"))]
    return f"{ir_dir.resolve()} {stats}"


@dataclasses.dataclass
class Measured:
    """The figures kept for one set of what they depend on (``path`` names it)."""

    path: Path
    figures: dict[str, Any]
    # When they were measured (UTC, ISO 8601), and whether this start read them back.
    at: str
    reused: bool

    @classmethod
    def open(cls, target_dir: Path, depends_on: Mapping[str, object], remeasure: bool = False) -> Measured:
        """The figures kept for ``depends_on`` (besides the CPU and OpenVINO's version) beside the
        target in ``target_dir``, or none (with ``remeasure``, or where none were kept)."""
        parts = {"cpu": machine.cpu_key(), "openvino": ov.__version__, **depends_on}
        key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
        path = Path(target_dir) / FOLDER / f"{key}.json"
        if not remeasure:
            try:
                kept = json.loads(path.read_text())
                log.info("measurements: read back from %s (measured %s; --remeasure to time again)", path, kept["at"])
                return cls(path, kept["figures"], kept["at"], reused=True)
            except (OSError, ValueError, KeyError):
                pass
        log.info("measurements: none kept for this machine, build, models and settings: timing at start")
        return cls(path, {}, _now(), reused=False)

    def get(self, name: str) -> Any:
        """A kept figure, or None."""
        return self.figures.get(name)

    def put(self, name: str, value: Any) -> None:
        """Keep a figure (written at once, whole: a start cut short keeps what it measured)."""
        self.figures[name] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"at": self.at, "figures": self.figures}, indent=1, default=_plain))
        partial.replace(self.path)

    def arrays(self, name: str) -> dict[str, np.ndarray] | None:
        """Arrays kept under ``name`` (:meth:`put_arrays`) by the start these figures come from, or None."""
        if not self.reused:
            return None
        try:
            with np.load(self._arrays_path(name)) as kept:
                return dict(kept)
        except (OSError, ValueError):
            return None

    def put_arrays(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Keep arrays beside the figures, in a file of their own (what start computed, not timed:
        the opening's cache entries, engine.core.sessions)."""
        path = self._arrays_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        with partial.open("wb") as file:
            np.savez(file, allow_pickle=False, **arrays)
        partial.replace(path)

    def _arrays_path(self, name: str) -> Path:
        return self.path.with_suffix(f".{name}.npz")

    def describe(self) -> str:
        """When, for people (the page's header and /health)."""
        return f"{self.at.replace('T', ' ')[:16]} UTC" + (", kept from an earlier start" if self.reused else "")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").removesuffix("+00:00")


def _plain(value: object) -> object:
    """A dataclass (the pass costs) as JSON takes it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot keep a {type(value).__name__}")
