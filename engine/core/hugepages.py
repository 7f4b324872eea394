"""The ggml kernels' weights on transparent huge pages (docs/design.md, "The GGUF's own kernels").

A decode step streams every weight byte once. On 4 KiB pages it takes a TLB miss every 4 KiB,
and the hardware prefetchers stop at each page's end; on 2 MiB pages a layer's weights are a few
pages. The IR's weights are a read-only file mapping, which Linux did not back with huge pages
(``MADV_COLLAPSE`` on it failed with EINVAL on Linux 6.18), so each GgmlLinear weight is copied
into anonymous memory advised for them (``MADV_HUGEPAGE`` before the first touch) and the graph
reads the copy. Each weight's pages in the file mapping are dropped once copied, so the process
never holds both.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from engine.ggml import FIRST_WEIGHT, GGML_LINEAR

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
OP = GGML_LINEAR


def available() -> bool:
    """Whether this kernel gives huge pages to memory advised for them."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in setting


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges this process maps from files (their pages can be dropped and read again)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _perms, _offset, _device, inode, *_path = line.split()
        if inode != "0":
            start, stop = span.split("-")
            spans.append((int(start, 16), int(stop, 16)))
    return spans


def _drop(view: np.ndarray) -> None:
    """Drop the whole pages of ``view``, in a read-only file mapping, from this process: a later
    read faults them in again from the file."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = -(-view.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = (view.ctypes.data + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


def _huge_region(size: int) -> tuple[np.ndarray, mmap.mmap] | None:
    """``size`` bytes of anonymous memory advised for huge pages, starting on one, and the
    mapping; None where the kernel refuses the advice."""
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        region.close()
        return None
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start : start + size], region


def move_weights(model: ov.Model) -> mmap.mmap | None:
    """Put every GgmlLinear weight of ``model`` on huge pages, one after another in one region
    (where the kernel gives them), before it is compiled; return the mapping that holds them (the
    graph's constants keep it alive), or None where they stay where they are."""
    ports: dict[str, list[ov.Input]] = {}  # each weight's readers, by its constant's name
    constants: dict[str, ov.Node] = {}
    for node in model.get_ordered_ops():
        if node.get_type_name() == OP:
            weights = len(node.get_attributes()["ggml_types"])
            for port in list(node.inputs())[FIRST_WEIGHT : FIRST_WEIGHT + weights]:
                constant = port.get_source_output().get_node()
                constants[constant.get_friendly_name()] = constant
                ports.setdefault(constant.get_friendly_name(), []).append(port)
    if not ports or not available():
        return None
    sources = {name: constant.get_data() for name, constant in constants.items()}
    sizes = [-(-source.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE for source in sources.values()]
    found = _huge_region(sum(sizes))
    if found is None:
        return None
    memory, region = found
    mapped, offset = _file_mappings(), 0
    for (name, source), size in zip(sources.items(), sizes, strict=True):
        copy = memory[offset : offset + source.nbytes].reshape(source.shape)
        copy[...] = source
        moved = ops.constant(copy, shared_memory=True).output(0)
        for port in ports[name]:
            port.replace_source_output(moved)
        if any(start <= source.ctypes.data < stop for start, stop in mapped):  # (not a graph built here)
            _drop(source)
        offset += size
    return region
