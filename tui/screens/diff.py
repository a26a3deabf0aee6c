"""The diff screen: tensors added, removed, changed (most moved first) and unchanged, the state's plain values
that differ (an optimizer's learning rate) and the metadata that differs, A and B side by side.

Unchanged tensors are known from chunk hashes without reading them; changed
ones are read, a pair at a time, by ``ckptfmt.tools.diff`` in a worker thread,
which compares the plain values too, as ``ckptfmt diff`` shows them.

The tables fit the terminal: a key longer than the room the other columns
leave is shortened in the middle (the full key of the row under the cursor
shows below the tables), and the key column stays put when a table scrolls right.
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.text import Text
from textual import events, work
from textual.app import ComposeResult
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from ckptfmt.errors import quoted
from ckptfmt.tools.diff import DiffReport, TensorDiff, diff
from ckptfmt.tools.formatting import counted, short
from ckptfmt.tui.screens.base import TAB_BINDINGS, ErrorPanel, WorkerScreen
from ckptfmt.tui.widgets.formatting import KeyText, number, shape_text, shorten_key

STATUS_STYLE = {"changed": "yellow", "added": "green", "removed": "red", "unchanged": "dim"}
STATUSES = ("changed", "added", "removed", "unchanged")
TENSOR_COLUMNS = ("key", "status", "dtype", "shape", "max |diff|", "rel L2", "changed")
#: Columns the keys leave room for: key to max |diff| stay on screen; rel L2 and changed may need a scroll.
KEPT_COLUMNS = 5
PAIR_COLUMNS = ("key", "A", "B")
#: Each table and its columns.
TABLES = {"#tensor-diff": TENSOR_COLUMNS, "#value-diff": PAIR_COLUMNS, "#metadata-diff": ("field", "A", "B")}
#: The fewest cells a shortened key keeps; the cells DataTable pads each column with; its scrollbar's.
KEY_MIN, PADDING, SCROLLBAR = 24, 2, 2


def _pair(values: tuple, fmt=str) -> str:
    """'x' when both sides agree or one is missing (added, removed), 'a -> b' when they differ."""
    a, b = (fmt(v) if v is not None else None for v in values)
    if a is None or b is None or a == b:
        return a or b or "-"
    return f"{a} -> {b}"


def tensor_row(t: TensorDiff) -> list[Any]:
    """A row of the tensor table, its key whole (``fit_keys`` shortens it)."""
    changed = f"{t.frac_changed:.1%}" if t.frac_changed is not None else "-"
    return [t.key, Text(t.status, style=STATUS_STYLE[t.status]), _pair(t.dtype), _pair(t.shape, shape_text),
            Text(number(t.max_abs_diff), justify="right"), Text(number(t.rel_l2), justify="right"),
            Text(changed, justify="right")]


def fit_keys(rows: list[list[Any]], headers: tuple[str, ...], width: int) -> list[list[Any]]:
    """``rows`` with their key (the first cell) shortened (``shorten_key``) so that the first KEPT_COLUMNS
    columns fit ``width`` cells; a key keeps at least KEY_MIN cells."""
    others = sum(_column_width(rows, headers, index) + PADDING for index in range(1, KEPT_COLUMNS))
    room = max(KEY_MIN, width - others - PADDING)
    return [[shorten_key(row[0], room), *row[1:]] for row in rows]


def fit_pairs(rows: list[tuple[str, str, str]], width: int) -> list[tuple[str, str, str]]:
    """(key, A, B) rows in ``width`` cells: A and B are cut at their end where they take more than a
    quarter of the width each and the key needs the room; a key longer than the rest is shortened."""
    share = max(8, width // 4)
    a, b = (min(share, _column_width(rows, PAIR_COLUMNS, index)) for index in (1, 2))
    key_room = min(_column_width(rows, PAIR_COLUMNS, 0), max(KEY_MIN, width - a - b - 3 * PADDING))
    value_room = max(8, (width - key_room - 3 * PADDING) // 2)
    return [(shorten_key(key, key_room), short(va, value_room), short(vb, value_room)) for key, va, vb in rows]


def _column_width(rows: list[list[Any]], headers: tuple[str, ...], index: int) -> int:
    return max([cell_len(headers[index])] + [cell_len(str(row[index])) for row in rows])


class DiffScreen(WorkerScreen):
    """Checkpoint A against checkpoint B."""

    HELP = ("Changed tensors come first, most moved (relative L2) first; unchanged ones are known from chunk "
            "hashes. max |diff|, rel L2 and changed (fraction of elements) compare A with B. [ and ] switch to "
            "the state's plain values that differ (an optimizer's lr) and to the metadata that differs, A and "
            "B side by side. A key too long for the terminal is shortened in the middle; the line below the "
            "table shows the whole key of the row under the cursor.")

    DEFAULT_CSS = """
    DiffScreen #summary, DiffScreen #current { padding: 0 1; }
    DiffScreen #current { color: $text-muted; }
    DiffScreen #tabs { height: 1fr; }
    """
    BINDINGS = TAB_BINDINGS

    def __init__(self, a: str, b: str) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.report: DiffReport | None = None
        self.fitted_width = 0  # the width the tables were last fitted to
        self.sub_title = f"{a} -> {b}"

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Comparing {self.a} -> {self.b} ...", id="summary", markup=False)
        yield ErrorPanel()
        with TabbedContent(id="tabs"):
            with TabPane("Tensors", id="tensors"):
                yield DataTable(id="tensor-diff", cursor_type="row", zebra_stripes=True, fixed_columns=1)
            with TabPane("Values", id="values"):
                yield DataTable(id="value-diff", cursor_type="row", zebra_stripes=True, fixed_columns=1)
            with TabPane("Metadata", id="metadata"):
                yield DataTable(id="metadata-diff", cursor_type="row", zebra_stripes=True, fixed_columns=1)
        yield Static("", id="current")
        yield Footer()

    def on_mount(self) -> None:
        for selector, columns in TABLES.items():
            self.query_one(selector, DataTable).add_columns(*columns)
        self.query_one("#tensor-diff", DataTable).focus()  # now: set later, it would pull the Tensors tab back
        self.compare()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def compare(self) -> None:
        report = diff(self.a, self.b, storage_options=self.app.storage_options)
        self.app.call_from_thread(self._show, report)

    def _show(self, report: DiffReport) -> None:
        self.report = report
        counts = ", ".join(f"{len(report.by_status(s))} {s}" for s in STATUSES)
        self.query_one("#summary", Static).update(
            Text.assemble((self.a, "bold"), " -> ", (self.b, "bold"), f": {counts}; "
                          f"{counted(len(report.values), 'value')} and "
                          f"{counted(len(report.metadata), 'metadata field')} differ")
        )
        # After the next refresh: a diff that comes back before the screen's first layout (a fast one)
        # would fit the tables to a width the screen does not have yet.
        self.call_after_refresh(self._fill)

    def on_resize(self, event: events.Resize) -> None:
        """Fit the keys to the new width."""
        if self.report is not None and self.size.width - SCROLLBAR != self.fitted_width:
            self._fill()

    def _fill(self) -> None:
        """(Re)write the tables for the screen's width, keeping each one's cursor on its row."""
        assert self.report is not None
        width = self.fitted_width = self.size.width - SCROLLBAR
        tensors = [tensor_row(t) for t in self.report.tensors]  # changed first, most moved first, as diff() sorts
        values = [(key, quoted(a), quoted(b)) for key, a, b in self.report.values]
        fields = [(field, short(a), short(b)) for field, a, b in self.report.metadata]
        self._refill("#tensor-diff", [t.key for t in self.report.tensors],
                     fit_keys(tensors, TENSOR_COLUMNS, width) if tensors else [])
        self._refill("#value-diff", [key for key, _, _ in values], fit_pairs(values, width))
        self._refill("#metadata-diff", [field for field, _, _ in fields], fit_pairs(fields, width))

    def _refill(self, selector: str, keys: list[str], rows: list) -> None:
        """Replace a table's rows; its columns too, whose header DataTable would otherwise draw at their old
        widths."""
        table = self.query_one(selector, DataTable)
        cursor = table.cursor_row
        table.clear(columns=True)
        table.add_columns(*TABLES[selector])
        for key, row in zip(keys, rows):
            table.add_row(*row, key=key)
        if rows:
            table.move_cursor(row=min(cursor, len(rows) - 1))

    def on_data_table_row_highlighted(self) -> None:
        self._show_current()

    def on_tabbed_content_tab_activated(self) -> None:
        self._show_current()

    def _show_current(self) -> None:
        """Show the whole key of the row under the cursor in the tab shown (the table may shorten it)."""
        table = self.query_one(f"#{self.query_one(TabbedContent).active} DataTable", DataTable)
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value if table.row_count else ""
        self.query_one("#current", Static).update(KeyText(key or ""))
