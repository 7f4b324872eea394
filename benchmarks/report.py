"""What the benchmarks write besides the tables (:mod:`engine.report` draws those, as the app
does): figures as files, and charts."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.core.budget import GIB, machine_memory
from engine.core.memory import peak_resident_bytes_of


def add_output_arguments(parser: argparse.ArgumentParser, json: Path | None = None, table: Path | None = None) -> None:
    """``--json`` and ``--table``: where a run's figures and its markdown table are written
    (by default ``json`` and ``table``; None: not written)."""
    parser.add_argument("--json", type=Path, default=json, help="write the figures (JSON) here")
    parser.add_argument("--table", type=Path, default=table, help="write the markdown table here")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` by nearest rank (None where there are none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_text(path: Path | None, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made as needed); nothing when no path is given."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@dataclass(frozen=True)
class Series:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    colour: str


def line_chart(series: Sequence[Series], out: Path, title: str, x_label: str, y_label: str) -> None:
    """A PNG line chart; a series without x values is drawn as a dashed horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in series:
        if s.x:
            ax.plot(s.x, s.y, "o-", color=s.colour, label=s.label)
        else:
            ax.axhline(s.y[0], color=s.colour, linestyle="--", label=s.label)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def several_engines_limit() -> int:
    """The memory budget of an engine in a benchmark that loads several, in turn or side by side,
    in one process: each engine's budget counts what the process holds, the others' models too."""
    return int(machine_memory() * 0.8)


def peak_rss_gib(pid: int | None) -> float | None:
    """A server's peak resident memory in GiB; None without a process of ours (an app at a URL
    given) or where it cannot be read (gone)."""
    peak = peak_resident_bytes_of(pid) if pid else None
    return peak / GIB if peak else None
