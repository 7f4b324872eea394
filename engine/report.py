"""Figures shown the same way everywhere (the app's paper table, the benchmarks): speedups and
markdown tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
# The paper's table (arXiv 2311.04951): autoregressive vs speculative by answer length N.
PAPER_COLUMNS = [Column("N", "n"), MODE, TOKENS_PER_S, SPEEDUP, ACCEPTANCE, MEAN_ACCEPTED]


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A GitHub markdown table, its columns padded to line up (each at least two wider than its
    header); columns of numbers align right."""
    right = [any(isinstance(r.get(c.key), (int, float)) for r in rows) for c in columns]
    cells = [[c.cell(r) for c in columns] for r in rows]
    headers = [c.header for c in columns]
    widths = [max([len(header) + 2, *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)]

    def line(values: list[str]) -> str:
        padded = (v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right))
        return f"| {' | '.join(padded)} |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
