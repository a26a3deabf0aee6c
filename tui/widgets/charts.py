"""Bar charts made of text: robust in any terminal, in snapshots and in ``tmux capture-pane``.

Charts are ``Fitted``: built when drawn, for the width they are drawn at, so that
a chart fits an 80-column terminal and its pane again after a resize.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ckptfmt.tools.formatting import number
from ckptfmt.tui.stats import TensorStats

_EIGHTHS = " ▏▎▍▌▋▊▉█"


class Fitted:
    """A renderable that ``build`` makes for the width it is drawn at."""

    def __init__(self, build: Callable[[int], RenderableType]) -> None:
        self.build = build

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.build(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)


def bar(value: float, largest: float, width: int) -> str:
    """A horizontal bar of ``width * value / largest`` cells, in eighths of a cell."""
    if largest <= 0 or value <= 0:
        return ""
    eighths = max(1, round(8 * width * value / largest))
    return "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")


def bar_room(width: int, *columns: Sequence[str], most: int) -> int:
    """Cells left for a bar beside columns of text (one cell between columns), at most ``most``, at least 1."""
    taken = sum(max((cell_len(cell) for cell in column), default=0) + 1 for column in columns)
    return max(1, min(most, width - taken))


def bar_chart(rows: Sequence[tuple[str, float]], fmt: Callable[[float], str], width: int = 40,
              style: str = "cyan") -> Fitted:
    """One labelled bar per row, scaled to the largest value, with the value printed after it; the bars
    take at most ``width`` cells, fewer where the labels and values need the room."""
    largest = max((value for _, value in rows), default=0.0)
    labels, values = [label for label, _ in rows], [fmt(value) for _, value in rows]

    def build(room: int) -> Table:
        cells = bar_room(room, labels, values, most=width)
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(width=cells, no_wrap=True)
        table.add_column(justify="right", no_wrap=True)
        for label, (_, value), shown in zip(labels, rows, values):
            table.add_row(label, Text(bar(value, largest, cells), style=style), shown)
        return table

    return Fitted(build)


def histogram(stats: TensorStats, width: int = 30) -> Fitted:
    """The histogram of a tensor's finite values: one row per bin, labelled by its range."""
    counts = stats.histogram
    lo, hi = stats.minimum, stats.maximum
    step = (hi - lo) / len(counts) if counts and lo is not None else 0.0
    rows = [(f"[{number(lo + i * step)}, {number(lo + (i + 1) * step)}]", float(c)) for i, c in enumerate(counts)]
    return bar_chart(rows, lambda v: str(int(v)), width=width, style="green")
