"""Figures shown the same way everywhere (bench, paper, ceiling, quantization report, app):
speedups, markdown tables and charts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

MISSING = "–"


def speedup(baseline_s: float | None, seconds: float | None) -> float | None:
    """How many times faster than the baseline: baseline wall time / this wall time."""
    return baseline_s / seconds if baseline_s and seconds else None


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    template: str = "{}"  # str.format template of a value; None shows as a dash

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        return MISSING if value is None else self.template.format(value)


# The columns every speed table shares, named as docs/design.md "Metrics" defines them.
MODE = Column("mode", "mode")
TOKENS_PER_S = Column("tokens/s", "tokens_per_s", "{:.1f}")
SPEEDUP = Column("speedup vs ar", "speedup_vs_ar", "{:.2f}×")
ACCEPTANCE = Column("acceptance", "acceptance_rate", "{:.2f}")
MEAN_ACCEPTED = Column("mean accepted length", "mean_accepted_length", "{:.2f}")


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A GitHub markdown table; columns of numbers align right."""
    numeric = [any(isinstance(r.get(c.key), (int, float)) for r in rows) for c in columns]
    return tabulate(
        [[c.cell(r) for c in columns] for r in rows],
        headers=[c.header for c in columns],
        tablefmt="github",
        disable_numparse=True,
        colalign=["right" if n else "left" for n in numeric],
    )


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
