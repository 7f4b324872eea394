"""A KV cache the op keeps (engine/prepare/ggml_op/kv_attention.h), for a graph whose attention is
the op's: each layer's keys and values live in the op's memory under an id, a pass writes its
entries after the ones it keeps, and a rollback is only a shorter length. Read and set whole
through the op's C calls, by layer, as a plugin state is."""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from pathlib import Path

import numpy as np

_ids = itertools.count(1)  # (one id per cache in the process: the op's caches are the process's)
_FLOATS = np.ctypeslib.ndpointer(dtype=np.float32, flags="C_CONTIGUOUS")


@functools.cache
def _native(library: Path) -> ctypes.CDLL:
    native = ctypes.CDLL(str(library))
    native.specchat_kv_bytes.argtypes = [ctypes.c_int64]
    native.specchat_kv_bytes.restype = ctypes.c_int64
    native.specchat_kv_free.argtypes = [ctypes.c_int64]
    sizes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    native.specchat_kv_read.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, _FLOATS, *sizes]
    native.specchat_kv_read.restype = ctypes.c_bool
    native.specchat_kv_write.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, _FLOATS, *sizes]
    return native


class OwnCache:
    """One cache of ``layers`` layers of ``heads`` KV heads of ``dim`` values, kept by the op in
    ``library``; :attr:`id` is what a pass names it by."""

    KINDS = ("key", "value")  # (the op's `which`: 0 keys, 1 values)

    def __init__(self, library: Path, layers: int, heads: int, dim: int):
        self.library, self.native = library, _native(library)
        self.layers, self.heads, self.dim = layers, heads, dim
        self.id = next(_ids)
        weakref.finalize(self, self.native.specchat_kv_free, self.id)  # (its memory goes with it)

    def other(self) -> OwnCache:
        """Another cache of the same shape, empty."""
        return OwnCache(self.library, self.layers, self.heads, self.dim)

    @property
    def bytes(self) -> int:
        """What the op holds for it (whole blocks of 256 entries a layer, kept until freed)."""
        return int(self.native.specchat_kv_bytes(self.id))

    def free(self) -> None:
        """Forget every entry and give the memory back."""
        self.native.specchat_kv_free(self.id)

    def read(self, length: int) -> dict[str, np.ndarray]:
        """A copy of its first ``length`` entries, by layer and kind ([1, heads, length, dim] each,
        as a plugin state holds them)."""
        entries = {}
        for layer, which, name in self._names():
            out = np.empty((1, self.heads, length, self.dim), dtype=np.float32)
            if not self.native.specchat_kv_read(self.id, layer, which, out, self.heads, length, self.dim):
                raise ValueError(f"cache {self.id} holds fewer than {length} entries")
            entries[name] = out
        return entries

    def write(self, entries: dict[str, np.ndarray], length: int) -> None:
        """Make it hold the first ``length`` of ``entries`` (:meth:`read`'s, or longer)."""
        for layer, which, name in self._names():
            values = np.ascontiguousarray(entries[name][:, :, :length], dtype=np.float32)
            self.native.specchat_kv_write(self.id, layer, which, values, self.heads, length, self.dim)

    def zeros(self, length: int) -> None:
        """Make it hold ``length`` entries of zeros."""
        zero = np.zeros((1, self.heads, length, self.dim), dtype=np.float32)
        self.write({name: zero for _, _, name in self._names()}, length)

    def _names(self) -> list[tuple[int, int, str]]:
        return [
            (layer, which, f"{layer}.{kind}") for layer in range(self.layers) for which, kind in enumerate(self.KINDS)
        ]
