"""GGUF files opened once per process, their metadata parsed in bulk.

gguf-py's reader parses an array field one element at a time, each through a memmap slice; a
vocabulary's tokens and merges are a few hundred thousand elements, so a reader of the default
target took longer to open than its graph takes to build (docs/operations.md, Resources), and
preparing a model opened its file several times (its architecture, its shape, its graphs, and
twice in transformers to read the tokenizer). :class:`Reader` gives the same fields (a part per
element, as gguf-py's) from plain array views; :func:`open_gguf` keeps one per file;
:func:`everywhere` makes ``gguf.GGUFReader`` this one in a process that reads through transformers.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

_LENGTH = np.dtype("<u8")


class Reader(gguf.GGUFReader):
    """gguf-py's reader whose array fields are parsed from a plain view of the file's bytes (its
    tensors stay memmap views, as gguf-py's). Files in the other byte order take gguf-py's way."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        item = GGUFValueType(int(raw_itype[0]))
        offs, count = orig_offs + 12, int(length[0])
        parts: list[Any] = [raw_itype, length]
        plain = self.data.view(np.ndarray)
        if item == GGUFValueType.STRING:
            raw = memoryview(plain.data)
            for _ in range(count):
                size = int.from_bytes(raw[offs : offs + 8], "little")
                parts += (plain[offs : offs + 8].view(_LENGTH), plain[offs + 8 : offs + 8 + size])
                offs += 8 + size
            indices = list(range(3, len(parts), 2))
        elif item in self.gguf_scalar_to_np:
            values = plain[offs:].view(np.uint8)[: count * np.dtype(self.gguf_scalar_to_np[item]).itemsize]
            values = values.view(self.gguf_scalar_to_np[item])
            parts += (values[i : i + 1] for i in range(count))
            offs += values.nbytes
            indices = list(range(2, len(parts)))
        else:  # (arrays of arrays: gguf-py's way)
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, indices, [GGUFValueType.ARRAY, item][: 2 if count else 1]


@functools.lru_cache(maxsize=4)
def _opened(path: str, size: int, mtime_ns: int) -> Reader:
    return Reader(path)


def open_gguf(path: os.PathLike[str] | str) -> Reader:
    """The reader of the file at ``path``, opened once per process (a file rewritten in place is
    opened again)."""
    stat = Path(path).stat()
    return _opened(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


def everywhere() -> None:
    """``gguf.GGUFReader`` made :func:`open_gguf` in this process, for libraries that open the file
    themselves (transformers, reading a tokenizer)."""
    gguf.GGUFReader = lambda path, mode="r": open_gguf(path) if mode == "r" else Reader(path, mode)  # type: ignore[assignment,misc]
