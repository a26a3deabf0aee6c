"""Bar charts made of text: robust in any terminal, in snapshots and in ``tmux capture-pane``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.table import Table
from rich.text import Text

from ckptfmt.tools.formatting import number
from ckptfmt.tui.stats import TensorStats

_EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(value: float, largest: float, width: int) -> str:
    """A horizontal bar of ``width * value / largest`` cells, in eighths of a cell."""
    if largest <= 0 or value <= 0:
        return ""
    eighths = max(1, round(8 * width * value / largest))
    return "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")


def bar_chart(rows: Sequence[tuple[str, float]], fmt: Callable[[float], str], width: int = 40,
              style: str = "cyan") -> Table:
    """One labelled bar per row, scaled to the largest value, with the value printed after it."""
    largest = max((value for _, value in rows), default=0.0)
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(width=width, no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    for label, value in rows:
        table.add_row(label, Text(bar(value, largest, width), style=style), fmt(value))
    return table


def histogram(stats: TensorStats, width: int = 30) -> Table:
    """The histogram of a tensor's finite values: one row per bin, labelled by its range."""
    counts = stats.histogram
    lo, hi = stats.minimum, stats.maximum
    step = (hi - lo) / len(counts) if counts and lo is not None else 0.0
    rows = [(f"[{number(lo + i * step)}, {number(lo + (i + 1) * step)}]", float(c)) for i, c in enumerate(counts)]
    return bar_chart(rows, lambda v: str(int(v)), width=width, style="green")
