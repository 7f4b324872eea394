"""Process-wide memory behaviour that serving many conversations needs.

Reading and setting KV-cache states copies them through numpy buffers of a few MB each (a trim,
a batch's rebuild, a row copied back). glibc raises its mmap threshold to the size of the
largest block freed, up to 32 MB, so after the first such copies they come from the heap, whose
freed holes are rarely returned: on this machine eight 5-turn conversations at once left the
process 4 GiB above its models' size, 0.9 GiB of it in freed heap (docs/design.md, "Batching").
A fixed threshold keeps those buffers in their own mappings, returned when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20
log = logging.getLogger("specchat.engine")


def return_freed_buffers() -> bool:
    """Make blocks of 1 MiB and more separate mappings (glibc only; elsewhere nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc
        log.debug("mallopt is not available: the allocator keeps its defaults")
        return False
