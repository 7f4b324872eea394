"""Process-wide memory behaviour that serving many conversations needs.

Reading and setting KV-cache states copies them through numpy buffers of a few MB each (a trim,
a batch's rebuild, a row copied back). glibc raises its mmap threshold to the size of the
largest block freed, up to 32 MB, so after the first such copies they come from the heap, whose
freed holes are rarely returned: many conversations at once left the process gigabytes above
its models' size, much of it freed heap (docs/design.md, "Batching").
A fixed threshold keeps those buffers in their own mappings, returned when freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from pathlib import Path

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20
ARENAS = 2  # a web server's many handler threads would otherwise each keep an arena of freed blocks
log = logging.getLogger("specchat.engine")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def return_freed_buffers() -> bool:
    """Make blocks of 1 MiB and more separate mappings, and all threads share two arenas (glibc
    only; elsewhere nothing changes)."""
    if _LIBC is None:
        log.debug("not glibc: the allocator keeps its defaults")
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _LIBC.mallopt(M_ARENA_MAX, ARENAS))


def trim_heap() -> None:
    """Return the heap's free pages to the system (after a batch's states were copied around)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of process ``pid``'s ``/proc/.../status`` in bytes (0 where there is none:
    not Linux, or no such process)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """The process's resident memory now."""
    return _status_bytes("VmRSS")


_peak_base = 0


def reset_peak_rss() -> None:
    """Start measuring the process's peak resident memory afresh (Linux: ``clear_refs``)."""
    global _peak_base
    with contextlib.suppress(OSError):  # (not Linux: the peak since the process started)
        Path("/proc/self/clear_refs").write_text("5")
    _peak_base = resident_bytes()


def peak_resident_bytes() -> int:
    """The process's peak resident memory since :func:`reset_peak_rss`. The kernel folds each
    thread's page counts into the high-water mark in batches, so it can trail the present
    resident size by a few pages: the larger of the two is the peak."""
    return max(_status_bytes("VmHWM"), resident_bytes())


def peak_resident_bytes_of(pid: int) -> int | None:
    """Another process's peak resident memory since it started (a server a benchmark runs);
    None where it cannot be read (the process is gone, or not Linux)."""
    return _status_bytes("VmHWM", pid) or None


def peak_rss_since() -> int:
    """How far the resident memory rose above what it was at :func:`reset_peak_rss`."""
    return max(0, peak_resident_bytes() - _peak_base)
