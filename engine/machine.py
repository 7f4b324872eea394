"""What this machine is, for the figures measured on it: a kernel built for a CPU, or a choice timed
on it, holds only where the CPU is the same."""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def cpu_flags() -> str:
    """The CPU's feature flags, sorted (what a native build depends on)."""
    flags = _cpuinfo().get("flags")
    return " ".join(sorted(set(flags.split()))) if flags else platform.processor()


def cpu_name() -> str:
    """The CPU's model name, for people and for keys."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_key() -> str:
    """A short key of the CPU's model and features: figures measured under another are not used."""
    parts = [cpu_name(), _cpuinfo().get("cpu family", ""), _cpuinfo().get("model", ""), cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
