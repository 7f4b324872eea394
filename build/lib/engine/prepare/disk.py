"""The cache's disk: room checked before each large write, a full disk reported as one, one
preparation per cache entry at a time (a file lock), and what an interrupted run left removed.

Every large intermediate lives in a folder named after its entry (``.build-NAME``,
``.download-NAME``) and is written only while that entry's lock (``.NAME.lock``) is held, so a
folder whose lock is free was left by a run that was killed: it is removed on the next run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import PrepareError

TEMPORARY_PREFIXES = (".build-", ".download-")
_FULL = (errno.ENOSPC, errno.EDQUOT)


def require_free(folder: Path, needed: int, what: str) -> None:
    """Refuse to start a write of about ``needed`` bytes into ``folder`` without room for it."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise PrepareError(
            f"not enough free disk in {folder} to {what}: {free / 2**30:.1f} GiB free, about "
            f"{needed / 2**30:.1f} GiB needed. Free space or pass --cache-dir."
        )


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL


@contextlib.contextmanager
def full_disk_reported(folder: Path, what: str) -> Iterator[None]:
    """Turn 'no space left on device' while writing into ``folder`` into a message saying so."""
    try:
        yield
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        free = shutil.disk_usage(folder).free / 2**30
        raise PrepareError(
            f"the disk filled up while trying to {what} in {folder} ({free:.1f} GiB free now); nothing was "
            "kept. Free space or pass --cache-dir, then run prepare again."
        ) from exc


def lock_path(folder: Path, name: str) -> Path:
    return folder / f".{name}.lock"


@contextlib.contextmanager
def exclusive(folder: Path, name: str, log: Callable[[str], None], prefix: str = ".build-") -> Iterator[Path]:
    """Hold entry ``name``'s lock; yield its temporary folder, emptied of what a killed run left.
    A second preparation of the same entry waits here for the first, then finds its result."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(lock_path(folder, name), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{name}: another preparation is writing it; waiting for it to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        scratch = folder / f"{prefix}{name}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def remove_stale(cache_dir: Path, log: Callable[[str], None]) -> None:
    """Remove temporary folders whose lock no run holds (left by an interrupted run)."""
    for folder in [p for prefix in TEMPORARY_PREFIXES for p in cache_dir.rglob(f"{prefix}*") if p.is_dir()]:
        name = folder.name.split("-", 1)[1]
        with open(lock_path(folder.parent, name), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a run is using it
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder, ignore_errors=True)
            log(f"removed {folder} ({size / 2**30:.1f} GiB), left by an interrupted preparation")
