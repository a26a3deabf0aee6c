"""The diff screen: tensors added, removed, changed (most moved first) and unchanged, and metadata side by side.

Unchanged tensors are known from chunk hashes without reading them; changed
ones are read, a pair at a time, by ``ckptfmt.tools.diff`` in a worker thread.
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from ckptfmt.tools.diff import DiffReport, diff
from ckptfmt.tui.screens.base import TAB_BINDINGS, ErrorPanel, WorkerScreen
from ckptfmt.tui.widgets.formatting import number, shape_text

STATUS_STYLE = {"changed": "yellow", "added": "green", "removed": "red", "unchanged": "dim"}
STATUSES = ("changed", "added", "removed", "unchanged")


def _pair(values: tuple, fmt=str) -> str:
    """'x' when both sides agree or one is missing (added, removed), 'a -> b' when they differ."""
    a, b = (fmt(v) if v is not None else None for v in values)
    if a is None or b is None or a == b:
        return a or b or "-"
    return f"{a} -> {b}"


def _short(value, width: int = 60) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


class DiffScreen(WorkerScreen):
    """Checkpoint A against checkpoint B."""

    HELP = ("Changed tensors come first, most moved (relative L2) first; unchanged ones are known from chunk "
            "hashes. max |diff|, rel L2 and changed (fraction of elements) compare A with B. [ and ] switch to "
            "the metadata that differs, A and B side by side.")

    DEFAULT_CSS = """
    DiffScreen #summary { padding: 0 1; }
    DiffScreen #tabs { height: 1fr; }
    """
    BINDINGS = TAB_BINDINGS

    def __init__(self, a: str, b: str) -> None:
        super().__init__()
        self.a, self.b = a, b

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Comparing {self.a} -> {self.b} ...", id="summary", markup=False)
        yield ErrorPanel()
        with TabbedContent(id="tabs"):
            with TabPane("Tensors", id="tensors"):
                yield DataTable(id="tensor-diff", cursor_type="row", zebra_stripes=True)
            with TabPane("Metadata", id="metadata"):
                yield DataTable(id="metadata-diff", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        tensors = self.query_one("#tensor-diff", DataTable)
        for column in ("key", "status", "dtype", "shape", "max |diff|", "rel L2", "changed"):
            tensors.add_column(column, key=column)
        fields = self.query_one("#metadata-diff", DataTable)
        for column in ("field", "A", "B"):
            fields.add_column(column, key=column)
        self.compare()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def compare(self) -> None:
        report = diff(self.a, self.b, storage_options=self.app.storage_options)
        self.app.call_from_thread(self._show, report)

    def _show(self, report: DiffReport) -> None:
        counts = ", ".join(f"{len(report.by_status(s))} {s}" for s in STATUSES)
        self.query_one("#summary", Static).update(
            Text.assemble((self.a, "bold"), " -> ", (self.b, "bold"), f": {counts}; "
                          f"{len(report.metadata)} metadata fields differ")
        )
        tensors = self.query_one("#tensor-diff", DataTable)
        for t in report.tensors:  # changed first, most moved first, as diff() sorts them
            changed = f"{t.frac_changed:.1%}" if t.frac_changed is not None else "-"
            tensors.add_row(
                t.key, Text(t.status, style=STATUS_STYLE[t.status]), _pair(t.dtype), _pair(t.shape, shape_text),
                Text(number(t.max_abs_diff), justify="right"), Text(number(t.rel_l2), justify="right"),
                Text(changed, justify="right"), key=t.key,
            )
        fields = self.query_one("#metadata-diff", DataTable)
        for field, a, b in report.metadata:
            fields.add_row(field, _short(a), _short(b), key=field)
        tensors.focus()
