"""Rich output for the CLI commands: tables in one style, and names that are never cut or folded."""

from __future__ import annotations

from collections.abc import Iterable

from fsspec.callbacks import Callback
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

#: Width used to measure what a table needs, whatever the console's width.
_UNBOUNDED = 2**20


def new_table(title: str, **options) -> Table:
    """A table in the CLI's style: light borders, so more width goes to keys and names.

    ``title`` is plain text (a URL may hold '[').
    """
    return Table(title=escape(title), box=box.SIMPLE_HEAD, title_justify="left", **options)


def add_name_column(table: Table, header: str, names: Iterable[str], **options) -> None:
    """A column of names (tensor keys, checkpoints) that stay whole, on one line, at any width."""
    widest = max((cell_len(name) for name in names), default=0)
    table.add_column(header, no_wrap=True, min_width=max(widest, cell_len(header)), **options)


def add_row(table: Table, *cells: str) -> None:
    """A row of plain text: metadata and names are data, never rich markup."""
    table.add_row(*(Text(cell) for cell in cells))


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` without cutting or folding its name columns.

    rich gives a pipe 80 columns and shrinks tables to the console's width,
    folding names. Into a pipe the table is printed at its natural width (one
    line per row, whatever its length); in a terminal narrower than the names,
    at the least width that keeps them whole (other columns wrap, and the
    terminal wraps what is wider than it).
    """
    needed = Measurement.get(console, console.options.update_width(_UNBOUNDED), table)
    width = needed.minimum if console.is_terminal else needed.maximum
    if width <= console.width:
        console.print(table)
        return
    saved = console.width
    console.width = width
    try:
        console.print(table)
    finally:
        console.width = saved


class ByteProgress(Callback):
    """An fsspec progress callback (bytes) shown as a rich bar on stderr, for ``with`` blocks; silent when
    ``quiet`` (``--json``) or when stderr is not a terminal: a bar in a log file is noise."""

    def __init__(self, description: str, *, quiet: bool):
        super().__init__()
        errors = Console(stderr=True)
        self.bar = Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=errors, transient=True,
            disable=quiet or not errors.is_terminal,
        )
        self.task = self.bar.add_task(description, total=None)

    def call(self, *args, **kwargs):
        self.bar.update(self.task, total=self.size, completed=self.value)

    def __enter__(self) -> "ByteProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)
